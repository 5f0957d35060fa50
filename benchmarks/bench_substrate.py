"""Host-side cost of the vToken substrate per decode step. A benchmark, not a test.

    python benchmarks/bench_substrate.py [--json PATH] [--repeats N] [--quick] [--sizes 64x8K,1024x8K]

R concurrent requests with an L-token context, block size S = 16, one new token per request
per step. Growth runs the same loop over the same calls (num_new_blocks_needed, allocate,
sync_new_tokens, slots) on two kinds of table:

    native   a plain block table: slot = block_table[pos // S] * S + pos % S for the new
             token, appended to a cached slot array (what a paged engine without eviction does)
    table    the token table (vtoken.kv.token_table), no eviction: the indirection alone

With eviction, each step adds, per request, one eviction from the unprotected middle (a random
live token outside the sinks and the recent window: one in, one out, as at a policy's steady
state) and the reclaimer (hole-fill, synchronous copies, no KV data). Two reclamation cadences:

    every-step  plan, launch and complete every step (the stress case: many one-block plans)
    default     the reclaimer's own gate (ReclaimConfig defaults: every k = 4 steps, when
                F >= theta_F = 0.25), measured over one whole cycle of it: from just after a
                reclamation round to the end of the next (B * S = 1,024 steps here), so that
                the mean amortizes the round; the worst step is that round
    budget      the default gate with max_moves_per_round = 2,048: rounds come every k steps
                while F >= theta_F, each moving at most about that many tokens, so that no
                step carries a whole round; 1,024 steps measured after 256 of warmup

Times are host microseconds of this process's CPU time (time.process_time: on a machine shared
with other work, wall time measures the others' load; `--wall` uses time.perf_counter); each
repetition takes the mean per step
after a warmup, the tables show the median over repetitions. Each evicting row also gives the
worst step's evict + reclaim, and both against the sim's modelled decode step of the same
configuration (StepCostModel, default model and GPU: one decode step of R requests reading
R x L KV tokens), as a share of it. Parts of an evicting step:
growth, evict (evict_tokens + release and free of blocks it emptied), reclaim (plan, launch,
apply_moves, release, free) and slots() of every request. Victims are chosen outside the timed
region (that is the policy's cost). check_plan (the I4 check the runtime runs on every plan) is
not included; its cost is reported apart.

A last table compares the two reclamation modes on the same eviction sequence: tokens the
reclaimer moved per block it freed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass

import numpy as np

from vtoken import defaults
from vtoken.engine.executor import StepLoad
from vtoken.engine.sim import SimExecutor, SimProfile
from vtoken.hardware import resolve_gpu
from vtoken.invariants import check_plan
from vtoken.kv.block_pool import BlockPool
from vtoken.kv.copy_engine import CopyEngine
from vtoken.kv.reclaim import ReclaimConfig, Reclaimer
from vtoken.kv.token_table import TokenTable
from vtoken.model_spec import resolve_model

BLOCK_SIZE = 16
NUM_SINK_TOKENS = 4
NUM_RECENT_TOKENS = 256
# (requests, context, steps of the growth and every-step measurements)
SCENARIOS = ((64, 8192, 400), (64, 32768, 200), (256, 8192, 100), (256, 32768, 60), (1024, 8192, 30))
clock = time.process_time  # main() sets time.perf_counter for --wall
TARGET_STEP_SHARE = 0.01  # evict + reclaim per step, of the modelled decode step
TARGET_TABLE_RATIO = 1.05
TARGET_EVICT_US_PER_STEP = 200.0  # at 64 requests x 8K


@dataclass(frozen=True)
class GrowthRow:
    num_requests: int
    context_tokens: int
    native_us: float  # per step, all requests
    table_us: float

    @property
    def ratio(self) -> float:
        return self.table_us / self.native_us


@dataclass(frozen=True)
class EvictRow:
    num_requests: int
    context_tokens: int
    cadence: str
    num_steps: int  # measured steps (default cadence: one reclamation cycle)
    growth_us: float  # per step, all requests; the four parts add up to the step
    evict_us: float
    reclaim_us: float
    slots_us: float
    max_reclaim_us: float  # the worst step's reclaim part
    plans_per_step: float
    check_plan_us_per_plan: float
    max_bookkeeping_us: float  # the worst step's evict + reclaim
    modelled_step_us: float  # the sim's decode step of this configuration

    @property
    def step_share(self) -> float:
        """Mean evict + reclaim per step over the modelled decode step."""
        return self.bookkeeping_us / self.modelled_step_us

    @property
    def worst_step_share(self) -> float:
        return self.max_bookkeeping_us / self.modelled_step_us

    @property
    def bookkeeping_us(self) -> float:
        """What eviction and reclamation add to a step: the target's quantity."""
        return self.evict_us + self.reclaim_us

    @property
    def total_us(self) -> float:
        return self.growth_us + self.evict_us + self.reclaim_us + self.slots_us


@dataclass(frozen=True)
class MovesRow:
    pattern: str
    mode: str
    num_tokens_moved: int
    num_blocks_freed: int  # by relocation plans
    tokens_per_freed_block: float
    num_blocks_freed_by_eviction: int  # emptied by the evictions themselves, no move needed


def modelled_step_us(num_requests: int, context_tokens: int) -> float:
    """The sim's duration of one decode step of `num_requests` requests with `context_tokens`
    each (every slot live), for the default model and GPU, in microseconds."""
    executor = SimExecutor(resolve_model(defaults.MODEL), resolve_gpu(defaults.GPU), SimProfile(), defaults.SEED)
    num_slots = num_requests * context_tokens
    load = StepLoad(1, num_slots, num_slots, num_requests, num_prefill_tokens=0, num_copied_tokens=0)
    return 1e6 * executor.iteration_time_s(load)


def num_pool_blocks(num_requests: int, context_tokens: int, num_steps: int) -> int:
    per_request = -(-(context_tokens + num_steps + 64) // BLOCK_SIZE) + 4
    return num_requests * per_request + 256


# ---- (a) native and (b) token table: growth with the same calls -----------------------------


class NativeTable:
    """A plain block table with the token table's growth calls: slot = block_table[pos // S] * S
    + pos % S for each new token, appended to a slot array (numpy buffers grown by doubling)."""

    def __init__(self, pool: BlockPool) -> None:
        self.block_size = pool.block_size
        self.block_table = np.zeros(64, dtype=np.int64)
        self.num_blocks = 0
        self.slot_buffer = np.zeros(1024, dtype=np.int64)
        self.num_tokens = 0

    def num_new_blocks_needed(self, num_new_tokens: int) -> int:
        overflow = self.num_tokens + num_new_tokens - self.num_blocks * self.block_size
        return -(-overflow // self.block_size) if overflow > 0 else 0

    def sync_new_tokens(self, new_block_ids: np.ndarray, num_tokens: int) -> None:
        if len(new_block_ids):
            end = self.num_blocks + len(new_block_ids)
            if end > self.block_table.size:
                self.block_table = np.concatenate((self.block_table, np.zeros(max(end, self.block_table.size), np.int64)))
            self.block_table[self.num_blocks : end] = new_block_ids
            self.num_blocks = end
        start = self.num_tokens
        if num_tokens > self.slot_buffer.size:
            self.slot_buffer = np.concatenate((self.slot_buffer, np.zeros(max(num_tokens, self.slot_buffer.size), np.int64)))
        if num_tokens == start + 1:
            self.slot_buffer[start] = self.block_table[start // self.block_size] * self.block_size + start % self.block_size
        else:
            positions = np.arange(start, num_tokens)
            self.slot_buffer[start:num_tokens] = self.block_table[positions // self.block_size] * self.block_size + positions % self.block_size
        self.num_tokens = num_tokens

    def slots(self) -> np.ndarray:
        return self.slot_buffer[: self.num_tokens]


NO_BLOCKS = np.zeros(0, dtype=np.int64)


def grow_one(pool: BlockPool, table: TokenTable | NativeTable) -> None:
    """The runtime's growth step for one new token: allocate what overflows the tail, sync."""
    num_needed = table.num_new_blocks_needed(1)
    table.sync_new_tokens(pool.allocate(num_needed) if num_needed else NO_BLOCKS, table.num_tokens + 1)


def make_tables(pool: BlockPool, num_requests: int, context_tokens: int, kind: type = TokenTable) -> list:
    tables = []
    for req_id in range(num_requests):
        table = TokenTable(req_id, pool, capacity=context_tokens + 1024) if kind is TokenTable else NativeTable(pool)
        table.sync_new_tokens(pool.allocate(table.num_new_blocks_needed(context_tokens)), context_tokens)
        tables.append(table)
    return tables


def time_growth(kind: type, num_requests: int, context_tokens: int, num_steps: int) -> float:
    """Mean microseconds per step of growth + slots() of every request: the same loop for both kinds."""
    pool = BlockPool(num_pool_blocks(num_requests, context_tokens, 2 * num_steps), BLOCK_SIZE)
    tables = make_tables(pool, num_requests, context_tokens, kind)
    step_s = []
    for step_idx in range(2 * num_steps):  # the first half warms up
        started = clock()
        for table in tables:
            grow_one(pool, table)
            table.slots()
        if step_idx >= num_steps:
            step_s.append(clock() - started)
    return 1e6 * statistics.fmean(step_s)


# ---- (c) eviction + reclamation ------------------------------------------------------------


def choose_victims(tables: list[TokenTable], rng: np.random.Generator, pattern: str) -> list[np.ndarray]:
    """One live token per request from [sinks, length - recent): random, or the oldest."""
    victims = []
    for table in tables:
        low, high = max(NUM_SINK_TOKENS, table.num_pinned_tokens), table.num_tokens + 1 - NUM_RECENT_TOKENS
        if pattern == "oldest":
            token_id = low + int(np.argmax(table.live_mask[low:high]))
        else:
            token_id = int(rng.integers(low, high))
            while not table.live_mask[token_id]:
                token_id = int(rng.integers(low, high))
        victims.append(np.array([token_id], dtype=np.int64))
    return victims


class EvictingRun:
    """R requests under one eviction per request per step, with the reclaimer on."""

    def __init__(self, num_requests: int, context_tokens: int, num_steps: int, mode: str, pattern: str,
                 cadence: str = "every-step", seed: int = 0) -> None:
        self.pool = BlockPool(num_pool_blocks(num_requests, context_tokens, num_steps) + 64 * num_requests, BLOCK_SIZE)
        self.tables = make_tables(self.pool, num_requests, context_tokens)
        budget = ROUND_BUDGET if cadence == "budget" else None
        self.reclaimer = Reclaimer(ReclaimConfig(mode=mode, max_moves_per_round=budget), self.pool)
        self.engine = CopyEngine(None, "sync")
        self.by_id = {t.req_id: t for t in self.tables}
        self.rng = np.random.default_rng(seed)
        self.pattern = pattern
        self.cadence = cadence
        self.step_idx = 0
        self.num_tokens_moved = 0
        self.num_blocks_freed_by_eviction = 0
        self.num_blocks_freed_by_plans = 0
        self.num_plans = 0
        self.num_rounds = 0  # steps whose reclamation launched plans

    def prefragment(self, num_dead_per_request: int | None = None) -> None:
        """Evict `num_dead_per_request` random tokens of every request (default: a different
        number below S each, so that requests do not all reach a reclaimable block at once)."""
        for table in self.tables:
            low, high = max(NUM_SINK_TOKENS, table.num_pinned_tokens), table.num_tokens + 1 - NUM_RECENT_TOKENS
            num_dead = int(self.rng.integers(0, BLOCK_SIZE)) if num_dead_per_request is None else num_dead_per_request
            if num_dead:
                candidates = low + np.flatnonzero(table.live_mask[low:high])
                self.evict(table, np.sort(self.rng.choice(candidates, num_dead, replace=False)))

    def evict(self, table: TokenTable, victims: np.ndarray) -> None:
        emptied = table.evict_tokens(victims)
        if emptied.size:
            table.release_blocks(emptied)
            self.pool.free(emptied)
            self.num_blocks_freed_by_eviction += emptied.size

    def reclaim(self) -> None:
        pool = self.pool
        plans = self.reclaimer.plan(self.tables)
        self.num_rounds += bool(plans)
        for plan in plans:
            table = self.by_id[plan.req_id]
            table.adopt_blocks(pool.allocate(plan.dst_new_block_ids.size))
            self.engine.launch(plan)
        for plan in self.engine.poll_completed():
            table = self.by_id[plan.req_id]
            table.apply_moves(plan.moves)
            table.release_blocks(plan.src_block_ids)
            pool.free(plan.src_block_ids)
            self.num_tokens_moved += plan.num_tokens_moved
            self.num_blocks_freed_by_plans += plan.num_blocks_freed
            self.num_plans += 1

    def step(self, victims: list[np.ndarray]) -> tuple[float, float, float, float]:
        """One decode step; returns seconds spent in growth, evict, reclaim and slots."""
        pool = self.pool
        started = clock()
        for table in self.tables:
            grow_one(pool, table)
        grown = clock()
        for table, victim in zip(self.tables, victims, strict=True):
            self.evict(table, victim)
        evicted = clock()
        if self.cadence == "every-step" or self.reclaimer.is_eligible(self.step_idx):
            self.reclaim()
        reclaimed = clock()
        for table in self.tables:
            table.slots()
        self.step_idx += 1
        return grown - started, evicted - grown, reclaimed - evicted, clock() - reclaimed

    def run(self, num_steps: int) -> np.ndarray:
        """Seconds per step of the four parts, [num_steps, 4]."""
        return np.array([self.step(choose_victims(self.tables, self.rng, self.pattern)) for _ in range(num_steps)])


def time_check_plan_us(run: EvictingRun, num_plans: int = 20) -> float:
    """Mean cost of the I4 check on fresh plans of this run's requests."""
    timings = []
    for plan in run.reclaimer.plan(run.tables)[:num_plans]:
        started = clock()
        check_plan(plan, run.by_id[plan.req_id], run.pool, frozenset())
        timings.append(clock() - started)
    return 1e6 * statistics.fmean(timings) if timings else 0.0


MAX_CYCLE_STEPS = 4000  # a lazy reclamation cycle takes about B * S = 1024 steps at one eviction per request
ROUND_BUDGET = 2048  # tokens moved per round, the budget cadence
BUDGET_STEPS, BUDGET_WARMUP_STEPS = 1024, 256
CADENCES = ("every-step", "default", "budget")


def evicting_run(num_requests: int, context_tokens: int, num_steps: int, cadence: str, seed: int) -> EvictingRun:
    """A run warmed up into its steady state. The default cadence starts with the pool's waste
    just under theta_F (random dead tokens in every request), so that the gate opens soon."""
    pool_steps = {"every-step": 4 * num_steps, "default": 2 * MAX_CYCLE_STEPS, "budget": 2 * (BUDGET_STEPS + BUDGET_WARMUP_STEPS)}
    run = EvictingRun(num_requests, context_tokens, pool_steps[cadence], "hole-fill", "random", cadence, seed)
    if cadence == "every-step":
        run.prefragment()
        run.run(max(num_steps, 2 * BLOCK_SIZE))
        return run
    run.prefragment(int(run.reclaimer.config.theta_f * context_tokens) - 2 * BLOCK_SIZE)
    if cadence == "default":
        run_until_a_round(run)
    else:
        run.run(BUDGET_WARMUP_STEPS)
    return run


def run_until_a_round(run: EvictingRun) -> np.ndarray:
    """Steps until, and including, the next step whose reclamation launched plans."""
    num_rounds, parts = run.num_rounds, []
    while run.num_rounds == num_rounds:
        if len(parts) == MAX_CYCLE_STEPS:
            raise RuntimeError(f"no reclamation round in {MAX_CYCLE_STEPS} steps (F = {run.pool.waste_ratio():.3f})")
        parts.append(run.step(choose_victims(run.tables, run.rng, run.pattern)))
    return np.array(parts)


def time_evict(num_requests: int, context_tokens: int, num_steps: int, num_repeats: int, cadence: str) -> EvictRow:
    """every-step: `num_steps` steps. default: one whole cycle of the lazy reclaimer, from just
    after a reclamation round to the end of the next, so that the mean amortizes the round.
    budget: BUDGET_STEPS steps."""
    means, max_reclaim, max_bookkeeping, plans_per_step, num_cycle_steps, check_us = [], [], [], [], [], 0.0
    for repeat_idx in range(num_repeats):
        run = evicting_run(num_requests, context_tokens, num_steps, cadence, seed=repeat_idx)
        num_plans_before = run.num_plans
        parts = {"every-step": lambda: run.run(num_steps), "default": lambda: run_until_a_round(run),
                 "budget": lambda: run.run(BUDGET_STEPS)}[cadence]()
        means.append(1e6 * parts.mean(axis=0))
        max_reclaim.append(1e6 * parts[:, 2].max())
        max_bookkeeping.append(1e6 * (parts[:, 1] + parts[:, 2]).max())
        plans_per_step.append((run.num_plans - num_plans_before) / len(parts))
        num_cycle_steps.append(len(parts))
        if repeat_idx == 0:
            for table in run.tables[: num_requests // 2]:  # some holes, so that check_plan has plans
                for _ in range(BLOCK_SIZE):
                    run.evict(table, choose_victims([table], run.rng, "random")[0])
            check_us = time_check_plan_us(run)
    totals = [m.sum() for m in means]
    median = int(np.argsort(totals)[len(totals) // 2])
    growth_us, evict_us, reclaim_us, slots_us = (float(x) for x in means[median])
    return EvictRow(num_requests, context_tokens, cadence, num_cycle_steps[median], growth_us, evict_us, reclaim_us, slots_us,
                    float(max_reclaim[median]), plans_per_step[median], check_us, float(max_bookkeeping[median]),
                    modelled_step_us(num_requests, context_tokens))


def measure_scenario(num_requests: int, context_tokens: int, num_steps: int, num_repeats: int) -> tuple[GrowthRow, list[EvictRow]]:
    native, table = [], []
    for _ in range(num_repeats):  # alternated, so that a slow spell of the machine hits both
        native.append(time_growth(NativeTable, num_requests, context_tokens, num_steps))
        table.append(time_growth(TokenTable, num_requests, context_tokens, num_steps))
    growth = GrowthRow(num_requests, context_tokens, statistics.median(native), statistics.median(table))
    evicts = [time_evict(num_requests, context_tokens, num_steps, num_repeats, cadence) for cadence in CADENCES]
    return growth, evicts


# ---- tokens moved per freed block ----------------------------------------------------------


def measure_moves(num_requests: int, context_tokens: int, num_steps: int) -> list[MovesRow]:
    rows = []
    for pattern in ("random", "oldest"):
        for mode in ("hole-fill", "ordered"):
            run = EvictingRun(num_requests, context_tokens, num_steps, mode, pattern, seed=7)
            run.run(num_steps)
            freed = run.num_blocks_freed_by_plans
            rows.append(MovesRow(pattern, mode, run.num_tokens_moved, freed, run.num_tokens_moved / freed if freed else float("nan"),
                                 run.num_blocks_freed_by_eviction))
    return rows


# ---- output --------------------------------------------------------------------------------


def table(header: str, lines: list[str]) -> str:
    return "\n".join([header, "-" * len(header), *lines])


def format_growth(rows: list[GrowthRow]) -> str:
    header = f"{'requests':>8} {'context':>7} {'native us/step':>14} {'table us/step':>13} {'us/req/step':>11} {'x native':>8}"
    return table(header, [f"{r.num_requests:>8} {r.context_tokens // 1024:>6}K {r.native_us:>14.1f} {r.table_us:>13.1f} "
                          f"{r.table_us / r.num_requests:>11.2f} {r.ratio:>8.2f}" for r in rows])


def format_evict(rows: list[EvictRow]) -> str:
    header = (f"{'requests':>8} {'context':>7} {'cadence':<10} {'steps':>5} {'growth':>7} {'evict':>7} {'reclaim':>8} {'slots':>7} "
              f"{'total':>7} {'evict+reclaim':>13} {'worst reclaim':>13} {'plans/step':>10} {'check_plan us':>13} "
              f"{'modelled step us':>16} {'mean % of step':>14} {'worst e+r us':>12} {'worst % of step':>15}")
    return table(header, [f"{r.num_requests:>8} {r.context_tokens // 1024:>6}K {r.cadence:<10} {r.num_steps:>5} {r.growth_us:>7.1f} "
                          f"{r.evict_us:>7.1f} {r.reclaim_us:>8.1f} {r.slots_us:>7.1f} {r.total_us:>7.1f} {r.bookkeeping_us:>13.1f} "
                          f"{r.max_reclaim_us:>13.1f} {r.plans_per_step:>10.2f} {r.check_plan_us_per_plan:>13.1f} "
                          f"{r.modelled_step_us:>16.0f} {100 * r.step_share:>14.2f} {r.max_bookkeeping_us:>12.0f} "
                          f"{100 * r.worst_step_share:>15.2f}" for r in rows])


def format_moves(rows: list[MovesRow]) -> str:
    header = f"{'pattern':<8} {'mode':<10} {'tokens moved':>12} {'blocks freed':>12} {'moved/freed':>11} {'freed by eviction':>17}"
    return table(header, [f"{r.pattern:<8} {r.mode:<10} {r.num_tokens_moved:>12} {r.num_blocks_freed:>12} "
                          f"{r.tokens_per_freed_block:>11.2f} {r.num_blocks_freed_by_eviction:>17}" for r in rows])


def format_targets(growth: list[GrowthRow], evicts: list[EvictRow]) -> str:
    lines = []
    for r in growth:
        verdict = "met" if r.ratio <= TARGET_TABLE_RATIO else "MISSED"
        lines.append(f"table <= {TARGET_TABLE_RATIO}x native at {r.num_requests} x {r.context_tokens // 1024}K: {r.ratio:.2f}x ({verdict})")
    for r in evicts:
        if (r.num_requests, r.context_tokens) == (64, 8192):
            verdict = "met" if r.bookkeeping_us <= TARGET_EVICT_US_PER_STEP else "MISSED"
            lines.append(f"evict + reclaim <= {TARGET_EVICT_US_PER_STEP:.0f} us/step at 64 x 8K, {r.cadence} cadence: "
                         f"{r.bookkeeping_us:.1f} us ({verdict}; worst step's reclaim {r.max_reclaim_us:.0f} us)")
    for r in evicts:
        if r.cadence != "every-step":
            verdict = "met" if r.step_share <= TARGET_STEP_SHARE else "MISSED"
            lines.append(f"evict + reclaim <= {100 * TARGET_STEP_SHARE:.0f}% of the modelled step at {r.num_requests} x "
                         f"{r.context_tokens // 1024}K, {r.cadence} cadence: {100 * r.step_share:.2f}% of "
                         f"{r.modelled_step_us / 1000:.1f} ms ({verdict}; worst step {100 * r.worst_step_share:.1f}%)")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--repeats", type=int, default=5, help="repetitions per measurement (median reported)")
    parser.add_argument("--quick", action="store_true", help="64 x 8K only, fewer steps")
    parser.add_argument("--sizes", help="only these requests x context, e.g. 64x8K,1024x8K (default: all)")
    parser.add_argument("--wall", action="store_true", help="wall time (time.perf_counter) instead of CPU time")
    args = parser.parse_args()
    global clock
    clock = time.perf_counter if args.wall else time.process_time
    scenarios = ((64, 8192, 100),) if args.quick else SCENARIOS
    if args.sizes:
        wanted = {size.strip().upper() for size in args.sizes.split(",")}
        scenarios = tuple(s for s in SCENARIOS if f"{s[0]}X{s[1] // 1024}K" in wanted)
        if not scenarios:
            parser.error(f"--sizes: none of {args.sizes} is one of "
                         f"{', '.join(f'{r}x{c // 1024}K' for r, c, _ in SCENARIOS)}")
    started = time.perf_counter()
    growth, evicts = [], []
    for num_requests, context_tokens, num_steps in scenarios:
        print(f"{num_requests} x {context_tokens // 1024}K ...", flush=True)
        growth_row, evict_rows = measure_scenario(num_requests, context_tokens, num_steps, args.repeats)
        growth.append(growth_row)
        evicts += evict_rows
    moves = measure_moves(64, 8192, 50 if args.quick else 200)
    print("\ngrowth + slots(), no eviction (us per step, all requests)")
    print(format_growth(growth))
    print("\none eviction per request per step (us per step, all requests)")
    print(format_evict(evicts))
    print("\ntokens moved per freed block, 64 requests x 8K, same eviction sequence for both modes")
    print(format_moves(moves))
    print()
    print(format_targets(growth, evicts))
    print(f"\n{time.perf_counter() - started:.0f} s", flush=True)
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"clock": clock.__name__, "block_size": BLOCK_SIZE, "num_sink_tokens": NUM_SINK_TOKENS, "num_recent_tokens": NUM_RECENT_TOKENS,
                       "repeats": args.repeats,
                       "growth": [dict(asdict(r), ratio=r.ratio) for r in growth],
                       "evict": [dict(asdict(r), bookkeeping_us=r.bookkeeping_us, total_us=r.total_us, step_share=r.step_share,
                                      worst_step_share=r.worst_step_share) for r in evicts],
                       "moves": [asdict(m) for m in moves]}, out, indent=2)


if __name__ == "__main__":
    main()
