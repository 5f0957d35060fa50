"""benchmarks/bench_substrate.py runs end to end at a tiny size (4 requests x 1K): every table
is printed and the JSON has a row per cadence against the modelled step; and the paced cadence
it measures keeps the substrate's invariants and bounds its rounds. No timing is checked:
figures come from the benchmark."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from vtoken import defaults
from vtoken.invariants import check_conservation, check_plan, check_unique_mapping
from vtoken.kv.reclaim import ReclaimConfig, StepShare

ROOT = Path(__file__).resolve().parent.parent


def test_the_substrate_bench_runs_at_a_tiny_size(tmp_path: Path) -> None:
    out = tmp_path / "substrate.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    completed = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_substrate.py"), "--sizes", "4x1K", "--repeats", "2",
         "--cadences", "default,paced", "--fit-budgets", "32,64", "--replan-first", "--json", str(out)],
        capture_output=True, text=True, env=env, timeout=600, check=False)
    assert completed.returncode == 0, completed.stderr
    for heading in ("growth + slots()", "one eviction per request per step", "one evict_one_each", "tokens moved per freed block",
                    "a step's moves bounded by", "a measured step that launched plans, by part of its reclaim",
                    "a round's first launching step"):
        assert heading in completed.stdout
    result = json.loads(out.read_text())
    rows = {row["cadence"]: row for row in result["evict"]}
    assert sorted(rows) == ["default", "paced"]
    for row in rows.values():
        assert (row["num_requests"], row["context_tokens"]) == (4, 1024)
        assert row["modelled_step_us"] > 0
        assert row["step_share"] == (row["evict_us"] + row["reclaim_us"]) / row["modelled_step_us"]
        assert row["mean_range_us"][0] <= row["bookkeeping_us"] <= row["mean_range_us"][1]
        assert row["worst_range_us"][0] <= row["worst_us"] <= row["worst_range_us"][1]
        assert f"{100 * row['step_share']:.2f}% ({'met' if row['step_share'] <= 0.01 else 'MISSED'})" in completed.stdout
        assert row["max_moved_per_step"] <= max(row["max_moves_per_step"], row["max_src_blocks"] * 16)
        # the cycle's round launched plans; the median launching step moved no more than any step may
        assert row["num_launching_steps"] >= 1 and row["launching_step_plans"] >= 1
        assert 0 < row["launching_step_moved"] <= row["max_moved_per_step"]
        assert len(row["launching_step_parts_us"]) == 4 and min(row["launching_step_parts_us"]) >= 0
        # one first launching step per repetition's round, replanned at once with --replan-first
        assert row["num_first_steps"] == 2 and min(row["first_step_parts_us"]) >= 0
        assert row["first_step_replan_us"] > 0 and row["first_step_evict_us"] > 0
    assert rows["default"]["max_moves_per_step"] == defaults.RECLAIM_MOVES_PER_STEP
    assert rows["default"]["moved_per_round"] > 0  # the cycle ends with a round that moved tokens
    assert 0 < rows["default"]["num_round_steps"] < rows["default"]["num_steps"]
    assert rows["paced"]["max_moves_per_step"] == rows["paced"]["paced_moves_per_step"]
    assert all(row["num_blocks_freed"] > 0 for row in result["moves"] if row["mode"] == "hole-fill")
    assert "find + shift alone us/step" in completed.stdout
    assert result["reader"] == "none" and all(row["reader"] == "none" and row["slots_us"] == 0 for row in rows.values())
    assert [(row["num_requests"], row["context_tokens"]) for row in result["evict_paths"]] == [(4, 1024)]
    assert all(row["find_shift_us"] > 0 for row in result["evict_paths"])
    # the budget fit: a row per budget of the steps that launched plans, and one line per size
    assert "a round step against the tokens it moved" in completed.stdout
    budget_rows, (fit,) = result["budget_fit"]["budgets"], result["budget_fit"]["fits"]
    assert [row["max_moves_per_step"] for row in budget_rows] == [32, 64]
    for row in budget_rows:
        assert row["num_launching_steps"] >= 2 and row["plans"] >= 1 and row["round_step_us"] > 0 and row["evict_us"] > 0
        assert 0 < row["moved"] <= max(row["max_moves_per_step"], 5 * row["max_moves_per_step"] // 4)
    assert fit["num_steps"] == sum(row["num_launching_steps"] for row in budget_rows)
    assert fit["fixed_range_us"][0] <= fit["fixed_us"] <= fit["fixed_range_us"][1]
    assert fit["us_per_token_range"][0] <= fit["us_per_token"] <= fit["us_per_token_range"][1]
    assert f"a round step's reclaim = {fit['fixed_us']:.0f} us" in completed.stdout


def _bench_substrate():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import bench_substrate
    finally:
        sys.path.pop(0)
    return bench_substrate


def test_the_budget_fit_recovers_a_line_and_the_moves_that_fit_the_target() -> None:
    bench = _bench_substrate()
    rng = np.random.default_rng(0)
    moved = np.repeat([256.0, 512.0, 1024.0, 2048.0], 25)
    reclaim_us = 500.0 + 0.3 * moved + rng.normal(0.0, 20.0, moved.size)
    fixed, per_token, residual = bench.fit_line(moved, reclaim_us)
    assert abs(fixed - 500.0) < 15 and abs(per_token - 0.3) < 0.015 and 5 < residual < 25
    with pytest.raises(ValueError, match="two different numbers of moves"):
        bench.fit_line(np.full(10, 414.0), reclaim_us[:10])

    def fit(fixed_us: float, us_per_token: float, evict_us: float, step_us: float = 100_000.0):
        return bench.BudgetFit(64, 8192, step_us, 100, fixed_us, (fixed_us, fixed_us), us_per_token,
                               (us_per_token, us_per_token), 10.0, evict_us)

    assert fit(500.0, 0.25, 100.0).max_moves_within_target == 1600  # (1,000 - 100 - 500) / 0.25
    assert fit(950.0, 0.25, 100.0).max_moves_within_target == 0  # the fixed cost and evictions exceed 1%
    assert fit(500.0, -0.1, 100.0).max_moves_within_target == 0  # no positive slope: no bound from it


def test_a_bad_size_is_a_one_line_usage_error() -> None:
    completed = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_substrate.py"), "--sizes", "64by8K"],
                               capture_output=True, text=True, timeout=120, check=False)
    assert completed.returncode == 2
    assert "--sizes: '64by8K' is not REQUESTSxCONTEXT" in completed.stderr
    assert "Traceback" not in completed.stderr


@pytest.mark.parametrize(("budgets", "message"), [("256,x", "is not a list of integers"),
                                                  ("512,512", "at least two different budgets"),
                                                  ("16,512", "at least two different budgets of at least 32 tokens")])
def test_bad_fit_budgets_are_a_one_line_usage_error(budgets: str, message: str) -> None:
    completed = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_substrate.py"), "--sizes", "4x1K",
                                "--fit-budgets", budgets], capture_output=True, text=True, timeout=120, check=False)
    assert completed.returncode == 2
    assert "--fit-budgets: " in completed.stderr and message in completed.stderr
    assert "Traceback" not in completed.stderr


@pytest.mark.parametrize(("cadence", "landing"), [("default", "same-step"), ("auto", "same-step"), ("auto", "next-step"),
                                                   ("paced", "same-step"), ("paced", "next-step")])
def test_a_cadence_keeps_every_invariant_and_bounds_every_step(cadence: str, landing: str) -> None:
    """The bench's reclaimer under one eviction per request per step: as shipped (a round of at
    most RECLAIM_MOVES_PER_STEP moves a step, going on at the next steps), auto (a budget that
    follows the modelled step, StepShare: plans of at most B' = 1.25 x budget / S blocks, a plan
    B' cut going on at the next step), and paced (auto's budget and B', checked every step).
    Every plan passes the I4 check, the mapping stays unique after every step, no live token is
    lost, no step moves more than max(budget, B' x S), and rounds keep F under theta_F plus a
    margin."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from substrate_workload import (
            BLOCK_SIZE, EvictingRun, choose_victims, modelled_step_us, paced_moves_per_step, reclaim_config,
        )
    finally:
        sys.path.pop(0)
    step_us = 10_000.0
    config = reclaim_config(cadence, step_us)
    if cadence == "paced":
        budget = paced_moves_per_step(step_us)
        assert (config.max_moves_per_step, config.max_src_blocks, config.check_interval_steps) == (budget, 5 * budget // (4 * BLOCK_SIZE), 1)
        num_requests, context_tokens = 8, 2048
        max_src_blocks = config.max_src_blocks
    elif cadence == "auto":
        assert config == ReclaimConfig(max_moves_per_step=StepShare())
        num_requests, context_tokens = 24, 4096
    else:
        budget = defaults.RECLAIM_MOVES_PER_STEP
        assert config == ReclaimConfig()
        num_requests, context_tokens = 24, 4096  # rounds of a few budgets each
    run = EvictingRun(num_requests, context_tokens, 600, config, seed=5, landing=landing)
    if cadence == "auto":  # the step's budget and B', from the configuration's modelled step
        budget, max_src_blocks = run.reclaimer.step_budget(run.step_s)
        assert run.step_s == modelled_step_us(num_requests, context_tokens) / 1e6 and max_src_blocks < config.max_src_blocks
    elif cadence == "default":
        max_src_blocks = config.max_src_blocks
    run.prefragment(int(config.theta_f * context_tokens) - 2 * BLOCK_SIZE)
    plan_rounds = run.reclaimer.plan

    def checked_plan(tables, busy=frozenset(), step_s=None):
        plans = plan_rounds(tables, busy, step_s)
        for plan in plans:
            check_plan(plan, run.by_id[plan.req_id], run.pool, busy)
        calls.append((len(plans), sum(plan.num_tokens_moved for plan in plans)))
        return plans

    calls: list[tuple[int, int]] = []  # per call of the reclaimer: plans, tokens they move
    round_launched = False
    run.reclaimer.plan = checked_plan
    for _ in range(400):
        victims = choose_victims(run.tables, run.rng, "random")
        live_before = [np.setdiff1d(t.live_token_ids(), [v]) for t, v in zip(run.tables, victims.tolist())]
        num_calls, num_logged = len(calls), len(run.round_steps)
        if not run.reclaimer.is_round_in_progress:
            round_launched = False  # a round starts at this step, if any
        in_flight = run.has_in_flight
        slots_before = [table.token_slots[: table.num_tokens].copy() for table in run.tables]
        _, _, reclaim_s, _ = run.step(victims)
        # a step that launched plans is logged once, with its plans and moves, its parts within its reclaim
        launching = [call for call in calls[num_calls:] if call[0]]
        assert [(step.num_plans, step.num_tokens_moved) for step in run.round_steps[num_logged:]] == launching
        if launching:
            step = run.round_steps[-1]
            assert min(step.parts_s) >= 0 and step.reclaim_s <= reclaim_s and 0 < step.evict_s
            # a round's first launching step is marked, a later one of the same round is not
            assert step.is_first == (not round_launched) and step.replan_s == 0.0
            round_launched = True
        # same-step: a step's plans land in it; next-step: at the next step, which lands them first
        assert run.has_in_flight == (landing == "next-step" and bool(launching))
        if landing == "next-step" and not in_flight:  # nothing landed: no token of any table moved
            for table, slots in zip(run.tables, slots_before):
                ids = table.live_token_ids()
                ids = ids[ids < slots.size]
                assert np.array_equal(table.token_slots[ids], slots[ids])
        check_unique_mapping(run.pool, run.tables)
        for table, live in zip(run.tables, live_before):
            check_conservation(table.req_id, live, table.live_token_ids()[: live.size])
    moved = [num_moved for _, num_moved in calls]
    assert sum(m > 0 for m in moved) >= 10 and max(moved) <= max(budget, max_src_blocks * BLOCK_SIZE)
    assert run.num_rounds >= 1 and sum(moved) > 2 * budget  # rounds that needed more than one step
    num_firsts = sum(step.is_first for step in run.round_steps)  # one a round; the last may be unfinished
    assert run.num_rounds <= num_firsts <= run.num_rounds + 1
    assert run.num_blocks_freed_by_plans > 0 and run.pool.waste_ratio() < config.theta_f + 0.05


def test_a_run_with_next_step_landing_and_replays_reports_its_worst_step_replayed(tmp_path: Path) -> None:
    out = tmp_path / "substrate.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    completed = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_substrate.py"), "--sizes", "4x1K", "--repeats", "2",
         "--cadences", "paced", "--landing", "next-step", "--replays", "3", "--json", str(out)],
        capture_output=True, text=True, env=env, timeout=600, check=False)
    assert completed.returncode == 0, completed.stderr
    assert "plans land at the next step" in completed.stdout and "the worst step replayed" in completed.stdout
    (row,) = json.loads(out.read_text())["evict"]
    assert (row["landing"], row["num_replays"]) == ("next-step", 3)
    low, high = row["replayed_worst_range_us"]
    assert 0 < low <= row["replayed_worst_us"] <= high
    assert row["replayed_worst_share"] == row["replayed_worst_us"] / row["modelled_step_us"]
    assert row["replayed_worst_kind"] in _bench_substrate().STEP_KINDS
    assert f"({100 * row['replayed_worst_share']:.2f}% replayed, " in completed.stdout


def test_the_worst_step_replayed_is_the_most_of_each_steps_median() -> None:
    bench = _bench_substrate()
    kinds = ["ordinary", "first launching", "launching", "landing"]

    def cycle(bookkeeping_us: list[float], step_kinds: list[str] = kinds, moved: int = 414):
        work = [(0, 3), (moved, 5), (2 * moved, 5), (2 * moved, 6)]  # tokens moved, blocks freed by evictions, so far
        return bench.Cycle(np.zeros((0, 4)), np.zeros((0, 4)), len(step_kinds), 1e-6 * np.array(bookkeeping_us), step_kinds, work)

    # a slow spell in one replay (the 900 of the ordinary step) is left out; the launching step's own cost is not
    worst_us, kind = bench.replayed_worst_us([cycle([900, 300, 250, 100]), cycle([60, 320, 240, 90]), cycle([55, 310, 500, 95])])
    assert kind == "first launching" and worst_us == pytest.approx(310)
    with pytest.raises(RuntimeError, match="diverged"):
        bench.replayed_worst_us([cycle([1, 2, 3, 4]), cycle([1, 2, 3, 4], ["ordinary", "launching", "launching", "landing"])])
    with pytest.raises(RuntimeError, match="diverged"):  # the same kinds of step, other moves
        bench.replayed_worst_us([cycle([1, 2, 3, 4]), cycle([1, 2, 3, 4], moved=413)])


@pytest.mark.parametrize(("argv", "message"), [(["--replays", "0"], "--replays must be > 0"),
                                               (["--fit-budgets", "32,64", "--landing", "next-step"], "needs --landing same-step")])
def test_bad_replays_or_a_fit_with_next_step_landing_are_one_line_usage_errors(argv: list[str], message: str) -> None:
    completed = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_substrate.py"), "--sizes", "4x1K", *argv],
                               capture_output=True, text=True, timeout=120, check=False)
    assert completed.returncode == 2
    assert message in completed.stderr and "Traceback" not in completed.stderr


@pytest.mark.parametrize("landing", ["same-step", "next-step"])
def test_a_cycle_names_its_steps_and_only_next_step_landing_has_a_step_that_only_lands(landing: str) -> None:
    """A round's last launch lands at the next step with next-step landing, a step that launches
    nothing: the cycle names it; with same-step landing no such step exists."""
    bench = _bench_substrate()
    run = bench.warmed_run(8, 2048, "paced", 10_000.0, seed=1, clock=bench.time.process_time, landing=landing)
    run.round_steps.clear()
    cycle = bench.time_cycle(run)
    assert len(cycle.kinds) == len(cycle.work) == cycle.bookkeeping_s.size == len(cycle.ordinary) + len(cycle.in_round)
    assert set(cycle.kinds) <= set(bench.STEP_KINDS) and cycle.kinds.count("first launching") == 1
    assert ("landing" in cycle.kinds) == (landing == "next-step")
    # the run's work after each step only grows, and the cycle moved tokens
    work = np.array(cycle.work)
    assert (np.diff(work, axis=0) >= 0).all() and work[-1, 0] > work[0, 0]


def test_warming_the_round_code_changes_no_step_of_the_cycle() -> None:
    """--warm-round-code runs the round's code on a pool of its own between the steps: the cycle
    is the same steps doing the same work (the same kinds, moves and blocks freed), and it ran
    (the warm-up was called at the steps outside a round, and only there)."""
    bench = _bench_substrate()
    calls = []
    cycles = []
    for warm in (None, "verbs"):
        run = bench.warmed_run(8, 2048, "paced", 10_000.0, seed=1, clock=bench.time.process_time)
        run.round_steps.clear()
        run.warm_round_code = warm
        workload = sys.modules[type(run).__module__]
        warm_up = workload.warm_compiled_loops
        workload.warm_compiled_loops = lambda: (calls.append(run.reclaimer.is_round_in_progress), warm_up())[1]
        try:
            cycles.append(bench.time_cycle(run))
        finally:
            workload.warm_compiled_loops = warm_up
    assert cycles[0].kinds == cycles[1].kinds and cycles[0].work == cycles[1].work
    assert calls and not any(calls)
    assert len(calls) == cycles[1].kinds.count("ordinary") + 1  # after each of them, and after the step that ended the round


def test_the_round_compiled_calls_are_made_again_whole_and_change_no_step_of_the_cycle() -> None:
    """--warm-round-code compiled makes the round's four compiled calls again on copies of the
    warm-up's arrays: each runs through (a call refused at its first check would warm little of
    its code) and leaves the recorded arrays as they were; the cycle is the same steps doing the
    same work with it, and with --sweep-mb's write between the steps, which ran after each."""
    bench = _bench_substrate()
    run = bench.warmed_run(8, 2048, "paced", 10_000.0, seed=1, clock=bench.time.process_time)
    workload = sys.modules[type(run).__module__]
    calls = workload.CompiledRoundCalls()
    assert set(calls.calls) == set(workload.ROUND_LOOPS)
    recorded = {name: [a.copy() if isinstance(a, np.ndarray) else a for a in args] for name, args in calls.calls.items()}
    results = {}
    functions = dict(calls.functions)
    calls.functions = {name: (lambda name: lambda *args: results.setdefault(name, functions[name](*args)))(name)
                       for name in functions}
    calls()
    plan_rows = results["hole_fill_round"][0]
    assert plan_rows.shape[1] >= 1  # at least one plan
    assert results["round_passes"] is True
    assert results["land_moves"][2] == 0 and results["release_empty_blocks"][4] == 0  # no refusal
    assert results["release_empty_blocks"][1].size >= 1  # blocks released
    for name, args in calls.calls.items():
        for kept, now in zip(recorded[name], args, strict=True):
            np.testing.assert_array_equal(kept, now)

    cycles = []
    for warm, sweep_bytes in ((None, 0), ("compiled", 0), (None, 1 << 16)):
        run = bench.warmed_run(8, 2048, "paced", 10_000.0, seed=1, clock=bench.time.process_time)
        run.round_steps.clear()
        run.warm_round_code, run.sweep_bytes = warm, sweep_bytes
        cycles.append(bench.time_cycle(run))
        if warm:
            assert run._warm_compiled is not None
        if sweep_bytes:
            assert run._sweep.size == sweep_bytes and (run._sweep == len(cycles[-1].kinds) % 256).all()
    for cycle in cycles[1:]:
        assert cycle.kinds == cycles[0].kinds and cycle.work == cycles[0].work


def test_the_slots_reader_keeps_every_slot_list_and_changes_no_step_of_the_cycle() -> None:
    """--reader slots reads every table's slot list after each step, as the hf executor's
    attention does: the lists are then kept up to date (each equal to the live tokens' slots)
    and their reading is the step's fourth part; without a reader no list is ever built and that
    part is 0. The reader decides nothing of the substrate's: the same steps do the same work."""
    bench = _bench_substrate()
    cycles, runs = [], []
    for reader in ("none", "slots"):
        run = bench.warmed_run(8, 2048, "paced", 10_000.0, seed=1, clock=bench.time.process_time, reader=reader)
        run.round_steps.clear()
        cycles.append(bench.time_cycle(run))
        runs.append(run)
    assert cycles[0].kinds == cycles[1].kinds and cycles[0].work == cycles[1].work
    none, slots = runs
    assert not any(table._cache.is_valid for table in none.tables)
    assert (cycles[0].ordinary[:, 3] == 0).all() and (cycles[0].in_round[:, 3] == 0).all()
    assert all(table._cache.is_valid for table in slots.tables)
    assert cycles[1].ordinary[:, 3].sum() > 0
    for table in slots.tables:
        np.testing.assert_array_equal(table.slots(), table.token_slots[table.live_mask])


def test_an_unknown_reader_is_refused() -> None:
    bench = _bench_substrate()
    with pytest.raises(ValueError, match="unknown reader 'attention'"):
        bench.warmed_run(4, 1024, "paced", 10_000.0, seed=1, clock=bench.time.process_time, reader="attention")


def test_an_unknown_warming_is_refused() -> None:
    bench = _bench_substrate()
    run = bench.warmed_run(4, 1024, "paced", 10_000.0, seed=1, clock=bench.time.process_time)
    run.warm_round_code = "python"
    with pytest.raises(ValueError, match="unknown warming 'python'"):
        run.run(64)
