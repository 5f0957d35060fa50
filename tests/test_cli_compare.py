"""`vtoken compare` through typer's CliRunner: the --json contract, --output, and bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from vtoken.compare import CompareOptions, compare, report_to_json
from vtoken.kv.reclaim import StepShare
from vtoken.replay import make_replayer
from vtoken.trace import load_trace
from vtoken_cli.app import app
from vtoken_cli.options import build_experiment

ROOT = Path(__file__).resolve().parent.parent
SAMPLE = ROOT / "sample_traces" / "azure_conv_sample.csv"
SMALL = ["--max-requests", "30", "--num-blocks", "600", "--concurrencies", "2,8", "--concurrency", "8"]

runner = CliRunner()


def invoke(*args: str):
    return runner.invoke(app, ["compare", *args])


def test_json_equals_the_library_result():
    result = invoke(str(SAMPLE), *SMALL, "--json")
    assert result.exit_code == 0, result.output
    printed = json.loads(result.stdout)
    config = build_experiment(model="llama-3.1-8b", gpu="h100-80gb", num_blocks=600, gpu_mem_util=0.9, block_size=16,
                              policy="h2o", budget="50%", eviction_interval=32, reclaim_mode="hole-fill", theta_f=0.25,
                              seed=0, sim_profile=None)
    report = compare(load_trace(SAMPLE, max_requests=30), config, CompareOptions((2, 8), concurrency=8), make_replayer("sim"),
                     num_blocks=600)
    expected = json.loads(json.dumps(report_to_json(report)))
    assert printed == expected
    assert set(printed["variants"]) == {"native", "naive-evict", "vtoken"}
    for key in ("waste_ratio", "frac_blocks_le_half", "utilization_histogram", "retained_blocks_per_request",
                "memory_utilization", "trapped_bytes", "throughput_tok_s", "latency_p50_s", "latency_p95_s",
                "latency_p99_s", "ttft_p95_s", "tpot_p95_s", "preemptions", "tokens_moved", "blocks_reclaimed"):
        assert key in printed["variants"]["vtoken"]
    assert set(printed["sla"]["c_sel"]) == {"native", "naive-evict", "vtoken"}
    assert printed["frontier"]["max_feasible_concurrency"].keys() == {"native", "naive-evict", "vtoken"}
    assert printed["variants"]["native"]["tokens_moved"] == 0


def test_the_reclaimers_cadence_reaches_the_run_and_its_json():
    """--reclaim-budget, --reclaim-interval and --reclaim-batch-blocks: the run's config, and
    its result equals the library's at that config."""
    args = [str(SAMPLE), *SMALL, "--no-sweep", "--no-frontier", "--json"]
    budgeted = json.loads(invoke(*args, "--reclaim-budget", "64", "--reclaim-interval", "1",
                                 "--reclaim-batch-blocks", "8").stdout)
    reclaim = budgeted["config"]["reclaim"]
    assert (reclaim["max_moves_per_step"], reclaim["check_interval_steps"], reclaim["max_src_blocks"]) == (64, 1, 8)
    config = build_experiment(model="llama-3.1-8b", gpu="h100-80gb", num_blocks=600, gpu_mem_util=0.9, block_size=16,
                              policy="h2o", budget="50%", eviction_interval=32, reclaim_mode="hole-fill", theta_f=0.25,
                              seed=0, sim_profile=None, reclaim_budget="64", reclaim_interval=1, reclaim_batch_blocks=8)
    options = CompareOptions((2, 8), with_sweep=False, with_frontier=False, concurrency=8)
    report = compare(load_trace(SAMPLE, max_requests=30), config, options, make_replayer("sim"), num_blocks=600)
    assert budgeted == json.loads(json.dumps(report_to_json(report)))



def test_a_budget_that_follows_the_step_reaches_the_run_and_its_json():
    """--reclaim-budget auto: the run's config holds the StepShare (its rate in the JSON), its
    result equals the library's at that config, and it moves otherwise than the fixed default."""
    args = [str(SAMPLE), *SMALL, "--no-sweep", "--no-frontier", "--json", "--theta-f", "0.05", "--variants", "vtoken"]
    following = json.loads(invoke(*args, "--reclaim-budget", "auto").stdout)
    assert following["config"]["reclaim"]["max_moves_per_step"] == {"moves_per_ms": 10.0}
    config = build_experiment(model="llama-3.1-8b", gpu="h100-80gb", num_blocks=600, gpu_mem_util=0.9, block_size=16,
                              policy="h2o", budget="50%", eviction_interval=32, reclaim_mode="hole-fill", theta_f=0.05,
                              seed=0, sim_profile=None, reclaim_budget="auto")
    assert config.reclaim.max_moves_per_step == StepShare()
    options = CompareOptions((2, 8), with_sweep=False, with_frontier=False, concurrency=8, variants=("vtoken",))
    report = compare(load_trace(SAMPLE, max_requests=30), config, options, make_replayer("sim"), num_blocks=600)
    assert following == json.loads(json.dumps(report_to_json(report)))
    fixed = json.loads(invoke(*args).stdout)
    assert following["variants"]["vtoken"]["relocation_events"] != fixed["variants"]["vtoken"]["relocation_events"]

def test_output_dir_has_json_csv_and_plots(tmp_path):
    out = tmp_path / "run"
    result = invoke(str(SAMPLE), *SMALL, "--output", str(out))
    assert result.exit_code == 0, result.output
    names = {p.name for p in out.iterdir()}
    assert {"report.json", "variants.csv", "sweep.csv", "frontier.csv", "utilization_histograms.png", "sweep.png",
            "frontier.png"} <= names
    again = invoke(str(SAMPLE), *SMALL, "--output", str(out))
    assert again.exit_code == 2 and "not empty" in again.output


def test_output_csvs_name_their_units_and_keep_counts_integer(tmp_path):
    import pandas as pd

    out = tmp_path / "run"
    assert invoke(str(SAMPLE), *SMALL, "--output", str(out)).exit_code == 0
    variants = pd.read_csv(out / "variants.csv")
    for column in ("preemptions", "tokens_moved", "blocks_reclaimed", "peak_allocated_blocks", "num_completed"):
        assert variants[column].dtype.kind == "i", column
    assert {"tpot_p95_ms", "latency_p95_s", "trapped_gib"} <= set(variants.columns)
    hist = pd.read_csv(out / "utilization_histogram.csv")
    assert list(hist.columns) == ["variant", "bin_low_pct", "bin_high_pct", "share_of_blocks"]
    assert list(hist["bin_low_pct"][:10]) == list(range(0, 100, 10))
    assert "p95_e2e_latency_s" in pd.read_csv(out / "sweep.csv").columns
    payload = json.loads((out / "report.json").read_text())
    for variant in ("native", "naive-evict", "vtoken"):
        requests = pd.read_csv(out / f"requests_{variant}.csv")
        assert list(requests.columns) == ["request_id", "arrival_s", "first_token_s", "finish_s", "ttft_s", "e2e_s",
                                          "num_prompt_tokens", "num_output_tokens", "num_preemptions"]
        assert len(requests) == payload["variants"][variant]["num_completed"]
        assert (requests["e2e_s"] >= requests["ttft_s"]).all()
        assert requests["num_preemptions"].sum() == payload["variants"][variant]["preemptions"]


def test_table_output_mentions_every_section():
    result = invoke(str(SAMPLE), *SMALL, "--explain")
    assert result.exit_code == 0, result.output
    for text in ("Memory", "Performance", "Concurrency sweep", "Capacity frontier", "Definitions", "block utilization"):
        assert text in result.stdout


def write(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize(
    "args, message",
    [
        (["missing.jsonl"], "missing.jsonl"),
        (["{sample}", "--policy", "lru"], "unknown policy 'lru'"),
        (["{sample}", "--model", "gpt-9"], "gpt-9"),
        (["{sample}", "--gpu", "tpu"], "tpu"),
        (["{sample}", "--budget", "150%"], "budget"),
        (["{sample}", "--reclaim-mode", "magic"], "unknown reclaim mode"),
        (["{sample}", "--theta-f", "1.5"], "--theta-f"),
        (["{sample}", "--reclaim-budget", "0"], "--reclaim-budget must be an integer > 0, 'auto' or 'none', got '0'"),
        (["{sample}", "--num-blocks", "0"], "--num-blocks"),
        (["{sample}", "--executor", "tpu"], "unknown executor"),
        (["{sample}", "--concurrencies", "1,x"], "--concurrencies"),
        (["{bad}"], "line 2"),
        (["{empty}"], "empty"),
    ],
)
def test_bad_input_is_one_line_exit_2(tmp_path, args, message):
    bad = write(tmp_path, "bad.jsonl", '{"timestamp": 0, "input_length": 5, "output_length": 3}\n{"timestamp": 1, "input_length": -2\n')
    empty = write(tmp_path, "empty.jsonl", "")
    args = [a.format(sample=SAMPLE, bad=bad, empty=empty) for a in args]
    result = invoke(*args, *SMALL[:2])
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert "Traceback" not in result.output
    assert result.output.strip().count("\n") == 0 or "Usage" in result.output


def test_request_larger_than_the_budget_is_reported(tmp_path):
    trace = write(tmp_path, "t.jsonl", '{"timestamp": 0, "input_length": 9000, "output_length": 3}\n'
                                       '{"timestamp": 1, "input_length": 100, "output_length": 30}\n')
    result = invoke(trace, "--num-blocks", "100", "--no-sweep", "--no-frontier", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["variants"]["native"]["num_skipped"] == 1


def test_open_loop_replays_trace_timestamps():
    result = invoke(str(SAMPLE), "--max-requests", "40", "--num-blocks", "2000", "--open-loop", "--no-sweep",
                    "--no-frontier", "--json")
    assert result.exit_code == 0, result.output
    printed = json.loads(result.stdout)
    assert printed["config"]["concurrency"] is None
    # the 40 requests arrive over several seconds of trace time, so the makespan covers them
    trace = load_trace(SAMPLE, max_requests=40)
    assert printed["variants"]["native"]["makespan_s"] >= trace.requests[-1].arrival_s
