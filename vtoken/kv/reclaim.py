"""The reclaimer: decides which live tokens to move so that whole blocks come free.

Four stages (DESIGN.md §3): eligibility, headroom, planning, copy. This module owns the first
three and mutates nothing: `plan` reads the pool and the token tables and returns
`RelocationPlan`s; the runtime launches the copy and, once it completed, applies the moves to
the table and frees the sources.

Two triggers. Lazy (the paper's): every k steps, when F >= theta_F and few blocks are free, a
round starts over every request with a reclaimable block (`is_eligible`, `plan`). The round
goes on over the next steps when it is larger than a step's share, `max_moves_per_step` tokens
moved: the requests it has not reached yet are planned at a later step, each against its layout
then, so that no step carries a whole round's relocation work (its host bookkeeping, and its
copies, which must fit behind the forward: the sim charges what does not). Under pressure: when the blocks the runtime needs
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
from vtoken.kv.planning import Movables, plan_hole_fill, plan_hole_fill_round, plan_ordered
from vtoken.kv.token_table import TokenTable

RECLAIM_MODES = ("hole-fill", "ordered")
# A budgeted step plans requests whose moves at most (bound x S) add up to this many budgets:
# the bound counts S moves for every block a perfect packing would free, where a hole-fill plan
# moves the live tokens of its sources, about half of that on the Azure trace (8.2 moves per
# freed block); the plans past the budget wait for the next step.
ROUND_PLANNING_SLACK = 2


@dataclass(frozen=True)
class StepShare:
    """A lazy round step's budget that follows the step it runs after (`--reclaim-budget auto`):
    `moves_per_ms` tokens moved for every millisecond that step took (the sim's modelled step,
    an executor's measured one), two blocks' worth at least. A fixed budget is a small share of
    a long step and a large one of a short step: with the default 2,048 moves, the worst step's
    evictions and round step took 0.45 ms of host time, 1.33% of the 33.6 ms step of 64
    requests x 8K tokens, and 0.75 ms, 0.18% of the 418 ms step of 256 x 32K
    (benchmarks/bench_substrate.py, the README's table).

    The default 10 a millisecond is 0.5% of the step at 0.5 us of host bookkeeping a moved
    token (plan, I4 check, apply, release, free: 0.3-0.5 us on the 2-core host in plans of a
    few hundred moves), half the 1% goal: a round step's fixed cost and the step's evictions
    share the rest.

    A step's plans take at most B' = 1.25 x budget / S source blocks each (2 at least, the
    configured B at most), so that a step moves at most 1.25x its budget however large a
    request's plan would be; a request whose plan B' cut short goes on at the next step, alone,
    until it has given the B blocks a round takes from a request at most, so that a round still
    takes up to B blocks from a request, over as many steps as that needs (`Reclaimer.plan`)."""

    moves_per_ms: float = defaults.RECLAIM_MOVES_PER_STEP_MS

    def __post_init__(self) -> None:
        if not self.moves_per_ms > 0:
            raise ConfigError(f"reclaim budget must be > 0 tokens moved per millisecond of the step, got {self.moves_per_ms:g}")

    def num_moves(self, step_s: float, block_size: int) -> int:
        """The budget of a round step after a step of `step_s` seconds."""
        return max(2 * block_size, int(self.moves_per_ms * 1e3 * step_s))

    def num_src_blocks(self, num_moves: int, block_size: int, max_src_blocks: int) -> int:
        """B' of a step with a budget of `num_moves`: `src_blocks_for_moves`, within the
        configured B (`max_src_blocks`)."""
        return min(max_src_blocks, src_blocks_for_moves(num_moves, block_size))


def src_blocks_for_moves(num_moves: int, block_size: int) -> int:
    """Source blocks a plan may take under a budget of `num_moves` a step: 1.25x that many
    slots, 2 at least. A request's last blocks are mostly full (recent tokens), so one such plan
    usually fills a step alone, and a step moves at most max(budget, that x S), 1.25x the budget."""
    return max(2, 5 * num_moves // (4 * block_size))


@dataclass(frozen=True)
class ReclaimConfig:
    mode: str = defaults.RECLAIM_MODE
    theta_f: float = defaults.THETA_F  # plan only when the pool's waste ratio F is at least this
    low_watermark_frac: float = 1.0  # ... and fewer than this fraction of blocks is free (1.0: always)
    check_interval_steps: int = defaults.RECLAIM_INTERVAL_STEPS  # k: eligibility is checked every k engine iterations
    max_src_blocks: int = defaults.RECLAIM_BATCH_BLOCKS  # B: source blocks per plan
    headroom_blocks: int | None = None  # reserve for ordered destinations; default B (0 for hole-fill)
    # a lazy round launches plans that move at most this many tokens a step (one request's plan
    # at least) and goes on at the next steps; a StepShare: a number that follows the step;
    # None: the whole round in the step it starts
    max_moves_per_step: int | StepShare | None = defaults.RECLAIM_MOVES_PER_STEP
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
        if self.max_moves_per_step is not None and not isinstance(self.max_moves_per_step, StepShare) and self.max_moves_per_step <= 0:
            raise ConfigError(f"reclaim budget must be > 0 tokens moved per step, got {self.max_moves_per_step}")
        if self.pressure_reserve_blocks is not None and self.pressure_reserve_blocks < 0:
            raise ConfigError(f"pressure reserve must be >= 0 blocks, got {self.pressure_reserve_blocks}")

    @property
    def num_headroom_blocks(self) -> int:
        if self.headroom_blocks is not None:
            return self.headroom_blocks
        return self.max_src_blocks if self.mode == "ordered" else 0


class Reclaimer:
    """Decides when to plan, for which requests, and what the plans move; changes no table and
    no block. Its one state is the lazy round in progress: the requests it has yet to plan."""

    def __init__(self, config: ReclaimConfig, pool: BlockPool) -> None:
        self.config = config
        self.pool = pool
        self.num_low_watermark_blocks = int(np.ceil(config.low_watermark_frac * pool.num_blocks))
        reserve = config.pressure_reserve_blocks
        self.num_pressure_reserve_blocks = max(1, -(-pool.num_blocks // 100)) if reserve is None else reserve
        self.num_headroom_blocks = config.num_headroom_blocks  # the config is frozen; asked every step
        self._round_req_ids: list[int] = []  # the lazy round's requests still to plan, the next one last
        # StepShare: source blocks the round's plans took from each request that goes on (a plan
        # B' cut short), against the B a round takes from it at most
        self._round_blocks_taken: dict[int, int] = {}

    @property
    def is_round_in_progress(self) -> bool:
        return bool(self._round_req_ids)

    def is_eligible(self, step_idx: int) -> bool:
        """Stage 1: every step while a lazy round is in progress; else every k steps, when F >=
        theta_F and free blocks are below the low watermark."""
        return bool(self._round_req_ids) or (
            step_idx % self.config.check_interval_steps == 0
            and self.pool.num_free_blocks < self.num_low_watermark_blocks
            and self.pool.waste_ratio() >= self.config.theta_f
        )

    def num_admissible_blocks(self) -> int:
        """Stage 2: free blocks admission may take; the headroom stays for destinations."""
        return max(0, self.pool.num_free_blocks - self.num_headroom_blocks)

    def num_blocks_short(self, num_blocks_needed: int) -> int:
        """Stage 1 under pressure: blocks to free now so that `num_blocks_needed` more fit in
        the admissible pool with the pressure reserve to spare; 0 when they do (no pressure)."""
        return max(0, num_blocks_needed + self.num_pressure_reserve_blocks - self.num_admissible_blocks())

    def plan(self, tables: Iterable[TokenTable], busy_req_ids: frozenset[int] = frozenset(),
             step_s: float | None = None) -> list[RelocationPlan]:
        """Stage 3, lazy: this step's plans of the lazy round over `tables` (the running
        requests), starting one when none is in progress; changes no table and no block.
        `step_s`: the duration of the step this one runs after, which a `StepShare` budget
        needs (`step_budget`): its plans then take at most its B' source blocks each, and a
        request whose plan B' cut (B' source blocks, B' < B) comes first at the next step, until
        it has given the B blocks a round takes from a request at most: it is then planned
        alone, within B' and what is left of its B.

        A round takes every request with a reclaimable block (by the O(1) bound), the most
        first, ties by req_id. A step plans the next of them while the moves they can make at
        most (bound x S each, B x S at most) fit in ROUND_PLANNING_SLACK budgets, and launches
        their plans, most reclaimable first, while they move at most `max_moves_per_step`
        tokens (one plan at least); the requests whose plans it did not launch come first at
        the next step, and the others after them, each planned against its layout then (skipped
        if it left, is busy or has nothing to give back). A hole-fill step counts each
        request's moves from the live counts before it makes the plan, and makes only the plans
        it launches (`within_budget`'s cut, in the planning call). So a step moves at most
        max(max_moves_per_step, B x S) tokens. Without a budget the whole round is planned and
        launched at once. Requests in `busy_req_ids` (a plan in flight) are skipped. Ordered
        plans stop when the free blocks run out.
        """
        tables = list(tables)
        budget, per_plan = self.step_budget(step_s)
        if budget is None:
            return self._plans(tables, busy_req_ids, None)[0]  # every planning entry point plans in _plans
        if not self._round_req_ids:
            self._round_req_ids = self._round_order(tables, busy_req_ids)
            self._round_blocks_taken = {}
        chosen = self._next_of_round(tables, busy_req_ids, ROUND_PLANNING_SLACK * budget, per_plan)
        max_src_blocks = self.config.max_src_blocks
        step_per_plan = per_plan
        if chosen and (num_taken := self._round_blocks_taken.get(chosen[0].req_id)) is not None:
            # it goes on from a plan B' cut (alone): within what is left of the B a round takes from it
            step_per_plan = min(per_plan, max_src_blocks - num_taken)
        plans, waiting_req_ids = self._plans(chosen, busy_req_ids, None, budget, step_per_plan)
        self._round_req_ids.extend(reversed(waiting_req_ids))
        if per_plan < max_src_blocks:  # a plan the step's B' cut goes on at the next step, first
            for plan in reversed(plans):
                num_taken = self._round_blocks_taken.get(plan.req_id, 0) + plan.src_block_ids.size
                if plan.src_block_ids.size == step_per_plan and num_taken < max_src_blocks:
                    self._round_blocks_taken[plan.req_id] = num_taken
                    self._round_req_ids.append(plan.req_id)
        return plans

    def step_budget(self, step_s: float | None) -> tuple[int | None, int]:
        """A lazy round step's budget, tokens moved (None: the whole round), and B, source
        blocks a plan takes at most, after a step of `step_s` seconds: the configured ones, or a
        `StepShare`'s budget for that step and its B', which need it."""
        budget = self.config.max_moves_per_step
        if not isinstance(budget, StepShare):
            return budget, self.config.max_src_blocks
        if step_s is None:
            raise ValueError("a reclaim budget that follows the step needs the step's duration (step_s)")
        block_size = self.pool.block_size
        num_moves = budget.num_moves(step_s, block_size)
        return num_moves, budget.num_src_blocks(num_moves, block_size, self.config.max_src_blocks)

    def _round_order(self, tables: list[TokenTable], busy_req_ids: frozenset[int]) -> list[int]:
        """A new round's requests, the next one last: every one with a reclaimable block by the
        O(1) bound, most first, ties by req_id."""
        ranked = sorted((-bound, table.req_id) for table in tables
                        if table.req_id not in busy_req_ids and (bound := table.max_reclaimable_blocks()) > 0)
        return [req_id for _, req_id in reversed(ranked)]

    def _next_of_round(self, tables: list[TokenTable], busy_req_ids: frozenset[int], max_moves: int,
                       per_block: int) -> list[TokenTable]:
        """This step's requests of the round: the next ones still running, idle and with a
        reclaimable block, while the tokens their plans of at most `per_block` source blocks
        can move at most fit in `max_moves` (one request at least). A request that goes on from
        a plan B' cut (`plan`) is chosen alone; while its copy is still in flight (asynchronous
        copies land at the next step) it waits in the round for it instead of leaving the round
        as a busy one does, and comes first again after this step's requests."""
        by_id = {table.req_id: table for table in tables}
        chosen, num_moves_at_most, in_flight = [], 0, []
        round_req_ids = self._round_req_ids
        while round_req_ids:
            req_id = round_req_ids[-1]
            table = by_id.get(req_id)
            if table is not None and req_id in busy_req_ids and req_id in self._round_blocks_taken:
                in_flight.append(round_req_ids.pop())
                continue
            bound = table.max_reclaimable_blocks() if table is not None and req_id not in busy_req_ids else 0
            if bound <= 0:
                round_req_ids.pop()
                continue
            goes_on = req_id in self._round_blocks_taken
            num_moves = min(bound, per_block) * table.block_size  # hole-fill: at most S moves per block freed
            if chosen and (goes_on or num_moves_at_most + num_moves > max_moves):
                break
            round_req_ids.pop()
            chosen.append(table)
            num_moves_at_most += num_moves
            if goes_on:
                break
        round_req_ids.extend(reversed(in_flight))
        return chosen

    def plan_to_free(self, tables: Iterable[TokenTable], busy_req_ids: frozenset[int],
                     num_blocks: int) -> list[RelocationPlan]:
        """Stage 3 under pressure: as `plan`, but only until the plans free `num_blocks` blocks
        (fewer when the requests cannot give that many). A hole-fill plan takes no more source
        blocks than the shortfall left, so the copy work is bounded by what the pressure needs."""
        return self._plans(tables, busy_req_ids, num_blocks)[0]

    def plan_repack(self, table: TokenTable, num_blocks: int) -> list[RelocationPlan]:
        """Stage 3 for one request that holds `num_blocks` more blocks than its uncompacted
        layout would (the runtime's layout trigger): plans over it alone, until they are freed."""
        return self._plans([table], frozenset(), num_blocks)[0]

    def _plans(self, tables: Iterable[TokenTable], busy_req_ids: frozenset[int], num_blocks_wanted: int | None,
               max_moves: int | None = None, max_src_blocks: int | None = None) -> tuple[list[RelocationPlan], list[int]]:
        """Plans over `tables`, most reclaimable first, until `num_blocks_wanted` are freed
        (None: every plan there is); with `max_moves` (a lazy round step's budget), the first of
        them while they move at most that many tokens, the first one whatever it moves
        (`within_budget`). Each plan takes at most `max_src_blocks` source blocks (None: the
        configured B). Returns the plans, and the req_ids of the requests with a plan past the
        budget, in order: a hole-fill round counts each request's moves before it plans it, so
        it does not make those plans; ordered plans are made and dropped."""
        per_plan = self.config.max_src_blocks if max_src_blocks is None else max_src_blocks
        if self.config.mode == "hole-fill" and num_blocks_wanted is None:
            plans, waiting = self._hole_fill_round(tables, busy_req_ids, max_moves, per_plan)
            return plans, [table.req_id for table in waiting]
        plans: list[RelocationPlan] = []
        num_dst_used = 0
        num_freed = 0
        for table, movable in most_reclaimable_first(tables, busy_req_ids):
            max_src_blocks = per_plan
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
                num_freed += plan.num_blocks_freed
        return within_budget(plans, max_moves) if max_moves is not None else (plans, [])


    def _hole_fill_round(self, tables: Iterable[TokenTable], busy_req_ids: frozenset[int], max_moves: int | None,
                         max_src_blocks: int) -> tuple[list[RelocationPlan], list[TokenTable]]:
        """Every hole-fill plan over `tables` at once (`plan_hole_fill_round`, one compiled call
        for them all), most reclaimable first, ties by req_id, or with `max_moves` the first of
        them within that many moves, and the tables of the others with a plan, in that order,
        left unplanned. The order and the plans are `most_reclaimable_first`'s and
        `plan_hole_fill`'s: hole-fill plans are independent of each other, so planning them all
        in that order gives what planning them one by one gives. Their arrays lie end to end in
        that order (moves.PlanBatch), so the plans a step launches are checked and landed with
        no concatenation. Planning under pressure, which stops after the first few, plans one
        request at a time instead: planning every request to keep one costs more than it saves."""
        candidates = [table for table in tables if table.req_id not in busy_req_ids and table.max_reclaimable_blocks() > 0]
        if not candidates:
            return [], []
        return plan_hole_fill_round(candidates, max_src_blocks, max_moves)


def reclaim_budget_text(moves: int | StepShare | None) -> int | str:
    """--reclaim-budget's text of a budget (`ReclaimConfig.max_moves_per_step`): its moves,
    'none', or 'auto' (a StepShare at the default rate; another rate, set through the library,
    as 'N/ms')."""
    if moves is None:
        return "none"
    if isinstance(moves, StepShare):
        return "auto" if moves == StepShare() else f"{moves.moves_per_ms:g}/ms"
    return moves


def within_budget(plans: list[RelocationPlan], max_moves: int) -> tuple[list[RelocationPlan], list[int]]:
    """The first `plans` while their moves add up to at most `max_moves` (the first one whatever
    it moves), and the req_ids of the others, in order: the cut of a lazy round step's plans
    (the hole-fill round makes it in its planning call, compiled.hole_fill_plans)."""
    num_launched, num_moved = 0, 0
    for plan in plans:
        if num_launched and num_moved + plan.num_tokens_moved > max_moves:
            break
        num_launched += 1
        num_moved += plan.num_tokens_moved
    return plans[:num_launched], [plan.req_id for plan in plans[num_launched:]]


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

