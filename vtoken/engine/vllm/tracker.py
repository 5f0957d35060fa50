"""The vToken side of a vLLM scheduler: token tables, policy, compaction, block release. No vLLM import.

`VTokenScheduler` (scheduler.py) is the glue; this class owns the state, so it is testable
without vLLM. The token tables run over a *ledger* `BlockPool` of the same size as vLLM's;
ledger ids map to vLLM block ids, so a table describes the real layout of the KV tensors.

Per request, a step goes:

    schedule()            sync(req, n new tokens, vLLM block list)  -> the table places them
                          take_step_plan()                          -> moves, lengths, truncations
    worker                copies, then the forward (positions logical, KV length physical)
    update_from_output()  complete_moves(plan)
                          after_step(req, ...)  -> policy -> evict -> compaction -> pending moves
                          num_releasable_blocks(req, ...) -> the scheduler frees that many
                          trailing blocks and calls blocks_released

Variants differ only in how many blocks a request keeps once its moves have landed:

    native       no eviction, nothing to release
    naive-evict  the blocks a never-compacted layout would hold (compaction.naive_num_blocks)
    vtoken       only the blocks holding live tokens, handed back when the reclaimer's stage 1
                 (F >= theta_F, every k steps) says so

KV-manager lengths: vLLM sizes a request's block list from `num_computed_tokens`. The tracker
gives each request a `manager_offset` so that the manager sees `num_computed - offset` tokens:
the dead count for vtoken (live tokens only), whole dead naive blocks for naive-evict.

With vLLM's prefix caching on, a `PrefixCacheView` (prefix_cache.py) says which leading blocks
to protect before each eviction and drops the hashes of the blocks the request is about to
rewrite; a request whose layout changed is no longer `is_cacheable`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from vtoken.engine.batch import TableFactory
from vtoken.engine.eviction import EvictionClock, EvictionEvent, EvictionSchedule
from vtoken.engine.scores import AttentionStats
from vtoken.engine.vllm.plan import StepPlan
from vtoken.engine.vllm.settings import VllmSettings
from vtoken.engine.warmup import warm_compiled_loops
from vtoken.errors import InvariantError, VTokenError
from vtoken.invariants import check_conservation, check_unique_mapping
from vtoken.kv.block_pool import BlockPool, waste_ratio
from vtoken.kv.compaction import live_positions, naive_num_blocks, plan_compaction
from vtoken.kv.token_table import TokenTable
from vtoken.metrics import RunCounters
from vtoken.policies import make_policy


@dataclass(frozen=True)
class EngineStats:
    """Counters and gauges of the vToken layer (exported as vtoken_* metrics)."""

    variant: str
    num_running_requests: int
    num_live_tokens: int
    num_allocated_blocks: int
    block_size: int
    counters: RunCounters
    # vLLM's allocated blocks per tenth of u = live / S ([0, .1), ..., [.9, 1.0]): the token
    # tables' blocks as they are packed, plus the blocks vLLM still holds that they emptied (u = 0)
    utilization_histogram: tuple[int, ...] = ()

    @property
    def waste_ratio(self) -> float:
        """F (Eq. 1) over vLLM's allocated blocks."""
        return waste_ratio(self.num_live_tokens, self.num_allocated_blocks, self.block_size)


class PrefixCacheView(Protocol):
    """vLLM's prefix cache as the tracker needs it (prefix_cache.PrefixCache)."""

    def num_protected_blocks(self, req_id: str, vllm_block_ids: np.ndarray) -> int:
        """Leading blocks of the request never to evict from, move or hand back."""

    def uncache(self, vllm_block_ids: np.ndarray) -> None:
        """Drop these blocks' prefix-cache hashes: the request is about to rewrite them."""


@dataclass
class _Request:
    req_idx: int  # integer id for the policy (seeded draws) and the table
    table: TokenTable
    eviction: EvictionClock = field(default_factory=EvictionClock)
    manager_offset: int = 0
    pending_src: list[np.ndarray] = field(default_factory=list)  # vLLM slots, not yet sent
    pending_dst: list[np.ndarray] = field(default_factory=list)
    has_moves_in_flight: bool = False
    events: list[EvictionEvent] = field(default_factory=list)
    scores: AttentionStats | None = None  # only for policies that need attention
    is_rewritten: bool = False  # its layout changed since its blocks were computed: never cache them

    @property
    def num_evicted_tokens(self) -> int:
        return self.table.num_tokens - self.table.num_live_tokens


class VTokenTracker:
    def __init__(self, settings: VllmSettings, num_blocks: int, block_size: int, num_heads_layers: int = 1,
                 table_factory: TableFactory = TokenTable, prefix_cache: PrefixCacheView | None = None,
                 num_ledger_blocks: int | None = None) -> None:
        """`num_ledger_blocks`: the ledger's size when it exceeds vLLM's pool (a block shared
        through the prefix cache is in every sharer's table, under one ledger id each)."""
        self.settings = settings
        self.block_size = block_size
        self.num_heads_layers = num_heads_layers  # attention rows are summed over heads and layers
        self.prefix_cache = prefix_cache
        num_ledger_blocks = max(num_blocks, num_ledger_blocks or 0)
        self.ledger = BlockPool(num_ledger_blocks, block_size)
        self.vllm_id_of = np.full(num_ledger_blocks, -1, dtype=np.int64)  # ledger id -> vLLM block id
        self.eviction = EvictionSchedule(settings.eviction, make_policy(settings.eviction.policy, seed=settings.seed))
        self.table_factory = table_factory
        self.requests: dict[str, _Request] = {}
        self._resumed: dict[str, _Request] = {}  # preempted: waits for its recompute
        self.finished_events: dict[int, list[EvictionEvent]] = {}  # by req_idx; only with record_events
        self.record_events = False
        self._next_req_idx = 0
        self._req_idx_of: dict[str, int] = {}
        self._truncations: dict[str, int] = {}
        self._num_synced: dict[str, int] = {}  # tokens each request got since the last step plan
        self.num_checks = dict.fromkeys(("I1", "I2", "I3"), 0)  # checks run (check_invariants)
        self.counters = RunCounters()
        if settings.evicts:  # not at the first eviction, which would stall that step's batch
            warm_compiled_loops()

    # ---- identities ----------------------------------------------------------------------------

    def req_idx(self, req_id: str) -> int:
        """A stable integer per request id, in order of first sight (same order in every variant)."""
        if req_id not in self._req_idx_of:
            self._req_idx_of[req_id] = self._next_req_idx
            self._next_req_idx += 1
        return self._req_idx_of[req_id]

    @property
    def num_requests_seen(self) -> int:
        """req_idx the next new request gets."""
        return self._next_req_idx

    def manager_offset(self, req_id: str) -> int:
        state = self.requests.get(req_id)
        return state.manager_offset if state is not None else 0

    # ---- schedule ------------------------------------------------------------------------------

    def num_new_blocks_needed(self, req_id: str, num_new_tokens: int) -> int:
        state = self.requests.get(req_id)
        if state is None:
            return -(-num_new_tokens // self.block_size)
        return state.table.num_new_blocks_needed(num_new_tokens)

    def sync(self, req_id: str, num_new_tokens: int, vllm_block_ids: list[int] | None,
             num_cached_tokens: int = 0) -> None:
        """Place the KV of `num_new_tokens` tokens the coming forward writes.

        `vllm_block_ids` is the request's whole vLLM block list, needed only when
        `num_new_blocks_needed` > 0: the table takes the next blocks of that list.
        `num_cached_tokens`: at a request's first step (or its first after a preemption), the
        tokens vLLM's prefix cache already holds for it (the first of its blocks).
        """
        state = self.requests.get(req_id)
        if state is None:
            state = self._resumed.pop(req_id, None)
            if state is None:
                table = self.table_factory(self.req_idx(req_id), self.ledger, max(64, num_new_tokens))
                state = _Request(table.req_id, table)
            self.requests[req_id] = state
        table = state.table
        if num_cached_tokens and table.num_tokens:
            raise VTokenError(f"request {req_id}: a prefix-cache hit of {num_cached_tokens} tokens after "
                              f"{table.num_tokens} tokens were placed")
        num_placed = num_cached_tokens + num_new_tokens
        num_needed = table.num_new_blocks_needed(num_placed)
        ledger_ids = np.zeros(0, dtype=np.int64)
        if num_needed:
            first = table.num_blocks
            new_vllm_ids = vllm_block_ids[first : first + num_needed]
            if len(new_vllm_ids) != num_needed:
                raise VTokenError(f"request {req_id}: needs {num_needed} more blocks, vLLM holds "
                                  f"{len(vllm_block_ids)} and the table {first}")
            ledger_ids = self.ledger.allocate(num_needed)
            self.vllm_id_of[ledger_ids] = new_vllm_ids
        table.sync_new_tokens(ledger_ids, table.num_tokens + num_placed)
        self._num_synced[req_id] = self._num_synced.get(req_id, 0) + num_new_tokens

    @property
    def needs_scores(self) -> bool:
        return self.settings.evicts and self.eviction.policy.needs_attention

    def take_step_plan(self, scheduled_req_ids: list[str]) -> StepPlan:
        """Moves planned since the last step, lengths of the scheduled requests, truncations,
        and which requests' attention the policy needs (not a recompute after preemption).
        With `check_invariants`, also the slots each scheduled request must read and write."""
        src, dst = [], []
        for req_id, state in self.requests.items():
            if state.pending_src:
                src.extend(state.pending_src)
                dst.extend(state.pending_dst)
                state.pending_src, state.pending_dst = [], []
                state.has_moves_in_flight = True
        num_evicted = {r: self.requests[r].num_evicted_tokens for r in scheduled_req_ids
                       if r in self.requests and self.requests[r].num_evicted_tokens}
        truncations, self._truncations = self._truncations, {}
        score_req_ids = frozenset()
        if self.needs_scores:
            score_req_ids = frozenset(r for r in scheduled_req_ids if self.requests[r].eviction.resume_token_ids is None)
        num_synced, self._num_synced = self._num_synced, {}
        live_slots, new_slots = {}, {}
        if self.settings.check_invariants:
            for req_id in scheduled_req_ids:
                table = self.requests[req_id].table
                new_ids = np.arange(table.num_tokens - num_synced.get(req_id, 0), table.num_tokens)
                live_slots[req_id] = np.sort(self._vllm_slots(table, table.live_token_ids()))
                new_slots[req_id] = self._vllm_slots(table, new_ids)
        empty = np.zeros(0, dtype=np.int64)
        return StepPlan(np.concatenate(src) if src else empty, np.concatenate(dst) if dst else empty,
                        num_evicted, truncations, score_req_ids, self.settings.check_invariants, live_slots, new_slots)

    def _vllm_slots(self, table: TokenTable, token_ids: np.ndarray) -> np.ndarray:
        """vLLM slots (vLLM block id * S + offset) of `token_ids` of `table`."""
        slots = table.token_slots[token_ids]  # ledger slots
        return self.vllm_id_of[slots // self.block_size] * self.block_size + slots % self.block_size

    # ---- update_from_output --------------------------------------------------------------------

    def add_scores(self, req_id: str, rows: np.ndarray) -> None:
        """Attention rows of the last forward, keys in physical order (positions 0..live-1)."""
        state = self.requests.get(req_id)
        if state is None:
            return
        live_ids, positions = live_positions(state.table)
        ids_by_position = np.empty(live_ids.size, dtype=np.int64)
        ids_by_position[positions] = live_ids
        if state.scores is None:
            state.scores = AttentionStats(self.num_heads_layers)
        state.scores.add(ids_by_position[: rows.shape[1]], rows)

    def is_cacheable(self, req_id: str) -> bool:
        """Whether vLLM may register the request's full blocks in its prefix cache."""
        state = self.requests.get(req_id)
        return state is None or not state.is_rewritten

    def complete_moves(self) -> None:
        """The step that carried the pending copies has run: their data has landed."""
        for state in self.requests.values():
            state.has_moves_in_flight = False

    def after_step(self, req_id: str, num_output_tokens: int, num_kv_tokens: int) -> None:
        """The request's KV holds `num_kv_tokens` tokens and a sampled token waits; maybe evict."""
        state = self.requests.get(req_id)
        if state is None or not self.settings.evicts:
            return
        if state.table.num_tokens != num_kv_tokens:
            raise VTokenError(f"request {req_id}: vLLM computed {num_kv_tokens} tokens, its table has {state.table.num_tokens}")
        if self.prefix_cache is not None and self.eviction.is_due(state.eviction, num_output_tokens):
            self._protect(req_id, state)
        scores = None
        if self.eviction.policy.needs_attention:
            scores = lambda token_ids, num_tokens: (state.scores or AttentionStats(self.num_heads_layers)).of(token_ids)  # noqa: E731
        event = self.eviction.decide(state.eviction, state.req_idx, state.table, num_output_tokens, scores)
        if event is not None and event.is_resume and state.table.num_pinned_tokens:
            # tokens lost before a preemption that a newly shared block now holds stay
            kept = event.token_ids[event.token_ids >= state.table.num_pinned_tokens]
            event = EvictionEvent(event.num_tokens, kept, is_resume=True) if kept.size else None
        if event is not None:
            self._evict(req_id, state, event)

    def _protect(self, req_id: str, state: _Request) -> None:
        """Pin the leading blocks the prefix cache protects (they are whole: never rewritten)."""
        table = state.table
        num_blocks = self.prefix_cache.num_protected_blocks(req_id, self.vllm_id_of[table.held_block_ids])
        if num_blocks * self.block_size > table.num_pinned_tokens:
            table.pin_prefix(num_blocks * self.block_size)

    def _evict(self, req_id: str, state: _Request, event: EvictionEvent) -> None:
        table = state.table
        if self.prefix_cache is not None and not state.is_rewritten:
            self.prefix_cache.uncache(self.vllm_id_of[table.held_block_ids[table.num_pinned_blocks:]])
        state.is_rewritten = True
        live_before = table.live_token_ids()
        table.evict_tokens(event.token_ids)
        moves = plan_compaction(table, self.settings.reclaim.mode)
        table.apply_moves(moves)
        num_dense_blocks = -(-table.num_live_tokens // self.block_size)
        emptied = table.held_block_ids[num_dense_blocks:].copy()  # release_blocks rewrites the held list
        table.release_blocks(emptied)
        self.ledger.free(emptied)
        # New tokens go right after the packed live tokens, where vLLM will write them; the
        # table keeps its cursor where it was unless the tail block itself was released.
        table.set_tail_cursor(table.num_live_tokens - (table.num_blocks - 1) * self.block_size)
        if moves.num_moves:
            state.pending_src.append(self.vllm_id_of[moves.src_block_ids] * self.block_size + moves.src_offsets)
            state.pending_dst.append(self.vllm_id_of[moves.dst_block_ids] * self.block_size + moves.dst_offsets)
            self.counters = self.counters.plus(tokens_moved=moves.num_moves, relocation_events=1)
        if self.settings.variant == "naive-evict":
            num_naive_blocks = max(naive_num_blocks(table), table.num_blocks)
            state.manager_offset = self.block_size * (-(-table.num_tokens // self.block_size) - num_naive_blocks)
        else:
            state.manager_offset = state.num_evicted_tokens
        self.counters = self.counters.plus(tokens_evicted=int(event.token_ids.size), eviction_events=1)
        if self.record_events:
            state.events.append(EvictionEvent(event.num_tokens, np.sort(event.token_ids).astype(np.int64), event.is_resume))
        if self.settings.check_invariants:
            self._check(req_id, table, np.setdiff1d(live_before, event.token_ids))

    def _check(self, req_id: str, table: TokenTable, expected_live: np.ndarray) -> None:
        try:
            self.num_checks["I1"] += 1
            check_conservation(table.req_id, expected_live, table.live_token_ids())
            self.num_checks["I2"] += 1
            check_unique_mapping(self.ledger, [s.table for s in self.requests.values()])
            self.num_checks["I3"] += 1
            _, positions = live_positions(table)
            if not np.array_equal(np.sort(positions), np.arange(positions.size)):
                raise InvariantError("I3", f"request {req_id}: live tokens not dense after compaction; "
                                     "attention would read a dead slot")
        except InvariantError:
            self.counters = self.counters.plus(invariant_violations=1)
            raise

    # ---- release -------------------------------------------------------------------------------

    def num_blocks_to_keep(self, req_id: str, num_vllm_blocks: int, reclaim_now: bool) -> int:
        """How many of its `num_vllm_blocks` blocks the request keeps now (the rest go back)."""
        state = self.requests.get(req_id)
        if state is None or not self.settings.evicts or state.has_moves_in_flight or state.pending_src:
            return num_vllm_blocks
        if self.settings.variant == "naive-evict":
            keep = max(naive_num_blocks(state.table), state.table.num_blocks)
        elif reclaim_now:
            keep = state.table.num_blocks
        else:
            return num_vllm_blocks
        return min(num_vllm_blocks, keep)

    def blocks_released(self, req_id: str, num_blocks_kept: int, num_blocks_freed: int) -> None:
        self._truncations[req_id] = num_blocks_kept
        self.counters = self.counters.plus(blocks_reclaimed=num_blocks_freed)

    def is_reclaim_step(self, step_idx: int, num_allocated_blocks: int) -> bool:
        """Stage 1 of the reclaimer: every k steps, when F over vLLM's blocks is at least theta_F."""
        reclaim = self.settings.reclaim
        if not self.settings.reclaims or step_idx % reclaim.check_interval_steps:
            return False
        return self.stats(num_allocated_blocks).waste_ratio >= reclaim.theta_f

    # ---- lifetimes -----------------------------------------------------------------------------

    def drop(self, req_id: str, is_finished: bool) -> None:
        """vLLM freed the request's blocks: finished (forget it) or preempted (rebuild on resume)."""
        state = self.requests.pop(req_id, None)
        self._truncations.pop(req_id, None)
        if is_finished:
            state = state or self._resumed.pop(req_id, None)
            self._req_idx_of.pop(req_id, None)
        if state is None:
            return
        if is_finished and state.eviction.resume_token_ids is not None and self.record_events:
            # It finished on the token its recompute sampled, before the re-eviction: that
            # token saw every token, which the recorded resume length tells the reference.
            state.events.append(EvictionEvent(state.table.num_tokens, state.eviction.resume_token_ids, is_resume=True))
        if not is_finished and self.settings.evicts:
            self.eviction.on_preempt(state.eviction, state.table)
        self.ledger.free(np.asarray(state.table.release_all(), dtype=np.int64))
        if is_finished:
            if self.record_events:
                self.finished_events[state.req_idx] = state.events
            return
        self.counters = self.counters.plus(preemptions=1)
        table = self.table_factory(state.req_idx, self.ledger, max(64, state.table.num_tokens))
        self._resumed[req_id] = _Request(state.req_idx, table, state.eviction, events=state.events, scores=state.scores)

    def events_of(self, req_idx: int) -> list[EvictionEvent]:
        """Recorded evictions of a request by its integer id (the order requests were added)."""
        for state in (*self.requests.values(), *self._resumed.values()):
            if state.req_idx == req_idx:
                return state.events
        return self.finished_events.get(req_idx, [])

    # ---- metrics -------------------------------------------------------------------------------

    def stats(self, num_allocated_blocks: int) -> EngineStats:
        num_live = sum(s.table.num_live_tokens for s in self.requests.values())
        histogram = self.ledger.utilization_histogram()
        num_ledger_blocks = self.ledger.num_allocated_blocks
        if self.prefix_cache is not None and len(self.requests) > 1:
            # a block shared through the prefix cache is whole in each sharer's table: count it once
            ids = np.concatenate([self.vllm_id_of[s.table.held_block_ids] for s in self.requests.values()])
            num_duplicates = ids.size - np.unique(ids).size
            num_live -= self.block_size * num_duplicates
            histogram[-1] -= num_duplicates
            num_ledger_blocks -= num_duplicates
        histogram[0] += max(0, num_allocated_blocks - num_ledger_blocks)
        return EngineStats(self.settings.variant, len(self.requests), num_live, num_allocated_blocks,
                           self.block_size, self.counters, tuple(int(n) for n in histogram))
