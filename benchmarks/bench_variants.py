"""Host time per variant on the whole Azure conversation trace, open loop: what `vtoken compare
TRACE --open-loop --no-sweep --no-frontier --variants V` replays (default model, GPU and block
budget, H2O at 50%). Host seconds, not a test.

    python benchmarks/bench_variants.py [--azure PATH] [--rounds 2] [--max-requests N] [--eviction-interval T]
                                        [--variants V,...] [--interleave STEPS] [--phases] [--step-costs]

The trace is read once; a short replay of every variant warms up (imports, first allocations)
and is not counted; then each round replays every variant, the order reversed every other
round, so that a slow spell of the machine hits all of them. Per variant: wall seconds
(RunResult.host_time_s) and this process's CPU seconds, median and range over the rounds, and
each median over native's; then each round's own ratios. Every round must give the same
results (checked).

`--interleave STEPS`: a round replays the variants side by side instead of one after another:
STEPS steps of one variant's runtime, then STEPS of the next, the order reversed at every turn,
each variant's seconds summed over its own turns (building the runtime and its result
included). A slow spell of a shared host, which lasts longer than a turn, then hits every
variant of the round alike, where one replay after another leaves it to whichever ran then.
The replays are independent (each runtime owns its executor, pool and policy), so they give
the results a replay alone gives (tests/test_bench_variants.py checks it on the sample). A
turn of 1,000 steps is about a tenth of a second of native's replay: long against what its
caches need to fill again after another variant's turn.

`--phases`: after the rounds, one more replay of every variant with the runtime's phases timed
(CPU seconds, calls and microseconds per call of each of PHASES): where a variant's time goes.
The runtime's step is schedule, execute and postprocess. Inside them, an eviction event,
`_evict`, is the policy's decision (`decide`, of which `scores` is the sim's synthetic attention
for the policies that rank by it), the table's and the pool's side (`evict_tokens`) and, in
vtoken, the layout trigger's check (`layout`, of which `count` is the count of the request's
uncompacted blocks, made only where the request can hold more); a reclamation round, `_reclaim` (which the
schedule's pressure packing and the layout trigger call too), is planning (`plans`), the
round's I4 check (`plans_pass`) and, the copies done, landing the moves and freeing the sources
(`landing`); inside those, the round step's compiled loops (kv/compiled.py), each one call a
step: planning's `hole_fill_round` (the movable blocks, the order and the plans), the check's `round_passes` and the
landing's `land_moves` (what is left of each phase is Python and numpy calls). Every variant counts a step's appends in the pool at the pool's first read after
them, in one batch (`appends`, `BlockPool.flush_deferred`). The timers wrap the functions,
about a microsecond a call, and nest, so this replay is not one of the rounds.

`--step-costs`: then one more replay of every variant that evicts, with the host time of each
step's KV-memory work set against the step's modelled duration (what `execute` returned): the
eviction's memory side (`_apply_eviction`: the table's and the pool's, the blocks it emptied
freed, and vtoken's layout trigger) and vtoken's reclamation (`_reclaim`, from the schedule's
pressure packing, the layout trigger or the lazy round after the step; with the sim's
synchronous copies its landing is inside it), this process's CPU time (a shared host's other
work does not land in it; a garbage collection does), each call timed once where they nest.
What bench_substrate.py's goal measures on its synthetic batch (evict + reclaim against the
modelled step), here in the engine's own loop, where the step's other work (the schedule, the
policy's decisions, the sim's cost model) runs between two rounds. Per variant: the steps with
such work, its mean (total host time over total modelled time), the distribution of its share
of each step, and the worst step: what ran in it; then every garbage collection of the replay,
inside that work or not (by generation, and the full ones' CPU time), and the objects the
collector tracked at its start and after its last step.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import gc
import os
import statistics
import time
from pathlib import Path
from typing import NamedTuple

from replay_inputs import checked_replay, fail, replayed

from vtoken import defaults, invariants
from vtoken.compare import variant_to_json
from vtoken.engine import VARIANTS, Experiment, Runtime, SimExecutor, run_sim, sim_runtime
from vtoken.engine.eviction import EvictionSchedule
from vtoken.errors import ConfigError
from vtoken.kv import compiled
from vtoken.kv.block_pool import BlockPool
from vtoken.kv.reclaim import Reclaimer, reclaim_budget_text
from vtoken.kv.token_table import TokenTable
from vtoken.metrics import RunResult
from vtoken_cli.options import parse_reclaim_budget

ROOT = Path(__file__).resolve().parent.parent
AZURE = ROOT.parent / "shared" / "traces" / "azure_llm_2023_conv.csv"
SCRIPT = "bench_variants"
NUM_WARMUP_REQUESTS = 100
# (label, owner, function) --phases times: the owner's attribute is wrapped while it replays
PHASES = (
    ("schedule", Runtime, "schedule"),
    ("execute", Runtime, "execute"),
    ("postprocess", Runtime, "postprocess"),
    ("_evict", Runtime, "_evict"),
    ("decide", EvictionSchedule, "decide"),
    ("scores", SimExecutor, "attention_stats"),
    ("evict_tokens", TokenTable, "evict_tokens"),
    ("layout", Runtime, "_repack_if_worse_than_uncompacted"),
    ("count", TokenTable, "num_uncompacted_blocks"),
    ("_reclaim", Runtime, "_reclaim"),
    ("plans", Reclaimer, "_plans"),
    ("hole_fill_round", compiled, "hole_fill_round"),
    ("plans_pass", invariants, "plans_pass"),
    ("round_passes", compiled, "round_passes"),
    ("landing", Runtime, "_complete"),
    ("land_moves", compiled, "land_moves"),
    ("appends", BlockPool, "flush_deferred"),
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--azure", default=str(AZURE))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-requests", type=int, default=None, help="only the first N requests (a quick check)")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--eviction-interval", type=int, default=defaults.EVICTION_INTERVAL_TOKENS,
                        help="the policy runs every T generated tokens (1: every request evicts every step)")
    parser.add_argument("--reclaim-budget", metavar="N|auto|none", default=None,
                        help="tokens a lazy round moves per step (vtoken compare's --reclaim-budget); default: as shipped")
    parser.add_argument("--interleave", type=int, metavar="STEPS",
                        help="replay the variants of a round side by side, STEPS steps of each in turn")
    parser.add_argument("--phases", action="store_true", help="then one replay per variant with the runtime's phases timed")
    parser.add_argument("--step-costs", action="store_true",
                        help="then one replay per evicting variant with each step's KV-memory work timed against its modelled step")
    args = parser.parse_args()
    variants = checked_replay(SCRIPT, args.variants, args.azure, args.max_requests)
    if args.rounds < 1:
        fail(SCRIPT, f"--rounds must be at least 1, got {args.rounds}")
    if args.interleave is not None and args.interleave < 1:
        fail(SCRIPT, f"--interleave must be at least 1 step, got {args.interleave}")
    if args.step_costs and variants == ["native"] * len(variants):
        fail(SCRIPT, "--step-costs times eviction and reclamation: add naive-evict or vtoken to --variants")
    try:
        budget = parse_reclaim_budget(args.reclaim_budget) if args.reclaim_budget is not None else defaults.RECLAIM_MOVES_PER_STEP
    except ConfigError as exc:
        fail(SCRIPT, str(exc))
    experiment, requests = replayed(args.azure, args.max_requests, args.eviction_interval)
    experiment = dataclasses.replace(experiment, reclaim=dataclasses.replace(experiment.reclaim, max_moves_per_step=budget))
    how = f"side by side, {args.interleave} steps a turn" if args.interleave else "one after another"
    budget_said = reclaim_budget_text(experiment.reclaim.max_moves_per_step)
    print(f"{len(requests)} requests, open loop, {experiment.model.name} on {experiment.gpu.name}, {experiment.num_blocks} blocks, "
          f"eviction every {args.eviction_interval} tokens, a lazy round's budget {budget_said} (tokens a step; auto: "
          f"{defaults.RECLAIM_MOVES_PER_STEP_MS:g} a millisecond of the step before), "
          f"variants {how}, "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores at the start", flush=True)
    for variant in variants:
        run_sim(experiment.run(variant, None), requests[:NUM_WARMUP_REQUESTS])
    wall_s: dict[str, list[float]] = {v: [] for v in variants}
    cpu_s: dict[str, list[float]] = {v: [] for v in variants}
    results: dict[str, list[dict]] = {v: [] for v in variants}
    for round_idx in range(args.rounds):
        order = variants if round_idx % 2 == 0 else variants[::-1]
        if args.interleave:
            replays = interleaved(experiment, order, requests, args.interleave)
        else:
            replays = {variant: alone(experiment, variant, requests) for variant in order}
        for variant, (result, wall, cpu) in replays.items():
            cpu_s[variant].append(cpu)
            wall_s[variant].append(wall)
            results[variant].append(variant_to_json(result))
            print(f"round {round_idx + 1}: {variant:12s} {wall:7.1f} s wall, {cpu:7.1f} s CPU, "
                  f"{result.num_decode_steps} decode steps, load average {os.getloadavg()[0]:.1f}", flush=True)
    print(f"\n{'variant':12s} {'wall s (median, range)':>26s} {'CPU s (median, range)':>26s} {'wall / native':>13s} "
          f"{'CPU / native':>12s}")
    for variant in variants:
        wall, cpu = wall_s[variant], cpu_s[variant]
        ratios = ""
        if "native" in variants:
            ratios = (f"{statistics.median(wall) / statistics.median(wall_s['native']):13.2f} "
                      f"{statistics.median(cpu) / statistics.median(cpu_s['native']):12.2f}")
        print(f"{variant:12s} {statistics.median(wall):8.1f} ({min(wall):6.1f}-{max(wall):6.1f}) "
              f"{statistics.median(cpu):13.1f} ({min(cpu):6.1f}-{max(cpu):6.1f}) {ratios}")
    if "native" in variants and len(variants) > 1:
        for variant in variants:
            if variant != "native":
                ratios = [cpu / base for cpu, base in zip(cpu_s[variant], cpu_s["native"])]
                print(f"{variant} / native CPU, round by round: {', '.join(f'{r:.2f}' for r in ratios)} "
                      f"(median {statistics.median(ratios):.2f})")
    print(f"same results in every round: {all(all(r == rs[0] for r in rs) for rs in results.values())}; "
          f"load average {os.getloadavg()[0]:.1f} at the end")
    if args.phases:
        print(f"\n{'variant':12s} {'phase':15s} {'CPU s':>8s} {'calls':>8s} {'us per call':>11s}")
        for variant in variants:
            seconds, calls = timed_phases(lambda: run_sim(experiment.run(variant, None), requests))
            for phase, _, _ in PHASES:
                if calls[phase]:
                    print(f"{variant:12s} {phase:15s} {seconds[phase]:8.2f} {calls[phase]:8d} {1e6 * seconds[phase] / calls[phase]:11.1f}")
    if args.step_costs:
        print_step_costs({variant: step_costs(lambda: run_sim(experiment.run(variant, None), requests))
                          for variant in variants if variant != "native"})


def alone(experiment: Experiment, variant: str, requests: list) -> tuple[RunResult, float, float]:
    """One replay of `variant`: its result, wall seconds and CPU seconds."""
    started_cpu = time.process_time()
    result = run_sim(experiment.run(variant, None), requests)
    return result, result.host_time_s, time.process_time() - started_cpu


def interleaved(experiment: Experiment, variants: list[str], requests: list,
                steps_per_turn: int) -> dict[str, tuple[RunResult, float, float]]:
    """One replay of every variant, side by side: `steps_per_turn` steps of each runtime in
    turn, the order reversed at every turn. Per variant: its result, and the wall and CPU
    seconds of its own turns (building its runtime and its result included)."""
    wall = dict.fromkeys(variants, 0.0)
    cpu = dict.fromkeys(variants, 0.0)
    runtimes: dict[str, Runtime] = {}

    def timed(variant: str, work):
        started_wall, started_cpu = time.perf_counter(), time.process_time()
        out = work()
        wall[variant] += time.perf_counter() - started_wall
        cpu[variant] += time.process_time() - started_cpu
        return out

    for variant in variants:
        runtimes[variant] = timed(variant, lambda: sim_runtime(experiment.run(variant, None), requests))
    active, turn = list(variants), 0
    while active:
        for variant in active if turn % 2 == 0 else active[::-1]:
            runtime = runtimes[variant]
            timed(variant, lambda: steps(runtime, steps_per_turn))
        active = [variant for variant in active if runtimes[variant].has_work()]
        turn += 1
    return {variant: (timed(variant, lambda: runtimes[variant].finish(wall[variant])), wall[variant], cpu[variant])
            for variant in variants}


def steps(runtime: Runtime, num_steps: int) -> None:
    """Up to `num_steps` steps of `runtime`, fewer when it runs out of work."""
    for _ in range(num_steps):
        if not runtime.has_work():
            return
        runtime.step()


class StepCost(NamedTuple):
    """One step's KV-memory work (`--step-costs`): its host seconds and the step's modelled
    seconds, the requests it ran, the eviction events and reclamation triggers in it (as
    `Runtime.reclaim_work` names them), the tokens its plans moved, and the seconds of the
    garbage collections that ran inside that work (a collection runs where an allocation
    crosses its threshold, whichever code that is: counted, and the worst step is also given
    without the steps that had one)."""

    host_s: float
    modelled_s: float
    num_requests: int
    num_evictions: int
    triggers: tuple[str, ...]
    num_tokens_moved: int
    gc_s: float  # of host_s, Python's garbage collections that ran inside the work
    # the step's lazy reclamation: "first" launched a round's first plans (no round was in
    # progress, or the one in progress had launched none), "later" went on with one, "" none
    round_step: str = ""

    @property
    def share(self) -> float:
        return self.host_s / self.modelled_s


class ReplayCosts(NamedTuple):
    """A replay under `step_costs`: its steps with KV-memory work (`rows`, StepCost's fields as
    plain tuples, which the collector stops tracking once it has seen them: hundreds of thousands
    of StepCost objects held while the next variant replays would be scanned by its every full
    collection), every garbage collection that ran during it, inside that work or not
    ((generation, CPU seconds) each), and the objects the collector tracked when it started and
    when its last step was done (gc.get_objects)."""

    rows: list[tuple]
    collections: list[tuple[int, float]]
    num_tracked_at_start: int
    num_tracked_at_end: int

    @property
    def steps(self) -> list[StepCost]:
        return [StepCost._make(row) for row in self.rows]


# what --step-costs times: (owner, name), each call timed once where they nest
MEMORY_WORK = ((Runtime, "_apply_eviction"), (Runtime, "_reclaim"), (Runtime, "_complete"))


def step_costs(replay) -> ReplayCosts:
    """Every step of `replay()` that did KV-memory work (MEMORY_WORK) and ran a forward, with
    that work's CPU seconds (the functions wrapped, then restored), and the replay's collections."""
    rows: list[tuple] = []
    collected: list[tuple[int, float]] = []  # every collection: (generation, CPU seconds)
    num_tracked = [len(gc.get_objects()), 0]
    # the step being timed, and whether the lazy round in progress has launched plans (across steps:
    # cleared after any step that leaves no round in progress)
    current = {"host_s": 0.0, "depth": 0, "evictions": 0, "modelled_s": None, "requests": 0, "gc_s": 0.0, "gc_started": 0.0,
               "launched_in_round": False}

    def on_collection(phase: str, info: dict) -> None:
        if phase == "start":
            current["gc_started"] = time.process_time()
            return
        seconds = time.process_time() - current["gc_started"]
        collected.append((info["generation"], seconds))
        if current["depth"]:
            current["gc_s"] += seconds

    def timed(name: str, function):
        def call(runtime, *args, **kwargs):
            current["depth"] += 1
            started = time.process_time()
            try:
                return function(runtime, *args, **kwargs)
            finally:
                current["depth"] -= 1
                if not current["depth"]:
                    current["host_s"] += time.process_time() - started
                current["evictions"] += name == "_apply_eviction"
        return call

    def execute(runtime, batch):
        current["modelled_s"] = own_execute(runtime, batch)
        current["requests"] = len(batch.decode) + len(batch.prefill)
        return current["modelled_s"]

    def step(runtime):
        moved_before = {trigger: work.num_tokens_moved for trigger, work in runtime.reclaim_work.items()}
        rounds_before = {trigger: work.num_rounds for trigger, work in runtime.reclaim_work.items()}
        current.update(host_s=0.0, evictions=0, modelled_s=None, requests=0, gc_s=0.0)
        own_step(runtime)
        work = runtime.reclaim_work
        round_step = ""
        if work["lazy"].num_tokens_moved > moved_before["lazy"]:
            round_step = "later" if current["launched_in_round"] else "first"
            current["launched_in_round"] = True
        if runtime.reclaimer is None or not runtime.reclaimer.is_round_in_progress:  # the next plans launched start a round
            current["launched_in_round"] = False
        if current["host_s"] and current["modelled_s"]:
            rows.append((current["host_s"], current["modelled_s"], current["requests"], current["evictions"],
                         tuple(t for t in work if work[t].num_rounds > rounds_before.get(t, 0)),
                         sum(work[t].num_tokens_moved - moved_before.get(t, 0) for t in work), current["gc_s"], round_step))

    def finish(runtime, host_time_s):  # after the last step, the runtime and what it holds still alive
        num_tracked[1] = len(gc.get_objects())
        return own_finish(runtime, host_time_s)

    own_step, own_execute, own_finish = Runtime.step, Runtime.execute, Runtime.finish
    replacements = [(owner, name, timed(name, getattr(owner, name))) for owner, name in MEMORY_WORK]
    gc.callbacks.append(on_collection)
    try:
        with patched([*replacements, (Runtime, "step", step), (Runtime, "execute", execute), (Runtime, "finish", finish)]):
            replay()
    finally:
        gc.callbacks.remove(on_collection)
    return ReplayCosts(rows, collected, *num_tracked)


def print_step_costs(replays: dict[str, ReplayCosts]) -> None:
    costs = {variant: replay.steps for variant, replay in replays.items()}
    print("\neach step's KV-memory work (the eviction's memory side, the reclamation) against the step's modelled "
          "duration, CPU time; its share of a step: its host time / the step's modelled time; gc: the steps in "
          "whose work a garbage collection ran")
    print(f"{'variant':12s} {'steps':>7s} {'mean':>6s} {'median':>6s} {'p99':>6s} {'p99.9':>6s} {'> 1%':>6s} {'gc':>4s} "
          f"{'worst':>8s} {'no gc':>6s}  the worst step without a garbage collection")
    for variant, steps in costs.items():
        if not steps:
            print(f"{variant:12s} {0:7d}  (no step did KV-memory work)")
            continue
        shares = sorted(step.share for step in steps)
        mean = sum(step.host_s for step in steps) / sum(step.modelled_s for step in steps)
        quantile = lambda q: shares[min(len(shares) - 1, int(q * len(shares)))]  # noqa: E731
        without_gc = [step for step in steps if not step.gc_s]
        worst_without_gc = "     -  (a collection ran in every step's work)"
        if without_gc:
            worst = max(without_gc, key=lambda step: step.share)
            what = ", ".join((*(f"{trigger} reclamation" for trigger in worst.triggers),
                              *([f"{worst.num_evictions} eviction event(s)"] if worst.num_evictions else [])))
            worst_without_gc = (f"{100 * worst.share:5.2f}%  {1e6 * worst.host_s:.0f} us of a {1e3 * worst.modelled_s:.1f} ms "
                                f"step of {worst.num_requests} requests: {what}, {worst.num_tokens_moved} tokens moved")
        print(f"{variant:12s} {len(steps):7d} {100 * mean:5.2f}% {100 * quantile(0.5):5.2f}% {100 * quantile(0.99):5.2f}% "
              f"{100 * quantile(0.999):5.2f}% {sum(share > 0.01 for share in shares):6d} {len(steps) - len(without_gc):4d} "
              f"{100 * shares[-1]:7.2f}% {worst_without_gc}")
    for variant, steps in costs.items():
        kinds = {kind: [step for step in steps if step.round_step == kind and not step.gc_s] for kind in ("first", "later")}
        if kinds["first"] and kinds["later"]:
            print(f"{variant}'s lazy round steps that launched plans, no collection in them, medians: " + "; ".join(
                f"{kind} {len(of_kind)}: {1e6 * statistics.median(s.host_s for s in of_kind):.0f} us, "
                f"{statistics.median(s.num_tokens_moved for s in of_kind):.0f} moves, "
                f"{100 * statistics.median(s.share for s in of_kind):.2f}% of the step" for kind, of_kind in kinds.items()))
    for variant, replay in replays.items():
        by_generation = collections.Counter(generation for generation, _ in replay.collections)
        full_ms = sorted(1e3 * seconds for generation, seconds in replay.collections if generation == 2)
        print(f"{variant}'s replay: {len(replay.collections)} garbage collections (generation 0, 1, 2: "
              f"{by_generation[0]}, {by_generation[1]}, {by_generation[2]})"
              + (f", the full ones {full_ms[0]:.0f}-{full_ms[-1]:.0f} ms of CPU each" if full_ms else "")
              + f"; objects tracked: {replay.num_tracked_at_start:,} at its start, {replay.num_tracked_at_end:,} after its last step")


def timed_phases(replay) -> tuple[collections.Counter, collections.Counter]:
    """CPU seconds and calls of each of PHASES while `replay()` runs (the functions wrapped,
    then restored: `patched`)."""
    seconds, calls = collections.Counter(), collections.Counter()

    def timed(phase: str, function):
        def call(*args, **kwargs):
            started = time.process_time()
            try:
                return function(*args, **kwargs)
            finally:
                seconds[phase] += time.process_time() - started
                calls[phase] += 1
        return call

    with patched([(owner, name, timed(phase, getattr(owner, name))) for phase, owner, name in PHASES]):
        replay()
    return seconds, calls


@contextlib.contextmanager
def patched(replacements: list[tuple[object, str, object]]):
    """Each (owner, name, value) set while the block runs, then what the owner had put back: an
    inherited method set on the class named is removed from it after."""
    restore = []
    try:
        for owner, name, value in replacements:
            restore.append((owner, name, vars(owner).get(name)))
            setattr(owner, name, value)
        yield
    finally:
        for owner, name, own in reversed(restore):
            if own is None:
                delattr(owner, name)
            else:
                setattr(owner, name, own)


if __name__ == "__main__":
    main()
