"""The reclaimer: decides which live tokens to move so that whole blocks come free.

Four stages (DESIGN.md §3): eligibility, headroom, planning, copy. This module owns the first
three and mutates nothing: `plan` reads the pool and the token tables and returns
`RelocationPlan`s; the runtime launches the copy and, once it completed, applies the moves to
the table and frees the sources.

Two triggers. Lazy (the paper's): every k steps, when F >= theta_F and few blocks are free,
plan over everything (`is_eligible`, `plan`). Under pressure: when the blocks the runtime needs
now (the next steps' growth of the running requests, and the prompt of the admission waiting
for blocks) do not fit in the free pool with `pressure_reserve_blocks` to spare, plan now,
whatever F and the step, and only until that shortfall is freed (`num_blocks_short`,
`plan_to_free`). The lazy trigger alone leaves a request up to 1 / (1 - theta_F) above its
packed footprint exactly when memory decides whether a request is admitted or preempted.

    free pool:  |<------------- free ------------->|
    needed:     |<-- growth + admission -->|<-res->|           fits: no pressure, lazy only
    needed:     |<---- growth + admission ---->|<-res->|       short by 4: free 4 blocks now

Two planning modes, both only over blocks the request alone owns (never a shared or pinned
prefix block) and never over the open tail block, where new tokens are being appended:

hole-fill (default, fewest moves): live tokens of the request's *last* blocks move into the
holes of its earlier blocks; the emptied blocks are freed. No destination blocks are needed.
Valid because cached keys already carry their rotary position and attention does not depend on
the order of keys.

    before:  [L . L L][L L . .][. L . L][L L L . tail]
    after:   [L L L L][L L L .][. . . .][L L L . tail]   the third block freed, 2 moves

ordered (the paper's): the live tokens of up to B lowest-utilization blocks are copied in
logical order into ceil(T/S) fresh blocks taken from the headroom, out of place.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np

from vtoken import defaults
from vtoken.errors import ConfigError
from vtoken.kv.arrays import block_slots
from vtoken.kv.block_pool import NO_BLOCKS, BlockPool
from vtoken.kv.moves import Moves
from vtoken.kv.token_table import TokenTable

RECLAIM_MODES = ("hole-fill", "ordered")


@dataclass(frozen=True)
class ReclaimConfig:
    mode: str = defaults.RECLAIM_MODE
    theta_f: float = defaults.THETA_F  # plan only when the pool's waste ratio F is at least this
    low_watermark_frac: float = 1.0  # ... and fewer than this fraction of blocks is free (1.0: always)
    check_interval_steps: int = defaults.RECLAIM_INTERVAL_STEPS  # k: eligibility is checked every k engine iterations
    max_src_blocks: int = 64  # B: source blocks per plan
    headroom_blocks: int | None = None  # reserve for ordered destinations; default B (0 for hole-fill)
    max_moves_per_round: int | None = None  # stop planning a round once its plans move this many tokens
    # blocks kept free beyond what pressure needs now, so that a packing round lasts a few steps;
    # default: 1% of the pool, at least 1
    pressure_reserve_blocks: int | None = None

    def __post_init__(self) -> None:
        if self.mode not in RECLAIM_MODES:
            raise ConfigError(f"unknown reclaim mode '{self.mode}'; choose one of: {', '.join(RECLAIM_MODES)}")
        if not 0.0 < self.theta_f < 1.0:
            raise ConfigError(f"theta_F must be in (0, 1), got {self.theta_f}")
        if not 0.0 < self.low_watermark_frac <= 1.0:
            raise ConfigError(f"low watermark must be a fraction in (0, 1], got {self.low_watermark_frac}")
        if self.check_interval_steps <= 0:
            raise ConfigError(f"reclaim check interval must be > 0 steps, got {self.check_interval_steps}")
        if self.max_src_blocks < 2:
            raise ConfigError(f"reclaim batch size B must be >= 2 blocks, got {self.max_src_blocks}")
        if self.headroom_blocks is not None and self.headroom_blocks < 0:
            raise ConfigError(f"headroom must be >= 0 blocks, got {self.headroom_blocks}")
        if self.max_moves_per_round is not None and self.max_moves_per_round <= 0:
            raise ConfigError(f"reclaim budget must be > 0 tokens moved per round, got {self.max_moves_per_round}")
        if self.pressure_reserve_blocks is not None and self.pressure_reserve_blocks < 0:
            raise ConfigError(f"pressure reserve must be >= 0 blocks, got {self.pressure_reserve_blocks}")

    @property
    def num_headroom_blocks(self) -> int:
        if self.headroom_blocks is not None:
            return self.headroom_blocks
        return self.max_src_blocks if self.mode == "ordered" else 0


@dataclass(frozen=True)
class RelocationPlan:
    """Moves for one request. Sources are freed and destinations adopted when the copy completes."""

    req_id: int
    mode: str
    moves: Moves
    src_block_ids: np.ndarray  # blocks emptied by the moves, freed on completion
    dst_new_block_ids: np.ndarray  # fresh destination blocks (ordered); empty for hole-fill
    layout_version: int  # the table's version the plan was computed from

    @property
    def num_tokens_moved(self) -> int:
        return self.moves.num_moves

    @property
    def num_blocks_freed(self) -> int:
        return int(self.src_block_ids.size - self.dst_new_block_ids.size)


class Reclaimer:
    def __init__(self, config: ReclaimConfig, pool: BlockPool) -> None:
        self.config = config
        self.pool = pool
        self.num_low_watermark_blocks = int(np.ceil(config.low_watermark_frac * pool.num_blocks))
        reserve = config.pressure_reserve_blocks
        self.num_pressure_reserve_blocks = max(1, -(-pool.num_blocks // 100)) if reserve is None else reserve

    def is_eligible(self, step_idx: int) -> bool:
        """Stage 1: every k steps, F >= theta_F and free blocks below the low watermark."""
        return (
            step_idx % self.config.check_interval_steps == 0
            and self.pool.num_free_blocks < self.num_low_watermark_blocks
            and self.pool.waste_ratio() >= self.config.theta_f
        )

    def num_admissible_blocks(self) -> int:
        """Stage 2: free blocks admission may take; the headroom stays for destinations."""
        return max(0, self.pool.num_free_blocks - self.config.num_headroom_blocks)

    def num_blocks_short(self, num_blocks_needed: int) -> int:
        """Stage 1 under pressure: blocks to free now so that `num_blocks_needed` more fit in
        the admissible pool with the pressure reserve to spare; 0 when they do (no pressure)."""
        return max(0, num_blocks_needed + self.num_pressure_reserve_blocks - self.num_admissible_blocks())

    def plan(self, tables: Iterable[TokenTable], busy_req_ids: frozenset[int] = frozenset()) -> list[RelocationPlan]:
        """Stage 3: plans for the given requests, most reclaimable first; mutates nothing.

        Requests in `busy_req_ids` (a plan in flight) are skipped. Ordered plans stop when the
        free blocks run out.
        """
        return self._plans(tables, busy_req_ids, None)

    def plan_to_free(self, tables: Iterable[TokenTable], busy_req_ids: frozenset[int],
                     num_blocks: int) -> list[RelocationPlan]:
        """Stage 3 under pressure: as `plan`, but only until the plans free `num_blocks` blocks
        (fewer when the requests cannot give that many). A hole-fill plan takes no more source
        blocks than the shortfall left, so the copy work is bounded by what the pressure needs."""
        return self._plans(tables, busy_req_ids, num_blocks)

    def plan_repack(self, table: TokenTable, num_blocks: int) -> list[RelocationPlan]:
        """Stage 3 for one request that holds `num_blocks` more blocks than its uncompacted
        layout would (the runtime's layout trigger): plans over it alone, until they are freed."""
        return self._plans([table], frozenset(), num_blocks)

    def _plans(self, tables: Iterable[TokenTable], busy_req_ids: frozenset[int],
               num_blocks_wanted: int | None) -> list[RelocationPlan]:
        if self.config.mode == "hole-fill" and num_blocks_wanted is None and self.config.max_moves_per_round is None:
            return self._hole_fill_round(tables, busy_req_ids)
        plans: list[RelocationPlan] = []
        num_dst_used, num_moved = 0, 0
        budget = self.config.max_moves_per_round
        num_freed = 0
        for table, movable in most_reclaimable_first(tables, busy_req_ids):
            if budget is not None and num_moved >= budget:
                break
            max_src_blocks = self.config.max_src_blocks
            if num_blocks_wanted is not None:
                if num_freed >= num_blocks_wanted:
                    break
                max_src_blocks = _src_blocks_to_free(self.config.mode, num_blocks_wanted - num_freed, max_src_blocks)
            if self.config.mode == "hole-fill":
                plan = plan_hole_fill(table, max_src_blocks, movable)
            else:
                plan = plan_ordered(table, max_src_blocks, self.pool, num_dst_used, movable)
            if plan is not None:
                plans.append(plan)
                num_dst_used += plan.dst_new_block_ids.size
                num_moved += plan.num_tokens_moved
                num_freed += plan.num_blocks_freed
        return plans


    def _hole_fill_round(self, tables: Iterable[TokenTable], busy_req_ids: frozenset[int]) -> list[RelocationPlan]:
        """A lazy hole-fill round without a move budget: every request's plan at once
        (`plan_hole_fill_each`, a fixed number of numpy calls for the round), then most
        reclaimable first, ties by req_id. The order and the plans are `most_reclaimable_first`'s
        and `plan_hole_fill`'s: hole-fill plans are independent of each other, so planning them
        all and then ordering them gives what planning them one by one in that order gives. A
        round with a budget (or under pressure) plans one request at a time instead, since it
        stops after the first few: planning every request to keep one costs more than it saves."""
        candidates = [(idx, table) for idx, table in enumerate(tables)
                      if table.req_id not in busy_req_ids and table.max_reclaimable_blocks() > 0]
        if not candidates:
            return []
        movables = Movables.of([table for _, table in candidates])
        plans = plan_hole_fill_each(movables, self.config.max_src_blocks)
        ranked = sorted((-int(num), table.req_id, idx, plan)
                        for (idx, table), num, plan in zip(candidates, movables.num_reclaimable.tolist(), plans)
                        if plan is not None)
        return [plan for *_, plan in ranked]


def most_reclaimable_first(tables: Iterable[TokenTable], busy_req_ids: frozenset[int]) -> Iterator[tuple[TokenTable, _Movable]]:
    """The requests with a reclaimable block, most reclaimable blocks first, ties by req_id.

    Lazy: every request enters a heap keyed by its O(1) upper bound (`max_reclaimable_blocks`),
    and only the one on top gets its exact count (`_Movable.of`, a few numpy calls), which goes
    back in under its exact key. An exact entry on top precedes every other, since no exact
    count exceeds its bound; so the order equals sorting every exact count, and a round that
    stops early (a budget, a pressure shortfall) reads the live counts of only the requests it
    plans for, not of every request.
    """
    heap = []  # (-blocks, req_id, position in `tables`: the tie a stable sort would keep, exact, table)
    for table_idx, table in enumerate(tables):
        if table.req_id not in busy_req_ids:
            bound = table.max_reclaimable_blocks()
            if bound > 0:
                heap.append((-bound, table.req_id, table_idx, None, table))
    heapq.heapify(heap)
    while heap:
        _, req_id, table_idx, movable, table = heap[0]
        if movable is not None:
            heapq.heappop(heap)
            yield table, movable
            continue
        movable = _Movable.of(table)
        if movable.num_reclaimable > 0:
            heapq.heapreplace(heap, (-movable.num_reclaimable, req_id, table_idx, movable, table))
        else:
            heapq.heappop(heap)


def _src_blocks_to_free(mode: str, num_blocks: int, max_src_blocks: int) -> int:
    """Source blocks a plan may take to free `num_blocks`: hole-fill frees every source it
    empties, so exactly that many; an ordered plan frees its sources minus its destinations,
    which depends on their fill, so it keeps the batch size B (the number of plans is bounded)."""
    return min(max_src_blocks, num_blocks) if mode == "hole-fill" else max_src_blocks


@dataclass(frozen=True)
class _Movable:
    """A request's movable blocks and their live counts, read once per planning pass."""

    block_ids: np.ndarray
    live_counts: np.ndarray
    num_reclaimable: int

    @classmethod
    def of(cls, table: TokenTable) -> _Movable:
        return Movables.of([table]).one(0)


@dataclass(frozen=True)
class Movables:
    """The movable blocks of several requests (`movable_block_ids`), concatenated in the
    requests' order, with their live counts: request k's are [starts[k], ends[k])."""

    tables: list[TokenTable]
    block_ids: np.ndarray
    live_counts: np.ndarray
    starts: np.ndarray
    ends: np.ndarray
    num_live: np.ndarray  # [requests] live tokens in their movable blocks
    num_reclaimable: np.ndarray  # [requests] blocks a perfect packing of those would give back

    @classmethod
    def of(cls, tables: list[TokenTable]) -> Movables:
        """One numpy pass over every request's held blocks (a slice per request, then the pool's
        ref counts and live counts read once for all of them)."""
        pool, block_size = tables[0].pool, tables[0].block_size
        held = []
        for table in tables:
            table_held = table.held_block_ids
            end = table_held.size - (table_held.size > table.num_pinned_blocks and table.tail_num_written < block_size)
            held.append(table_held[table.num_pinned_blocks : end])
        block_ids = np.concatenate(held) if len(held) > 1 else held[0]
        unshared = pool.ref_counts[block_ids] == 1
        counts = np.cumsum(unshared)  # unshared blocks up to each held one: the requests' new bounds
        ends_held = np.cumsum([h.size for h in held])
        ends = np.where(ends_held > 0, counts[np.maximum(ends_held - 1, 0)], 0) if block_ids.size else np.zeros(len(held), np.int64)
        starts = np.concatenate(([0], ends[:-1]))
        block_ids = block_ids[unshared]
        live_counts = pool.live_counts[block_ids]
        live_before = np.concatenate(([0], np.cumsum(live_counts)))
        num_live = live_before[ends] - live_before[starts]
        return cls(tables, block_ids, live_counts, starts, ends, num_live, (ends - starts) - -(-num_live // block_size))

    def one(self, k: int) -> _Movable:
        start, end = int(self.starts[k]), int(self.ends[k])
        return _Movable(self.block_ids[start:end], self.live_counts[start:end], int(self.num_reclaimable[k]))


def num_reclaimable_blocks(table: TokenTable) -> int:
    """Blocks a perfect packing of the request's relocatable live tokens would give back."""
    return _Movable.of(table).num_reclaimable


def num_uncompacted_blocks(table: TokenTable) -> int:
    """Blocks the request would hold had nothing ever been moved (naive-evict's layout): every
    logical block of S token ids with a live token, and the one being written.

        token ids:  [0..S) [S..2S) [2S..3S) [3S..4S)      live ids 1, 2S+3, 3S+1 (writing)
        held:        yes    no      yes      yes           -> 3 blocks
    """
    if not table.num_tokens:
        return 0
    num_before_writing = (table.num_tokens - 1) // table.block_size  # the block being written counts, live or not
    live = table.live_mask[: num_before_writing * table.block_size].reshape(num_before_writing, table.block_size)
    return int(np.count_nonzero(live.any(axis=1))) + 1


def movable_block_ids(table: TokenTable) -> np.ndarray:
    """Blocks a plan may touch: held, not a pinned prefix, not the open tail, not shared."""
    held = table.held_block_ids[table.num_pinned_blocks :]
    if held.size and table.tail_num_written < table.block_size:
        held = held[:-1]
    return held[table.pool.ref_counts[held] == 1]


def plan_hole_fill(table: TokenTable, max_src_blocks: int, movable: _Movable | None = None) -> RelocationPlan | None:
    """The hole-fill plan of one request (`plan_hole_fill_each` of it alone)."""
    movable = movable or _Movable.of(table)
    num_blocks, num_live = movable.block_ids.size, int(movable.live_counts.sum())
    movables = Movables([table], movable.block_ids, movable.live_counts, np.array([0]), np.array([num_blocks]),
                        np.array([num_live]), np.array([movable.num_reclaimable]))
    return plan_hole_fill_each(movables, max_src_blocks)[0]


def plan_hole_fill_each(movables: Movables, max_src_blocks: int) -> list[RelocationPlan | None]:
    """The hole-fill plan of every request of `movables` (None where it has none), with a fixed
    number of numpy calls over all their blocks, not a few dozen per request.

    Per request, over its movable blocks in order (positions i = 0..n-1): the last blocks are
    sources while the live tokens of the last 1, 2, ... of them fit in the holes before them, up
    to B = min(max_src_blocks, n - 1) sources. Position i can start the sources when the live
    tokens in [i, n) fit in the holes of [0, i); the sources are the longest run of such
    positions from the end. Their live tokens, in logical order, fill the first holes of the
    kept blocks, in block order and offsets ascending; the moves pair them in that order.
    """
    block_size, pool = movables.tables[0].block_size, movables.tables[0].pool
    starts, ends = movables.starts, movables.ends
    sizes = ends - starts
    planned = (movables.num_reclaimable > 0) & (sizes >= 2)
    plans: list[RelocationPlan | None] = [None] * len(movables.tables)
    if not planned.any():
        return plans
    request_of = np.repeat(np.arange(sizes.size), sizes)  # the request of each movable block
    position = np.arange(request_of.size) - starts[request_of]
    live = movables.live_counts.astype(np.int64)
    live_before = np.cumsum(live) - live  # live tokens before each block, over all requests
    holes_before = np.cumsum(block_size - live) - (block_size - live)
    live_before_in = live_before - live_before[starts][request_of]  # ... within its request
    holes_before_in = holes_before - holes_before[starts][request_of]
    live_from = movables.num_live[request_of] - live_before_in  # live tokens in [i, n)
    num_from_end = sizes[request_of] - position  # sources if the run starts here (n - i)
    max_src = np.minimum(max_src_blocks, sizes - 1)
    stops = (live_from > holes_before_in) | (num_from_end > max_src[request_of])
    # the run from the end stops at the last position that cannot start it (position 0 always
    # stops it: it would leave no block to fill)
    last_stop = np.full(sizes.size, -1, dtype=np.int64)
    np.maximum.at(last_stop, request_of[stops], position[stops])
    num_src = np.where(planned, sizes - 1 - last_stop, 0)
    planned &= num_src > 0
    if not planned.any():
        return plans
    is_src = position >= (sizes - num_src)[request_of]
    is_src &= planned[request_of]
    num_moves = np.where(planned, live_from[np.minimum(ends - num_src, request_of.size - 1)], 0)
    # the sources' live tokens, in logical order per request (the pool's reverse map)
    src_blocks, src_request = movables.block_ids[is_src], request_of[is_src]
    slots = block_slots(src_blocks, block_size)
    token_ids = pool.token_at[slots]
    is_live = token_ids >= 0
    slots, token_ids, token_request = slots[is_live], token_ids[is_live], np.repeat(src_request, block_size)[is_live]
    order = np.lexsort((token_ids, token_request))
    slots, token_ids = slots[order], token_ids[order]
    # the holes: only kept blocks of a planned request whose free slots before them fall short
    # of its moves, and that have a free slot
    need = num_moves[request_of]
    is_dst = ~is_src & planned[request_of] & (holes_before_in < need) & (live < block_size)
    dst_blocks, dst_request = movables.block_ids[is_dst], request_of[is_dst]
    dst_slots = block_slots(dst_blocks, block_size)
    is_hole = pool.token_at[dst_slots] < 0
    dst_slots, hole_request = dst_slots[is_hole], np.repeat(dst_request, block_size)[is_hole]
    rank = np.arange(hole_request.size) - np.searchsorted(hole_request, hole_request)
    dst_slots = dst_slots[rank < num_moves[hole_request]]
    src_sorted = np.lexsort((src_blocks, src_request))
    src_blocks_sorted = src_blocks[src_sorted]
    move_ends = np.cumsum(num_moves)
    src_ends = np.cumsum(num_src)
    src_block_of, src_offset_of = slots // block_size, slots % block_size
    dst_block_of, dst_offset_of = dst_slots // block_size, dst_slots % block_size
    for k in np.flatnonzero(planned).tolist():
        table = movables.tables[k]
        a, b = int(move_ends[k] - num_moves[k]), int(move_ends[k])
        moves = Moves(token_ids[a:b], src_block_of[a:b], src_offset_of[a:b], dst_block_of[a:b], dst_offset_of[a:b])
        sources = src_blocks_sorted[int(src_ends[k] - num_src[k]) : int(src_ends[k])]
        plans[k] = RelocationPlan(table.req_id, "hole-fill", moves, sources, NO_BLOCKS, table.layout_version)
    return plans


def plan_ordered(table: TokenTable, max_src_blocks: int, pool: BlockPool, num_dst_used: int,
                 movable: _Movable | None = None) -> RelocationPlan | None:
    movable = movable or _Movable.of(table)
    block_ids, live_counts = movable.block_ids, movable.live_counts
    order = np.argsort(live_counts, kind="stable")
    src_block_ids = block_ids[order[:max_src_blocks]]
    src_block_ids = src_block_ids[pool.live_counts[src_block_ids] < table.block_size]
    num_live = int(pool.live_counts[src_block_ids].sum())
    num_dst = -(-num_live // table.block_size)
    if num_dst >= src_block_ids.size or num_dst_used + num_dst > pool.num_free_blocks:
        return None
    dst_new_block_ids = pool.peek_free(num_dst_used + num_dst)[num_dst_used:]
    token_ids, block_of_token, offset_of_token = _live_tokens_in(table, src_block_ids)
    positions = np.arange(num_live)
    moves = Moves(token_ids, block_of_token, offset_of_token, dst_new_block_ids[positions // table.block_size], positions % table.block_size)
    return RelocationPlan(table.req_id, "ordered", moves, np.sort(src_block_ids), dst_new_block_ids, table.layout_version)


def _live_tokens_in(table: TokenTable, block_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Live tokens of `table` stored in `block_ids`, in logical order, with their slots."""
    token_ids = table.live_ids_in(block_ids)
    slots = table.token_slots[token_ids]
    return token_ids, slots // table.block_size, slots % table.block_size
