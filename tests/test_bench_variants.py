"""benchmarks/bench_variants.py runs end to end on the bundled sample: every variant's row, the
same results in every round, and with --phases the runtime's phases per variant (eviction only
where the variant evicts, reclamation only in vtoken); the variants replayed side by side
(--interleave) give the results each gives alone; bad input is a one-line error. No timing is
checked."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_the_variants_bench_runs_on_the_sample_with_phases() -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    completed = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_variants.py"), "--azure", str(ROOT / "sample_traces" / "azure_conv_sample.csv"),
         "--max-requests", "120", "--rounds", "2", "--phases"],
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


@pytest.mark.parametrize(("args", "message"), [
    (("--variants", "native,fast"), "--variants: unknown variant 'fast'; known: native, naive-evict, vtoken"),
    (("--max-requests", "0"), "--max-requests must be at least 1, got 0"),
    (("--rounds", "0", "--azure", str(ROOT / "sample_traces" / "azure_conv_sample.csv")), "--rounds must be at least 1, got 0"),
    (("--interleave", "0", "--azure", str(ROOT / "sample_traces" / "azure_conv_sample.csv")),
     "--interleave must be at least 1 step, got 0"),
    (("--azure", "/nonexistent/trace.csv"), "--azure: no trace at /nonexistent/trace.csv"),
])
def test_bad_input_is_one_line_and_exit_2(args: tuple[str, ...], message: str) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    completed = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_variants.py"), *args],
                               capture_output=True, text=True, env=env, timeout=600, check=False)
    assert completed.returncode == 2
    assert completed.stderr.strip().splitlines() == [f"bench_variants: {message}"]
    assert completed.stdout == ""
