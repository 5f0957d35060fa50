"""`vtoken sweep` through typer's CliRunner: --json equals the library's result, one factor at
a time versus a grid, --output, and bad --vary values."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from vtoken.kv.reclaim import StepShare
from vtoken.replay import SimReplayer
from vtoken.sweep import PARAMETERS, SweepOptions, Vary, report_to_json, sweep
from vtoken.trace import load_trace
from vtoken_cli.app import app
from vtoken_cli.options import build_experiment, parse_budget

ROOT = Path(__file__).resolve().parent.parent
SAMPLE = ROOT / "sample_traces" / "azure_conv_sample.csv"
SMALL = ["--max-requests", "12", "--num-blocks", "400", "--concurrency", "4", "--workers", "1", "--no-cache"]

runner = CliRunner()


def invoke(*args: str):
    return runner.invoke(app, ["sweep", str(SAMPLE), *SMALL, *args])


def test_json_equals_the_library_result() -> None:
    result = invoke("--vary", "block_size=8,32", "--vary", "budget=25%,50%", "--variants", "naive-evict,vtoken",
                    "--json")
    assert result.exit_code == 0, result.output
    printed = json.loads(result.stdout)
    base = build_experiment(model="llama-3.1-8b", gpu="h100-80gb", num_blocks=400, gpu_mem_util=0.9, block_size=16,
                            policy="h2o", budget="50%", eviction_interval=32, reclaim_mode="hole-fill", theta_f=0.25,
                            seed=0, sim_profile=None).run("vtoken", 4)
    options = SweepOptions((Vary("block_size", (8, 32)), Vary("budget", (parse_budget("25%"), parse_budget("50%")))),
                           variants=("naive-evict", "vtoken"))
    report = sweep(load_trace(SAMPLE, max_requests=12), base, options, SimReplayer(), num_blocks=400)
    assert printed == json.loads(json.dumps(report_to_json(report)))
    assert [p["params"] for p in printed["points"]] == [
        {"block_size": 8, "budget": "50%"}, {"block_size": 32, "budget": "50%"},
        {"block_size": 16, "budget": "25%"}, {"block_size": 16, "budget": "50%"}]
    assert all(set(p["variants"]) == {"naive-evict", "vtoken"} for p in printed["points"])
    assert {"waste_ratio", "throughput_tok_s", "utilization_histogram", "tokens_moved"} <= set(
        printed["points"][0]["variants"]["vtoken"])


@pytest.mark.parametrize(("grid", "num_points"), [([], 3 + 2 - 1), (["--grid"], 3 * 2)])
def test_one_factor_at_a_time_versus_a_grid(grid, num_points) -> None:
    # one factor: theta_f 0.1, 0.25 (the base), 0.5 at the base interval, and interval 16, 32 (the
    # base, a repeat of the theta_f=0.25 point) at the base theta_f
    result = invoke("--vary", "theta_f=0.1,0.25,0.5", "--vary", "eviction_interval=16,32", "--variants", "vtoken",
                    *grid, "--json")
    assert result.exit_code == 0, result.output
    points = json.loads(result.stdout)["points"]
    assert len(points) == num_points
    assert len({tuple(p["params"].items()) for p in points}) == num_points


def test_the_reclaimers_cadence_is_a_run_parameter() -> None:
    """--vary reclaim_budget, reclaim_interval and reclaim_batch_blocks reach each point's run
    (the JSON equals the library's sweep over those configs) and name it in the JSON ('none':
    the whole round in one step, 'auto': a budget that follows the step); the cadence changes
    what the reclaimer moves."""
    result = invoke("--vary", "reclaim_budget=none,64,auto", "--vary", "reclaim_interval=1", "--vary",
                    "reclaim_batch_blocks=2,8", "--variants", "vtoken", "--theta-f", "0.05", "--json")
    assert result.exit_code == 0, result.output
    printed = json.loads(result.stdout)
    base = build_experiment(model="llama-3.1-8b", gpu="h100-80gb", num_blocks=400, gpu_mem_util=0.9, block_size=16,
                            policy="h2o", budget="50%", eviction_interval=32, reclaim_mode="hole-fill", theta_f=0.05,
                            seed=0, sim_profile=None).run("vtoken", 4)
    options = SweepOptions((Vary("reclaim_budget", (None, 64, StepShare())), Vary("reclaim_interval", (1,)),
                            Vary("reclaim_batch_blocks", (2, 8))), variants=("vtoken",))
    report = sweep(load_trace(SAMPLE, max_requests=12), base, options, SimReplayer(), num_blocks=400)
    assert printed == json.loads(json.dumps(report_to_json(report)))
    assert [p["params"] for p in printed["points"]] == [
        {"reclaim_budget": "none", "reclaim_interval": 4, "reclaim_batch_blocks": 64},
        {"reclaim_budget": 64, "reclaim_interval": 4, "reclaim_batch_blocks": 64},
        {"reclaim_budget": "auto", "reclaim_interval": 4, "reclaim_batch_blocks": 64},
        {"reclaim_budget": 2048, "reclaim_interval": 1, "reclaim_batch_blocks": 64},
        {"reclaim_budget": 2048, "reclaim_interval": 4, "reclaim_batch_blocks": 2},
        {"reclaim_budget": 2048, "reclaim_interval": 4, "reclaim_batch_blocks": 8}]
    moved = [p["variants"]["vtoken"]["tokens_moved"] for p in printed["points"]]
    assert min(moved) > 0 and len(set(moved)) > 1, moved
    for key, field, value in [("reclaim_budget", "max_moves_per_step", 64), ("reclaim_interval", "check_interval_steps", 1),
                              ("reclaim_batch_blocks", "max_src_blocks", 8)]:
        assert getattr(PARAMETERS[key].set(base, value).experiment.reclaim, field) == value


def test_varying_the_gpu_resizes_the_budget_unless_it_is_given() -> None:
    args = ["sweep", str(SAMPLE), "--max-requests", "6", "--workers", "1", "--no-cache", "--variants", "vtoken",
            "--vary", "gpu=h100-80gb,l40s", "--json"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    blocks = [p["num_blocks"] for p in json.loads(result.stdout)["points"]]
    assert blocks[0] > blocks[1] > 0


def test_output_writes_a_csv_and_a_plot_per_key(tmp_path) -> None:
    result = invoke("--vary", "block_size=8,16", "--vary", "policy=h2o,tova", "--variants", "vtoken",
                    "--output", str(tmp_path / "out"))
    assert result.exit_code == 0, result.output
    names = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert names == [".vtoken-output.json", "report.json", "sweep.csv", "sweep_block_size.png", "sweep_policy.png"]
    assert (tmp_path / "out" / "sweep.csv").read_text().count("\n") == 1 + 3


@pytest.mark.parametrize(("vary", "message"), [
    ("size=8", "--vary: unknown key 'size'; choose one of: block_size, budget"),
    ("block_size", "--vary block_size: expected KEY=V1,V2,..."),
    ("block_size=8,x", "--vary block_size: 'x' is not an integer"),
    ("theta_f=0.5,high", "--vary theta_f: 'high' is not a number"),
    ("block_size=0", "--vary block_size=0: --block-size must be > 0, got 0"),
    ("budget=lots", "--vary budget=lots:"),
    ("policy=lru", "--vary policy=lru:"),
    ("gpu=tpu", "--vary gpu=tpu:"),
    ("block_size=8,8", "--vary block_size: 8 is given twice"),
    ("reclaim_budget=0", "--vary reclaim_budget=0: --reclaim-budget must be an integer > 0, 'auto' or 'none'"),
    ("reclaim_interval=0", "--vary reclaim_interval=0: --reclaim-interval must be > 0, got 0"),
    ("reclaim_batch_blocks=1", "--vary reclaim_batch_blocks=1: --reclaim-batch-blocks must be >= 2"),
    ("block_size=", "--vary block_size: give at least one value"),
])
def test_a_bad_vary_is_one_line_and_exit_2(vary, message) -> None:
    result = invoke("--vary", vary)
    assert result.exit_code == 2
    assert message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert "Traceback" not in result.output


def test_the_same_key_twice_and_an_unknown_variant_are_refused() -> None:
    result = invoke("--vary", "block_size=8", "--vary", "block_size=32")
    assert result.exit_code == 2 and "--vary block_size: given twice" in result.stderr
    result = invoke("--vary", "block_size=8", "--variants", "vtoken,fast")
    assert result.exit_code == 2 and "--variants: unknown variant 'fast'" in result.stderr


@pytest.mark.parametrize("width", [80, 120])
def test_the_table_fits_the_terminal_without_cutting(width) -> None:
    from rich.console import Console

    from vtoken_cli.render.sweep import sweep_table

    base = build_experiment(model="llama-3.1-8b", gpu="h100-80gb", num_blocks=400, gpu_mem_util=0.9, block_size=16,
                            policy="h2o", budget="50%", eviction_interval=32, reclaim_mode="hole-fill", theta_f=0.25,
                            seed=0, sim_profile=None).run("vtoken", 4)
    options = SweepOptions((Vary("theta_f", (0.05, 0.25)), Vary("block_size", (16, 32))))
    report = sweep(load_trace(SAMPLE, max_requests=12), base, options, SimReplayer(), num_blocks=400)
    console = Console(width=width, record=True)
    console.print(sweep_table(report))
    text = console.export_text()
    assert "…" not in text and max(len(line) for line in text.splitlines()) <= width
    assert "point 3: theta_f=0.25, block_size=32 (400 blocks)" in text
    assert "naive-evict" in text
