"""vtoken.endpoint against a loopback fake server that serves a real vLLM 0.32 scrape."""

from __future__ import annotations

import base64
import json
import math
import socket
import time
from pathlib import Path

import pytest
from fakeserver import HANG, Hang, Route, Trickle, serve

from vtoken.endpoint import (
    OLD_SERVER_HINT,
    CacheConfig,
    Histogram,
    LiveState,
    parse_metrics,
    scrape,
)
from vtoken.errors import ConfigError, EndpointError
from vtoken.http_get import redact_url

FIXTURE_TEXT = (Path(__file__).parent / "data" / "vllm-0.32-cpu-metrics.txt").read_text()
MODELS_JSON = json.dumps(
    {"object": "list", "data": [{"id": "tiny-llama", "object": "model", "max_model_len": 2048}]}
)
JSON = "application/json"


def vllm_routes(metrics: str = FIXTURE_TEXT, models: Route | Hang | None = None) -> dict:
    return {"/metrics": Route(metrics), "/v1/models": models or Route(MODELS_JSON, 200, JSON)}


def without_cache_config_info(text: str) -> str:
    return "\n".join(line for line in text.splitlines() if "vllm:cache_config_info" not in line)


def two_engine_metrics(usage: tuple[float, float], running: tuple[int, int]) -> str:
    lines = ["# TYPE vllm:cache_config_info gauge"]
    for engine, blocks in ((1, 900), (0, 1000)):
        lines.append(
            f'vllm:cache_config_info{{block_size="16",engine="{engine}",'
            f'num_gpu_blocks="{blocks}"}} 1.0'
        )
    gauges = (("vllm:kv_cache_usage_perc", usage), ("vllm:num_requests_running", running))
    for name, values in gauges:
        lines.append(f"# TYPE {name} gauge")
        for engine, value in enumerate(values):
            lines.append(f'{name}{{engine="{engine}",model_name="m"}} {value}')
    lines.append(f'vtoken:live_tokens{{engine="0",model_name="m"}} {7}')
    lines.append(f'vtoken:live_tokens{{engine="1",model_name="m"}} {9}')
    return "\n".join(lines) + "\n"


@pytest.fixture(autouse=True)
def no_proxy(monkeypatch: pytest.MonkeyPatch) -> None:
    """urllib honours *_proxy variables; a proxy must not sit between the tests and loopback."""
    for scheme in ("http", "https", "all"):
        monkeypatch.delenv(f"{scheme}_proxy", raising=False)
        monkeypatch.delenv(f"{scheme.upper()}_PROXY", raising=False)


def refused_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


# --- the real scrape ------------------------------------------------------------------------


def test_scrape_reads_the_real_vllm_032_scrape() -> None:
    with serve(vllm_routes()) as server:
        state = scrape(server.url, timeout_s=2.0)

    assert state.url == server.url
    assert state.model_name == "tiny-llama"
    assert state.max_model_len == 2048
    config = state.cache_config
    assert config.block_size == 32
    assert config.num_gpu_blocks == 8192
    assert config.cache_dtype == "auto"
    assert config.enable_prefix_caching is True
    assert config.gpu_memory_utilization == 0.92
    assert config.kv_cache_memory_bytes == 1073741824
    assert config.labels["kv_cache_size_tokens"] == "262144"
    assert config.labels["num_cpu_blocks"] == "None"
    assert config.labels["engine"] == "0"
    assert len(config.labels) == 37
    assert state.metrics.kv_cache_usage == 0.0
    assert state.metrics.num_requests_running == 0.0
    assert state.metrics.num_requests_waiting == 0.0
    assert state.metrics.num_preemptions == 0.0
    assert state.metrics.vtoken_metrics == {}
    assert state.notes == ()
    assert [r.path for r in server.requests] == ["/metrics", "/v1/models"]


def test_the_real_scrape_keeps_its_workload_series_per_engine() -> None:
    _, metrics = parse_metrics(FIXTURE_TEXT, "fixture")

    (engine,) = metrics.engines
    assert engine.engine == "0" and engine.histogram_problems == {}
    bounds = (1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, math.inf)
    assert engine.prompt_tokens == Histogram(bounds, (0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1), 4.0, 1.0)
    assert engine.generation_tokens == Histogram(bounds, (0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1), 16.0, 1.0)
    assert engine.num_requests_by_reason == {"stop": 0, "length": 1, "abort": 0, "error": 0, "repetition": 0}
    assert (engine.num_prompt_tokens, engine.num_generation_tokens) == (4.0, 16.0)
    assert (engine.num_prefix_cache_queries, engine.num_prefix_cache_hits) == (4.0, 0.0)
    assert (engine.num_requests_running, engine.num_requests_waiting) == (0.0, 0.0)
    assert engine.e2e_latency_s_total == pytest.approx(0.1119, abs=1e-4)


def test_two_engines_keep_two_sets_of_workload_series() -> None:
    _, metrics = parse_metrics(two_engine_metrics((0.5, 0.25), (3, 4)), "two")

    assert [(e.engine, e.num_requests_running) for e in metrics.engines] == [("0", 3.0), ("1", 4.0)]
    assert all(e.prompt_tokens is None for e in metrics.engines)
    assert metrics.engines[0].histogram_problems["vllm:request_prompt_tokens"] == (
        "no vllm:request_prompt_tokens histogram (no _bucket, _sum or _count series)")


def test_scrape_reads_load_values_from_the_body() -> None:
    text = (
        FIXTURE_TEXT.replace(
            'vllm:kv_cache_usage_perc{engine="0",model_name="tiny-llama"} 0.0',
            'vllm:kv_cache_usage_perc{engine="0",model_name="tiny-llama"} 0.375',
        )
        .replace(
            'vllm:num_requests_running{engine="0",model_name="tiny-llama"} 0.0',
            'vllm:num_requests_running{engine="0",model_name="tiny-llama"} 3.0',
        )
        .replace(
            'vllm:num_preemptions_total{engine="0",model_name="tiny-llama"} 0.0',
            'vllm:num_preemptions_total{engine="0",model_name="tiny-llama"} 5.0',
        )
    )
    with serve(vllm_routes(text)) as server:
        state = scrape(server.url, timeout_s=2.0)

    assert (state.metrics.kv_cache_usage, state.metrics.num_requests_running, state.metrics.num_preemptions) == (
        0.375,
        3.0,
        5.0,
    )


@pytest.mark.parametrize("suffix", ["/", "/metrics", "/v1", "/v1/"])
def test_scrape_accepts_the_metrics_or_openai_url(suffix: str) -> None:
    with serve(vllm_routes()) as server:
        state = scrape(server.url + suffix, timeout_s=2.0)

    assert state.url == server.url
    assert state.cache_config.block_size == 32


def test_vtoken_metrics_are_picked_up_when_the_server_has_them() -> None:
    extra = (
        "# TYPE vtoken:reclaimed_blocks counter\n"
        'vtoken:reclaimed_blocks_total{engine="0",model_name="tiny-llama"} 12.0\n'
        "# TYPE vtoken_waste_ratio gauge\n"
        'vtoken_waste_ratio{engine="0",model_name="tiny-llama",policy="h2o"} 0.25\n'
    )
    with serve(vllm_routes(FIXTURE_TEXT + extra)) as server:
        state = scrape(server.url, timeout_s=2.0)

    assert state.metrics.vtoken_metrics == {
        "vtoken:reclaimed_blocks_total": 12.0,
        'vtoken_waste_ratio{policy="h2o"}': 0.25,
    }


def test_two_engines_average_usage_sum_requests_and_keep_engine_in_vtoken_keys() -> None:
    config, metrics = parse_metrics(two_engine_metrics((0.25, 0.75), (2, 3)), "x")

    assert config.num_gpu_blocks == 1000  # engine 0's, though engine 1 comes first in the body
    assert metrics.num_engines == 2
    assert metrics.kv_cache_usage == 0.5
    assert metrics.num_requests_running == 5.0
    assert metrics.num_requests_waiting is None
    assert metrics.vtoken_metrics == {
        'vtoken:live_tokens{engine="0"}': 7.0,
        'vtoken:live_tokens{engine="1"}': 9.0,
    }
    assert len(metrics.notes) == 1 and "2 engines" in metrics.notes[0]


def test_labels_are_parsed_tolerantly() -> None:
    text = (
        'vllm:cache_config_info{block_size="16",num_gpu_blocks="None",'
        'enable_prefix_caching="maybe",new_label_of_vllm_99="x"} 1.0\n'
    )
    config, metrics = parse_metrics(text, "saved.txt")

    assert config == CacheConfig(
        block_size=16,
        num_gpu_blocks=None,
        cache_dtype=None,
        enable_prefix_caching=None,
        gpu_memory_utilization=None,
        kv_cache_memory_bytes=None,
        labels={
            "block_size": "16",
            "num_gpu_blocks": "None",
            "enable_prefix_caching": "maybe",
            "new_label_of_vllm_99": "x",
        },
    )
    assert metrics.kv_cache_usage is None and metrics.model_name is None


def test_pre_010_usage_gauge_is_read_with_a_note() -> None:
    text = FIXTURE_TEXT.replace("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc").replace(
        'vllm:gpu_cache_usage_perc{engine="0",model_name="tiny-llama"} 0.0',
        'vllm:gpu_cache_usage_perc{engine="0",model_name="tiny-llama"} 0.5',
    )
    _, metrics = parse_metrics(text, "x")

    assert metrics.kv_cache_usage == 0.5
    assert metrics.notes == (
        "kv_cache_usage read from vllm:gpu_cache_usage_perc (pre-0.10 server)",
    )


# --- /v1/models fallback --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("models", "cause"),
    [
        (Route("boom", 500, "text/plain"), "HTTP 500"),
        (Route("<html>login</html>", 200, "text/html"), "not an OpenAI model list"),
        (Route('{"object":"list","data":[]}', 200, JSON), "not an OpenAI model list"),
    ],
)
def test_failing_models_endpoint_falls_back_to_the_metrics_label(models: Route, cause: str) -> None:
    with serve(vllm_routes(models=models)) as server:
        state = scrape(server.url, timeout_s=2.0)

    assert state.model_name == "tiny-llama"
    assert state.max_model_len is None
    assert state.cache_config.block_size == 32
    assert len(state.notes) == 1
    assert f"{server.url}/v1/models" in state.notes[0] and cause in state.notes[0]
    assert "model_name label" in state.notes[0]


def test_hanging_models_endpoint_is_cut_at_the_scrape_deadline() -> None:
    with serve(vllm_routes(models=HANG)) as server:
        start_s = time.monotonic()
        state = scrape(server.url, timeout_s=0.5)
        elapsed_s = time.monotonic() - start_s

    assert elapsed_s < 15.0  # the server would hang for 30 s: the client gave up on its own
    assert state.model_name == "tiny-llama"
    assert "no answer within 0.5 s" in state.notes[0]


# --- faults ---------------------------------------------------------------------------------


def assert_one_line(err: pytest.ExceptionInfo) -> str:
    message = str(err.value)
    assert "\n" not in message
    assert err.value.__cause__ is None
    assert err.value.__context__ is None or err.value.__suppress_context__
    return message


def test_connection_refused() -> None:
    url = refused_url()
    with pytest.raises(EndpointError) as err:
        scrape(url, timeout_s=2.0)

    assert assert_one_line(err) == (
        f"{url}/metrics: connection refused (is the server running on that port?)"
    )


def test_dns_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*args: object, **kwargs: object) -> None:
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", fail)
    with pytest.raises(EndpointError) as err:
        scrape("http://vllm.example.invalid:8000", timeout_s=2.0)

    assert assert_one_line(err) == (
        "http://vllm.example.invalid:8000/metrics: "
        "cannot resolve host 'vllm.example.invalid' (Name or service not known)"
    )


@pytest.mark.parametrize(
    "hang", [HANG, Hang(after_headers=True), Trickle()], ids=["silent", "no-body", "trickle"]
)
def test_a_server_that_never_answers_is_cut_at_the_timeout(hang: Hang | Trickle) -> None:
    with serve({"/metrics": hang}) as server:
        start_s = time.monotonic()
        with pytest.raises(EndpointError) as err:
            scrape(server.url, timeout_s=0.5)
        elapsed_s = time.monotonic() - start_s

    assert 0.4 < elapsed_s < 15.0  # the server would hang for 30 s: the client gave up on its own
    message = assert_one_line(err)
    assert message.startswith(f"{server.url}/metrics: no ") and "within 0.5 s" in message


@pytest.mark.parametrize(
    ("route", "expected"),
    [
        (None, "/metrics: HTTP 404 Not Found"),
        (Route("oops", 500, "text/plain"), "/metrics: HTTP 500 Internal Server Error"),
        (
            Route("<!DOCTYPE html>\n<html><body>It works!</body></html>\n", 200, "text/html"),
            "/metrics: body is not Prometheus text: invalid metric name:<!DOCTYPE html>",
        ),
        (Route(""), "/metrics: body is not Prometheus text: no samples in it"),
        (Route(b"\xff\xfe\x00garbage"), "/metrics: body is not Prometheus text: not UTF-8"),
        (
            Route("# TYPE up gauge\nup 1\n"),
            "/metrics: no vllm: metrics in the body (is this a vLLM server?)",
        ),
        (
            Route(without_cache_config_info(FIXTURE_TEXT)),
            f"/metrics: no vllm:cache_config_info (an older vLLM server?); {OLD_SERVER_HINT}",
        ),
    ],
    ids=["404", "500", "html", "empty", "binary", "not-vllm", "old-vllm"],
)
def test_unusable_metrics_endpoint(route: Route | None, expected: str) -> None:
    routes = {"/v1/models": Route(MODELS_JSON, 200, JSON)}
    if route is not None:
        routes["/metrics"] = route
    with serve(routes) as server:
        with pytest.raises(EndpointError) as err:
            scrape(server.url, timeout_s=2.0)

    assert assert_one_line(err) == server.url + expected


def test_old_server_message_names_the_flags_to_pass() -> None:
    with pytest.raises(EndpointError, match="--block-size, --num-blocks and --model"):
        parse_metrics(without_cache_config_info(FIXTURE_TEXT), "x")


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("ftp://vllm:8000", "ftp://vllm:8000: unsupported scheme 'ftp'; use http:// or https://"),
        (
            "localhost:8000",
            "localhost:8000: no scheme; use http://localhost:8000 or https://localhost:8000",
        ),
        (
            "http://vllm:eighty",
            "http://vllm:eighty: not a usable URL: "
            "Port could not be cast to integer value as 'eighty'",
        ),
        ("http:///metrics", "http:///metrics: no host in the URL"),
        (
            "ftp://admin:s3cret@vllm:21",
            "ftp://vllm:21: unsupported scheme 'ftp'; use http:// or https://",
        ),
    ],
)
def test_unusable_url_is_a_config_error_before_any_network(url: str, expected: str) -> None:
    with pytest.raises(ConfigError) as err:
        scrape(url)

    assert str(err.value) == expected


def test_non_positive_timeout_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="timeout must be > 0 seconds, got 0"):
        scrape("http://127.0.0.1:8000", timeout_s=0)


# --- credentials ----------------------------------------------------------------------------


def test_credentials_are_sent_as_basic_auth_and_kept_nowhere() -> None:
    with serve(vllm_routes()) as server:
        url = server.url.replace("http://", "http://admin:s3cret@")
        state = scrape(url, timeout_s=2.0)

    assert isinstance(state, LiveState)
    assert state.url == server.url
    assert "s3cret" not in repr(state) and "admin" not in repr(state)
    expected = "Basic " + base64.b64encode(b"admin:s3cret").decode()
    assert [r.headers.get("Authorization") for r in server.requests] == [expected, expected]


def test_credentials_stay_out_of_error_messages_and_notes() -> None:
    url = refused_url().replace("http://", "http://admin:s3cret@")
    with pytest.raises(EndpointError) as err:
        scrape(url, timeout_s=2.0)
    assert "s3cret" not in str(err.value) and "admin" not in str(err.value)

    with serve(vllm_routes(models=Route("no", 401, "text/plain"))) as server:
        state = scrape(server.url.replace("http://", "http://admin:s3cret@"), timeout_s=2.0)
    assert "HTTP 401" in state.notes[0]
    assert "s3cret" not in repr(state)


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("http://admin:s3cret@host:8000/metrics", "http://host:8000/metrics"),
        ("https://token@host/v1?x=1", "https://host/v1?x=1"),
        ("http://u:p@ss@host:8000", "http://host:8000"),
        ("u:p@host:8000", "host:8000"),
        ("http://host:8000/a@b", "http://host:8000/a@b"),
        ("http://host:8000", "http://host:8000"),
    ],
)
def test_redact_url(url: str, expected: str) -> None:
    assert redact_url(url) == expected


def test_unencodable_host_name_is_an_endpoint_error() -> None:
    host = "a" * 64  # one DNS label is at most 63 characters; IDNA encoding fails before DNS
    with pytest.raises(EndpointError) as err:
        scrape(f"http://{host}:8000", timeout_s=2.0)

    assert assert_one_line(err).startswith(f"http://{host}:8000/metrics: UnicodeError: ")
