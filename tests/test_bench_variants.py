"""benchmarks/bench_variants.py runs end to end on the bundled sample: every variant's row, the
same results in every round, with --phases the runtime's phases per variant (eviction only
where the variant evicts, reclamation only in vtoken), and with --step-costs each evicting
variant's steps' memory work against the modelled step; the variants replayed side by side
(--interleave) give the results each gives alone; bad input is a one-line error. No timing is
checked."""

from __future__ import annotations

import dataclasses
import gc
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_the_variants_bench_runs_on_the_sample_with_phases() -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    completed = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_variants.py"), "--azure", str(ROOT / "sample_traces" / "azure_conv_sample.csv"),
         "--max-requests", "120", "--rounds", "2", "--phases", "--step-costs"],
        capture_output=True, text=True, env=env, timeout=600, check=False)
    assert completed.returncode == 0, completed.stderr
    assert "same results in every round: True" in completed.stdout
    phases = {(m["variant"], m["phase"]): int(m["calls"]) for m in re.finditer(
        r"^(?P<variant>native|naive-evict|vtoken)\s+(?P<phase>\w+)\s+[\d.]+\s+(?P<calls>\d+)\s+[\d.]+$",
        completed.stdout, re.MULTILINE)}
    for variant in ("native", "naive-evict", "vtoken"):
        assert phases[(variant, "schedule")] >= phases[(variant, "execute")] == phases[(variant, "postprocess")] > 0
        assert phases[(variant, "appends")] > 0
    for phase in ("_evict", "decide", "scores"):  # H2O ranks by the sim's attention scores
        assert ("native", phase) not in phases and phases[("naive-evict", phase)] == phases[("vtoken", phase)] > 0
    assert 0 < phases[("naive-evict", "evict_tokens")] == phases[("vtoken", "evict_tokens")] <= phases[("vtoken", "_evict")]
    assert phases[("vtoken", "layout")] == phases[("vtoken", "evict_tokens")] and ("naive-evict", "layout") not in phases
    assert ("naive-evict", "count") not in phases  # the layout trigger's count is vtoken's alone
    for phase in ("_reclaim", "plans", "plans_pass"):
        assert ("naive-evict", phase) not in phases and phases[("vtoken", phase)] > 0
    # the round step's compiled loops: planning's, then one check and one landing of what it planned
    for phase in ("hole_fill_round", "round_passes", "land_moves"):
        assert ("naive-evict", phase) not in phases and phases[("vtoken", phase)] > 0
    assert phases[("vtoken", "land_moves")] <= phases[("vtoken", "round_passes")] <= phases[("vtoken", "plans_pass")]
    # --step-costs: a row per evicting variant, its worst step named; reclamation in vtoken's alone
    rows = {m["variant"]: m for m in re.finditer(
        r"^(?P<variant>native|naive-evict|vtoken)\s+(?P<steps>\d+)\s+(?:[\d.]+%\s+){4}\d+\s+\d+\s+[\d.]+%\s+[\d.]+%\s+\d+ us of a "
        r"[\d.]+ ms step of \d+ requests: (?P<what>.*), (?P<moved>\d+) tokens moved$", completed.stdout, re.MULTILINE)}
    assert set(rows) == {"naive-evict", "vtoken"} and all(int(row["steps"]) > 0 for row in rows.values())
    assert "reclamation" not in rows["naive-evict"]["what"] and rows["naive-evict"]["moved"] == "0"


def test_variants_side_by_side_give_the_results_each_gives_alone() -> None:
    """--interleave's premise: stepping the variants' runtimes in turns of a few steps each, so
    that every runtime is left mid-run hundreds of times, changes none of their results, and
    `finish` gives each its own."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from bench_variants import alone, interleaved
        from replay_inputs import replayed
    finally:
        sys.path.pop(0)
    from vtoken.compare import variant_to_json
    from vtoken.engine import VARIANTS

    experiment, requests = replayed(str(ROOT / "sample_traces" / "azure_conv_sample.csv"), 80)
    # a small pool, so that vtoken packs under pressure too, not only in lazy rounds
    experiment = dataclasses.replace(experiment, num_blocks=experiment.num_blocks // 40)
    side_by_side = interleaved(experiment, list(VARIANTS), requests, 7)
    for variant in VARIANTS:
        result, wall_s, cpu_s = side_by_side[variant]
        assert cpu_s > 0 and 0 < result.host_time_s <= wall_s
        assert variant_to_json(result) == variant_to_json(alone(experiment, variant, requests)[0]), variant
    assert side_by_side["vtoken"][0].pressure_reclaim.num_plans > 0 and side_by_side["vtoken"][0].lazy_reclaim.num_plans > 0


def test_step_costs_times_each_steps_memory_work_and_restores_the_runtime() -> None:
    """--step-costs: every step with eviction or reclamation work is one entry, with its
    modelled duration, and the tokens its plans moved add up to the run's; the runtime's
    methods are its own again after."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from bench_variants import step_costs
        from replay_inputs import replayed
    finally:
        sys.path.pop(0)
    from vtoken.engine import Runtime, sim_runtime

    experiment, requests = replayed(str(ROOT / "sample_traces" / "azure_conv_sample.csv"), 80)
    experiment = dataclasses.replace(experiment, num_blocks=experiment.num_blocks // 40,  # pressure packing too
                                     reclaim=dataclasses.replace(experiment.reclaim, max_moves_per_step=64))  # rounds over several steps
    own = Runtime.step, Runtime.execute, Runtime._reclaim, Runtime._apply_eviction, Runtime._complete, Runtime.finish
    runtimes = {variant: sim_runtime(experiment.run(variant, None), requests) for variant in ("naive-evict", "vtoken")}
    slowed: list[int] = []  # the first few reclamations of vtoken take 20 ms of CPU more: their steps must show it

    def slow_reclaim(runtime, *args, **kwargs):
        if len(slowed) < 3:
            slowed.append(runtime.num_iterations)
            started = time.process_time()
            while time.process_time() < started + 0.02:
                pass
        return own[2](runtime, *args, **kwargs)

    Runtime._reclaim = slow_reclaim
    try:
        replays = {variant: step_costs(runtime.run) for variant, runtime in runtimes.items()}
    finally:
        Runtime._reclaim = own[2]
    assert (Runtime.step, Runtime.execute, Runtime._reclaim, Runtime._apply_eviction, Runtime._complete, Runtime.finish) == own
    costs = {variant: replay.steps for variant, replay in replays.items()}
    for replay in replays.values():  # every collection of the replay, those inside the memory work among them
        assert replay.collections and {generation for generation, _ in replay.collections} <= {0, 1, 2}
        assert sum(step.gc_s for step in replay.steps) <= sum(seconds for _, seconds in replay.collections)
        assert replay.num_tracked_at_start > 0 and replay.num_tracked_at_end > 0
    gc.collect()  # the rows held between replays are not the collector's to scan
    assert not any(gc.is_tracked(row) for replay in replays.values() for row in replay.rows)
    assert len(slowed) == 3 and sum(step.host_s >= 0.02 for step in costs["vtoken"]) >= len(set(slowed))
    for variant, steps in costs.items():
        runtime = runtimes[variant]
        assert 0 < len(steps) <= runtime.num_iterations
        assert all(step.host_s > 0 and step.modelled_s > 0 and 0 < step.num_requests and 0 <= step.gc_s <= step.host_s for step in steps)
        assert sum(step.num_evictions for step in steps) == runtime.counters.eviction_events > 0
        assert sum(step.num_tokens_moved for step in steps) == sum(work.num_tokens_moved for work in runtime.reclaim_work.values())
    assert not any(step.triggers or step.round_step for step in costs["naive-evict"])
    assert {"lazy", "pressure"} <= {trigger for step in costs["vtoken"] for trigger in step.triggers}
    # a lazy round's steps that launched plans: its first, then the later ones, every lazy move in one of them
    round_steps = [step for step in costs["vtoken"] if step.round_step]
    assert round_steps[0].round_step == "first" and {step.round_step for step in round_steps} == {"first", "later"}
    assert sum(step.num_tokens_moved for step in round_steps) >= runtimes["vtoken"].reclaim_work["lazy"].num_tokens_moved > 0
    assert all("lazy" in step.triggers for step in round_steps)


@pytest.mark.parametrize(("args", "message"), [
    (("--variants", "native,fast"), "--variants: unknown variant 'fast'; known: native, naive-evict, vtoken"),
    (("--max-requests", "0"), "--max-requests must be at least 1, got 0"),
    (("--rounds", "0", "--azure", str(ROOT / "sample_traces" / "azure_conv_sample.csv")), "--rounds must be at least 1, got 0"),
    (("--interleave", "0", "--azure", str(ROOT / "sample_traces" / "azure_conv_sample.csv")),
     "--interleave must be at least 1 step, got 0"),
    (("--azure", "/nonexistent/trace.csv"), "--azure: no trace at /nonexistent/trace.csv"),
    (("--reclaim-budget", "0", "--azure", str(ROOT / "sample_traces" / "azure_conv_sample.csv")),
     "--reclaim-budget must be an integer > 0, 'auto' or 'none', got '0'"),
    (("--variants", "native", "--step-costs", "--azure", str(ROOT / "sample_traces" / "azure_conv_sample.csv")),
     "--step-costs times eviction and reclamation: add naive-evict or vtoken to --variants"),
])
def test_bad_input_is_one_line_and_exit_2(args: tuple[str, ...], message: str) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    completed = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_variants.py"), *args],
                               capture_output=True, text=True, env=env, timeout=600, check=False)
    assert completed.returncode == 2
    assert completed.stderr.strip().splitlines() == [f"bench_variants: {message}"]
    assert completed.stdout == ""
