"""Admission, the step's token budget, growth and preemption over the block pool, as vLLM V1's
scheduler does them (vllm/v1/core/sched/scheduler.py, `Scheduler.schedule`).

The scheduler owns request lifetimes: when a request arrives (closed loop: when its client's
previous request finished; open loop: at its trace timestamp), when it is admitted, what each
step computes, and whom to preempt. There is no prefill or decode phase: each request has
`num_tokens` (prompt + generated) and a table holding the KV of the tokens computed so far, and
each step gives every request some of the tokens it lacks, within a token budget:

    budget = max_num_batched_tokens
    running requests, in admission order:   a decode takes 1 token, a prompt being computed
        its next chunk (min(what it lacks, long_prefill_token_threshold, budget)); when its
        blocks do not fit, the most recently admitted running request is preempted
        (recompute: its blocks freed, back at the head of the queue) until they do
    then, if nothing was preempted, waiting requests in order, while the budget lasts and
        fewer than max_num_seqs run: admitted when the blocks of all its tokens fit
        (`scheduler_reserve_full_isl`), given a first chunk; with chunked prefill off a prompt
        is scheduled whole or waits
    a request whose scheduled tokens reach `num_tokens` samples a token after the forward

A live shared prefix counts as computed on admission (vLLM's prefix-cache hit); its blocks are
held through ref counts and pinned (never evicted, never relocated).
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from vtoken.engine.batch import Batch, PrefillChunk, ReqState, TableFactory
from vtoken.engine.executor import kv_extent
from vtoken.kv.block_pool import BlockPool
from vtoken.kv.token_table import TokenTable
from vtoken.trace import Request

@dataclass(frozen=True)
class SchedulerLimits:
    """vLLM V1's scheduler limits (vllm/config/scheduler.py names them)."""

    max_num_batched_tokens: int
    max_num_seqs: int
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0


class SchedulerHooks(Protocol):
    """What the runtime is told while a step is scheduled."""

    def on_synced(self, table: TokenTable, num_tokens_before: int) -> None:
        """`table` took new tokens (their slots are written by the coming forward)."""

    def on_preempt(self, state: ReqState) -> None:
        """`state` is about to lose its table (recompute preemption)."""

    def on_drop(self, state: ReqState) -> None:
        """`state` is about to be given up: it cannot fit even alone."""


@dataclass
class _Prefix:
    block_ids: np.ndarray
    num_holders: int = 0


@dataclass
class Scheduler:
    pool: BlockPool
    requests: list[Request]
    concurrency: int | None
    limits: SchedulerLimits
    hooks: SchedulerHooks
    admit_all_at_start: bool = False
    table_factory: TableFactory = TokenTable
    running: list[ReqState] = field(default_factory=list)  # in admission order
    waiting: deque = field(default_factory=deque)
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (request_id, why)

    def __post_init__(self) -> None:
        self._next_idx = 0
        self._num_admissions = 0
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

    # ---- one step --------------------------------------------------------------------------

    def schedule(self, num_reserved_blocks: int, now_s: float) -> Batch:
        """The next step: running requests first, then admissions, within the token budget.
        Allocates and maps the blocks of every scheduled token; preempts when they do not fit.
        `num_reserved_blocks`: free blocks no admission may take (the reclaimer's headroom)."""
        budget = self.limits.max_num_batched_tokens
        threshold = self._chunk_cap()
        decode: list[ReqState] = []
        chunks: list[PrefillChunk] = []
        num_slots = num_live = 0
        preempted: list[ReqState] = []
        idx = 0
        while idx < len(self.running) and budget > 0:
            state = self.running[idx]
            num_new = self._num_to_schedule(state, budget, threshold)
            if not self._make_room(state, num_new, now_s, preempted):
                break
            if state.is_decoding:
                num_slots += kv_extent(state.table)
                num_live += state.table.num_live_tokens
                decode.append(state)
            else:
                chunks.append(self._chunk(state, num_new))
            self._grow(state, num_new)
            budget -= num_new
            idx += 1
        if not preempted:
            budget = self._admit(budget, threshold, num_reserved_blocks, now_s, chunks)
        return Batch(tuple(decode), tuple(chunks), num_slots, num_live)

    @staticmethod
    def _num_to_schedule(state: ReqState, budget: int, threshold: int) -> int:
        num_new = min(state.num_tokens - state.num_computed_tokens, budget)
        return threshold if 0 < threshold < num_new else num_new

    def _chunk_cap(self) -> int:
        """vLLM caps a chunk at long_prefill_token_threshold only when another request could use
        the budget (one request alone has nobody to starve)."""
        if len(self.running) + len(self.waiting) > 1:
            return self.limits.long_prefill_token_threshold
        return 0

    def _chunk(self, state: ReqState, num_new: int) -> PrefillChunk:
        table = state.table
        return PrefillChunk(state, table.num_tokens, num_new, kv_extent(table), table.num_live_tokens)

    def _make_room(self, state: ReqState, num_new: int, now_s: float, preempted: list[ReqState]) -> bool:
        """Preempt the most recently admitted running requests (appended to `preempted`) until
        `state`'s `num_new` tokens fit; False when `state` itself had to go (preempted, or
        dropped when it runs alone: it cannot fit even then)."""
        while state.table.num_new_blocks_needed(num_new) > self.pool.num_free_blocks:
            if len(self.running) == 1:
                self.hooks.on_drop(state)
                self.drop(state, f"does not fit in {self.pool.num_blocks} blocks even alone", now_s)
                return False
            victim = self.preempt_last()
            preempted.append(victim)
            if victim is state:
                return False
        return True

    def _grow(self, state: ReqState, num_new: int) -> None:
        table = state.table
        num_before = table.num_tokens
        table.sync_new_tokens(self.pool.allocate(table.num_new_blocks_needed(num_new)), num_before + num_new)
        if self._pin_own_prefix(state):
            num_before = 0  # its earlier chunks' prefix tokens are the shared prefix's from now on
        self.hooks.on_synced(table, num_before)

    # ---- admission -------------------------------------------------------------------------

    def _admit(self, budget: int, threshold: int, num_reserved_blocks: int, now_s: float,
               chunks: list[PrefillChunk]) -> int:
        """Admit waiting requests in order while the budget lasts, fewer than max_num_seqs run and
        all of the head's tokens fit; each gets its first chunk. Returns the budget left."""
        while self.waiting and budget > 0 and len(self.running) < self.limits.max_num_seqs:
            state = self.waiting[0]
            prefix = self._live_prefix(state)
            num_cached = prefix.block_ids.size * self.pool.block_size if prefix else 0
            num_new = state.num_tokens - num_cached
            if 0 < threshold < num_new:
                num_new = threshold
            why = self._never_fits(state, num_new)
            if why is not None:
                self.waiting.popleft()
                self.skipped.append((state.request.request_id, why))
                if self.concurrency is not None and not self.admit_all_at_start:
                    self._release_next(now_s)
                continue
            if not self.limits.enable_chunked_prefill and num_new > budget:
                break
            if self._num_blocks_to_place(state) > self.pool.num_free_blocks - num_reserved_blocks:
                break
            num_new = min(num_new, budget)
            self.waiting.popleft()
            self._place(state, num_cached, prefix)
            chunks.append(self._chunk(state, num_new))
            self._grow(state, num_new)
            budget -= num_new
            self._num_admissions += 1
            state.admitted_seq = self._num_admissions
            self.running.append(state)
        return budget

    def _never_fits(self, state: ReqState, num_new: int) -> str | None:
        num_needed = self._num_blocks_to_place(state)
        if num_needed > self.pool.num_blocks:
            return f"needs {num_needed} blocks, the budget is {self.pool.num_blocks}"
        if not self.limits.enable_chunked_prefill and num_new > self.limits.max_num_batched_tokens:
            return (f"needs {num_new} tokens in one step with chunked prefill off, max_num_batched_tokens is "
                    f"{self.limits.max_num_batched_tokens}")
        return None

    def num_blocks_to_admit_next(self) -> int:
        """Blocks the head of the queue needs to be admitted; 0 when nothing waits, the batch is
        full (`max_num_seqs`) or the head can never fit (`schedule` skips it)."""
        if not self.waiting or len(self.running) >= self.limits.max_num_seqs:
            return 0
        num_needed = self._num_blocks_to_place(self.waiting[0])
        return num_needed if num_needed <= self.pool.num_blocks else 0

    def _num_blocks_to_place(self, state: ReqState) -> int:
        """Fresh blocks all of a waiting request's tokens take (a live shared prefix is not fresh)."""
        prefix = self._live_prefix(state)
        return -(-state.num_tokens // self.pool.block_size) - (prefix.block_ids.size if prefix else 0)

    def _live_prefix(self, state: ReqState) -> _Prefix | None:
        """The registered prefix `state` shares, if it leaves a token to compute (vLLM's prefix
        cache never hits a request's last token: it must be computed to sample)."""
        prefix_id = state.request.prefix_id
        prefix = self._prefixes.get(prefix_id) if prefix_id is not None else None
        if prefix is None or prefix.block_ids.size * self.pool.block_size >= state.num_tokens:
            return None
        return prefix

    def _place(self, state: ReqState, num_cached: int, prefix: _Prefix | None) -> None:
        """A table for `state`, holding the live shared prefix (computed) if there is one."""
        table = self.table_factory(state.req_idx, self.pool, state.num_tokens + state.num_remaining + 1)
        if prefix is not None:
            self.pool.share(prefix.block_ids)
            table.attach_shared_prefix(prefix.block_ids, num_cached)
            prefix.num_holders += 1
            state.holds_prefix = state.request.prefix_id
            self.hooks.on_synced(table, 0)  # the prefix's tokens are this request's too
        state.table = table

    def _pin_own_prefix(self, state: ReqState) -> bool:
        """Once a request has computed its whole-block prefix itself, pin it and offer it to the
        requests that share it (unless another request already offers the same prefix). True
        when it was pinned now."""
        table = state.table
        num_prefix_blocks = state.request.num_prefix_tokens // self.pool.block_size
        num_prefix_tokens = num_prefix_blocks * self.pool.block_size
        if num_prefix_blocks == 0 or table.num_pinned_tokens or table.num_tokens < num_prefix_tokens:
            return False
        table.pin_prefix(num_prefix_tokens)
        if state.request.prefix_id not in self._prefixes:
            self._prefixes[state.request.prefix_id] = _Prefix(table.held_block_ids[:num_prefix_blocks].copy(), 1)
            state.holds_prefix = state.request.prefix_id
        return True

    # ---- growth and preemption -------------------------------------------------------------

    def num_blocks_to_grow(self) -> int:
        """Fresh blocks the running requests' tokens of the next step take, in the budget's order."""
        budget, threshold, num_needed = self.limits.max_num_batched_tokens, self._chunk_cap(), 0
        for state in self.running:
            if budget <= 0:
                break
            num_new = self._num_to_schedule(state, budget, threshold)
            num_needed += state.table.num_new_blocks_needed(num_new)
            budget -= num_new
        return num_needed

    def max_num_blocks_to_grow(self) -> int:
        """An upper bound of `num_blocks_to_grow`, in O(1): a request's n new tokens take at most
        n // S + 1 fresh blocks, and the step's tokens are at most the budget."""
        return len(self.running) + self.limits.max_num_batched_tokens // self.pool.block_size

    def preempt_last(self) -> ReqState:
        """Recompute-style preemption of the most recently admitted running request: it waits
        at the head of the queue and is prefilled again from all its tokens."""
        state = self.running[-1]  # `running` is in admission order (vLLM: `self.running.pop()`)
        self.hooks.on_preempt(state)
        self.running.pop()
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
