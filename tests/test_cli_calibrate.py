"""`vtoken calibrate` and `vtoken validate` on the hf executor with a tiny model built offline
(validate's figures against engines whose step times are known: tests/test_validate.py)."""

from __future__ import annotations

import json
from dataclasses import replace

import pandas as pd
import pytest
from typer.testing import CliRunner

from tests.test_validate import TRACE, TRUE, experiment_of
from vtoken.calibration.profile import load_calibration
from vtoken.engine.sim import SimProfile, load_sim_profile
from vtoken.models.tiny import build_tiny_model
from vtoken.replay import make_replayer
from vtoken.trace import load_trace
from vtoken.validate import FIGURES, VALIDATED_VARIANTS, figure_of, simulate
from vtoken_cli.app import app

runner = CliRunner()
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("calibrate")
    trace = root / "trace.jsonl"
    trace.write_text(TRACE)
    return root, trace, build_tiny_model(root / "tiny")


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
def test_the_decode_grid_is_the_flags(setup):
    root, _, model_dir = setup
    output = root / "wide.toml"
    result = runner.invoke(app, ["calibrate", "--executor", "hf", "--model", str(model_dir), "--quick", "--rounds", "1",
                                 "--decode-batch-sizes", "1,3", "--decode-contexts", "24", "--output", str(output),
                                 "--json"])
    assert result.exit_code == 0, result.output
    grid = load_calibration(output).grid
    assert (grid.decode_batch_sizes, grid.decode_context_tokens) == ((1, 3), (24,))
    # the timed decode steps are those batches (the mixed scenario adds its own decodes)
    batches = {s["num_decoding_requests"] for s in json.loads(result.stdout)["steps"] if s["kind"] == "decode"}
    assert 3 in batches and max(batches) <= max(3, *grid.mixed_batch_sizes)


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
                                 "--eviction-interval", "8", "--rounds", "2", "--json"])
    assert result.exit_code == 0, result.output
    printed = json.loads(result.stdout)
    assert list(printed) == ["variants", "steps"] and list(printed["variants"]) == list(VALIDATED_VARIANTS)
    assert printed["steps"] == {"native": {}}  # the hf replay records no steps
    # the simulated side is deterministic: the library replays the same config to the same figures
    requests = load_trace(trace).requests
    experiment = make_replayer("hf", model=str(model_dir)).resolve(experiment_of(), requests, 2)
    simulated = simulate(replace(experiment, sim=load_sim_profile(profile_path)), requests, 2)
    for variant, figures in printed["variants"].items():
        assert list(figures) == list(FIGURES)
        for figure, entry in figures.items():
            assert entry["simulated"] == figure_of(simulated[variant], figure)
            # the measured side: the two rounds in order, their median (numpy's: the mean of two)
            spread = entry["spread"]
            assert len(spread["values"]) == 2 and all(v > 0 for v in spread["values"])
            assert (spread["min"], spread["max"]) == (min(spread["values"]), max(spread["values"]))
            assert entry["measured"] == spread["median"] == pytest.approx(sum(spread["values"]) / 2)
            assert entry["rel_error"] == pytest.approx((entry["simulated"] - entry["measured"]) / entry["measured"])
