"""`vtoken calibrate --executor vllm` and `vtoken validate --executor vllm` end to end, on the
tiny model: a quick grid, then a one-round validation of a short trace with that profile."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from tests.vllm_tier.conftest import VLLM_MISSING, VLLM_PROBE

pytest.importorskip(VLLM_PROBE, reason=VLLM_MISSING)

from vtoken.calibration.profile import load_calibration  # noqa: E402
from vtoken.calibration.vllm_steps import load_of  # noqa: E402
from vtoken.validate import FIGURES  # noqa: E402
from vtoken_cli.app import app  # noqa: E402

runner = CliRunner()
TRACE = "".join(json.dumps({"timestamp": 0, "input_length": 40 + 24 * i, "output_length": 8 + 4 * i}) + "\n"
                for i in range(4))


def test_a_vllm_step_load_counts_decodes_and_prompt_chunks():
    # a decode at 70 computed tokens, a prompt chunk of 32 after 64 of its 200, a new prompt of 10
    load = load_of({"a": 1, "b": 32, "c": 10}, {"a": 70, "b": 64, "c": 0}, {"a": 60, "b": 200, "c": 10})
    assert (load.num_decoding_requests, load.num_kv_slots_read, load.num_prefill_tokens, load.num_prefill_requests) == \
        (1, 70, 42, 2)
    assert load.prefill_kv_pairs() == 32 * 64 + 32 * 33 // 2 + 10 * 11 // 2
    assert load_of({}, {}, {}) is None


def test_calibrate_then_validate_on_vllm(tiny_model_dir, tmp_path):
    profile_path = tmp_path / "tiny-vllm.toml"
    result = runner.invoke(app, ["calibrate", "--executor", "vllm", "--model", tiny_model_dir, "--quick",
                                 "--output", str(profile_path)])
    assert result.exit_code == 0, result.output
    profile = load_calibration(profile_path)
    provenance = profile.sim.step_model.provenance
    assert provenance.engine == "vllm" and provenance.vllm_version.startswith("0.32")
    assert set(profile.fit_errors) == {"decode", "prefill", "mixed", "copy"}
    assert profile.sim.step_model.overhead_s > 0

    trace = tmp_path / "trace.jsonl"
    trace.write_text(TRACE)
    result = runner.invoke(app, ["validate", str(trace), "--executor", "vllm", "--model", tiny_model_dir,
                                 "--sim-profile", str(profile_path), "--concurrency", "2", "--rounds", "1", "--json"])
    assert result.exit_code == 0, result.output
    printed = json.loads(result.stdout[result.stdout.index("{"):])
    assert list(printed) == ["variants", "steps"] and list(printed["variants"]) == ["native", "vtoken"]
    for figures in printed["variants"].values():
        assert list(figures) == list(FIGURES)
        for entry in figures.values():
            assert entry["measured"] > 0 and entry["simulated"] > 0
            assert entry["rel_error"] == pytest.approx((entry["simulated"] - entry["measured"]) / entry["measured"])
    # vLLM's own native steps, timed with their loads: one per iteration of the round's replay
    steps = printed["steps"]["native"]
    assert {"decode", "all"} <= set(steps) and steps["all"]["num_steps"] == sum(
        s["num_steps"] for kind, s in steps.items() if kind != "all")
    assert all(s["measured_mean_s"] > 0 and s["predicted_mean_s"] > 0 for s in steps.values())
