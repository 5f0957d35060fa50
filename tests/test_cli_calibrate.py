"""`vtoken calibrate` and `vtoken validate` on the hf executor with a tiny model built offline,
and `validate`'s figures against engines whose step times are known (the sim itself)."""

from __future__ import annotations

import json
from dataclasses import replace

import pandas as pd
import pytest
from typer.testing import CliRunner

from vtoken.calibration.model import Provenance, StepTimeModel
from vtoken.calibration.profile import load_calibration
from vtoken.engine.sim import SimProfile, load_sim_profile
from vtoken.models.tiny import build_tiny_model
from vtoken.replay import SimReplayer, make_replayer
from vtoken.trace import load_trace
from vtoken.validate import FIGURES, VALIDATED_VARIANTS, simulate, validate
from vtoken.validate import report_to_json as validation_json
from vtoken_cli.app import app
from vtoken_cli.options import build_experiment

runner = CliRunner()
pytestmark = pytest.mark.usefixtures("one_torch_thread")

TRUE = StepTimeModel(4e-3, 2e-3, 1e-7, 5e-4, 1e-3, 1e-8, 2e-7,
                     Provenance("vllm", "m", "c", 2, "t", "v", "cpu", "2026-12-01T00:00:00+00:00"))
TRACE = "".join(json.dumps({"timestamp": 0, "input_length": 20 + 16 * i, "output_length": 10 + 2 * i}) + "\n"
                for i in range(5))


def experiment_of(block_size: int = 16):
    return build_experiment(model="smollm2-135m", gpu="h100-80gb", num_blocks=None, gpu_mem_util=0.9,
                            block_size=block_size, policy="streaming_llm", budget="50%", eviction_interval=8,
                            reclaim_mode="hole-fill", theta_f=0.25, seed=0, sim_profile=None)


class SimEngine:
    """An engine whose step times are a known StepTimeModel: the sim with that model."""

    name = "vllm"
    null_blocks = 1

    def __init__(self, truth: StepTimeModel) -> None:
        self.truth = truth
        self.replayed: list[str] = []

    def replay(self, run, requests):
        self.replayed.append(run.spec.variant)
        experiment = replace(run.experiment, sim=SimProfile(sync_copy=True, step_model=self.truth),
                             num_blocks=run.experiment.num_blocks - self.null_blocks)
        return SimReplayer().run(replace(run, experiment=experiment), requests)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("calibrate")
    trace = root / "trace.jsonl"
    trace.write_text(TRACE)
    return root, trace, build_tiny_model(root / "tiny")


def test_validate_against_the_calibrated_engine_itself_has_no_error(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text(TRACE)
    requests = load_trace(trace).requests
    experiment = replace(experiment_of(), num_blocks=40)
    engine = SimEngine(TRUE)
    report = validate(str(trace), requests, experiment, 2, SimProfile(sync_copy=True, step_model=TRUE), engine,
                      num_rounds=3)
    # warm-up, then the variants alternate: native first in odd rounds, vtoken first in even ones
    assert engine.replayed == ["native", "native", "vtoken", "vtoken", "native", "native", "vtoken"]
    assert set(report.checks) == set(VALIDATED_VARIANTS)
    for figures in report.checks.values():
        assert list(figures) == list(FIGURES)
        assert all(c.rel_error == 0.0 and c.spread[0] == c.spread[1] == c.measured for c in figures.values())


def test_validate_reports_a_slower_model_as_its_error(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text(TRACE)
    requests = load_trace(trace).requests
    experiment = replace(experiment_of(), num_blocks=40)
    slower = replace(TRUE, **{name: 1.1 * getattr(TRUE, name) for name in
                              ("overhead_s", "per_decode_token_s", "per_kv_slot_s", "per_prefill_token_s",
                               "per_prefill_request_s", "per_prefill_kv_pair_s", "per_copied_token_s")})
    report = validate(str(trace), requests, experiment, 2, SimProfile(sync_copy=True, step_model=slower),
                      SimEngine(TRUE), 1)
    for figures in report.checks.values():
        # every step 10% slower: latencies 10% longer, throughput 1/1.1 (same schedule, closed loop)
        assert figures["throughput_tok_s"].rel_error == pytest.approx(1 / 1.1 - 1)
        for figure in FIGURES[1:]:
            assert figures[figure].rel_error == pytest.approx(0.1), figure
    payload = validation_json(report)
    assert list(payload) == ["variants"]
    assert payload["variants"]["native"]["tpot_p50_s"] == {
        "measured": report.checks["native"]["tpot_p50_s"].measured,
        "simulated": report.checks["native"]["tpot_p50_s"].simulated,
        "rel_error": report.checks["native"]["tpot_p50_s"].rel_error}


@pytest.mark.slow
def test_calibrate_writes_a_profile_the_sim_reads(setup):
    root, _, model_dir = setup
    output = root / "hf.toml"
    result = runner.invoke(app, ["calibrate", "--executor", "hf", "--model", str(model_dir), "--quick",
                                 "--output", str(output), "--json"])
    assert result.exit_code == 0, result.output
    printed = json.loads(result.stdout)
    profile = load_calibration(output)
    assert json.loads(json.dumps(profile.sim.as_dict())) == printed["sim_profile"]
    assert profile.sim.step_model.provenance.engine == "hf" and profile.sim.step_model.provenance.model == "tiny"
    assert set(profile.fit_errors) == {"decode", "prefill", "mixed", "copy"}
    assert profile.num_steps == len(printed["steps"])
    steps = pd.read_csv(output.with_suffix(".steps.csv"))
    assert list(steps["kind"]) == [s["kind"] for s in printed["steps"]]
    assert output.with_suffix(".png").stat().st_size > 0
    # the mixed scenario's steps carry a prompt and decodes in one iteration
    mixed = [s for s in printed["steps"] if s["kind"] == "mixed"]
    assert mixed and all(s["num_prefill_tokens"] > 0 and s["num_decoding_requests"] > 0 for s in mixed)
    compare = runner.invoke(app, ["compare", str(root / "trace.jsonl"), "--sim-profile", str(output), "--no-sweep",
                                  "--no-frontier", "--model", "smollm2-135m", "--json", "--no-cache"])
    assert compare.exit_code == 0, compare.output
    step_times = json.loads(compare.stdout)["config"]["step_times"]
    assert step_times["source"] == "calibrated" and step_times["provenance"]["engine"] == "hf"
    header = runner.invoke(app, ["compare", str(root / "trace.jsonl"), "--sim-profile", str(output), "--no-sweep",
                                 "--no-frontier", "--model", "smollm2-135m", "--no-cache"])
    assert "calibrated against hf tiny" in " ".join(header.stdout.split())


@pytest.mark.slow
def test_validate_json_is_the_library_result(setup):
    root, trace, model_dir = setup
    profile_path = root / "truth.toml"
    from vtoken.calibration.grid import CalibrationGrid
    from vtoken.calibration.profile import CalibrationProfile, profile_to_toml

    hf_truth = replace(TRUE, provenance=replace(TRUE.provenance, engine="hf", vllm_version=""))
    profile_path.write_text(profile_to_toml(CalibrationProfile(SimProfile(sync_copy=True, step_model=hf_truth),
                                                               CalibrationGrid(), {"block_size": 16}, {}, 0)))
    result = runner.invoke(app, ["validate", str(trace), "--executor", "hf", "--model", str(model_dir),
                                 "--sim-profile", str(profile_path), "--block-size", "16", "--concurrency", "2",
                                 "--eviction-interval", "8", "--rounds", "1", "--json"])
    assert result.exit_code == 0, result.output
    printed = json.loads(result.stdout)
    assert list(printed) == ["variants"] and list(printed["variants"]) == list(VALIDATED_VARIANTS)
    # the simulated side is deterministic: the library replays the same config to the same figures
    requests = load_trace(trace).requests
    experiment = make_replayer("hf", model=str(model_dir)).resolve(experiment_of(), requests, 2)
    simulated = simulate(replace(experiment, sim=load_sim_profile(profile_path)), requests, 2)
    from vtoken.validate import figure_of

    for variant, figures in printed["variants"].items():
        assert list(figures) == list(FIGURES)
        for figure, entry in figures.items():
            assert entry["simulated"] == figure_of(simulated[variant], figure)
            assert entry["measured"] > 0
            assert entry["rel_error"] == pytest.approx((entry["simulated"] - entry["measured"]) / entry["measured"])
