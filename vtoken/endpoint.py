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

import json
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from statistics import fmean

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from vtoken.errors import ConfigError, EndpointError
from vtoken.http_get import Target, decode_text, fetch, one_line, parse_target

OLD_SERVER_HINT = "pass --block-size, --num-blocks and --model instead"
_VTOKEN_PREFIXES = ("vtoken_", "vtoken:")
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
    target = parse_target(url)
    deadline = time.monotonic() + timeout_s
    metrics_url = target.base_url + "/metrics"
    text = decode_text(fetch(target, "/metrics", deadline, timeout_s), metrics_url)
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
        raise EndpointError(f"{source}: body is not Prometheus text: {one_line(err)}") from None
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
            return None, f"a {name}_bucket sample has no numeric le label: {one_line(sample.labels)}"
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


def _read_models(
    target: Target, deadline: float, timeout_s: float
) -> tuple[str | None, int | None, str | None]:
    """(model_name, max_model_len, None), or (None, None, why /v1/models was unusable)."""
    url = target.base_url + "/v1/models"
    try:
        body = fetch(target, "/v1/models", deadline, timeout_s)
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
