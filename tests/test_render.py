"""The terminal reports at 80 and 120 columns: nothing cut with "…", every configuration value in
the header, histograms compared on one scale, a lower-bound capacity marked N+."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from rich.console import Console

from vtoken.analysis import Frontier, FrontierPoint
from vtoken.audit import Overrides, audit_deployment
from vtoken.checker import CheckOptions, check_invariants
from vtoken.compare import CompareOptions, compare
from vtoken.replay import make_replayer
from vtoken.trace import load_trace
from vtoken_cli.options import build_experiment
from vtoken_cli.render.audit import audit_report
from vtoken_cli.render.check import check_report
from vtoken_cli.render.common import BAR_WIDTH, histograms
from vtoken_cli.render.compare import compare_report, demand_text, frontier_table, max_feasible_phrase

ROOT = Path(__file__).resolve().parent.parent
SAMPLE = ROOT / "sample_traces" / "azure_conv_sample.csv"
WIDTHS = (80, 120)


def config(**changes):
    values = dict(model="llama-3.1-8b", gpu="h100-80gb", num_blocks=600, gpu_mem_util=0.9, block_size=16,
                  policy="h2o", budget="50%", eviction_interval=32, reclaim_mode="hole-fill", theta_f=0.25,
                  seed=3, sim_profile=None)
    return build_experiment(**{**values, **changes})


@pytest.fixture(scope="module")
def compare_result():
    return compare(load_trace(SAMPLE, max_requests=30), config(), CompareOptions((2, 8), concurrency=8), make_replayer("sim"),
                   num_blocks=600)


@pytest.fixture(scope="module")
def check_result():
    options = CheckOptions(policies=("h2o",), reclaim_modes=("ordered",), concurrency=4)
    base = config(num_blocks=None, theta_f=0.05, reclaim_mode="ordered")
    return check_invariants([load_trace(ROOT / "sample_traces" / "shared_prefix.jsonl")], base, options)


@pytest.fixture(scope="module")
def audit_result():
    return audit_deployment([str(ROOT / "tests" / "data" / "audit_small.toml")], Overrides()).replicas[0]


def render(renderable, width: int) -> str:
    console = Console(width=width, record=True, color_system=None)
    console.print(renderable)
    return console.export_text()


def header_of(text: str) -> str:
    """The first panel, its lines joined: a value wrapped inside the panel reads as one."""
    lines = text.splitlines()
    end = next(idx for idx, line in enumerate(lines) if line.startswith("╰"))
    return " ".join(" ".join(line.strip("│╭╮ ").split()) for line in lines[:end])


@pytest.mark.parametrize("width", WIDTHS)
def test_compare_fits_and_names_every_configuration_value(compare_result, width):
    text = render(compare_report(compare_result, explain=True), width)
    assert "…" not in text
    assert max(len(line) for line in text.splitlines()) <= width
    cfg = compare_result.experiment
    header = header_of(text)
    for value in (str(compare_result.trace.source), cfg.model.name, cfg.gpu.name, f"block size {cfg.block_size}",
                  f"{cfg.num_blocks} blocks", "h2o", cfg.eviction.budget.describe(),
                  f"every {cfg.eviction.interval_tokens} tokens", cfg.reclaim.mode, f"theta_F {cfg.reclaim.theta_f:g}",
                  f"concurrency {compare_result.options.concurrency}", f"seed {cfg.seed}", "executor sim"):
        assert value in header, value
    for variant in ("native", "naive-evict", "vtoken"):
        assert variant in text


@pytest.mark.parametrize("width", WIDTHS)
def test_check_fits_and_names_every_configuration_value(check_result, width):
    text = render(check_report(check_result), width)
    assert "…" not in text
    assert max(len(line) for line in text.splitlines()) <= width
    base, run = check_result.base, check_result.runs[0]
    header = header_of(text)
    for value in ("shared_prefix.jsonl", base.model.name, base.gpu.name, f"block size {run.block_size}",
                  f"{run.num_blocks} blocks", "h2o", base.eviction.budget.describe(),
                  f"every {base.eviction.interval_tokens} tokens", "ordered", f"theta_F {base.reclaim.theta_f:g}",
                  f"concurrency {check_result.options.concurrency}", f"seed {base.seed}", "executor sim"):
        assert value in header, value


@pytest.mark.parametrize("width", WIDTHS)
def test_audit_fits_and_names_every_configuration_value(audit_result, width):
    text = render(audit_report(audit_result), width)
    assert "…" not in text
    assert max(len(line) for line in text.splitlines()) <= width
    d = audit_result.deployment
    flat = " ".join(" ".join(line.strip("│╭╮ ").split()) for line in text.splitlines())
    for value in ("tests/data/audit_small.toml", d.model.name, d.gpu.name, f"block size {d.block_size}",
                  f"{d.num_blocks} blocks", "h2o, streaming_llm", d.budget.describe(),
                  f"every {d.interval_tokens} tokens", "hole-fill", "theta_F", f"concurrency {d.workload.concurrency}",
                  f"seed {d.seed}", "executor sim"):
        assert value in flat, value


def test_audit_verdict_and_tables_give_one_room_for_figure(audit_result):
    h2o = audit_result.policies[0]
    num_more = h2o.capacity["vtoken"].max_concurrency - h2o.capacity["naive-evict"].max_concurrency
    assert f"room for {num_more} more concurrent request" in audit_result.verdict


def bars(text: str, title: str, label: str) -> int:
    """Length of the bar of bin `label` in the histogram titled `title` (stacked at 80 columns)."""
    lines = text.splitlines()
    start = lines.index(next(line for line in lines if line.strip() == title))
    row = next(line for line in lines[start:] if line.startswith(label))
    return row.count("█")


def test_histograms_share_one_scale():
    tall = [0.0] * 9 + [0.988]
    short = [0.0] * 5 + [0.254] + [0.0] * 4
    text = render(histograms([("tall", tall), ("short", short), ("third", short)], "utilization"), 80)
    assert bars(text, "tall", "90-100%") == BAR_WIDTH
    assert bars(text, "short", "50-60%") == int(0.254 / 0.988 * BAR_WIDTH)


def test_histograms_sit_side_by_side_where_they_fit():
    values = [0.1] * 10
    named = [("a", values), ("b", values), ("c", values)]
    narrow = render(histograms(named, "u"), 80)
    assert [line.count("90-100%") for line in narrow.splitlines() if "90-100%" in line] == [1, 1, 1]
    wide = render(histograms(named, "u"), 120)
    assert [line.count("90-100%") for line in wide.splitlines() if "90-100%" in line] == [3]


def test_max_feasible_concurrency_is_a_lower_bound_when_the_largest_tried_fits(compare_result):
    points = tuple(FrontierPoint(v, c, 10 * c, 10 * c / 600, True) for c in (16, 32, 48) for v in ("native", "vtoken"))
    points += (FrontierPoint("naive-evict", 16, 500, 500 / 600, True), FrontierPoint("naive-evict", 32, 602, 602 / 600, False),
               FrontierPoint("naive-evict", 48, 900, 1.5, False))
    frontier = Frontier(600, points, {"native": 48, "naive-evict": 16, "vtoken": 48}, 60)
    assert max_feasible_phrase(frontier, "vtoken") == "48+"
    assert max_feasible_phrase(frontier, "naive-evict") == "16"
    text = render(frontier_table(replace(compare_result, frontier=frontier)), 80)
    assert "48+" in text and "1.003 ✗" in text


def test_demand_shows_the_digits_that_tell_over_from_within():
    assert demand_text(1.0032, False) == "1.003 ✗"
    assert demand_text(0.9999, True) == "0.9999"
    assert demand_text(1.0, True) == "1.00"
    assert demand_text(0.5, True) == "0.50"


@pytest.mark.parametrize("command, usage", [
    ("compare", "vtoken compare [OPTIONS] {TRACE}"), ("check-invariants", "vtoken check-invariants [OPTIONS] [TRACE]"),
    ("audit", "vtoken audit [OPTIONS] {DEPLOYMENT}..."), ("serve", "vtoken serve [OPTIONS] {MODEL}"),
])
def test_help_names_the_argument_and_gives_examples_and_exit_codes(command, usage):
    from typer.testing import CliRunner

    from vtoken_cli.app import app

    result = CliRunner().invoke(app, [command, "--help"], env={"COLUMNS": "80"})
    assert result.exit_code == 0
    assert usage in result.stdout
    assert "Examples" in result.stdout and f"vtoken {command} " in result.stdout
    assert "Exit codes" in result.stdout and "  2  bad input" in result.stdout
    assert "…" not in result.stdout.split("Arguments")[0]  # the text above typer's option panels
    schema = {"compare": "input_length   int > 0, required", "audit": "num_gpu_blocks = 4096"}.get(command)
    assert schema is None or schema in result.stdout


@pytest.mark.parametrize("command", ["compare", "check-invariants", "audit", "sweep", "serve"])
def test_help_at_80_columns_names_every_option_in_full(command):
    import typer
    from typer.testing import CliRunner

    from vtoken_cli.app import app

    result = CliRunner().invoke(app, [command, "--help"], env={"COLUMNS": "80"})
    assert result.exit_code == 0
    assert "…" not in result.stdout
    assert max(len(line) for line in result.stdout.splitlines()) <= 80
    params = typer.main.get_command(app).commands[command].params
    names = [name for p in params if not p.hidden for name in (*p.opts, *p.secondary_opts) if name.startswith("-")]
    assert names and [n for n in names if n not in result.stdout] == []
