"""Host-side cost of the vToken substrate per decode step, against the modelled step. A benchmark, not a test.

    python benchmarks/bench_substrate.py [--quick] [--sizes 64x8K,1024x8K] [--cadences default,auto,whole-round,paced]
                                         [--landing same-step|next-step] [--reader none|slots] [--replays N]
                                         [--fit-budgets 256,512,1024,2048] [--replan-first]
                                         [--warm-round-code [verbs|compiled]] [--sweep-mb MB]
                                         [--repeats N] [--wall]
                                         [--json PATH]

R concurrent requests with an L-token context, block size S = 16, one new token per request
per step (the workload and the reclaimer's cadences: substrate_workload.py). Growth runs the
same loop over the same calls (num_new_blocks_needed, allocate, sync_new_tokens, slots, and at
the end of the step the pool's `flush_deferred`, which counts the step's appends as the runtime's
per-step memory sample makes it do; a plain block table has none to count) on two kinds of
table:

    native   a plain block table: slot = block_table[pos // S] * S + pos % S for the new
             token, appended to a cached slot array (what a paged engine without eviction does)
    table    the token table (vtoken.kv.token_table), no eviction: the indirection alone

With eviction, each step adds one eviction per request from the unprotected middle (a random
live token outside the sinks and the recent window: one in, one out, as at a policy's steady
state), all of a step's evictions in one `TokenTable.evict_one_each` call and the blocks they
emptied in one `BlockPool.free`, and the reclaimer, whose step frees its source blocks in one
call too. evict = that eviction call with releasing and freeing; reclaim = planning, applying
and freeing; slots = with `--reader slots`, every request's `slots()` after the step, what a
reader of the dense host slot list (the hf executor's attention) pays to bring it up to date
after the step's evictions; a list kept up to date also makes every eviction record its
entry's removal (slot_cache.py), in evict. By default nothing reads the lists (`--reader
none`): the sim's and the vLLM executor's engines never do, and the modelled step below is
theirs. The round cadences (default, auto, whole-round, paced) are measured over one
whole cycle (from the step a round ends in to the step the next one ends in), so that the mean
amortizes the round: 64 timed steps after the round, then (untimed) 32 steps at a time in bulk
while F is more than 0.005 below theta_F, then timed steps up to and including the end of the
next round; the mean weighs the timed ordinary steps by their number in the cycle and adds
every step of the round; every-step is timed over a window of steps. The worst step is the
most evict + reclaim of one measured step; beside it, the most tokens one step moved against
the bound a budget sets, max(budget, B x S).

Times are host microseconds of this process's CPU time (time.process_time; on a machine shared
with other work wall time measures the others' load; `--wall` uses time.perf_counter). Each
repetition is a fresh run with its own seed; a row gives the median repetition's parts and the
min-max over repetitions of the mean and of the worst step's evict + reclaim, both against the
sim's modelled decode step of the same configuration (SimExecutor.iteration_time_s, default model and GPU: one
step of R requests reading R x L KV tokens). The goal is evict + reclaim within 1% of that step.
Victims are chosen outside the timed region (that is the policy's cost). The reclaimer's step is
the runtime's (substrate_workload.py): the I4 check of the step's plans in one `plans_pass`
call is in `reclaim`; `check_plan`, which checks one plan and runs plan by plan only when
`plans_pass` finds something, is timed apart, per plan.

Beside it, the steps that launched plans (a round's steps; the worst step is one of them), by
part of their reclaim: planning, the I4 check, launching and landing, each the median over the
median repetition's such steps, with the plans and tokens moved of the median one. Between two
cadences of one size (paced: about one plan a step under a small budget; default: about two
under 2,048 moves) they separate, roughly, what a round step costs whatever it moves from what
it costs per token moved. Then a round's first launching step apart, the medians over every
repetition's (one round each for the round cadences), against the others: the worst step is
usually that one, which ranks the round's requests and meets the round's code and data cold
after the ordinary steps since the last round. `--replan-first` plans that step's requests
again right after its planning, timed apart: the same planning warm. It warms what the step's
check and landing read as well, so their figures in that table read low with it.
`--warm-round-code` (a diagnostic, for no figure but its own) runs the round's code, Python and
compiled, on a small pool of its own after every step outside a round, untimed
(engine/warmup.py): the first launching step then meets its code warm and only its data cold,
which tells its code's cold start from its work; `--warm-round-code compiled` makes only the
round's four compiled calls again there (planning, the I4 check, landing, release: those the
warm-up made, on copies of their arrays), which tells the compiled code's share of that cold
start from the Python's. `--sweep-mb MB` (a diagnostic too) writes a buffer of MB megabytes of
its own after every step, untimed, as the host's other work between two steps evicts its data
caches (with MB above the L2 cache, every step meets its data there cold).

When a step's plans land: `--landing same-step` (the default) lands them in the step that
launched them, as the runtime does with synchronous copies (the sim's executor, and the CPU
ones); `--landing next-step` lands them at the next step, before its evictions, as the runtime
does with asynchronous copies on a GPU (`Runtime.execute` polls the copy engine before the
forward: the copy runs on its own stream behind the step that launched it). The modelled step
is a GPU's (an H100's), so next-step is the landing that goes with it; with it a launching
step's landing is that of the plans of the step before.

The worst step of one run is one step's time, and on a shared host a slow spell that lands on
one step decides it. `--replays N` runs each repetition's cycle N times from its seed: the
same work at every step (the same victims, rounds and plans; a replay whose steps differ is an
error), each step's evict + reclaim taken as its median over the N, and the worst step replayed
is the most of those, with what that step was (a round's first launching step, a later one,
a landing alone). A step's own cost, cold code and data included, stays in it; a spell that
hits one replay does not.

`--fit-budgets B1,B2,...` fits that split instead of reading it off two cadences: at every size,
the paced cadence's reclaimer at each budget (B1, B2, ... tokens moved a step, B x S = 1.25 x the
budget), one cycle per budget and repetition, the budgets' order reversed every other
repetition; every step that launched plans is a point (tokens moved, its reclaim), and a least-
squares line through one repetition's points gives a round step's fixed cost and its cost per
token moved (the median repetition's, by fixed cost, with the min-max over repetitions). With
the median step's evictions, the fit says how many moves a step can make within 1% of the
modelled step: none where the evictions and the fixed cost alone exceed it.

Two smaller tables: the step's evictions one `evict_tokens` call per request against one
`evict_one_each` call (the same victims on identical states, alternated), with finding and
shifting each slot list's entry alone beside them (what a dense host slot list costs per
eviction at the least), and the tokens the two reclamation modes move per block they free.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import NamedTuple

import numpy as np
from substrate_workload import (
    BLOCK_SIZE, CADENCES, NUM_RECENT_TOKENS, NUM_SINK_TOKENS, EvictingRun, NativeTable, RoundStep, choose_victims, grow_one,
    LANDINGS, READERS, ROUND_CADENCES, WARMINGS, budgeted_config, make_tables, modelled_step_us, num_pool_blocks,
    paced_moves_per_step, reclaim_config,
)

from vtoken.invariants import check_plan
from vtoken.kv.block_pool import BlockPool
from vtoken.kv.reclaim import ReclaimConfig
from vtoken.kv.token_table import TokenTable

# (requests, context, growth steps, every-step cadence's steps): the default run
SCENARIOS = ((64, 8192, 400, 512), (256, 8192, 100, 256), (1024, 8192, 30, 96), (64, 32768, 200, 512), (256, 32768, 60, 256))
QUICK_SCENARIOS = ((64, 8192, 100, 128),)
DEFAULT_CADENCES = ("default", "whole-round")
TARGET_STEP_SHARE = 0.01  # evict + reclaim per step, of the modelled decode step
TARGET_TABLE_RATIO = 1.05
MAX_CYCLE_STEPS = 8000  # a default cycle takes about B * S = 1024 steps at one eviction per request; paced at 32K about 4,500
ORDINARY_STEPS = 64  # timed steps of a cycle right after its round; then it advances in bulk
BULK_STEPS, BULK_MARGIN_F = 32, 0.005  # steps per bulk advance; while F < theta_F - margin
WINDOW_WARMUP_STEPS = 64  # every-step: after its first round, before measuring


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
    landing: str  # when launched plans land (substrate_workload.LANDINGS)
    reader: str  # who reads the slot lists after each step (substrate_workload.READERS)
    max_moves_per_step: int | None
    num_steps: int  # measured steps of the median repetition (the round cadences: one cycle)
    num_round_steps: int  # of them, steps the reclaimer planned in (a round started or went on) or, next-step, landed in
    growth_us: float  # per step, all requests, median repetition; the four parts add up to the step
    evict_us: float
    reclaim_us: float
    slots_us: float
    plans_per_step: float
    moved_per_round: float  # tokens moved per round that launched plans, median repetition
    max_moved_per_step: int  # the most tokens one measured step moved, over the repetitions
    mean_range_us: tuple[float, float]  # min-max over repetitions of the mean evict + reclaim
    worst_us: float  # the worst step's evict + reclaim, median repetition
    worst_range_us: tuple[float, float]
    check_plan_us_per_plan: float
    modelled_step_us: float  # the sim's decode step of this configuration
    max_src_blocks: int  # B: source blocks per plan
    # the median repetition's measured steps that launched plans (RoundStep): how many, and the
    # median over them of their plans, tokens moved, and each part's microseconds (plan, check,
    # launch, land)
    num_launching_steps: int
    launching_step_plans: float
    launching_step_moved: float
    launching_step_parts_us: tuple[float, float, float, float]
    # a round's first launching step (RoundStep.is_first), over every repetition: how many,
    # the median of each part (us), of their evictions, and of planning their requests again
    # at once (us; 0 without --replan-first); and the median sum of the parts of the median
    # repetition's other launching steps
    num_first_steps: int
    first_step_parts_us: tuple[float, float, float, float]
    first_step_evict_us: float
    first_step_replan_us: float
    other_steps_sum_us: float
    # --replays N (round cadences): each repetition's cycle run N times from its seed; its worst
    # step replayed (`replayed_worst_us`): the median repetition's (us), the min-max over the
    # repetitions, and what that step was (STEP_KINDS); None without replays
    num_replays: int = 1
    replayed_worst_us: float | None = None
    replayed_worst_range_us: tuple[float, float] | None = None
    replayed_worst_kind: str | None = None

    @property
    def bookkeeping_us(self) -> float:
        """What eviction and reclamation add to a step: the goal's quantity."""
        return self.evict_us + self.reclaim_us

    @property
    def step_share(self) -> float:
        return self.bookkeeping_us / self.modelled_step_us

    @property
    def worst_step_share(self) -> float:
        return self.worst_us / self.modelled_step_us

    @property
    def replayed_worst_share(self) -> float | None:
        return None if self.replayed_worst_us is None else self.replayed_worst_us / self.modelled_step_us


@dataclass(frozen=True)
class BudgetRow:
    """One budget of `--fit-budgets` at one size: the steps that launched plans, over every
    repetition, and their medians (plans, tokens moved, the round step's reclaim, the step's
    evictions)."""

    num_requests: int
    context_tokens: int
    max_moves_per_step: int
    num_launching_steps: int
    plans: float
    moved: float
    round_step_us: float  # the reclaim of a step that launched plans: planning, check, launch, land
    evict_us: float  # that step's evictions (every request's, one call)


@dataclass(frozen=True)
class BudgetFit:
    """A round step's reclaim against the tokens it moved, fitted by least squares over the
    launching steps of every budget of one repetition: fixed_us + us_per_token x moved. The
    median repetition's fit (by its fixed cost) with the min-max over repetitions; from it and
    the step's evictions, how many moves a step can make within 1% of the modelled step."""

    num_requests: int
    context_tokens: int
    modelled_step_us: float
    num_steps: int  # launching steps fitted, over every repetition
    fixed_us: float
    fixed_range_us: tuple[float, float]
    us_per_token: float
    us_per_token_range: tuple[float, float]
    median_abs_residual_us: float  # of the median repetition's steps about its line
    evict_us: float  # median over every launching step

    @property
    def max_moves_within_target(self) -> int:
        """Tokens a round step may move with its evictions and its fixed cost within 1% of the
        step: 0 when those alone do not fit (or the fit has no positive slope)."""
        room = TARGET_STEP_SHARE * self.modelled_step_us - self.evict_us - self.fixed_us
        return int(room / self.us_per_token) if room > 0 and self.us_per_token > 0 else 0


@dataclass(frozen=True)
class EvictPathRow:
    num_requests: int
    context_tokens: int
    per_table_us: float  # per step, all requests: one evict_tokens call per request
    batched_us: float  # one evict_one_each call
    find_shift_us: float  # finding and shifting each slot list's entry alone (`time_find_and_shift`)


@dataclass(frozen=True)
class MovesRow:
    pattern: str
    mode: str
    num_tokens_moved: int
    num_blocks_freed: int  # by relocation plans
    tokens_per_freed_block: float
    num_blocks_freed_by_eviction: int  # emptied by the evictions themselves, no move needed


# ---- measurements ----------------------------------------------------------------------------


def time_growth(kind: type, num_requests: int, context_tokens: int, num_steps: int, clock) -> float:
    """Mean microseconds per step of growth + slots() of every request: the same loop for both kinds."""
    pool = BlockPool(num_pool_blocks(num_requests, context_tokens, 2 * num_steps), BLOCK_SIZE)
    tables = make_tables(pool, num_requests, context_tokens, kind)
    step_s = []
    for step_idx in range(2 * num_steps):  # the first half warms up
        started = clock()
        for table in tables:
            grow_one(pool, table)
            table.slots()
        pool.flush_deferred()  # the token table's appends counted in the pool (a plain block table has none)
        if step_idx >= num_steps:
            step_s.append(clock() - started)
    return 1e6 * statistics.fmean(step_s)


def measure_growth(num_requests: int, context_tokens: int, num_steps: int, num_repeats: int, clock) -> GrowthRow:
    native, table = [], []
    for _ in range(num_repeats):  # alternated, so that a slow spell of the machine hits both
        native.append(time_growth(NativeTable, num_requests, context_tokens, num_steps, clock))
        table.append(time_growth(TokenTable, num_requests, context_tokens, num_steps, clock))
    return GrowthRow(num_requests, context_tokens, statistics.median(native), statistics.median(table))


def warmed_run(num_requests: int, context_tokens: int, cadence: str, step_us: float, seed: int, clock,
               config: ReclaimConfig | None = None, landing: str = "same-step", reader: str = "none") -> EvictingRun:
    """A run in its steady state: waste just under theta_F (random dead tokens in every
    request), then steps until a reclamation round ended (and a few more, every-step).
    `config`: the reclaimer's, in place of the cadence's (a round cadence's); `landing`,
    `reader`: EvictingRun's."""
    num_steps = 1024 if cadence == "every-step" else 2 * MAX_CYCLE_STEPS
    run = EvictingRun(num_requests, context_tokens, num_steps, config or reclaim_config(cadence, step_us),
                      every_step=cadence == "every-step", seed=seed, clock=clock, landing=landing, reader=reader)
    if cadence == "every-step":
        run.prefragment()
        run.run(2 * BLOCK_SIZE)
        return run
    run.prefragment(int(run.reclaimer.config.theta_f * context_tokens) - 2 * BLOCK_SIZE)
    run.run_until_a_round(MAX_CYCLE_STEPS)
    if cadence not in ROUND_CADENCES:
        run.run(WINDOW_WARMUP_STEPS)
    return run


def time_check_plan_us(run: EvictingRun, num_plans: int = 20) -> float:
    """Mean cost of the I4 check on fresh plans of this run's requests."""
    for table in run.tables[: len(run.tables) // 2]:  # some holes, so that there are plans
        for _ in range(BLOCK_SIZE):
            emptied = table.evict_tokens(choose_victims([table], run.rng, "random"))
            table.release_blocks(emptied)
            run.pool.free(emptied)
    timings = []
    plans = run.reclaimer.plan(run.tables, step_s=run.step_s)[:num_plans]
    for plan in plans[:1]:  # once untimed: its first call imports what it uses
        check_plan(plan, run.by_id[plan.req_id], run.pool, frozenset())
    for plan in plans:
        started = run.clock()
        check_plan(plan, run.by_id[plan.req_id], run.pool, frozenset())
        timings.append(run.clock() - started)
    return 1e6 * statistics.fmean(timings) if timings else 0.0


class Cycle(NamedTuple):
    """A timed cycle (`time_cycle`): the parts of its timed ordinary steps and of its round's
    steps ([steps, 4] each), its length in steps, and per timed step in order its evict +
    reclaim (seconds), what it was (STEP_KINDS) and the run's work after it (tokens moved by
    landed plans, blocks freed by evictions, both so far): the same in every replay of one seed."""

    ordinary: np.ndarray
    in_round: np.ndarray
    num_steps: int
    bookkeeping_s: np.ndarray
    kinds: list[str]
    work: list[tuple[int, int]]


# what a timed step of a cycle was: a round's first step to launch plans, a later one, a round
# step that launched nothing but landed the plans before it (next-step landing) or neither
STEP_KINDS = ("ordinary", "first launching", "launching", "landing", "round")


def step_kind(run: EvictingRun, num_round_steps_before: int, had_in_flight: bool) -> str:
    """What the step `run` just ran was, from its round steps' count and whether plans were in
    flight before it (which it landed)."""
    if len(run.round_steps) > num_round_steps_before:
        return "first launching" if run.round_steps[-1].is_first else "launching"
    if not run.is_round_step:
        return "ordinary"
    return "landing" if had_in_flight else "round"


def time_cycle(run: EvictingRun) -> Cycle:
    """One cycle of a round cadence, from the step a round ended in to the step the next one
    ends in: ORDINARY_STEPS timed steps, then steps advanced in bulk while F is below theta_F
    by a margin, no round is in progress and no plan in flight (untimed: what they cost is what
    the timed ordinary steps cost), then timed steps up to the end of the next round."""
    theta_f, first_step_idx = run.reclaimer.config.theta_f, run.step_idx
    num_rounds, ordinary, in_round, bookkeeping, kinds, work = run.num_rounds, [], [], [], [], []
    while run.num_rounds == num_rounds:
        if (len(ordinary) >= ORDINARY_STEPS and not run.reclaimer.is_round_in_progress and not run.has_in_flight
                and run.pool.waste_ratio() < theta_f - BULK_MARGIN_F):
            run.advance_in_bulk(BULK_STEPS)
            continue
        if run.step_idx - first_step_idx >= MAX_CYCLE_STEPS:
            raise RuntimeError(f"no reclamation round ended in {MAX_CYCLE_STEPS} steps (F = {run.pool.waste_ratio():.3f})")
        num_round_steps, had_in_flight = len(run.round_steps), run.has_in_flight
        parts = run.step(choose_victims(run.tables, run.rng, run.pattern))
        (in_round if run.is_round_step else ordinary).append(parts)
        bookkeeping.append(parts[1] + parts[2])
        kinds.append(step_kind(run, num_round_steps, had_in_flight))
        work.append((run.num_tokens_moved, run.num_blocks_freed_by_eviction))
    return Cycle(np.array(ordinary).reshape(-1, 4), np.array(in_round).reshape(-1, 4), run.step_idx - first_step_idx,
                 np.array(bookkeeping), kinds, work)


def replayed_worst_us(cycles: list[Cycle]) -> tuple[float, str]:
    """The worst step of identical replays of one cycle (the same seed: the same work at every
    step): each timed step's median evict + reclaim over the replays, the most of them (us),
    and what that step was. A slow spell of the host that hits one replay's step is left out;
    what the step's own work costs, cold code and data included, is not."""
    if any(cycle.kinds != cycles[0].kinds or cycle.work != cycles[0].work for cycle in cycles):
        raise RuntimeError("replays of one seed diverged: their steps differ")
    medians = np.median(np.array([cycle.bookkeeping_s for cycle in cycles]), axis=0)
    worst = int(np.argmax(medians))
    return 1e6 * float(medians[worst]), cycles[0].kinds[worst]


def measure_evict(num_requests: int, context_tokens: int, num_window_steps: int, cadence: str, num_repeats: int, clock,
                  replan_first: bool = False, landing: str = "same-step", num_replays: int = 1,
                  warm_round_code: str | None = None, sweep_mb: int = 0, reader: str = "none") -> EvictRow:
    """The round cadences: a cycle's mean, its ordinary steps weighted by their number in it
    and every step of the round added (`time_cycle`); the others: the mean of
    `num_window_steps` steps. `replan_first`, `landing`, `warm_round_code`, `reader`: EvictingRun's; `sweep_mb`:
    its sweep_bytes, in megabytes.
    `num_replays` > 1 (round cadences): each repetition's cycle runs that many times in all,
    from the same seed, for its worst step replayed (`replayed_worst_us`)."""
    step_us = modelled_step_us(num_requests, context_tokens)
    means, worst, plans_per_step, moved_per_round, num_steps, num_round_steps, check_us = [], [], [], [], [], [], 0.0
    launching: list[list[RoundStep]] = []
    max_moved_per_step = 0
    replayed: list[tuple[float, str]] = []  # per repetition: its worst step replayed, and what it was

    def repetition(seed: int) -> EvictingRun:  # a repetition's run, and each of its replays
        run = warmed_run(num_requests, context_tokens, cadence, step_us, seed=seed, clock=clock, landing=landing, reader=reader)
        run.replan_first = replan_first  # its first launching step does the same work in every replay
        run.warm_round_code = warm_round_code
        run.sweep_bytes = sweep_mb << 20
        return run

    for repeat_idx in range(num_repeats):
        run = repetition(repeat_idx)
        first_step_idx, num_rounds_before = run.step_idx, run.num_rounds
        run.round_steps.clear()  # from here on: the measured steps
        if cadence in ROUND_CADENCES:
            cycle = time_cycle(run)
            ordinary, in_round, cycle_steps = cycle.ordinary, cycle.in_round, cycle.num_steps
            num_ordinary = cycle_steps - len(in_round)
            mean = (ordinary.sum(axis=0) * num_ordinary / max(len(ordinary), 1) + in_round.sum(axis=0)) / cycle_steps
            parts = np.vstack((ordinary, in_round))
            num_round_steps.append(len(in_round))
        else:
            parts = run.run(num_window_steps)
            mean = parts.mean(axis=0)
            num_round_steps.append(num_window_steps)
        means.append(1e6 * mean)
        worst.append(1e6 * float((parts[:, 1] + parts[:, 2]).max()))
        num_steps.append(run.step_idx - first_step_idx)
        measured = list(run.round_steps)
        plans_per_step.append(sum(step.num_plans for step in measured) / num_steps[-1])
        moved_per_round.append(sum(step.num_tokens_moved for step in measured) / max(run.num_rounds - num_rounds_before, 1))
        max_moved_per_step = max(max_moved_per_step, max((step.num_tokens_moved for step in measured), default=0))
        launching.append(measured)
        if repeat_idx == 0:
            check_us = time_check_plan_us(run)
        if num_replays > 1 and cadence in ROUND_CADENCES:
            replays = [cycle] + [time_cycle(repetition(repeat_idx)) for _ in range(num_replays - 1)]
            replayed.append(replayed_worst_us(replays))
    bookkeeping = [float(m[1] + m[2]) for m in means]
    median = int(np.argsort(bookkeeping)[len(bookkeeping) // 2])
    growth_us, evict_us, reclaim_us, slots_us = (float(x) for x in means[median])
    budget = run.reclaimer.step_budget(run.step_s)[0]
    steps = launching[median]
    columns = [(s.num_plans, s.num_tokens_moved, *s.parts_s) for s in steps]  # plans, moved, then the four parts
    step_medians = np.median(np.array(columns, dtype=np.float64), axis=0) if steps else np.zeros(6)
    firsts = [s for repetition in launching for s in repetition if s.is_first]
    first_columns = [(*s.parts_s, s.evict_s, s.replan_s) for s in firsts]  # the four parts, evictions, replanning
    first_medians = 1e6 * np.median(np.array(first_columns, dtype=np.float64), axis=0) if firsts else np.zeros(6)
    others = [s.reclaim_s for s in steps if not s.is_first]
    return EvictRow(num_requests, context_tokens, cadence, landing, reader, budget, num_steps[median], num_round_steps[median], growth_us, evict_us,
                    reclaim_us, slots_us, plans_per_step[median], moved_per_round[median], max_moved_per_step, (min(bookkeeping), max(bookkeeping)),
                    worst[median], (min(worst), max(worst)), check_us, step_us, run.reclaimer.step_budget(run.step_s)[1],
                    len(steps), float(step_medians[0]), float(step_medians[1]), tuple(float(1e6 * t) for t in step_medians[2:]),
                    len(firsts), tuple(float(t) for t in first_medians[:4]), float(first_medians[4]), float(first_medians[5]),
                    float(1e6 * np.median(others)) if others else 0.0, num_replays if replayed else 1,
                    *replayed_summary(replayed))


def replayed_summary(replayed: list[tuple[float, str]]) -> tuple[float | None, tuple[float, float] | None, str | None]:
    """The repetitions' replayed worst steps: the median one's (us), the min-max, and what the
    median one's step was; None for each without replays."""
    if not replayed:
        return None, None, None
    ordered = sorted(replayed)
    worst_us, kind = ordered[len(ordered) // 2]
    return worst_us, (ordered[0][0], ordered[-1][0]), kind


def fit_line(moved: np.ndarray, step_us: np.ndarray) -> tuple[float, float, float]:
    """(intercept, slope, median absolute residual) of the least-squares line step_us = a + b x
    moved; needs at least two distinct values of `moved`."""
    if np.unique(moved).size < 2:
        raise ValueError("a line needs steps with at least two different numbers of moves")
    slope, intercept = np.polyfit(moved, step_us, 1)
    residuals = step_us - (intercept + slope * moved)
    return float(intercept), float(slope), float(np.median(np.abs(residuals)))


def measure_budget_fit(num_requests: int, context_tokens: int, budgets: list[int], num_repeats: int,
                       clock, reader: str = "none") -> tuple[list[BudgetRow], BudgetFit]:
    """The paced cadence's reclaimer (`budgeted_config`) at each budget, one warmed run and one
    cycle per budget and repetition, the budgets' order reversed every other repetition so that
    a slow spell of the host does not land on one budget; every step that launched plans is a
    point (tokens moved, the step's reclaim)."""
    step_us = modelled_step_us(num_requests, context_tokens)
    by_budget: dict[int, list[RoundStep]] = {budget: [] for budget in budgets}
    fits = []
    for repeat_idx in range(num_repeats):
        steps = []
        for budget in budgets if repeat_idx % 2 == 0 else budgets[::-1]:
            run = warmed_run(num_requests, context_tokens, "paced", step_us, seed=repeat_idx, clock=clock,
                             config=budgeted_config(budget), reader=reader)
            run.round_steps.clear()
            time_cycle(run)
            by_budget[budget] += run.round_steps
            steps += run.round_steps
        fits.append(fit_line(np.array([s.num_tokens_moved for s in steps], dtype=np.float64),
                             1e6 * np.array([s.reclaim_s for s in steps])))
    rows = [BudgetRow(num_requests, context_tokens, budget, len(steps), float(np.median([s.num_plans for s in steps])),
                      float(np.median([s.num_tokens_moved for s in steps])), 1e6 * float(np.median([s.reclaim_s for s in steps])),
                      1e6 * float(np.median([s.evict_s for s in steps])))
            for budget, steps in by_budget.items() if steps]  # a budget whose cycles launched nothing has no row, and no point
    all_steps = [s for steps in by_budget.values() for s in steps]
    median = sorted(range(len(fits)), key=lambda i: fits[i][0])[len(fits) // 2]
    fixed, per_token, residual = fits[median]
    fit = BudgetFit(num_requests, context_tokens, step_us, len(all_steps), fixed,
                    (min(f[0] for f in fits), max(f[0] for f in fits)), per_token,
                    (min(f[1] for f in fits), max(f[1] for f in fits)), residual,
                    1e6 * float(np.median([s.evict_s for s in all_steps])))
    return rows, fit


def measure_evict_paths(num_requests: int, context_tokens: int, num_steps: int, clock) -> EvictPathRow:
    """The same victims on two identical states, one call per request against one call."""
    runs = [EvictingRun(num_requests, context_tokens, num_steps, reclaim_config("default", 1.0), seed=3) for _ in range(2)]
    for run in runs:
        run.prefragment(BLOCK_SIZE)
    per_table_s, batched_s = [], []
    for run in runs:  # each step's slots() keeps the slot lists, as attention reads them
        for table in run.tables:
            table.slots()
    for step_idx in range(num_steps):
        victims = choose_victims(runs[0].tables, runs[0].rng, "random")
        for path in ((0, 1) if step_idx % 2 else (1, 0)):
            run = runs[path]
            started = clock()
            if path == 0:
                for table, token_id in zip(run.tables, victims.tolist()):
                    emptied = table.evict_tokens(np.array([token_id]))
                    if emptied.size:
                        table.release_blocks(emptied)
                        run.pool.free(emptied)
            else:
                run.evict(victims)
            (per_table_s if path == 0 else batched_s).append(clock() - started)
            for table in run.tables:
                table.slots()
    return EvictPathRow(num_requests, context_tokens, 1e6 * statistics.fmean(per_table_s), 1e6 * statistics.fmean(batched_s),
                        time_find_and_shift(num_requests, context_tokens, num_steps, clock))


def time_find_and_shift(num_requests: int, context_tokens: int, num_steps: int, clock) -> float:
    """Microseconds per step of what a dense slot list needs per eviction and nothing else: R
    lists of L int64 slots and L live bits in separate buffers (as each table keeps its own),
    each finding one random entry by counting the live bits on its nearer side and shifting
    that side over it, as `SlotCache` does for a removal (a count_nonzero and a memoryview
    copy). The least that keeping the list dense on the host costs, whatever does the
    bookkeeping around it: memory traffic of about L / 4 slots and L / 4 live bits each."""
    rng = np.random.default_rng(5)
    lives = [np.ones(context_tokens, dtype=bool) for _ in range(num_requests)]
    views = [memoryview(np.arange(context_tokens, dtype=np.int64)) for _ in range(num_requests)]
    step_s = []
    for _ in range(2 * num_steps):  # the first half warms up
        positions = rng.integers(1, context_tokens - 1, num_requests).tolist()
        started = clock()
        for live, view, token_id in zip(lives, views, positions):
            if 2 * token_id < context_tokens:
                idx = np.count_nonzero(live[:token_id])
                view[1 : idx + 1] = view[:idx]
            else:
                idx = context_tokens - 1 - np.count_nonzero(live[token_id + 1 :])
                view[idx : context_tokens - 1] = view[idx + 1 :]
        step_s.append(clock() - started)
    return 1e6 * statistics.fmean(step_s[num_steps:])


def measure_moves(num_requests: int, context_tokens: int, num_steps: int) -> list[MovesRow]:
    rows = []
    for pattern in ("random", "oldest"):
        for mode in ("hole-fill", "ordered"):
            run = EvictingRun(num_requests, context_tokens, num_steps, reclaim_config("default", 1.0, mode), pattern, every_step=True, seed=7)
            run.run(num_steps)
            freed = run.num_blocks_freed_by_plans
            rows.append(MovesRow(pattern, mode, run.num_tokens_moved, freed, run.num_tokens_moved / freed if freed else float("nan"),
                                 run.num_blocks_freed_by_eviction))
    return rows


# ---- output ----------------------------------------------------------------------------------


def table(header: str, lines: list[str]) -> str:
    return "\n".join([header, "-" * len(header), *lines])


def size_name(num_requests: int, context_tokens: int) -> str:
    return f"{num_requests} x {context_tokens // 1024}K"


def format_growth(rows: list[GrowthRow]) -> str:
    header = f"{'requests x context':<18} {'native us/step':>14} {'table us/step':>13} {'us/req/step':>11} {'x native':>8}"
    return table(header, [f"{size_name(r.num_requests, r.context_tokens):<18} {r.native_us:>14.1f} {r.table_us:>13.1f} "
                          f"{r.table_us / r.num_requests:>11.2f} {r.ratio:>8.2f}" for r in rows])


def verdict(share: float) -> str:
    return "met" if share <= TARGET_STEP_SHARE else "MISSED"


def step_bound(row: EvictRow) -> int | None:
    """The most tokens a step's reclamation may move under the row's config: max(budget,
    B x S) (a budgeted round step launches one plan at least); None without a budget."""
    if row.max_moves_per_step is None:
        return None
    return max(row.max_moves_per_step, row.max_src_blocks * BLOCK_SIZE)


def bound_verdict(row: EvictRow) -> str:
    bound = step_bound(row)
    if bound is None:
        return "none"
    return "held" if row.max_moved_per_step <= bound else "BROKEN"


def format_evict(rows: list[EvictRow]) -> str:
    header = (f"{'requests x context':<18} {'cadence':<11} {'moves/step':>10} {'steps':>5} {'round':>5} {'growth':>7} {'evict':>8} {'reclaim':>8} "
              f"{'slots':>7} {'plans/step':>10} {'moved/round':>11} {'step ms':>8} {'evict+reclaim [min-max]':>25} {'% of step':>9} {'1%':>6} "
              f"{'worst step [min-max]':>24} {'% of step':>9} {'max moved':>9} {'bound':>6}")
    lines = []
    for r in rows:
        budget = "-" if r.max_moves_per_step is None else str(r.max_moves_per_step)
        mean_range = f"{r.bookkeeping_us:,.0f} [{r.mean_range_us[0]:,.0f}-{r.mean_range_us[1]:,.0f}]"
        worst_range = f"{r.worst_us:,.0f} [{r.worst_range_us[0]:,.0f}-{r.worst_range_us[1]:,.0f}]"
        lines.append(f"{size_name(r.num_requests, r.context_tokens):<18} {r.cadence:<11} {budget:>10} {r.num_steps:>5} {r.num_round_steps:>5} {r.growth_us:>7.0f} "
                     f"{r.evict_us:>8.0f} {r.reclaim_us:>8.0f} {r.slots_us:>7.0f} {r.plans_per_step:>10.2f} {r.moved_per_round:>11,.0f} "
                     f"{r.modelled_step_us / 1000:>8.1f} {mean_range:>25} {100 * r.step_share:>9.2f} {verdict(r.step_share):>6} "
                     f"{worst_range:>24} {100 * r.worst_step_share:>9.2f} {r.max_moved_per_step:>9,} {bound_verdict(r):>6}")
    return table(header, lines)


def format_launching_steps(rows: list[EvictRow]) -> str:
    header = (f"{'requests x context':<18} {'cadence':<11} {'steps':>5} {'plans':>5} {'moved':>6} {'plan':>6} {'check':>6} {'launch':>6} "
              f"{'land':>6} {'sum':>6} {'% of step':>9}")
    lines = []
    for r in rows:
        total = sum(r.launching_step_parts_us)  # of the parts' medians
        parts = " ".join(f"{part:>6.0f}" for part in r.launching_step_parts_us)
        lines.append(f"{size_name(r.num_requests, r.context_tokens):<18} {r.cadence:<11} {r.num_launching_steps:>5} "
                     f"{r.launching_step_plans:>5.0f} {r.launching_step_moved:>6,.0f} {parts} {total:>6.0f} "
                     f"{100 * total / r.modelled_step_us:>9.2f}")
    return table(header, lines)


def format_first_steps(rows: list[EvictRow]) -> str:
    header = (f"{'requests x context':<18} {'cadence':<11} {'rounds':>6} {'evict':>6} {'plan':>6} {'check':>6} {'launch':>6} "
              f"{'land':>6} {'sum':>6} {'others':>6} {'replan':>6}")
    lines = []
    for r in rows:
        if not r.num_first_steps:
            continue
        parts = " ".join(f"{part:>6.0f}" for part in r.first_step_parts_us)
        replan = f"{r.first_step_replan_us:>6.0f}" if r.first_step_replan_us else f"{'-':>6}"
        lines.append(f"{size_name(r.num_requests, r.context_tokens):<18} {r.cadence:<11} {r.num_first_steps:>6} "
                     f"{r.first_step_evict_us:>6.0f} {parts} {sum(r.first_step_parts_us):>6.0f} {r.other_steps_sum_us:>6.0f} {replan}")
    return table(header, lines)


def format_replayed_worst(rows: list[EvictRow]) -> str:
    header = (f"{'requests x context':<18} {'cadence':<11} {'replays':>7} {'worst step [min-max]':>24} {'% of step':>9} "
              f"{'replayed [min-max]':>22} {'% of step':>9} {'1%':>6}  the replayed worst step")
    lines = []
    for r in rows:
        if r.replayed_worst_us is None:
            continue
        worst_range = f"{r.worst_us:,.0f} [{r.worst_range_us[0]:,.0f}-{r.worst_range_us[1]:,.0f}]"
        replayed_range = f"{r.replayed_worst_us:,.0f} [{r.replayed_worst_range_us[0]:,.0f}-{r.replayed_worst_range_us[1]:,.0f}]"
        lines.append(f"{size_name(r.num_requests, r.context_tokens):<18} {r.cadence:<11} {r.num_replays:>7} {worst_range:>24} "
                     f"{100 * r.worst_step_share:>9.2f} {replayed_range:>22} {100 * r.replayed_worst_share:>9.2f} "
                     f"{verdict(r.replayed_worst_share):>6}  {r.replayed_worst_kind}")
    return table(header, lines)


def format_budget_fit(rows: list[BudgetRow], fits: list[BudgetFit]) -> str:
    header = (f"{'requests x context':<18} {'budget':>6} {'steps':>5} {'plans':>5} {'moved':>6} {'reclaim us':>10} "
              f"{'evict us':>8}")
    lines = [f"{size_name(r.num_requests, r.context_tokens):<18} {r.max_moves_per_step:>6,} {r.num_launching_steps:>5} "
             f"{r.plans:>5.0f} {r.moved:>6,.0f} {r.round_step_us:>10.0f} {r.evict_us:>8.0f}" for r in rows]
    lines.append("")
    for f in fits:
        target_us = TARGET_STEP_SHARE * f.modelled_step_us
        lines.append(f"{size_name(f.num_requests, f.context_tokens)}: a round step's reclaim = {f.fixed_us:.0f} us "
                     f"({f.fixed_range_us[0]:.0f}-{f.fixed_range_us[1]:.0f}) + {1000 * f.us_per_token:.0f} us per 1,000 tokens moved "
                     f"({1000 * f.us_per_token_range[0]:.0f}-{1000 * f.us_per_token_range[1]:.0f}), {f.num_steps} steps, "
                     f"median residual {f.median_abs_residual_us:.0f} us; 1% of the step {target_us:.0f} us, its evictions "
                     f"{f.evict_us:.0f}: " + (f"up to {f.max_moves_within_target:,} moves a step fit" if f.max_moves_within_target
                                               else "no round step fits, whatever it moves"))
    return table(header, lines)


def format_evict_paths(rows: list[EvictPathRow]) -> str:
    header = (f"{'requests x context':<18} {'per table us/step':>17} {'evict_one_each us/step':>22} {'x per table':>11} "
              f"{'find + shift alone us/step':>26} {'% of evict_one_each':>19}")
    return table(header, [f"{size_name(r.num_requests, r.context_tokens):<18} {r.per_table_us:>17.0f} {r.batched_us:>22.0f} "
                          f"{r.batched_us / r.per_table_us:>11.2f} {r.find_shift_us:>26.0f} {100 * r.find_shift_us / r.batched_us:>19.0f}"
                          for r in rows])


def format_moves(rows: list[MovesRow]) -> str:
    header = f"{'pattern':<8} {'mode':<10} {'tokens moved':>12} {'blocks freed':>12} {'moved/freed':>11} {'freed by eviction':>17}"
    return table(header, [f"{r.pattern:<8} {r.mode:<10} {r.num_tokens_moved:>12} {r.num_blocks_freed:>12} "
                          f"{r.tokens_per_freed_block:>11.2f} {r.num_blocks_freed_by_eviction:>17}" for r in rows])


def format_targets(growth: list[GrowthRow], evicts: list[EvictRow]) -> str:
    lines = [f"table <= {TARGET_TABLE_RATIO}x native at {size_name(r.num_requests, r.context_tokens)}: {r.ratio:.2f}x "
             f"({'met' if r.ratio <= TARGET_TABLE_RATIO else 'MISSED'})" for r in growth]
    lines += [f"evict + reclaim <= 1% of the {r.modelled_step_us / 1000:.1f} ms step at {size_name(r.num_requests, r.context_tokens)}, "
              f"{r.cadence}{', landing next-step' if r.landing == 'next-step' else ''}: mean {100 * r.step_share:.2f}% "
              f"({verdict(r.step_share)}); worst step "
              f"{100 * r.worst_step_share:.2f}% of the step"
              + (f" ({100 * r.replayed_worst_share:.2f}% replayed, {verdict(r.replayed_worst_share)})"
                 if r.replayed_worst_share is not None else "") + ", "
              + (f"a step's moves bounded by {step_bound(r):,}: {r.max_moved_per_step:,} at most ({bound_verdict(r)})"
                 if step_bound(r) is not None else f"no bound on a step's moves: {r.max_moved_per_step:,} at most")
              for r in evicts if r.cadence != "every-step"]
    return "\n".join(lines)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--repeats", type=int, default=3, help="repetitions per measurement (median and min-max reported)")
    parser.add_argument("--quick", action="store_true", help="64 x 8K only, fewer steps and repetitions (a smoke run)")
    parser.add_argument("--sizes", help="only these requests x context, e.g. 64x8K,1024x8K, or tiny sizes such as 4x1K")
    parser.add_argument("--cadences", default=",".join(DEFAULT_CADENCES), help=f"of {', '.join(CADENCES)}")
    parser.add_argument("--wall", action="store_true", help="wall time (time.perf_counter) instead of CPU time")
    parser.add_argument("--replan-first", action="store_true",
                        help="at a round's first launching step, plan its requests again right after its planning, timed "
                             "apart (what the same planning costs warm; the step's check and landing then read warm data too)")
    parser.add_argument("--warm-round-code", nargs="?", const="verbs", choices=WARMINGS,
                        help="a diagnostic: after every step outside a round, untimed, run the round's code on a small "
                             "pool of its own, so that a round's first launching step meets its code warm: what is left "
                             "of its cost over the round's other steps is its work and its data; verbs (the default): "
                             "through the substrate's verbs, Python and compiled (engine/warmup.py); compiled: the "
                             "round's four compiled calls alone")
    parser.add_argument("--sweep-mb", type=int, default=0, metavar="MB",
                        help="a diagnostic: after every step, untimed, write a buffer of MB megabytes of its own, as the "
                             "host's other work between two steps evicts its data caches")
    parser.add_argument("--landing", choices=LANDINGS, default="same-step",
                        help="when a step's launched plans land: same-step (synchronous copies, the sim's and the CPU "
                             "executors'), or next-step (asynchronous copies on a GPU: landed at the next step, before "
                             "its evictions, as the runtime polls them before the forward)")
    parser.add_argument("--reader", choices=READERS, default="none",
                        help="who reads every table's slot list after each step: none (the default: the sim's and the "
                             "vLLM executor's engines, whose step the modelled one is, never read it), or slots (the hf "
                             "executor's attention reads every request's, so each eviction also records its entry's "
                             "removal; the slots column is that reader's time)")
    parser.add_argument("--replays", type=int, default=1, metavar="N",
                        help="run each repetition's cycle N times from its seed (the same work at every step) and report "
                             "its worst step replayed: each step's median over the N, the most of them (round cadences)")
    parser.add_argument("--fit-budgets", metavar="B1,B2,...",
                        help="fit a round step's fixed cost and cost per token moved over these budgets (tokens a step)")
    args = parser.parse_args()
    args.cadences = [c.strip() for c in args.cadences.split(",")]
    if bad := [c for c in args.cadences if c not in CADENCES]:
        parser.error(f"--cadences: {', '.join(bad)} is not one of {', '.join(CADENCES)}")
    if args.fit_budgets is not None and args.landing != "same-step":
        parser.error("--fit-budgets fits a step's reclaim on its own moves: it needs --landing same-step")
    if args.repeats <= 0:
        parser.error(f"--repeats must be > 0, got {args.repeats}")
    if args.replays <= 0:
        parser.error(f"--replays must be > 0, got {args.replays}")
    if args.sweep_mb < 0:
        parser.error(f"--sweep-mb must be >= 0, got {args.sweep_mb}")
    if args.fit_budgets is not None:
        try:
            args.fit_budgets = [int(b) for b in args.fit_budgets.split(",")]
        except ValueError:
            parser.error(f"--fit-budgets: '{args.fit_budgets}' is not a list of integers, e.g. 256,512,1024,2048")
        if min(args.fit_budgets) < 2 * BLOCK_SIZE or len(set(args.fit_budgets)) < 2:
            parser.error(f"--fit-budgets: needs at least two different budgets of at least {2 * BLOCK_SIZE} tokens, "
                         f"got {','.join(map(str, args.fit_budgets))}")
    args.scenarios = QUICK_SCENARIOS if args.quick else SCENARIOS
    if args.sizes:
        args.scenarios = tuple(parse_size(parser, size, args.scenarios) for size in args.sizes.split(","))
    return args


def parse_size(parser: argparse.ArgumentParser, size: str, known: tuple) -> tuple[int, int, int, int]:
    """'256x8K' -> a scenario: a known one's step counts, or a small one's for other sizes."""
    try:
        requests, context = size.strip().upper().split("X")
        num_requests, context_tokens = int(requests), int(context.removesuffix("K")) * 1024
    except ValueError:
        parser.error(f"--sizes: '{size}' is not REQUESTSxCONTEXT, e.g. 64x8K")
    if num_requests <= 0 or context_tokens < 2 * NUM_RECENT_TOKENS:
        parser.error(f"--sizes: '{size}' needs at least 1 request and a context of at least 1K")
    return next((s for s in SCENARIOS if s[:2] == (num_requests, context_tokens)), (num_requests, context_tokens, 20, 64))


def main() -> None:
    args = parse_args()
    clock = time.perf_counter if args.wall else time.process_time
    num_repeats = 1 if args.quick else args.repeats
    started = time.perf_counter()
    growth, evicts, paths, budget_rows, fits = [], [], [], [], []
    for num_requests, context_tokens, num_growth_steps, num_window_steps in args.scenarios:
        print(f"{size_name(num_requests, context_tokens)} ...", flush=True)
        growth.append(measure_growth(num_requests, context_tokens, num_growth_steps, num_repeats, clock))
        paths.append(measure_evict_paths(num_requests, context_tokens, num_growth_steps, clock))
        evicts += [measure_evict(num_requests, context_tokens, num_window_steps, cadence, num_repeats, clock, args.replan_first,
                                 args.landing, 1 if args.quick else args.replays, args.warm_round_code, args.sweep_mb,
                                 args.reader)
                   for cadence in args.cadences]
        if args.fit_budgets:
            try:
                rows, fit = measure_budget_fit(num_requests, context_tokens, args.fit_budgets, num_repeats, clock, args.reader)
            except ValueError as error:
                print(f"bench_substrate: --fit-budgets at {size_name(num_requests, context_tokens)}: {error}", file=sys.stderr)
                raise SystemExit(1) from None
            budget_rows += rows
            fits.append(fit)
    moves_size = args.scenarios[0][:2] if args.sizes else (64, 8192)
    moves = measure_moves(*moves_size, 50 if args.quick or args.sizes else 200)
    print("\ngrowth + slots(), no eviction (us per step, all requests)")
    print(format_growth(growth))
    print("\none eviction per request per step (us per step, all requests; step ms: the modelled decode step; plans land "
          + ("at the step that launched them" if args.landing == "same-step" else "at the next step, before its evictions")
          + ("; slots: every request's slots() after the step, as the hf executor's attention reads them (--reader slots)"
             if args.reader == "slots" else "; nothing reads the slot lists (--reader none, as the sim's and vLLM's engines)")
          + (f"; --warm-round-code {args.warm_round_code}: the round's code run on a pool of its own after every step "
             "outside a round, untimed, a diagnostic" if args.warm_round_code else "")
          + (f"; --sweep-mb {args.sweep_mb}: a buffer of its own written after every step, untimed, a diagnostic"
             if args.sweep_mb else "") + ")")
    print(format_evict(evicts))
    print("check_plan alone (a round's I4 check plan by plan, as when plans_pass finds something; "
          "not in the figures above), us per plan: "
          + ", ".join(f"{size_name(r.num_requests, r.context_tokens)} {r.cadence} {r.check_plan_us_per_plan:.0f}" for r in evicts))
    if any(r.replayed_worst_us is not None for r in evicts):
        print(f"\nthe worst step replayed (--replays): each repetition's cycle run {args.replays} times from its seed, the same "
              "work at every step; each step's median evict + reclaim over them, the most of them (us; the median repetition's, "
              "min-max over the repetitions), beside the worst step measured once as above, and what that step was")
        print(format_replayed_worst(evicts))
    print("\na measured step that launched plans, by part of its reclaim (the median over the median repetition's such steps, "
          "us): planning, the I4 check (check_round), launching (destinations, copies launched and polled), landing "
          "(moves applied, emptied blocks released and freed), and their sum; plans and moved: the median step's")
    print(format_launching_steps(evicts))
    print("\na round's first launching step (the medians over every repetition's first steps, us): its evictions, the "
          "parts of its reclaim as above and their sum; others: the median sum of the median repetition's other launching "
          "steps; replan: its requests planned again right after its planning (--replan-first)")
    print(format_first_steps(evicts))
    if fits:
        print("\na round step against the tokens it moved: the paced cadence's reclaimer at each budget, the steps that "
              "launched plans over every repetition (medians: plans, moved, their reclaim, the step's evictions), then the "
              "least-squares line of reclaim on moves")
        print(format_budget_fit(budget_rows, fits))
    print("\na step's evictions, one evict_tokens per request against one evict_one_each, and finding and shifting "
          "each slot list's entry alone (us per step)")
    print(format_evict_paths(paths))
    print(f"\ntokens moved per freed block, {size_name(*moves_size)}, same eviction sequence for both modes")
    print(format_moves(moves))
    print()
    print(format_targets(growth, evicts))
    print(f"\n{time.perf_counter() - started:.0f} s", flush=True)
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"clock": clock.__name__, "block_size": BLOCK_SIZE, "num_sink_tokens": NUM_SINK_TOKENS,
                       "warm_round_code": args.warm_round_code, "sweep_mb": args.sweep_mb, "reader": args.reader,
                       "num_recent_tokens": NUM_RECENT_TOKENS, "repeats": num_repeats,
                       "growth": [dict(asdict(r), ratio=r.ratio) for r in growth],
                       "evict": [dict(asdict(r), bookkeeping_us=r.bookkeeping_us, step_share=r.step_share,
                                      worst_step_share=r.worst_step_share, replayed_worst_share=r.replayed_worst_share,
                                      paced_moves_per_step=paced_moves_per_step(r.modelled_step_us))
                                 for r in evicts],
                       "evict_paths": [asdict(r) for r in paths],
                       "budget_fit": {"budgets": [asdict(r) for r in budget_rows],
                                      "fits": [dict(asdict(f), max_moves_within_target=f.max_moves_within_target) for f in fits]},
                       "moves": [asdict(m) for m in moves]}, out, indent=2)


if __name__ == "__main__":
    main()
