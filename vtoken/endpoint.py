"""Read a running vLLM server: cache config and load from `/metrics`, model from `/v1/models`.

`scrape(url)` is the one entry point `vtoken audit URL` needs; `parse_metrics` is the pure part
(Prometheus text in, frozen dataclasses out) and is usable on a saved scrape. Only stdlib HTTP
is used. Every failure reaches the caller as one `VTokenError` with a one-line message that
names the endpoint (credentials removed) and the cause; no urllib, socket or parser exception
escapes, and no credential is ever kept, printed or put in a message.

Aggregation over engines (a data-parallel server labels every sample with `engine`; one engine
is the usual case): `kv_cache_usage` is the mean over engines (each engine owns a pool of the
same size, so the mean is the fraction of all blocks in use); request and preemption counts are
summed; `CacheConfig` comes from the lowest-numbered engine, so `num_gpu_blocks` is per engine.
A note says so whenever there is more than one engine.

The workload series (`vllm:request_prompt_tokens` and `vllm:request_generation_tokens`
histograms, the success, token and prefix-cache counters, the running and waiting gauges) are
kept per engine, unaggregated, in `ServerMetrics.engines`: `vtoken.audit.workload` derives the
deployment's workload from them. A missing or malformed histogram is not an error here (an
audit given a trace does not need it); `EngineCounters.histogram_problems` says what is wrong,
and the workload derivation raises with it when it needs that histogram.
"""

from __future__ import annotations

import base64
import http.client
import json
import re
import socket
import time
import urllib.error
import urllib.request
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from statistics import fmean
from urllib.parse import unquote, urlsplit

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from vtoken.errors import ConfigError, EndpointError

OLD_SERVER_HINT = "pass --block-size, --num-blocks and --model instead"
MAX_BODY_BYTES = 64 << 20
_READ_CHUNK_BYTES = 1 << 16
_VTOKEN_PREFIXES = ("vtoken_", "vtoken:")
_MAX_CAUSE_CHARS = 160
PROMPT_TOKENS_HISTOGRAM = "vllm:request_prompt_tokens"
GENERATION_TOKENS_HISTOGRAM = "vllm:request_generation_tokens"


@dataclass(frozen=True)
class CacheConfig:
    """The server's KV cache settings, from the labels of `vllm:cache_config_info`.

    A field is None when its label is absent, "None" or unparseable; `labels` keeps every label
    as scraped, because the label set changes between vLLM versions.
    """

    block_size: int | None
    num_gpu_blocks: int | None
    cache_dtype: str | None
    enable_prefix_caching: bool | None
    gpu_memory_utilization: float | None
    kv_cache_memory_bytes: int | None
    labels: dict[str, str]


@dataclass(frozen=True)
class Histogram:
    """One engine's Prometheus histogram: `cumulative_counts[i]` observations were at most
    `upper_bounds[i]`; bounds ascend and the last is +inf. Checked: counts never fall, the +Inf
    bucket holds `count`."""

    upper_bounds: tuple[float, ...]
    cumulative_counts: tuple[float, ...]
    total: float  # the `_sum` series: exact
    count: float  # the `_count` series: exact


@dataclass(frozen=True)
class EngineCounters:
    """One engine's workload series in one scrape; counters count since the server started."""

    engine: str  # the `engine` label; "" when the samples carry none
    prompt_tokens: Histogram | None  # vllm:request_prompt_tokens, tokens per finished request
    generation_tokens: Histogram | None  # vllm:request_generation_tokens
    # histogram name -> why it is None (absent, or malformed: which bucket and how), one line each
    histogram_problems: Mapping[str, str]
    num_requests_by_reason: Mapping[str, float]  # vllm:request_success_total by finished_reason
    num_prompt_tokens: float | None  # vllm:prompt_tokens_total
    num_generation_tokens: float | None  # vllm:generation_tokens_total
    num_prefix_cache_queries: float | None  # vllm:prefix_cache_queries_total, tokens looked up
    num_prefix_cache_hits: float | None  # vllm:prefix_cache_hits_total, tokens found
    num_requests_running: float | None
    num_requests_waiting: float | None
    e2e_latency_s_total: float | None  # vllm:e2e_request_latency_seconds_sum (Little's law)


@dataclass(frozen=True)
class ServerMetrics:
    """The load-related values of one scrape, aggregated over engines (see the module docstring)."""

    model_name: str | None  # the `model_name` label of the vllm: samples
    num_engines: int
    kv_cache_usage: float | None  # fraction of KV blocks in use, 0..1
    num_requests_running: float | None
    num_requests_waiting: float | None
    num_preemptions: float | None
    vtoken_metrics: dict[str, float]
    notes: tuple[str, ...]
    engines: tuple[EngineCounters, ...] = ()  # per engine, in engine order (module docstring)


@dataclass(frozen=True)
class LiveState:
    """What `vtoken audit URL` knows about a running server after one scrape."""

    url: str  # base URL of the server, credentials removed
    model_name: str | None  # from /v1/models (else the metrics' model_name label)
    max_model_len: int | None  # tokens
    cache_config: CacheConfig
    metrics: ServerMetrics
    notes: tuple[str, ...]  # the metrics' notes and the scrape's own
    # time.monotonic() when the /metrics body had arrived: two scrapes' counters over this delta
    # give rates
    scraped_at_s: float = field(default=0.0, compare=False)


@dataclass(frozen=True)
class _Target:
    base_url: str  # scheme://host[:port][/prefix], no credentials, no trailing slash
    host: str
    auth_header: str | None  # "Basic ..." built from user:password@, never shown


def redact_url(url: str) -> str:
    """Return `url` without its `user:password@` part; everything else is left as written."""
    return re.sub(r"^((?:[A-Za-z][A-Za-z0-9+.\-]*:)?//)?[^/?#]*@", r"\1", url)


def scrape(url: str, timeout_s: float = 5.0) -> LiveState:
    """Read `/metrics` and `/v1/models` of the vLLM server at `url`.

    `url` is the server's base URL (`http://host:8000`); a trailing `/metrics` or `/v1` is
    accepted and dropped. `user:password@` in it is sent as HTTP basic auth and removed from
    everything returned or raised. The whole scrape (both requests) takes at most `timeout_s`,
    except for DNS resolution, which the OS bounds.

    Raises ConfigError for a URL that is not usable before any network access (scheme other
    than http/https, no host, bad port) or timeout_s <= 0. Raises EndpointError when `/metrics`
    cannot be read (refused, DNS, timeout, HTTP error status), is not Prometheus text, has no
    vllm: metrics, or has no `vllm:cache_config_info` (an older server). A failing `/v1/models`
    is not fatal: the model name falls back to the metrics' `model_name` label and a note says so.
    """
    if not timeout_s > 0:
        raise ConfigError(f"timeout must be > 0 seconds, got {timeout_s}")
    target = _parse_target(url)
    deadline = time.monotonic() + timeout_s
    metrics_url = target.base_url + "/metrics"
    text = _decode_text(_fetch(target, "/metrics", deadline, timeout_s), metrics_url)
    scraped_at_s = time.monotonic()
    cache_config, metrics = parse_metrics(text, metrics_url)
    model_name, max_model_len, models_note = _read_models(target, deadline, timeout_s)
    notes = metrics.notes
    if models_note is not None:
        model_name = metrics.model_name
        notes += (f"{models_note}; model name taken from the metrics' model_name label",)
    return LiveState(
        url=target.base_url,
        model_name=model_name,
        max_model_len=max_model_len,
        cache_config=cache_config,
        metrics=metrics,
        notes=notes,
        scraped_at_s=scraped_at_s,
    )


def parse_metrics(text: str, source: str) -> tuple[CacheConfig, ServerMetrics]:
    """Parse a vLLM `/metrics` body; `source` names it in error messages. Pure.

    Raises EndpointError when the body is not Prometheus text (the parser fails, or it yields
    no sample at all: an empty or HTML body), has no vllm: sample, or has no
    `vllm:cache_config_info` (older server: the message says which flags to pass instead).
    """
    samples = _parse_samples(text, source)
    vllm_samples = [s for s in samples if s.name.startswith("vllm:")]
    if not vllm_samples:
        raise EndpointError(f"{source}: no vllm: metrics in the body (is this a vLLM server?)")
    # Server-wide samples (admission rejections, ...) carry no engine label; they count no engine.
    engine_labels = {s.labels["engine"] for s in vllm_samples if "engine" in s.labels}
    engines = sorted(engine_labels, key=_engine_order)
    infos = [s for s in vllm_samples if s.name == "vllm:cache_config_info"]
    if not infos:
        raise EndpointError(
            f"{source}: no vllm:cache_config_info (an older vLLM server?); {OLD_SERVER_HINT}"
        )
    first_info = min(infos, key=lambda s: _engine_order(s.labels.get("engine", "")))
    return _cache_config(first_info.labels), _server_metrics(samples, engines)


def _parse_samples(text: str, source: str) -> list[Sample]:
    try:
        families = list(text_string_to_metric_families(text))
    # The parser is third-party code over untrusted input and raises ValueError, IndexError
    # and others on garbage; all of them mean the same thing here.
    except Exception as err:  # noqa: BLE001
        raise EndpointError(f"{source}: body is not Prometheus text: {_short(err)}") from None
    samples = [sample for family in families for sample in family.samples]
    if not samples:
        raise EndpointError(f"{source}: body is not Prometheus text: no samples in it")
    return samples


def _cache_config(labels: dict[str, str]) -> CacheConfig:
    return CacheConfig(
        block_size=_label_int(labels, "block_size"),
        num_gpu_blocks=_label_int(labels, "num_gpu_blocks"),
        cache_dtype=_label_str(labels, "cache_dtype"),
        enable_prefix_caching=_label_bool(labels, "enable_prefix_caching"),
        gpu_memory_utilization=_label_float(labels, "gpu_memory_utilization"),
        kv_cache_memory_bytes=_label_int(labels, "kv_cache_memory_bytes"),
        labels=dict(labels),
    )


def _server_metrics(samples: list[Sample], engines: list[str]) -> ServerMetrics:
    notes: list[str] = []
    if len(engines) > 1:
        notes.append(
            f"{len(engines)} engines: kv_cache_usage is their mean, request and preemption "
            f"counts their sum, cache config from engine {engines[0]}"
        )
    usage = _values(samples, "vllm:kv_cache_usage_perc")
    if not usage:
        usage = _values(samples, "vllm:gpu_cache_usage_perc")
        if usage:
            notes.append("kv_cache_usage read from vllm:gpu_cache_usage_perc (pre-0.10 server)")
    return ServerMetrics(
        model_name=next(
            (s.labels["model_name"] for s in samples if "model_name" in s.labels),
            None,
        ),
        num_engines=len(engines),
        kv_cache_usage=fmean(usage) if usage else None,
        num_requests_running=_sum(_values(samples, "vllm:num_requests_running")),
        num_requests_waiting=_sum(_values(samples, "vllm:num_requests_waiting")),
        num_preemptions=_sum(_values(samples, "vllm:num_preemptions_total")),
        vtoken_metrics=_vtoken_metrics(samples, keep_engine=len(engines) > 1),
        notes=tuple(notes),
        engines=tuple(_engine_counters(samples, engine) for engine in engines or [""]),
    )


# ---- the workload series, per engine ---------------------------------------------------------------


def _engine_counters(samples: list[Sample], engine: str) -> EngineCounters:
    """The workload series of `engine` ("": samples without an engine label, a one-engine server)."""
    mine = [s for s in samples if s.labels.get("engine", "") == engine]
    histograms: dict[str, Histogram | None] = {}
    problems: dict[str, str] = {}
    for name in (PROMPT_TOKENS_HISTOGRAM, GENERATION_TOKENS_HISTOGRAM):
        histograms[name], problem = _histogram(mine, name)
        if problem is not None:
            problems[name] = problem
    by_reason: dict[str, float] = {}
    for sample in mine:
        if sample.name == "vllm:request_success_total":
            reason = sample.labels.get("finished_reason", "")
            by_reason[reason] = by_reason.get(reason, 0.0) + float(sample.value)
    return EngineCounters(
        engine=engine,
        prompt_tokens=histograms[PROMPT_TOKENS_HISTOGRAM],
        generation_tokens=histograms[GENERATION_TOKENS_HISTOGRAM],
        histogram_problems=problems,
        num_requests_by_reason=by_reason,
        num_prompt_tokens=_sum(_values(mine, "vllm:prompt_tokens_total")),
        num_generation_tokens=_sum(_values(mine, "vllm:generation_tokens_total")),
        num_prefix_cache_queries=_sum(_values(mine, "vllm:prefix_cache_queries_total")),
        num_prefix_cache_hits=_sum(_values(mine, "vllm:prefix_cache_hits_total")),
        num_requests_running=_sum(_values(mine, "vllm:num_requests_running")),
        num_requests_waiting=_sum(_values(mine, "vllm:num_requests_waiting")),
        e2e_latency_s_total=_sum(_values(mine, "vllm:e2e_request_latency_seconds_sum")),
    )


def _histogram(samples: list[Sample], name: str) -> tuple[Histogram | None, str | None]:
    """(histogram, None), or (None, why not) for an absent or malformed series."""
    buckets: dict[float, float] = {}
    for sample in samples:
        if sample.name != name + "_bucket":
            continue
        try:
            bound = float(sample.labels["le"])
        except (KeyError, ValueError):
            return None, f"a {name}_bucket sample has no numeric le label: {_short(sample.labels)}"
        if bound in buckets:
            return None, f"{name}_bucket has le={_bound(bound)} twice (two series in one engine?)"
        buckets[bound] = float(sample.value)
    sums, counts = _values(samples, name + "_sum"), _values(samples, name + "_count")
    if not buckets and not sums and not counts:
        return None, f"no {name} histogram (no _bucket, _sum or _count series)"
    if not buckets or len(sums) != 1 or len(counts) != 1:
        return None, (f"{name} is incomplete: {len(buckets)} buckets, {len(sums)} _sum and "
                      f"{len(counts)} _count series (one _sum and one _count expected)")
    bounds = sorted(buckets)
    cumulative = [buckets[b] for b in bounds]
    if bounds[-1] != math.inf:
        return None, f"{name} has no le=\"+Inf\" bucket"
    for idx in range(len(bounds)):
        below = cumulative[idx - 1] if idx else 0.0
        if cumulative[idx] < below or not math.isfinite(cumulative[idx]):
            return None, (f"{name}_bucket{{le=\"{_bound(bounds[idx])}\"}} is {cumulative[idx]:g}, below the "
                          f"{below:g} of the bucket before it (cumulative counts cannot fall)")
    if cumulative[-1] != counts[0]:
        return None, f"{name}: the +Inf bucket holds {cumulative[-1]:g}, _count says {counts[0]:g}"
    if not math.isfinite(sums[0]) or sums[0] < 0:
        return None, f"{name}_sum is {sums[0]:g}"
    return Histogram(tuple(bounds), tuple(cumulative), sums[0], counts[0]), None


def _bound(bound: float) -> str:
    return "+Inf" if bound == math.inf else f"{bound:g}"


def _vtoken_metrics(samples: list[Sample], keep_engine: bool) -> dict[str, float]:
    """name -> value; labels other than model_name (and engine, when only one) join the key.

    `vtoken:reclaimed_blocks_total{engine="0",model_name="m"}` on a one-engine server gives the
    key `vtoken:reclaimed_blocks_total`; a `policy="h2o"` label gives
    `vtoken:x{policy="h2o"}`, so no two series share a key and no value is aggregated.
    """
    dropped = {"model_name"} if keep_engine else {"model_name", "engine"}
    values: dict[str, float] = {}
    for sample in samples:
        if not sample.name.startswith(_VTOKEN_PREFIXES):
            continue
        kept = sorted((k, v) for k, v in sample.labels.items() if k not in dropped)
        suffix = "{" + ",".join(f'{k}="{v}"' for k, v in kept) + "}" if kept else ""
        values[sample.name + suffix] = float(sample.value)
    return values


def _values(samples: list[Sample], name: str) -> list[float]:
    return [float(s.value) for s in samples if s.name == name]


def _sum(values: list[float]) -> float | None:
    return sum(values) if values else None


def _engine_order(engine: str) -> tuple[int, int | str]:
    return (0, int(engine)) if engine.isdigit() else (1, engine)


def _label_str(labels: dict[str, str], key: str) -> str | None:
    value = labels.get(key)
    return None if value in (None, "", "None") else value


def _label_int(labels: dict[str, str], key: str) -> int | None:
    value = _label_str(labels, key)
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def _label_float(labels: dict[str, str], key: str) -> float | None:
    value = _label_str(labels, key)
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


def _label_bool(labels: dict[str, str], key: str) -> bool | None:
    return {"true": True, "false": False}.get((_label_str(labels, key) or "").lower())


def _parse_target(url: str) -> _Target:
    shown = redact_url(url.strip())
    if "://" not in shown:
        raise ConfigError(f"{shown}: no scheme; use http://{shown} or https://{shown}")
    try:
        parts = urlsplit(url.strip())
        parts.port  # noqa: B018 -- urlsplit checks the port only when it is read
    except ValueError as err:
        raise ConfigError(f"{shown}: not a usable URL: {_short(err)}") from None
    if parts.scheme.lower() not in ("http", "https"):
        raise ConfigError(f"{shown}: unsupported scheme {parts.scheme!r}; use http:// or https://")
    if not parts.hostname:
        raise ConfigError(f"{shown}: no host in the URL")
    path = parts.path.rstrip("/")
    for suffix in ("/metrics", "/v1"):
        path = path.removesuffix(suffix)
    auth = None
    if parts.username is not None:
        userpass = f"{unquote(parts.username)}:{unquote(parts.password or '')}"
        auth = "Basic " + base64.b64encode(userpass.encode()).decode("ascii")
    hostport = parts.netloc.rpartition("@")[2]
    return _Target(f"{parts.scheme.lower()}://{hostport}{path}", parts.hostname, auth)


def _fetch(target: _Target, path: str, deadline: float, timeout_s: float) -> bytes:
    """GET base_url + path before `deadline` (time.monotonic()); EndpointError on any failure."""
    url = target.base_url + path
    headers = {"User-Agent": "vtoken", "Accept": "text/plain, application/json"}
    if target.auth_header is not None:
        headers["Authorization"] = target.auth_header
    remaining_s = deadline - time.monotonic()
    if remaining_s <= 0:
        raise EndpointError(f"{url}: no answer within {timeout_s:g} s")
    request = urllib.request.Request(url, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=remaining_s) as response:
            return _read_body(response, url, deadline, timeout_s)
    except urllib.error.HTTPError as err:
        err.close()
        raise EndpointError(f"{url}: HTTP {err.code} {_short(err.reason)}") from None
    except urllib.error.URLError as err:
        cause = _describe(err.reason, target.host, timeout_s)
        raise EndpointError(f"{url}: {cause}") from None
    # ValueError: a host name that IDNA cannot encode (a label over 63 characters, ...).
    except (OSError, http.client.HTTPException, ValueError) as err:
        raise EndpointError(f"{url}: {_describe(err, target.host, timeout_s)}") from None


def _read_body(
    response: http.client.HTTPResponse, url: str, deadline: float, timeout_s: float
) -> bytes:
    # Each read is bounded by the socket timeout set at connect time; read1 returns what one
    # recv got, so checking the deadline between chunks also cuts off a server that trickles
    # bytes (read() would wait for a full chunk, resetting the socket timeout at every byte).
    chunks: list[bytes] = []
    num_bytes = 0
    while chunk := response.read1(_READ_CHUNK_BYTES):
        chunks.append(chunk)
        num_bytes += len(chunk)
        if num_bytes > MAX_BODY_BYTES:
            raise EndpointError(f"{url}: body larger than {MAX_BODY_BYTES >> 20} MiB")
        if time.monotonic() > deadline:
            raise EndpointError(f"{url}: no complete answer within {timeout_s:g} s")
    return b"".join(chunks)


def _describe(cause: object, host: str, timeout_s: float) -> str:
    if isinstance(cause, TimeoutError):
        return f"no answer within {timeout_s:g} s"
    if isinstance(cause, socket.gaierror):
        return f"cannot resolve host {host!r} ({cause.strerror})"
    if isinstance(cause, ConnectionRefusedError):
        return "connection refused (is the server running on that port?)"
    if isinstance(cause, http.client.RemoteDisconnected):
        return "server closed the connection without answering"
    if isinstance(cause, BaseException):
        return f"{type(cause).__name__}: {_short(cause)}"
    return _short(cause)


def _decode_text(body: bytes, url: str) -> str:
    try:
        return body.decode("utf-8")
    except UnicodeDecodeError:
        raise EndpointError(f"{url}: body is not Prometheus text: not UTF-8") from None


def _read_models(
    target: _Target, deadline: float, timeout_s: float
) -> tuple[str | None, int | None, str | None]:
    """(model_name, max_model_len, None), or (None, None, why /v1/models was unusable)."""
    url = target.base_url + "/v1/models"
    try:
        body = _fetch(target, "/v1/models", deadline, timeout_s)
    except EndpointError as err:
        return None, None, str(err)
    try:
        first = json.loads(body)["data"][0]
        model_name = first["id"]
    except (ValueError, KeyError, IndexError, TypeError):
        return None, None, f"{url}: not an OpenAI model list"
    if not isinstance(model_name, str):
        return None, None, f"{url}: model id is not a string"
    max_model_len = first.get("max_model_len")
    is_int = isinstance(max_model_len, int) and not isinstance(max_model_len, bool)
    return model_name, max_model_len if is_int else None, None


def _short(value: object) -> str:
    """One line of at most _MAX_CAUSE_CHARS characters: messages must stay one line."""
    line = " ".join(str(value).split())
    return line if len(line) <= _MAX_CAUSE_CHARS else line[: _MAX_CAUSE_CHARS - 3] + "..."
