"""What the runtime asks of an executor: run (or cost) one step, score tokens for the policy.

    executor.execute(batch, load) -> seconds the step took (measured) or would take (modelled)

`StepLoad` is what one step (one forward, as vLLM V1 schedules it: decodes and prompt chunks
together) asks of the hardware, counted by the scheduler from the token tables; the sim turns
it into a duration, a real executor runs the batch and measures it.

What attention reads is a request's *KV extent*: every slot of its block list up to its last
written token, dead or alive. Paged kernels walk the block table to `seq_len` and take no token
mask, so a dead token left in a held block costs what a live one does; a block the request
handed back is not in its block table and costs nothing:

    held:    [L . L L][. L . .][L . . L][L L . . ]    4 blocks of S = 4, cursor at 2
    extent:   4       + 4      + 4      + 2        = 14 slots read, 8 of them live

`kv_extent(table)` counts it; compaction is what makes it shrink. A prompt chunk reads the
same way: vLLM runs decodes and chunks in one attention call with
`seq_lens = num_computed_tokens + num_scheduled_tokens` per request
(vllm/v1/worker/gpu_model_runner.py, `_prepare_inputs`), and FlashAttention's varlen kernel
reads each request's keys through its block table up to `seqused_k = seq_lens`
(vllm/v1/attention/backends/flash_attn.py): a chunk's queries read the request's KV extent
so far, then the chunk's own keys (causally).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import numpy as np

if TYPE_CHECKING:
    from vtoken.engine.batch import Batch
    from vtoken.kv.token_table import TokenTable

TokenScores = tuple[np.ndarray, np.ndarray, np.ndarray]  # (attention_sum, attention_last, importance_count)
SCORE_FIELDS = ("attention_sum", "attention_last", "importance_count")  # TokenScores' order


@dataclass(frozen=True)
class ChunkLoad:
    """One prompt chunk of a step: `num_new_tokens` queries over a context already in the cache."""

    num_context_slots: int  # the request's KV extent before the chunk (kv_extent): dead slots included
    num_context_live_tokens: int  # its live tokens then (what a gather kernel reads)
    num_new_tokens: int

    def kv_pairs(self, reads_extent: bool = True) -> int:
        """Query-key pairs of the chunk's causal attention over its context (slots or live tokens)."""
        return prefill_kv_pairs(self.num_context_slots if reads_extent else self.num_context_live_tokens,
                                self.num_new_tokens)


@dataclass(frozen=True)
class StepLoad:
    """What one engine step (one forward) asks of the hardware."""

    num_kv_slots_read: int  # KV slots the decodes' attention reads before their new token (kv_extent)
    num_live_kv_tokens: int  # live KV tokens of the decodes then (what a gather kernel reads)
    num_decoding_requests: int  # each adds one slot and one live token, its own new one
    prefill_chunks: tuple[ChunkLoad, ...]
    num_copied_tokens: int  # tokens relocated since the previous forward (lazily after it, under pressure before this one)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(c.num_new_tokens for c in self.prefill_chunks)

    @property
    def num_prefill_requests(self) -> int:
        """Requests with a prompt chunk in this step."""
        return len(self.prefill_chunks)

    def prefill_kv_pairs(self, reads_extent: bool = True) -> int:
        """Query-key pairs of every prompt chunk's causal attention (`ChunkLoad.kv_pairs`)."""
        return sum(c.kv_pairs(reads_extent) for c in self.prefill_chunks)

    def counts(self) -> dict[str, int]:
        """The load as flat counts (one row of a steps table), the chunks summed."""
        return {"num_kv_slots_read": self.num_kv_slots_read, "num_live_kv_tokens": self.num_live_kv_tokens,
                "num_decoding_requests": self.num_decoding_requests, "num_prefill_tokens": self.num_prefill_tokens,
                "num_prefill_requests": self.num_prefill_requests, "num_prefill_kv_pairs": self.prefill_kv_pairs(),
                "num_copied_tokens": self.num_copied_tokens}


def copy_load(num_copied_tokens: int) -> StepLoad:
    """A relocation copy alone, no forward."""
    return StepLoad(0, 0, 0, (), num_copied_tokens)


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
    runs_prompt_chunks: bool  # False: every prompt is computed whole (run with chunked prefill off)

    def execute(self, batch: Batch, load: StepLoad) -> float:
        """Run (or cost) the batch's forward; the step's duration in seconds."""

    def attention_stats(self, req_idx: int, token_ids: np.ndarray, num_tokens: int,
                        fields: tuple[str, ...] = SCORE_FIELDS) -> TokenScores:
        """Scores of `token_ids` of a request as of logical length `num_tokens`, for the policy;
        those not in `fields` (what the policy reads) may be None."""

    def forget(self, req_idx: int) -> None:
        """The request left the engine (finished or dropped): drop what is kept for it."""


@runtime_checkable
class CopyCostModel(Protocol):
    def raw_copy_time_s(self, num_copied_tokens: int) -> float:
        """The modelled time of relocating tokens (read + write of their K/V), overlapped or not."""
