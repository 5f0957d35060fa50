"""`vtoken validate` in the library (vtoken/validate.py) against engines whose step times are
known (the sim with a given step model): no error against itself, a slower model's error, the
measurement taken by vtoken/rounds.py (its warm-up, its order, each round's figures), and the
`--json` object built from the report."""

from __future__ import annotations

import json
from dataclasses import asdict, replace
from pathlib import Path

import pytest

from vtoken import defaults
from vtoken.calibration.grid import QUICK_GRID, CalibrationGrid
from vtoken.calibration.fit import MeasuredStep, step_kind
from vtoken.calibration.model import Provenance, StepTimeModel
from vtoken.engine.runtime import Runtime
from vtoken.engine.sim import SimExecutor, SimProfile
from vtoken.replay import SimReplayer
from vtoken.rounds import run_rounds
from vtoken.trace import load_trace
from vtoken.validate import (FIGURES, VALIDATED_VARIANTS, WARMUP_OUTPUT_TOKENS, figure_of, report_to_json, validate,
                             warmup_requests)
from vtoken_cli.options import build_experiment

ROOT = Path(__file__).resolve().parent.parent
TRUE = StepTimeModel(4e-3, 2e-3, 1e-7, 5e-4, 1e-3, 1e-8, 2e-7,
                     Provenance("vllm", "m", "c", 2, "t", "v", "cpu", "2026-12-01T00:00:00+00:00"))
TRACE = "".join(json.dumps({"timestamp": 0, "input_length": 20 + 16 * i, "output_length": 10 + 2 * i}) + "\n"
                for i in range(5))
COEFFICIENTS = ("overhead_s", "per_decode_token_s", "per_kv_slot_s", "per_prefill_token_s", "per_prefill_request_s",
                "per_prefill_kv_pair_s", "per_copied_token_s")


def experiment_of(block_size: int = 16):
    return build_experiment(model="smollm2-135m", gpu="h100-80gb", num_blocks=None, gpu_mem_util=0.9,
                            block_size=block_size, policy="streaming_llm", budget="50%", eviction_interval=8,
                            reclaim_mode="hole-fill", theta_f=0.25, seed=0, sim_profile=None)


def scaled(model: StepTimeModel, factor: float) -> StepTimeModel:
    return replace(model, **{name: factor * getattr(model, name) for name in COEFFICIENTS})


class SimEngine:
    """An engine whose step times are a known StepTimeModel: the sim with that model. `drift`:
    every replay `drift` times slower than the one before (a machine whose load grows)."""

    name = "vllm"
    null_blocks = 1

    def __init__(self, truth: StepTimeModel, drift: float = 1.0) -> None:
        self.truth = truth
        self.drift = drift
        self.replayed: list[tuple[str, bool]] = []  # (variant, whether it was a warm-up replay)
        self.results: list = []

    def replay(self, run, requests):
        is_warmup = all(r.num_output_tokens <= WARMUP_OUTPUT_TOKENS for r in requests)
        self.replayed.append((run.spec.variant, is_warmup))
        truth = scaled(self.truth, self.drift ** len(self.results))
        experiment = replace(run.experiment, sim=SimProfile(sync_copy=True, step_model=truth),
                             num_blocks=run.experiment.num_blocks - self.null_blocks)
        steps = []

        class Recording(SimExecutor):  # every step's load and time, as the vllm engine records them
            def execute(self, batch, load):
                duration_s = super().execute(batch, load)
                steps.append(MeasuredStep(step_kind(load), load, duration_s))
                return duration_s

        run = replace(run, experiment=experiment.with_scheduler_defaults())
        self.results.append(Runtime(run, requests, Recording(experiment.model, experiment.gpu, experiment.sim,
                                                             experiment.seed)).run())
        self.recorded_steps = tuple(steps) if not run.spec.evicts else ()
        return self.results[-1]


@pytest.fixture()
def requests(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text(TRACE)
    return load_trace(trace).requests


def run_validate(requests, engine, model=TRUE, num_rounds=3):
    experiment = replace(experiment_of(), num_blocks=40)
    return validate("t.jsonl", requests, experiment, 2, SimProfile(sync_copy=True, step_model=model), engine,
                    num_rounds=num_rounds)


def test_validate_against_the_calibrated_engine_itself_has_no_error(requests):
    report = run_validate(requests, SimEngine(TRUE))
    assert set(report.checks) == set(VALIDATED_VARIANTS)
    for figures in report.checks.values():
        assert list(figures) == list(FIGURES)
        for c in figures.values():
            assert c.rel_error == 0.0 and c.spread.min == c.spread.max == c.measured
            assert len(c.spread.values) == 3


def test_validate_reports_a_slower_model_as_its_error(requests):
    report = run_validate(requests, SimEngine(TRUE), scaled(TRUE, 1.1), num_rounds=1)
    for figures in report.checks.values():
        # every step 10% slower: latencies 10% longer, throughput 1/1.1 (same schedule, closed loop)
        assert figures["throughput_tok_s"].rel_error == pytest.approx(1 / 1.1 - 1)
        for figure in FIGURES[1:]:
            assert figures[figure].rel_error == pytest.approx(0.1), figure


def test_the_step_check_is_the_model_on_the_engine_s_own_native_steps(requests):
    engine = SimEngine(scaled(TRUE, 1.25))  # every step of the engine 25% slower than the profile says
    report = run_validate(requests, engine, num_rounds=2)
    assert list(report.steps) == ["decode", "prefill", "mixed", "all"]
    native_rounds = [r for r, (variant, is_warmup) in zip(engine.results, engine.replayed)
                     if variant == "native" and not is_warmup]
    assert report.steps["all"].num_steps == sum(r.num_iterations for r in native_rounds)
    for c in report.steps.values():
        assert c.rel_error == pytest.approx(1 / 1.25 - 1)
    # the figures' error is the steps' here (same schedule on both sides)
    assert report.checks["native"]["latency_p50_s"].rel_error == pytest.approx(1 / 1.25 - 1)
    payload = report_to_json(report)["steps"]["native"]
    assert payload["all"] == {"num_steps": report.steps["all"].num_steps,
                              "measured_mean_s": report.steps["all"].measured_mean_s,
                              "predicted_mean_s": report.steps["all"].predicted_mean_s,
                              "rel_error": report.steps["all"].rel_error}


def test_an_engine_that_records_no_steps_gets_no_step_check(requests):
    class Unrecorded(SimEngine):  # as the hf engine: it replays, but keeps no steps
        def replay(self, run, requests):
            result = super().replay(run, requests)
            self.recorded_steps = ()
            return result

    assert run_validate(requests, Unrecorded(TRUE), num_rounds=1).steps == {}


def test_the_measurement_is_run_rounds_warm_up_and_order(requests):
    engine = SimEngine(TRUE)
    report = run_validate(requests, engine, num_rounds=4)
    # a warm-up replay of each variant, then the rounds alternate which variant runs first
    assert engine.replayed == [("native", True), ("vtoken", True),
                               ("native", False), ("vtoken", False), ("vtoken", False), ("native", False),
                               ("native", False), ("vtoken", False), ("vtoken", False), ("native", False)]
    # ... which is exactly what vtoken.rounds runs for these variants, rounds and warm-up
    calls = []
    expected = run_rounds(VALIDATED_VARIANTS, lambda variant, round_idx: calls.append((variant, round_idx is None)),
                          4, defaults.MEASURED_WARMUP)
    assert engine.replayed == calls
    assert report.rounds == expected.record
    assert report.rounds.order == (("native", "vtoken"), ("vtoken", "native")) * 2


def test_a_warm_up_replay_is_the_first_requests_cut_short(requests):
    warmup = warmup_requests(requests, 2)
    assert [r.request_id for r in warmup] == [r.request_id for r in requests[:2]]
    assert [r.num_prompt_tokens for r in warmup] == [20, 36]
    assert [r.num_output_tokens for r in warmup] == [4, 4]
    assert len(warmup_requests(requests, None)) == 4


def test_every_figure_is_its_rounds_in_order_and_their_median(requests):
    engine = SimEngine(TRUE, drift=1.05)  # every replay slower than the last: each round differs
    report = run_validate(requests, engine)
    measured_calls = [i for i, (_, is_warmup) in enumerate(engine.replayed) if not is_warmup]
    for variant in VALIDATED_VARIANTS:
        rounds = [engine.results[i] for i in measured_calls if engine.replayed[i][0] == variant]
        assert report.measured[variant] == tuple(rounds)
        for figure, c in report.checks[variant].items():
            values = [figure_of(r, figure) for r in rounds]
            assert c.spread.values == tuple(values)
            assert c.measured == sorted(values)[1] and (c.spread.min, c.spread.max) == (min(values), max(values))
            assert c.simulated == figure_of(report.simulated[variant], figure)
            assert c.rel_error == pytest.approx((c.simulated - c.measured) / c.measured)
    # drifting slower: native ran first in rounds 1 and 3, so its spread is not vtoken's
    assert report.checks["native"]["tpot_p50_s"].spread.values != report.checks["vtoken"]["tpot_p50_s"].spread.values


def test_the_json_is_the_report(requests):
    report = run_validate(requests, SimEngine(TRUE, drift=1.05))
    payload = json.loads(json.dumps(report_to_json(report)))
    assert list(payload) == ["variants", "steps"] and list(payload["variants"]) == list(VALIDATED_VARIANTS)
    for variant, figures in report.checks.items():
        assert list(payload["variants"][variant]) == list(FIGURES)
        for figure, c in figures.items():
            assert payload["variants"][variant][figure] == {
                "measured": c.measured, "simulated": c.simulated, "rel_error": c.rel_error,
                "spread": {**asdict(c.spread), "values": list(c.spread.values)}}


def test_the_validation_trace_is_none_of_the_grids_prompts():
    trace = load_trace(ROOT / "examples" / "validation_trace.jsonl")
    grid_prompts = {tokens for grid in (CalibrationGrid(), QUICK_GRID)
                    for tokens in (*grid.decode_context_tokens, *grid.prefill_tokens, *grid.mixed_prefill_tokens,
                                   grid.mixed_context_tokens)}
    assert len(trace.requests) == 32
    assert not {r.num_prompt_tokens for r in trace.requests} & grid_prompts


def test_the_report_renders_the_figures_and_the_step_check(requests):
    from rich.console import Console

    from vtoken_cli.render.validate import validation_report

    console = Console(width=200, record=True)
    console.print(validation_report(run_validate(requests, SimEngine(scaled(TRUE, 1.25)), num_rounds=1)))
    text = console.export_text()
    assert "TPOT p50 (ms)" in text and "-20.0%" in text
    assert "step model on vllm's own native steps" in text
    rows = [line.strip("│ ").split()[0] for line in text.splitlines()
            if line.startswith("│ ") and line.split()[1] in ("decode", "prefill", "mixed", "all")]
    assert rows == ["decode", "prefill", "mixed", "all"]


def test_a_note_says_when_the_engine_ran_past_the_grid(requests):
    from vtoken.validate import extrapolation_notes

    report = run_validate(requests, SimEngine(TRUE), num_rounds=1)  # C = 2: at most 2 decodes a step
    assert len(report.notes) == 1  # no grid given: the naive-evict note only
    engine = SimEngine(TRUE)
    engine.replay(replace(experiment_of(), num_blocks=40).run("native", 2), requests)
    assert extrapolation_notes("vllm", engine.recorded_steps, CalibrationGrid(decode_batch_sizes=(2,),
                                                                              mixed_batch_sizes=(2,))) == []
    narrow = CalibrationGrid(decode_batch_sizes=(1,), mixed_batch_sizes=(1,))
    assert extrapolation_notes("vllm", engine.recorded_steps, narrow) == [
        "vllm ran steps of up to 2 decodes; the profile's grid went to 1, so the fit extrapolates past it: "
        "calibrate with --decode-batch-sizes up to 2"]
    experiment = replace(experiment_of(), num_blocks=40)
    with_grid = validate("t.jsonl", requests, experiment, 2, SimProfile(sync_copy=True, step_model=TRUE),
                         SimEngine(TRUE), num_rounds=1, grid=narrow)
    assert with_grid.notes[1:] == tuple(extrapolation_notes("vllm", engine.recorded_steps, narrow))
