"""What a step hands out: a request's progress (`ReqState`) and what one forward computes
(`Batch`: decodes and `PrefillChunk`s), as the scheduler (engine/scheduler.py) makes them and the
runtime, executors and observers read them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from vtoken.engine.eviction import EvictionClock
from vtoken.kv.block_pool import BlockPool
from vtoken.kv.token_table import TokenTable
from vtoken.trace import Request

TableFactory = Callable[[int, BlockPool, int], TokenTable]  # (req_id, pool, capacity) -> an empty table


@dataclass
class ReqState:
    """A request's progress. Mutable, private to the engine; results leave as frozen records."""

    req_idx: int  # position in the replayed request list: the request's id inside the engine
    request: Request
    arrival_s: float
    table: TokenTable | None = None  # the KV of its computed tokens; None while waiting
    num_generated: int = 0
    first_token_s: float | None = None
    num_preemptions: int = 0
    eviction: EvictionClock = field(default_factory=EvictionClock)
    holds_prefix: str | None = None
    admitted_seq: int = -1  # order of its last admission (preemption picks the largest)

    @property
    def num_remaining(self) -> int:
        return self.request.num_output_tokens - self.num_generated

    @property
    def num_tokens(self) -> int:
        """Prompt and generated tokens: what it must have computed before it samples the next one."""
        return self.request.num_prompt_tokens + self.num_generated

    @property
    def num_computed_tokens(self) -> int:
        return self.table.num_tokens if self.table is not None else 0

    @property
    def is_decoding(self) -> bool:
        return self.num_tokens - self.num_computed_tokens == 1 and self.num_generated > 0


@dataclass(frozen=True)
class PrefillChunk:
    """`num_new_tokens` prompt tokens (after a preemption: prompt and output tokens) of a request
    computed in one step, after `num_context_tokens` already computed. Its attention reads the
    request's KV extent so far, `num_context_slots`, then its own tokens."""

    state: ReqState
    num_context_tokens: int
    num_new_tokens: int
    num_context_slots: int  # KV extent before the chunk (executor.kv_extent): dead slots included
    num_context_live_tokens: int

    @property
    def is_last(self) -> bool:
        """This chunk completes the request's tokens: a token is sampled after the forward."""
        return self.num_context_tokens + self.num_new_tokens == self.state.num_tokens


@dataclass(frozen=True)
class Batch:
    """What one step (one forward) computes: one token of each decode and the prompt chunks."""

    decode: tuple[ReqState, ...]
    prefill: tuple[PrefillChunk, ...]
    num_kv_slots_read: int  # the decodes' KV extents before this step's tokens (executor.kv_extent)
    num_live_kv_tokens: int  # their live KV tokens then

    @property
    def states(self) -> tuple[ReqState, ...]:
        return self.decode + tuple(c.state for c in self.prefill)

    @property
    def num_scheduled_tokens(self) -> int:
        return len(self.decode) + sum(c.num_new_tokens for c in self.prefill)
