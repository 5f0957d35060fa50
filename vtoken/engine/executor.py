"""What the runtime asks of an executor: run (or cost) one step, score tokens for the policy.

    executor.execute(batch, load) -> seconds the step took (measured) or would take (modelled)

`StepLoad` is what one iteration asks of the hardware, counted by the runtime from the token
tables; the sim turns it into a duration, a real executor runs the batch and measures it.
An executor that advances several decode steps per iteration (`max_fused_steps > 1`) must also
predict a step's duration (`StepCostModel`), so that fused steps never run past the next
open-loop arrival.

What attention reads is a request's *KV extent*: every slot of its block list up to its last
written token, dead or alive. Paged kernels walk the block table to `seq_len` and take no token
mask, so a dead token left in a held block costs what a live one does; a block the request
handed back is not in its block table and costs nothing:

    held:    [L . L L][. L . .][L . . L][L L . . ]    4 blocks of S = 4, cursor at 2
    extent:   4       + 4      + 4      + 2        = 14 slots read, 8 of them live

`kv_extent(table)` counts it; compaction is what makes it shrink.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import numpy as np

if TYPE_CHECKING:
    from vtoken.engine.scheduler import Batch
    from vtoken.kv.token_table import TokenTable

TokenScores = tuple[np.ndarray, np.ndarray, np.ndarray]  # (attention_sum, attention_last, importance_count)
SCORE_FIELDS = ("attention_sum", "attention_last", "importance_count")  # TokenScores' order


@dataclass(frozen=True)
class StepLoad:
    """What one engine iteration asks of the hardware."""

    num_decode_steps: int  # fused decode steps in this iteration (>= 1)
    num_kv_slots_read: int  # KV slots paged attention reads at the first of those steps (kv_extent)
    num_live_kv_tokens: int  # live KV tokens of the decodes at that step (what a gather kernel reads)
    num_decoding_requests: int  # each adds one slot and one live token per step
    num_prefill_tokens: int  # prompt tokens computed in the first step
    num_copied_tokens: int  # tokens relocated after this iteration's forward
    num_prefill_requests: int = 0  # requests whose prompt (or a chunk of it) runs in the first step
    num_prefill_kv_pairs: int = 0  # query-key pairs of those prompts' causal attention (prefill_kv_pairs)


def kv_extent(table: TokenTable) -> int:
    """KV slots attention reads for `table`: (held blocks - 1) x S + the tail's written slots."""
    num_blocks = table.num_blocks
    return (num_blocks - 1) * table.block_size + table.tail_num_written if num_blocks else 0


def prefill_kv_pairs(num_context_tokens: int, num_new_tokens: int) -> int:
    """Query-key pairs of a causal prompt chunk: `num_new_tokens` queries after `num_context_tokens`
    cached tokens, each reading the context and the chunk's tokens up to itself."""
    return num_new_tokens * num_context_tokens + num_new_tokens * (num_new_tokens + 1) // 2


class Executor(Protocol):
    name: str
    max_fused_steps: int  # decode steps one `execute` may advance (1: one real forward per token)

    def execute(self, batch: Batch, load: StepLoad) -> float:
        """Run (or cost) the batch's forward; the step's duration in seconds."""

    def attention_stats(self, req_idx: int, token_ids: np.ndarray, num_tokens: int,
                        fields: tuple[str, ...] = SCORE_FIELDS) -> TokenScores:
        """Scores of `token_ids` of a request as of logical length `num_tokens`, for the policy;
        those not in `fields` (what the policy reads) may be None."""

    def forget(self, req_idx: int) -> None:
        """The request left the engine (finished or dropped): drop what is kept for it."""


@runtime_checkable
class StepCostModel(Protocol):
    def iteration_time_s(self, load: StepLoad) -> float:
        """The modelled duration of an iteration with this load."""
