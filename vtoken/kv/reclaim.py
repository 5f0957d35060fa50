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

Two planning modes, hole-fill (the default) and ordered (the paper's): planning.py.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np

from vtoken import defaults
from vtoken.errors import ConfigError
from vtoken.kv.block_pool import BlockPool
from vtoken.kv.moves import RelocationPlan
from vtoken.kv.planning import Movables, plan_hole_fill, plan_hole_fill_each, plan_ordered
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


def most_reclaimable_first(tables: Iterable[TokenTable], busy_req_ids: frozenset[int]) -> Iterator[tuple[TokenTable, Movables]]:
    """The requests with a reclaimable block, most reclaimable blocks first, ties by req_id.

    Lazy: every request enters a heap keyed by its O(1) upper bound (`max_reclaimable_blocks`),
    and only the one on top gets its exact count (`Movables.of` of it, a few numpy calls), which goes
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
        movable = Movables.of([table])
        num_reclaimable = int(movable.num_reclaimable[0])
        if num_reclaimable > 0:
            heapq.heapreplace(heap, (-num_reclaimable, req_id, table_idx, movable, table))
        else:
            heapq.heappop(heap)


def _src_blocks_to_free(mode: str, num_blocks: int, max_src_blocks: int) -> int:
    """Source blocks a plan may take to free `num_blocks`: hole-fill frees every source it
    empties, so exactly that many; an ordered plan frees its sources minus its destinations,
    which depends on their fill, so it keeps the batch size B (the number of plans is bounded)."""
    return min(max_src_blocks, num_blocks) if mode == "hole-fill" else max_src_blocks


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
