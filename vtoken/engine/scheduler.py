"""Admission, growth and preemption of requests over the block pool (continuous batching).

The scheduler owns request lifetimes: when a request arrives (closed loop: when its client's
previous request finished; open loop: at its trace timestamp), when it is admitted (FIFO, while
its prompt's blocks fit in what the variant may take), how far the batch advances in one
iteration, and whom to preempt (recompute-style, the most recently admitted first, as vLLM
does) when the pool cannot hold the next tokens. Shared prefixes are blocks that several
requests hold through ref counts; they are pinned (never evicted, never relocated).
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

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
    table: TokenTable | None = None
    num_generated: int = 0
    first_token_s: float | None = None
    num_preemptions: int = 0
    eviction: EvictionClock = field(default_factory=EvictionClock)
    holds_prefix: str | None = None

    @property
    def num_remaining(self) -> int:
        return self.request.num_output_tokens - self.num_generated


@dataclass(frozen=True)
class Batch:
    """What one iteration runs: new prefills (one step) and decodes (`num_decode_steps`)."""

    prefill: tuple[ReqState, ...]
    decode: tuple[ReqState, ...]
    num_decode_steps: int
    num_kv_slots_read: int  # the decodes' KV extents before this iteration's tokens (executor.kv_extent)
    num_live_kv_tokens: int  # their live KV tokens then


@dataclass
class _Prefix:
    block_ids: np.ndarray
    num_holders: int = 0


@dataclass
class Scheduler:
    pool: BlockPool
    requests: list[Request]
    concurrency: int | None
    max_num_seqs: int
    admit_all_at_start: bool = False
    table_factory: TableFactory = TokenTable
    running: list[ReqState] = field(default_factory=list)
    waiting: deque = field(default_factory=deque)
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (request_id, why)

    def __post_init__(self) -> None:
        self._next_idx = 0
        self._arrivals: list[tuple[float, int, ReqState]] = []  # heap by (time, idx)
        self._prefixes: dict[str, _Prefix] = {}
        num_clients = len(self.requests) if self.admit_all_at_start else self.concurrency
        if num_clients is None:
            for _ in range(len(self.requests)):
                self._release_next(None)
        else:
            for _ in range(min(num_clients, len(self.requests))):
                self._release_next(0.0)

    def _release_next(self, at_s: float | None) -> None:
        """Closed loop: the next request arrives at `at_s`; open loop: at its timestamp."""
        if self._next_idx >= len(self.requests):
            return
        request = self.requests[self._next_idx]
        state = ReqState(self._next_idx, request, request.arrival_s if at_s is None else at_s)
        heapq.heappush(self._arrivals, (state.arrival_s, state.req_idx, state))
        self._next_idx += 1

    # ---- what happens next -----------------------------------------------------------------

    def has_work(self) -> bool:
        return bool(self.running or self.waiting or self._arrivals)

    def next_arrival_s(self) -> float | None:
        return self._arrivals[0][0] if self._arrivals else None

    def collect_arrivals(self, now_s: float) -> None:
        while self._arrivals and self._arrivals[0][0] <= now_s:
            self.waiting.append(heapq.heappop(self._arrivals)[2])

    # ---- admission -------------------------------------------------------------------------

    def admit(self, num_admissible_blocks: int, now_s: float) -> list[ReqState]:
        """Admit waiting requests in order while their prompt blocks fit; allocate and map them."""
        admitted = []
        while self.waiting and len(self.running) < self.max_num_seqs:
            state = self.waiting[0]
            num_tokens = state.request.num_prompt_tokens + state.num_generated
            prefix = self._live_prefix(state)
            num_needed = self._num_blocks_to_place(state)
            if num_needed > self.pool.num_blocks:
                self.waiting.popleft()
                self.skipped.append((state.request.request_id, f"needs {num_needed} blocks, the budget is {self.pool.num_blocks}"))
                if self.concurrency is not None and not self.admit_all_at_start:
                    self._release_next(now_s)
                continue
            if num_needed > num_admissible_blocks:
                break
            self.waiting.popleft()
            self._place(state, num_tokens, prefix)
            num_admissible_blocks -= num_needed
            self.running.append(state)
            admitted.append(state)
        return admitted

    def num_blocks_to_admit_next(self) -> int:
        """Blocks the head of the queue needs to be admitted; 0 when nothing waits, the batch is
        full (`max_num_seqs`) or the head can never fit (`admit` skips it)."""
        if not self.waiting or len(self.running) >= self.max_num_seqs:
            return 0
        num_needed = self._num_blocks_to_place(self.waiting[0])
        return num_needed if num_needed <= self.pool.num_blocks else 0

    def _num_blocks_to_place(self, state: ReqState) -> int:
        """Fresh blocks a waiting request's tokens take (a live shared prefix is not fresh)."""
        prefix = self._live_prefix(state)
        num_tokens = state.request.num_prompt_tokens + state.num_generated
        return -(-num_tokens // self.pool.block_size) - (prefix.block_ids.size if prefix else 0)

    def _live_prefix(self, state: ReqState) -> _Prefix | None:
        prefix_id = state.request.prefix_id
        return self._prefixes.get(prefix_id) if prefix_id is not None else None

    def _place(self, state: ReqState, num_tokens: int, prefix: _Prefix | None) -> None:
        table = self.table_factory(state.req_idx, self.pool, num_tokens + state.num_remaining + 1)
        num_prefix_blocks = state.request.num_prefix_tokens // self.pool.block_size
        if prefix is not None:
            self.pool.share(prefix.block_ids)
            table.attach_shared_prefix(prefix.block_ids, prefix.block_ids.size * self.pool.block_size)
        block_ids = self.pool.allocate(table.num_new_blocks_needed(num_tokens - table.num_tokens))
        table.sync_new_tokens(block_ids, num_tokens)
        if prefix is None and num_prefix_blocks > 0:
            table.pin_prefix(num_prefix_blocks * self.pool.block_size)
            prefix = self._prefixes.setdefault(state.request.prefix_id, _Prefix(table.held_block_ids[:num_prefix_blocks].copy()))
        if prefix is not None:
            prefix.num_holders += 1
            state.holds_prefix = state.request.prefix_id
        state.table = table

    # ---- growth and preemption -------------------------------------------------------------

    def num_blocks_to_grow(self, decode: list[ReqState], num_steps: int) -> int:
        return sum(s.table.num_new_blocks_needed(num_steps) for s in decode)

    def preempt_last(self) -> ReqState:
        """Recompute-style preemption of the most recently admitted running request: it waits
        at the head of the queue and is prefilled again from all its tokens."""
        state = self.running.pop()
        self._drop_table(state)
        state.num_preemptions += 1
        self.waiting.appendleft(state)
        return state

    def drop(self, state: ReqState, why: str, now_s: float) -> None:
        """Give up on a request that cannot fit even alone."""
        self.running.remove(state)
        self._drop_table(state)
        self.skipped.append((state.request.request_id, why))
        if self.concurrency is not None and not self.admit_all_at_start:
            self._release_next(now_s)

    def finish(self, state: ReqState, now_s: float) -> None:
        self.running.remove(state)
        self._drop_table(state)
        if self.concurrency is not None and not self.admit_all_at_start:
            self._release_next(now_s)

    def _drop_table(self, state: ReqState) -> None:
        self.pool.free(np.asarray(state.table.release_all(), dtype=np.int64))
        state.table = None
        if state.holds_prefix is not None:
            prefix = self._prefixes[state.holds_prefix]
            prefix.num_holders -= 1
            if prefix.num_holders == 0:
                del self._prefixes[state.holds_prefix]
            state.holds_prefix = None
