"""`vtoken check-invariants` through typer's CliRunner: exit codes, every fault caught by the
invariant it breaks, the --json contract, fuzzing with a seed, and bad input."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from vtoken.checker import FAULT_DETECTED_BY, FAULT_KINDS, INVARIANTS, CheckOptions, TraceLimits, check_invariants, report_to_json
from vtoken.trace import load_trace
from vtoken_cli.app import app
from vtoken_cli.options import build_experiment

ROOT = Path(__file__).resolve().parent.parent
SHARED = ROOT / "sample_traces" / "shared_prefix.jsonl"
SMALL = ["--max-requests", "12", "--max-output-tokens", "96"]
ONE_RUN = ["--policy", "h2o", "--reclaim-mode", "hole-fill", *SMALL]

runner = CliRunner()


def invoke(*args: str):
    return runner.invoke(app, ["check-invariants", *args])


def without_timings(payload: dict) -> dict:
    payload = {k: v for k, v in payload.items() if k not in ("elapsed_s", "relocation_events_per_s")}
    payload["runs"] = [{k: v for k, v in run.items() if k != "elapsed_s"} for run in payload["runs"]]
    return payload


def test_clean_run_over_every_sample_trace_exits_0_with_both_tables():
    result = invoke(*SMALL, "--max-prompt-tokens", "1024")
    assert result.exit_code == 0, result.output
    for text in ("Invariants", "I1 token conservation", "I4 layout-aware planning", "Per policy and reclaim mode",
                 "streaming_llm", "ordered", "PASSED", "events/s", "copy engine 'deferred'"):
        assert text in result.stdout
    for name in ("azure_conv_sample.csv", "longbench_like.jsonl", "shared_prefix.jsonl"):
        assert name in result.stdout


@pytest.mark.parametrize("fault", FAULT_KINDS)
def test_each_fault_exits_1_caught_by_the_invariant_it_breaks(fault):
    # shared-block needs a plan while a prefix is shared: requests of a prefix group resident together
    shared = ["--concurrency", "12"] if fault == "shared-block" else []
    result = invoke(str(SHARED), *ONE_RUN, *shared, "--inject-fault", fault, "--json")
    assert result.exit_code == 1, result.output
    payload = json.loads(result.stdout)
    expected = FAULT_DETECTED_BY[fault]
    assert payload["passed"] is False
    assert {name for name, tally in payload["invariants"].items() if tally["violations"]} == {expected}
    assert payload["fault"]["kind"] == fault and payload["fault"]["expected_invariant"] == expected
    assert payload["fault"]["num_injected"] > 0
    first = payload["invariants"][expected]["first_violation"]
    assert first["invariant"] == expected and first["request_id"].startswith("shared-") and first["block_id"] >= 0
    assert expected in first["message"]


def test_a_fault_in_table_form_says_which_invariant_caught_it():
    result = invoke(str(SHARED), *ONE_RUN, "--inject-fault", "early-read")
    assert result.exit_code == 1, result.output
    assert "FAILED" in result.stdout and "I3 violated" in result.stdout
    assert re.search(r"fault early-read: injected \d+ times; detected by I3 \(expected I3\)", result.stdout)


def test_json_has_the_documented_keys_and_equals_the_library_result():
    result = invoke(str(SHARED), *SMALL, "--policy", "h2o,random", "--json")
    assert result.exit_code == 0, result.output
    printed = json.loads(result.stdout)
    assert {"invariants", "relocation_events", "tokens_moved", "passed", "by_policy_mode", "elapsed_s",
            "relocation_events_per_s", "runs", "fault", "config", "notes"} <= printed.keys()
    assert list(printed["invariants"]) == list(INVARIANTS)
    for tally in printed["invariants"].values():
        assert type(tally["checked"]) is int and type(tally["violations"]) is int and tally["first_violation"] is None
    assert printed["passed"] is True and printed["fault"] is None
    assert type(printed["relocation_events"]) is int and printed["relocation_events"] > 0
    assert type(printed["tokens_moved"]) is int and isinstance(printed["elapsed_s"], float)
    assert [(g["policy"], g["reclaim_mode"]) for g in printed["by_policy_mode"]] == [
        ("h2o", "hole-fill"), ("h2o", "ordered"), ("random", "hole-fill"), ("random", "ordered")]
    assert sum(g["relocation_events"] for g in printed["by_policy_mode"]) == printed["relocation_events"]

    config = build_experiment(model="llama-3.1-8b", gpu="h100-80gb", num_blocks=None, gpu_mem_util=0.9, block_size=16,
                              policy="h2o", budget="50%", eviction_interval=32, reclaim_mode="hole-fill", theta_f=0.05,
                              seed=0, sim_profile=None, reclaim_interval=1)
    options = CheckOptions(policies=("h2o", "random"), limits=TraceLimits(12, 4096, 96))
    report = check_invariants([load_trace(SHARED)], config, options)
    expected = json.loads(json.dumps(report_to_json(report)))
    assert without_timings(printed) == without_timings(expected)


def test_fuzz_with_a_fixed_seed_passes_and_repeats():
    first = invoke("--fuzz", "8", "--seed", "3", "--json")
    again = invoke("--fuzz", "8", "--seed", "3", "--json")
    assert first.exit_code == 0 and again.exit_code == 0, first.output
    printed = json.loads(first.stdout)
    assert [run["scenario"] for run in printed["runs"]] == [f"fuzz-{i:03d}" for i in range(8)]
    assert without_timings(printed) == without_timings(json.loads(again.stdout))


def test_output_dir_gets_the_json_and_a_csv(tmp_path):
    out = tmp_path / "check"
    result = invoke(str(SHARED), *ONE_RUN, "--output", str(out))
    assert result.exit_code == 0, result.output
    assert {p.name for p in out.iterdir()} == {".vtoken-output.json", "report.json", "runs.csv"}
    assert json.loads((out / "report.json").read_text())["passed"] is True
    assert json.loads((out / ".vtoken-output.json").read_text())["files"] == ["report.json", "runs.csv"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--policy", "lru"], "unknown policy 'lru'"),
        (["--executor", "tpu"], "unknown executor 'tpu'; check-invariants runs on: sim, hf, vllm"),
        (["missing.jsonl"], "missing.jsonl"),
        (["--reclaim-mode", "magic"], "unknown reclaim mode 'magic'"),
        (["--inject-fault", "bit-flip"], "unknown fault 'bit-flip'"),
        (["--fuzz", "-1"], "--fuzz must be >= 0"),
        (["--block-size", "0"], "--block-size must be > 0"),
        (["--budget", "150%"], "budget"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args, message):
    result = invoke(*args)
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert "Traceback" not in result.output
    assert result.output.strip().count("\n") == 0
