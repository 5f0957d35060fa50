"""Closing the loop on a vToken server: its vtoken_* figures beside the sim's prediction for
the workload it served (a loopback server whose vToken integrals move between scrapes)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from fakeserver import Computed, Route, serve
from fakevllm import Served, metrics_text, routes
from typer.testing import CliRunner

from vtoken.audit import Overrides, audit, report_to_json, resolve_deployment
from vtoken.audit.loop import server_vtoken
from vtoken.endpoint import LiveState, parse_metrics
from vtoken_cli.app import app

BLOCK_SIZE = 32  # the fixture's vllm:cache_config_info
INFO = ('vtoken_info{budget="keep 48 tokens (4 sinks, 16 recent)",interval_tokens="8",policy="streaming_llm",'
        'reclaim_mode="hole-fill",theta_f="0.05",variant="vtoken"}')
FAST = Overrides(model="llama-3.1-8b", frontier_max_concurrency=8, max_requests=12)


@pytest.fixture(autouse=True)
def no_proxy(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("http_proxy", "https_proxy", "all_proxy", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"):
        monkeypatch.delenv(name, raising=False)


def vtoken_engine(live_s: float, allocated_s: float, waste_mean: float = 0.3) -> Served:
    prompts = [300, 500, 700, 900] * 5
    return Served(prompts, [100, 200] * 10, num_running=4, vtoken={
        INFO: 1, "vtoken_live_token_seconds_total": live_s, "vtoken_allocated_token_seconds_total": allocated_s,
        "vtoken_waste_ratio_mean": waste_mean, "vtoken_live_tokens": 400, "vtoken_allocated_blocks": 20,
        "vtoken_tokens_moved_total": 900, "vtoken_blocks_reclaimed_total": 60,
        **{f'vtoken_block_utilization_blocks{{bin="{i}"}}': n for i, n in enumerate((2, 0, 0, 0, 0, 3, 0, 0, 0, 15))}})


def moving_server() -> Computed:
    """Two scrapes: the integrals move by 6,000 live and 8,000 allocated token-seconds between them."""
    bodies = iter([metrics_text({"0": vtoken_engine(10_000.0, 12_000.0)}),
                   metrics_text({"0": vtoken_engine(16_000.0, 20_000.0)})])
    return Computed(lambda: next(bodies))


def test_the_servers_info_labels_are_read_back() -> None:
    cache, metrics = parse_metrics(metrics_text({"0": vtoken_engine(1.0, 2.0)}), "http://h/metrics")

    server = server_vtoken(LiveState("http://h", "m", 4096, cache, metrics, ()))
    assert (server.variant, server.policy, server.interval_tokens, server.reclaim_mode, server.theta_f) == (
        "vtoken", "streaming_llm", 8, "hole-fill", 0.05)
    assert (server.budget.num_tokens, server.budget.num_sink_tokens, server.budget.num_recent_tokens) == (48, 4, 16)


def test_the_audit_replays_what_the_server_runs_unless_flags_say_otherwise() -> None:
    with serve(routes(Route(metrics_text({"0": vtoken_engine(1.0, 2.0)})))) as server:
        deployment, _ = resolve_deployment(server.url, FAST)
        flagged, _ = resolve_deployment(server.url, replace(FAST, policies=("h2o",), budget="50%"))

    assert deployment.policies == ("streaming_llm",) and deployment.interval_tokens == 8
    assert (deployment.budget.num_tokens, deployment.budget.num_recent_tokens) == (48, 16)
    assert any("as the server runs them (vtoken_info: vtoken, streaming_llm" in n for n in deployment.notes)
    assert flagged.policies == ("h2o",) and flagged.budget.keep_ratio == 0.5
    # vtoken replays reclaim as the server does, every step as inside vLLM
    assert (deployment.reclaim.mode, deployment.reclaim.theta_f, deployment.reclaim.check_interval_steps) == (
        "hole-fill", 0.05, 1)
    assert any("reclaim as the server does: hole-fill, theta_F 0.05" in n for n in deployment.notes)


def test_over_a_window_the_measured_waste_comes_from_the_integrals_beside_the_sim() -> None:
    with serve(routes(moving_server())) as server:
        report = audit(server.url, replace(FAST, window_s=0.1))

    loop, window_s = report.loop, report.deployment.workload.server.window_s
    m = loop.measured
    assert m.waste_ratio == pytest.approx(1 - 6_000 / 8_000) and m.waste_ratio_span.startswith("window ")
    assert m.trapped_tokens == pytest.approx(2_000 / window_s)
    assert m.trapped_blocks == pytest.approx(2_000 / window_s / BLOCK_SIZE)
    assert m.trapped_bytes == pytest.approx(2_000 / window_s * report.deployment.model.kv_bytes_per_token)
    assert m.utilization_histogram == pytest.approx((0.1, 0, 0, 0, 0, 0.15, 0, 0, 0, 0.75))
    predicted = report.policies[0].runs["vtoken"]
    assert (loop.policy, loop.variant, loop.predicted) == ("streaming_llm", "vtoken", predicted)
    assert loop.waste_ratio_difference == pytest.approx(m.waste_ratio - predicted.waste_ratio)
    assert loop.trapped_bytes_difference == pytest.approx(m.trapped_bytes - predicted.trapped_bytes)

    closing = report_to_json(report)["closing_the_loop"]
    assert closing["measured"]["waste_ratio"] == pytest.approx(0.25)
    assert closing["predicted"]["waste_ratio"] == predicted.waste_ratio
    assert closing["difference"]["waste_ratio"] == pytest.approx(0.25 - predicted.waste_ratio)
    assert len(closing["difference"]["utilization_histogram"]) == 10
    predicted_blocks = predicted.trapped_bytes / report.deployment.kv_bytes_per_block
    assert closing["predicted"]["trapped_blocks"] == pytest.approx(predicted_blocks)
    assert closing["difference"]["trapped_blocks"] == pytest.approx(m.trapped_blocks - predicted_blocks)
    assert closing["server"]["budget"] == "keep 48 tokens (4 sinks, 16 recent)"
    assert "the sim predicts" in report.verdict and "F = 0.250" in report.verdict


def test_from_one_scrape_f_is_the_lifetime_mean_and_trapped_is_now() -> None:
    with serve(routes(Route(metrics_text({"0": vtoken_engine(1.0, 2.0, waste_mean=0.3)})))) as server:
        report = audit(server.url, FAST)

    m = report.loop.measured
    assert (m.waste_ratio, m.waste_ratio_span) == (0.3, "since the engines started")
    assert (m.trapped_tokens, m.trapped_span) == (20 * BLOCK_SIZE - 400, "now")


def test_a_server_policy_the_audit_did_not_replay_is_said() -> None:
    with serve(routes(Route(metrics_text({"0": vtoken_engine(1.0, 2.0)})))) as server:
        report = audit(server.url, replace(FAST, policies=("h2o",)))

    assert report.loop.predicted is None and report.loop.waste_ratio_difference is None
    assert any("pass --policy streaming_llm" in note for note in report.loop.notes)


def test_the_cli_shows_measured_predicted_and_difference() -> None:
    with serve(routes(moving_server())) as server:
        result = CliRunner().invoke(app, ["audit", server.url, "--model", "llama-3.1-8b", "--frontier-max", "8",
                                          "--max-requests", "12", "--window", "0.1"])

    assert result.exit_code == 0, result.output
    text = " ".join(result.stdout.replace("│", " ").split())
    for fragment in ("Closing the loop", "measured on the server", "sim predicts", "difference",
                     "F (waste ratio) 0.250 (window 0.", "trapped blocks", "block utilization"):
        assert fragment in text, fragment
