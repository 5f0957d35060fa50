"""vtoken.audit.workload: the workload a server served, from a loopback vLLM whose counters move."""

from __future__ import annotations

import json
import math
import socket
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import pytest
from fakeserver import Computed, Route, serve
from fakevllm import BOUNDS, DATA, MAX_MODEL_LEN, Served, metrics_text, routes

from vtoken.audit import (
    Overrides, audit, audit_deployment, deployment_to_json, report_to_json, resolve_deployment, resolve_replicas,
    workload_traces,
)
from vtoken.audit.workload import SHARED_PREFIX_ID, derive_server_workload
from vtoken.endpoint import parse_metrics
from vtoken.errors import EndpointError

MODEL = Overrides(model="llama-3.1-8b")
FAST = replace(MODEL, policies=("h2o",), frontier_max_concurrency=8, max_requests=12)


@pytest.fixture(autouse=True)
def no_proxy(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("http_proxy", "https_proxy", "all_proxy", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"):
        monkeypatch.delenv(name, raising=False)


def served_lengths(seed: int, num_requests: int) -> Served:
    rng = np.random.default_rng(seed)
    prompts = rng.lognormal(6.5, 0.8, num_requests).astype(int).clip(1, MAX_MODEL_LEN - 1)
    outputs = rng.lognormal(4.5, 1.0, num_requests).astype(int).clip(1, 2000)
    return Served([int(x) for x in prompts], [int(x) for x in outputs])


def bucket_of(length: float) -> int:
    return next((i for i, b in enumerate(BOUNDS) if length <= b), len(BOUNDS))


def refused_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


# ---- lengths -------------------------------------------------------------------------------------


def test_derived_means_equal_the_served_means_and_the_trace_keeps_them() -> None:
    served = served_lengths(1, 300)
    with serve(routes(Route(metrics_text({"0": served})))) as server:
        deployment, _ = resolve_deployment(server.url, MODEL)

    workload = deployment.workload
    assert workload.source == "server" and workload.replica.num_requests_observed == 300
    assert workload.replica.prompt_tokens.mid.mean == sum(served.prompts) / 300
    assert workload.replica.output_tokens.mid.mean == sum(served.outputs) / 300
    traces = workload_traces(workload)
    mid = traces["mid"].requests
    assert len(mid) == 256  # min(observed, MAX_SYNTHETIC_REQUESTS)
    # Rounded to integers whose sum is N x the exact mean: within 0.5 / N of it.
    assert abs(np.mean([r.num_prompt_tokens for r in mid]) - sum(served.prompts) / 300) <= 0.5 / 256
    assert abs(np.mean([r.num_output_tokens for r in mid]) - sum(served.outputs) / 300) <= 0.5 / 256
    # In random order: the capacity search replays the first C requests, which must not be the shortest.
    first_quarter = [r.num_prompt_tokens for r in mid[:64]]
    assert np.mean(first_quarter) == pytest.approx(sum(served.prompts) / 300, rel=0.25)
    assert first_quarter != sorted(first_quarter)


def test_p50_and_p90_fall_in_the_buckets_of_the_served_quantiles() -> None:
    served = served_lengths(2, 500)
    with serve(routes(Route(metrics_text({"0": served})))) as server:
        deployment, _ = resolve_deployment(server.url, MODEL)

    for lengths, dist in ((served.prompts, deployment.workload.replica.prompt_tokens),
                          (served.outputs, deployment.workload.replica.output_tokens)):
        ordered = sorted(lengths)
        for q, derived in ((0.5, dist.mid.p50), (0.9, dist.mid.p90)):
            true = ordered[math.ceil(q * len(ordered)) - 1]
            assert bucket_of(derived) == bucket_of(true)
            lo, hi = dist.bucket_tokens[bucket_of(true)]
            assert lo <= derived <= hi
        assert dist.low.mean <= dist.mid.mean <= dist.high.mean


def test_the_edge_traces_put_every_request_at_its_bucket_bound() -> None:
    served = Served(prompts=[3, 4, 40, 3000], outputs=[7, 7, 7, 7])
    with serve(routes(Route(metrics_text({"0": served})))) as server:
        deployment, _ = resolve_deployment(server.url, MODEL)

    traces = workload_traces(deployment.workload)
    by_edge = {edge: sorted(r.num_prompt_tokens for r in t.requests) for edge, t in traces.items()}
    assert by_edge["low"] == [3, 3, 21, 2001]
    assert by_edge["high"] == [5, 5, 50, MAX_MODEL_LEN]  # the +Inf bucket ends at max_model_len
    assert sorted(r.num_prompt_tokens for r in traces["mid"].requests)[2] in range(21, 51)
    assert {r.num_output_tokens for r in traces["low"].requests} == {6}
    assert {r.num_output_tokens for r in traces["high"].requests} == {10}
    assert sum(r.num_output_tokens for r in traces["mid"].requests) == 28


def test_prefix_cache_hits_become_one_shared_prefix_stated_as_an_assumption() -> None:
    served = replace(served_lengths(3, 100), num_prefix_queries=10_000, num_prefix_hits=3_000)
    with serve(routes(Route(metrics_text({"0": served})))) as server:
        deployment, _ = resolve_deployment(server.url, MODEL)

    assert deployment.workload.replica.prefix_cache_hit_ratio == 0.3
    trace = workload_traces(deployment.workload)["mid"]
    shared = [r for r in trace.requests if r.prefix_id == SHARED_PREFIX_ID]
    share = sum(r.num_prefix_tokens for r in shared) / sum(r.num_prompt_tokens for r in trace.requests)
    assert shared and len({r.num_prefix_tokens for r in shared}) == 1
    assert share == pytest.approx(0.3, abs=0.02)
    assert any("an assumption" in note and "30.0%" in note for note in trace.notes)


# ---- rate, resets, missing series ------------------------------------------------------------


def test_the_window_rate_matches_the_rate_served() -> None:
    rate_per_s, in_flight, start_s = 40.0, 6.0, time.monotonic()

    def render() -> str:
        elapsed_s = time.monotonic() - start_s
        num_done = 100 + int(rate_per_s * elapsed_s)
        served = Served([500] * num_done, [50] * num_done, e2e_latency_s=in_flight * elapsed_s)
        return metrics_text({"0": served})

    with serve(routes(Computed(render))) as server:
        deployment, _ = resolve_deployment(server.url, replace(MODEL, window_s=0.6))

    replica = deployment.workload.replica
    assert replica.request_rate_per_s == pytest.approx(rate_per_s, rel=0.1)
    assert deployment.workload.server.window_s == pytest.approx(0.6, abs=0.2)
    assert deployment.workload.concurrency == round(in_flight)  # Little's law over the window
    assert any("Little's law" in note for note in deployment.notes)


def test_rates_are_exact_counter_deltas_over_the_scrape_interval() -> None:
    first = _live(metrics_text({"0": Served([10] * 30, [5] * 30, e2e_latency_s=60.0)}), 100.0)
    later = _live(metrics_text({"0": Served([10] * 54, [5] * 54, e2e_latency_s=96.0)}), 108.0)

    replica = derive_server_workload(first, later).total
    assert replica.request_rate_per_s == 24 / 8
    assert replica.concurrency == 36 / 8
    assert replica.notes == ()


def test_a_counter_reset_between_the_scrapes_gives_a_clear_line() -> None:
    first = _live(metrics_text({"0": Served([10] * 500, [5] * 500)}), 100.0)
    later = _live(metrics_text({"0": Served([10] * 12, [5] * 12)}), 110.0)

    replica = derive_server_workload(first, later).total
    assert replica.request_rate_per_s == 12 / 10
    (note,) = [n for n in replica.notes if "vllm:request_success_total" in n]
    assert note == ("vllm:request_success_total fell from 500 to 12 between the scrapes (the server restarted): "
                    "only the 12 since the restart count, so the rate is a lower bound")


def test_a_counter_reset_on_a_live_server_is_noted_in_the_workload() -> None:
    bodies = iter([metrics_text({"0": Served([10] * 500, [5] * 500)}), metrics_text({"0": Served([10] * 9, [5] * 9)})])
    with serve(routes(Computed(lambda: next(bodies)))) as server:
        deployment, _ = resolve_deployment(server.url, replace(MODEL, window_s=0.1))

    assert any("fell from 500 to 9" in note and "restarted" in note for note in deployment.workload.notes)


@pytest.mark.parametrize("dropped", ["vllm:request_prompt_tokens", "vllm:request_generation_tokens"])
def test_a_missing_histogram_is_one_line_naming_the_url_and_the_metric(dropped: str) -> None:
    with serve(routes(Route(metrics_text({"0": served_lengths(4, 20)}, drop=(dropped,))))) as server:
        with pytest.raises(EndpointError) as err:
            resolve_deployment(server.url, MODEL)
        url = server.url

    message = str(err.value)
    assert "\n" not in message
    assert message == (f"{url}/metrics: no {dropped} histogram (no _bucket, _sum or _count series); "
                       "pass --trace to audit a workload of your own")


def test_a_malformed_histogram_names_the_bucket() -> None:
    text = metrics_text({"0": served_lengths(5, 20)}).replace(
        'vllm:request_prompt_tokens_bucket{engine="0",model_name="tiny-llama",le="1000.0"}',
        'vllm:request_prompt_tokens_bucket{engine="0",model_name="tiny-llama",le="1000.0"} 0.0\n#')
    with serve(routes(Route(text))) as server, pytest.raises(EndpointError) as err:
        resolve_deployment(server.url, MODEL)

    assert 'vllm:request_prompt_tokens_bucket{le="1000"} is 0, below the' in str(err.value)
    assert "cumulative counts cannot fall" in str(err.value) and "\n" not in str(err.value)


def test_with_a_trace_the_histograms_are_not_needed() -> None:
    text = metrics_text({"0": served_lengths(6, 20)}, drop=("vllm:request_prompt_tokens",))
    with serve(routes(Route(text))) as server:
        deployment, _ = resolve_deployment(server.url, replace(MODEL, trace=DATA / "native.jsonl"))

    assert deployment.workload.source == "trace" and deployment.workload.replica is None


def test_a_server_that_served_nothing_replays_the_bundled_sample_and_says_so() -> None:
    with serve(routes(Route(metrics_text({"0": Served([], [])})))) as server:
        deployment, _ = resolve_deployment(server.url, MODEL)

    assert deployment.workload.source == "bundled-sample"
    assert any("has finished no request yet" in note and "bundled sample" in note for note in deployment.notes)


# ---- replicas ------------------------------------------------------------------------------------


def test_two_engine_labels_are_two_replicas() -> None:
    engines = {"0": served_lengths(7, 40), "1": Served([100] * 30, [10] * 30)}
    with serve(routes(Route(metrics_text(engines)))) as server:
        deployments, _ = resolve_replicas(server.url, MODEL)
        (together, _) = resolve_deployment(server.url, MODEL)
        url = server.url

    assert [d.source for d in deployments] == [f"{url} engine 0", f"{url} engine 1"]
    assert [d.workload.replica.num_requests_observed for d in deployments] == [40, 30]
    assert deployments[1].workload.replica.prompt_tokens.mid.mean == 100
    assert together.workload.replica.engine == "all" and together.workload.replica.num_requests_observed == 70
    mean = (sum(engines["0"].prompts) + 3000) / 70
    assert together.workload.replica.prompt_tokens.mid.mean == mean


def test_an_unreachable_second_url_is_reported_and_the_first_audited() -> None:
    dead = refused_url()
    with serve(routes(Route(metrics_text({"0": served_lengths(8, 20)})))) as server:
        result = audit_deployment([server.url, dead], FAST)

    (report,) = result.replicas
    assert report.deployment.workload.source == "server"
    (failure,) = result.failures
    assert failure.target == dead and failure.reason.startswith(f"{dead}/metrics: connection refused")
    payload = deployment_to_json(result)
    assert payload["total"]["num_replicas"] == 1 and payload["total"]["num_failed"] == 1
    assert payload["failures"] == [{"target": dead, "reason": failure.reason}]


def test_replicas_sum_into_the_deployment_total() -> None:
    engines = {"0": served_lengths(9, 20), "1": served_lengths(10, 20)}
    with serve(routes(Route(metrics_text(engines)))) as server:
        result = audit_deployment([server.url], FAST)

    assert len(result.replicas) == 2 and not result.failures
    total = result.totals()["policies"]["h2o"]
    for variant in ("native", "naive-evict", "vtoken"):
        assert total["max_concurrency"][variant] == sum(r.policies[0].capacity[variant].max_concurrency
                                                        for r in result.replicas)
    assert total["trapped_bytes"] == sum(r.policies[0].evicted.trapped_bytes for r in result.replicas)


def test_no_replica_answering_is_one_error_naming_each() -> None:
    first, second = refused_url(), refused_url()
    with pytest.raises(EndpointError) as err:
        audit_deployment([first, second], FAST)

    assert str(err.value).startswith(f"no replica answered: {first}/metrics: connection refused")
    assert f"{second}/metrics" in str(err.value) and "\n" not in str(err.value)


# ---- the report ----------------------------------------------------------------------------------


def test_json_workload_block_and_headline_ranges() -> None:
    served = served_lengths(11, 60)
    with serve(routes(Route(metrics_text({"0": served})))) as server:
        report = audit(server.url, replace(FAST, window_s=0.1))

    payload = report_to_json(report)
    workload = payload["workload"]
    assert workload["source"] == "server" and workload["num_requests_observed"] == 60
    assert workload["prompt_tokens"]["mean"] == sum(served.prompts) / 60
    assert set(workload["prompt_tokens"]) >= {"mean", "p50", "p90", "low", "high"}
    assert workload["output_tokens"]["low"]["mean"] <= workload["output_tokens"]["mean"]
    assert workload["request_rate_per_s"] == 0.0  # nothing moved during the window
    assert workload["num_requests"] == 12  # --max-requests caps the synthetic trace
    h2o = payload["policies"]["h2o"]
    for figure in ("waste_ratio", "trapped_bytes", "reclaimable_bytes"):
        low, high = h2o["ranges"][figure]
        assert low <= h2o[figure] <= high
    low, high = h2o["ranges"]["max_concurrency"]["vtoken"]
    assert low <= h2o["max_concurrency"]["vtoken"] <= high
    assert set(payload["edges"]) == {"low", "high"}
    assert "histogram buckets" in report.verdict


def _live(text: str, at_s: float):
    from vtoken.endpoint import LiveState

    cache, metrics = parse_metrics(text, "http://h/metrics")
    return LiveState("http://h", "tiny-llama", MAX_MODEL_LEN, cache, metrics, (), scraped_at_s=at_s)


def test_the_windows_of_several_replicas_are_taken_at_the_same_moments() -> None:
    """Every replica's first scrape comes before any replica's second one: the windows overlap
    (replica after replica, the first replica's second scrape would come before the second's first)."""
    order: list[str] = []

    def recorder(name: str, served: Served) -> Computed:
        def render() -> str:
            order.append(name)
            return metrics_text({"0": served})
        return Computed(render)

    dead = refused_url()
    with serve(routes(recorder("a", served_lengths(12, 20)))) as a, serve(routes(recorder("b", served_lengths(13, 30)))) as b:
        result = audit_deployment([a.url, dead, b.url], replace(FAST, window_s=0.3))

    assert sorted(order[:2]) == ["a", "b"] and sorted(order[2:]) == ["a", "b"]
    windows = [r.deployment.workload.server.window_s for r in result.replicas]
    assert len(windows) == 2 and all(w >= 0.3 for w in windows)
    assert [r.deployment.workload.replica.num_requests_observed for r in result.replicas] == [20, 30]
    (failure,) = result.failures  # a replica that does not answer has no window, the others still do
    assert failure.target == dead and "connection refused" in failure.reason
