"""The workload a running vLLM server has served, from its `/metrics`, and a trace that replays it.

    derive_server_workload(first, later)   one scrape, or two `--window` seconds apart
        -> ServerWorkload                  per engine (a data-parallel server has several) + total
    synthetic_traces(replica, ...)         -> {"low", "mid", "high"}: N requests each

What each figure is made of:

- lengths: `vllm:request_prompt_tokens` / `vllm:request_generation_tokens` are histograms of
  finished requests with 1-2-5 buckets. Bucket i holds the integer lengths lo..hi with
  lo = floor(le[i-1]) + 1 and hi = floor(le[i]); the +Inf bucket ends at `max_model_len` (or at
  the next 1-2-5 step when the server does not say it). A quantile is interpolated linearly
  inside its bucket (Prometheus' histogram_quantile); the mean is exact, `_sum / _count`; `low`
  and `high` are the same figures with every request at its bucket's lo or hi.
- request rate: the requests finished between two scrapes (`vllm:request_success_total`, all
  finish reasons) over the seconds between them. A counter that went down was reset by a
  restart: its later value alone counts since then, and a note says the rate is a lower bound.
- concurrency: over a window, Little's law (e2e latency seconds finished in it / its seconds:
  the mean number of requests in the server); from one scrape, the running + waiting gauges.
- prefix-cache hit ratio: hit tokens / queried tokens (`vllm:prefix_cache_*_total`).

The trace (`synthetic_traces`): N = min(requests observed, MAX_SYNTHETIC_REQUESTS, max_requests).
Request j's length is the quantile at (j + u_j) / N, u_j ~ U(0, 1) seeded: stratified, so each
bucket holds its share of the N requests to within one. Then every length moves inside its own
bucket by the same fraction t of the way to its hi (t > 0) or lo (t < 0), t bisected until the
trace's mean is the exact mean, and lengths are rounded so that their sum is N x that mean
(largest remainders). Prompt and output lengths are paired at random: the histograms do not say
which go together, and the requests come in random order. The low and high traces put the same requests at their buckets' lo and hi.
The hit ratio becomes one prefix of P tokens shared by every request longer than P, P chosen so
that the shared share of prompt tokens is closest to the ratio: an assumption, said in the notes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np

from vtoken.endpoint import (
    GENERATION_TOKENS_HISTOGRAM, PROMPT_TOKENS_HISTOGRAM, EngineCounters, Histogram, LiveState,
)
from vtoken.errors import EndpointError
from vtoken.trace import Request, Trace

MAX_SYNTHETIC_REQUESTS = 256  # requests of a synthetic trace: enough for every bucket of a 1-2-5 histogram
EDGES = ("low", "mid", "high")  # the replays of a server workload: buckets' lo, interpolated, buckets' hi
SHARED_PREFIX_ID = "server-prefix"
TRACE_FORMAT = "server"  # Trace.format of a synthetic trace
_BISECTION_STEPS = 60


@dataclass(frozen=True)
class LengthStats:
    mean: float  # tokens
    p50: float
    p90: float


@dataclass(frozen=True)
class LengthDistribution:
    """Token lengths of finished requests from one histogram (module docstring: lo, hi, quantiles)."""

    metric: str  # vllm:request_prompt_tokens or vllm:request_generation_tokens
    bucket_tokens: tuple[tuple[int, int], ...]  # (lo, hi) integer lengths of each bucket
    cumulative_counts: tuple[float, ...]  # requests in this bucket and all before it
    mid: LengthStats  # mean exact (_sum / _count), quantiles interpolated
    low: LengthStats  # every request at its bucket's lo
    high: LengthStats  # every request at its bucket's hi

    @property
    def num_requests(self) -> float:
        return self.cumulative_counts[-1]

    def bucket_idx(self, q: float) -> int:
        """The bucket holding quantile q in [0, 1]: the first whose cumulative count reaches q x N."""
        rank = max(q * self.num_requests, math.ulp(self.num_requests))
        return int(np.searchsorted(self.cumulative_counts, rank, side="left"))

    def quantile(self, q: float) -> float:
        """Length at quantile q, linear inside its bucket's lo..hi."""
        idx = self.bucket_idx(q)
        below = self.cumulative_counts[idx - 1] if idx else 0.0
        lo, hi = self.bucket_tokens[idx]
        frac = (q * self.num_requests - below) / (self.cumulative_counts[idx] - below)
        return lo + (hi - lo) * min(max(frac, 0.0), 1.0)


@dataclass(frozen=True)
class ReplicaWorkload:
    """What one engine (or all of them together) served."""

    engine: str  # the engine label; "all" for the engines together, "" for an unlabelled server
    num_requests_observed: int  # finished requests: the prompt histogram's _count
    num_requests_by_reason: Mapping[str, float]  # vllm:request_success_total by finished_reason
    prompt_tokens: LengthDistribution | None  # None when nothing was served yet
    output_tokens: LengthDistribution | None
    prefix_cache_hit_ratio: float | None  # hit tokens / queried tokens
    request_rate_per_s: float | None  # over the window; None from one scrape
    concurrency: float | None  # mean requests in the server (module docstring); None: not known
    notes: tuple[str, ...]


@dataclass(frozen=True)
class ServerWorkload:
    url: str
    max_model_len: int | None
    window_s: float | None  # seconds between the two scrapes; None from one scrape
    replicas: tuple[ReplicaWorkload, ...]  # one per engine, in engine order
    total: ReplicaWorkload  # the engines together; concurrency is per engine (each has its own pool)


def derive_server_workload(first: LiveState, later: LiveState | None = None) -> ServerWorkload:
    """The workload of the server scraped as `first` (and `later`, a window after it). Pure.

    Lengths, hit ratio and gauges come from the latest scrape. Raises EndpointError, naming the
    URL and the metric, when a length histogram is absent or malformed.
    """
    last = later or first
    window_s = last.scraped_at_s - first.scraped_at_s if later is not None else None
    if window_s is not None and not window_s > 0:
        raise EndpointError(f"{first.url}: two scrapes {window_s:g} s apart give no rate")
    earlier = {c.engine: c for c in first.metrics.engines} if later is not None else {}
    max_model_len = last.max_model_len
    where = f"{last.url}/metrics"
    engines = last.metrics.engines
    replicas = tuple(_replica(where + (f" engine {c.engine}" if len(engines) > 1 else ""), c,
                              earlier.get(c.engine, _NOTHING), window_s, max_model_len) for c in engines)
    total = replicas[0]
    if len(replicas) > 1:
        merged_first = _merge(list(earlier.values()), "all") if earlier else _NOTHING
        total = _replica(where, _merge(list(engines), "all"), merged_first, window_s, max_model_len)
        total = replace(total, concurrency=None if total.concurrency is None else total.concurrency / len(replicas))
    return ServerWorkload(last.url, max_model_len, window_s, replicas, total)


def synthetic_traces(workload: ServerWorkload, replica: ReplicaWorkload, num_requests: int,
                     seed: int) -> dict[str, Trace]:
    """{"low", "mid", "high"}: `num_requests` requests following `replica`'s lengths (module docstring)."""
    assert replica.prompt_tokens is not None and replica.output_tokens is not None
    rng = np.random.default_rng(seed)
    prompts = _lengths(replica.prompt_tokens, num_requests, rng)
    outputs = _lengths(replica.output_tokens, num_requests, rng)
    # Stratified lengths come out sorted; the capacity search replays the first C requests, so
    # both are shuffled (the same way in every edge trace).
    prompt_order, output_order = rng.permutation(num_requests), rng.permutation(num_requests)
    is_one_of_several = len(workload.replicas) > 1 and replica.engine != "all"
    source = f"{workload.url}/metrics" + (f" engine {replica.engine}" if is_one_of_several else "")
    traces = {}
    for edge in EDGES:
        notes = list(replica.notes) + _trace_notes(replica, num_requests)
        requests = _requests(prompts[edge][prompt_order], outputs[edge][output_order], replica.prefix_cache_hit_ratio, notes)
        traces[edge] = Trace(requests, f"{source} ({edge})" if edge != "mid" else source, TRACE_FORMAT, tuple(notes))
    return traces


# ---- one engine's figures ----------------------------------------------------------------------


_NOTHING = EngineCounters("", None, None, {}, {}, None, None, None, None, None, None, None)


def _replica(where: str, now: EngineCounters, before: EngineCounters, window_s: float | None,
             max_model_len: int | None) -> ReplicaWorkload:
    notes: list[str] = []
    prompt = _distribution(where, now.prompt_tokens, PROMPT_TOKENS_HISTOGRAM, now, max_model_len, notes)
    output = _distribution(where, now.generation_tokens, GENERATION_TOKENS_HISTOGRAM, now, max_model_len, notes)
    rate = concurrency = None
    if window_s is not None:
        finished = _finished(now, before, notes)
        rate = finished / window_s
        latency_s = counter_delta(now.e2e_latency_s_total, before.e2e_latency_s_total, "vllm:e2e_request_latency_seconds_sum", notes)
        concurrency = latency_s / window_s if latency_s is not None else None
    elif None not in (now.num_requests_running, now.num_requests_waiting):
        concurrency = now.num_requests_running + now.num_requests_waiting
    hits, queries = now.num_prefix_cache_hits, now.num_prefix_cache_queries
    hit_ratio = hits / queries if hits is not None and queries else None
    return ReplicaWorkload(
        engine=now.engine, num_requests_observed=int(now.prompt_tokens.count), num_requests_by_reason=dict(
            now.num_requests_by_reason), prompt_tokens=prompt, output_tokens=output, prefix_cache_hit_ratio=hit_ratio,
        request_rate_per_s=rate, concurrency=concurrency, notes=tuple(notes),
    )


def _distribution(where: str, histogram: Histogram | None, metric: str, counters: EngineCounters,
                  max_model_len: int | None, notes: list[str]) -> LengthDistribution | None:
    if histogram is None:
        raise EndpointError(f"{where}: {counters.histogram_problems[metric]}; pass --trace to audit a workload of your own")
    if histogram.count == 0:
        return None
    buckets = _bucket_tokens(histogram.upper_bounds, max_model_len, metric, notes)
    cumulative = histogram.cumulative_counts
    counts = np.diff(cumulative, prepend=0.0)
    dist = LengthDistribution(metric, buckets, cumulative, LengthStats(0, 0, 0), LengthStats(0, 0, 0), LengthStats(0, 0, 0))
    lows, highs = (np.array([b[k] for b in buckets], dtype=float) for k in (0, 1))
    p50_idx, p90_idx = dist.bucket_idx(0.5), dist.bucket_idx(0.9)
    return replace(
        dist,
        mid=LengthStats(histogram.total / histogram.count, dist.quantile(0.5), dist.quantile(0.9)),
        low=LengthStats(float(counts @ lows) / histogram.count, float(lows[p50_idx]), float(lows[p90_idx])),
        high=LengthStats(float(counts @ highs) / histogram.count, float(highs[p50_idx]), float(highs[p90_idx])),
    )


def _bucket_tokens(upper_bounds: Sequence[float], max_model_len: int | None, metric: str,
                   notes: list[str]) -> tuple[tuple[int, int], ...]:
    finite = [b for b in upper_bounds if math.isfinite(b)]
    top = max_model_len
    if top is None:
        top = _next_125(finite[-1]) if finite else 1
        notes.append(f"{metric}: no max_model_len from /v1/models; its +Inf bucket is taken to end at {top}")
    buckets, lo = [], 1
    for bound in upper_bounds:
        hi = max(top if not math.isfinite(bound) else min(math.floor(bound), top), lo)
        buckets.append((lo, hi))
        if math.isfinite(bound):
            lo = max(lo, math.floor(bound) + 1)
    return tuple(buckets)


def _next_125(bound: float) -> int:
    """The 1-2-5 step after `bound` (vLLM's bucket sequence): 1000 -> 2000, 2000 -> 5000."""
    scale = 10 ** math.floor(math.log10(bound))
    return int(next(m * scale for m in (1, 2, 5, 10) if m * scale > bound))


def _finished(now: EngineCounters, before: EngineCounters, notes: list[str]) -> float:
    if now.num_requests_by_reason:
        reasons = sorted(now.num_requests_by_reason)
        total_now = sum(now.num_requests_by_reason[r] for r in reasons)
        total_before = sum(before.num_requests_by_reason.get(r, 0.0) for r in reasons) if before is not _NOTHING else None
        return counter_delta(total_now, total_before, "vllm:request_success_total", notes)
    before_count = before.prompt_tokens.count if before.prompt_tokens is not None else None
    notes.append("no vllm:request_success_total: the rate counts vllm:request_prompt_tokens_count")
    return counter_delta(now.prompt_tokens.count, before_count, PROMPT_TOKENS_HISTOGRAM + "_count", notes)


def counter_delta(now: float | None, before: float | None, name: str, notes: list[str]) -> float | None:
    """now - before for a counter; after a reset (it went down), `now` alone, with a note."""
    if now is None:
        return None
    if before is None:
        return now
    if now < before:
        notes.append(f"{name} fell from {before:g} to {now:g} between the scrapes (the server restarted): "
                     f"only the {now:g} since the restart count, so the rate is a lower bound")
        return now
    return now - before


def _merge(counters: list[EngineCounters], engine: str) -> EngineCounters:
    """The engines' series summed (histograms bucket by bucket: vLLM gives every engine the same buckets)."""
    def total(name: str) -> float | None:
        values = [getattr(c, name) for c in counters if getattr(c, name) is not None]
        return sum(values) if values else None

    reasons: dict[str, float] = {}
    for c in counters:
        for reason, value in c.num_requests_by_reason.items():
            reasons[reason] = reasons.get(reason, 0.0) + value
    problems = {k: f"engine {c.engine}: {v}" for c in counters for k, v in c.histogram_problems.items()}
    return EngineCounters(
        engine, _merge_histograms([c.prompt_tokens for c in counters]),
        _merge_histograms([c.generation_tokens for c in counters]), problems, reasons,
        *(total(name) for name in ("num_prompt_tokens", "num_generation_tokens", "num_prefix_cache_queries",
                                   "num_prefix_cache_hits", "num_requests_running", "num_requests_waiting",
                                   "e2e_latency_s_total")),
    )


def _merge_histograms(histograms: list[Histogram | None]) -> Histogram | None:
    if not histograms or any(h is None for h in histograms):
        return None
    bounds = sorted({b for h in histograms for b in h.upper_bounds})
    cumulative = [sum(_cumulative_at(h, b) for h in histograms) for b in bounds]
    return Histogram(tuple(bounds), tuple(cumulative), sum(h.total for h in histograms),
                     sum(h.count for h in histograms))


def _cumulative_at(histogram: Histogram, bound: float) -> float:
    idx = int(np.searchsorted(histogram.upper_bounds, bound, side="right")) - 1
    return histogram.cumulative_counts[idx] if idx >= 0 else 0.0


# ---- the synthetic trace -------------------------------------------------------------------------


def _lengths(dist: LengthDistribution, num_requests: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """{"low", "mid", "high"}: int64[num_requests] lengths, stratified; "mid" has the exact mean."""
    points = (np.arange(num_requests) + rng.random(num_requests)) / num_requests
    values = np.array([dist.quantile(q) for q in points])
    idx = np.array([dist.bucket_idx(q) for q in points])
    lows = np.array([dist.bucket_tokens[i][0] for i in idx], dtype=float)
    highs = np.array([dist.bucket_tokens[i][1] for i in idx], dtype=float)
    mid = _round_to_sum(_shift_to_mean(values, lows, highs, dist.mid.mean), dist.mid.mean * num_requests)
    return {"low": lows.astype(np.int64), "mid": mid, "high": highs.astype(np.int64)}


def _shift_to_mean(values: np.ndarray, lows: np.ndarray, highs: np.ndarray, mean: float) -> np.ndarray:
    """Move every value the same fraction t toward its hi (t > 0) or lo (t < 0) until the mean
    is `mean`; t stops at +-1 (all at hi or lo) when the sample cannot reach it."""
    def at(t: float) -> np.ndarray:
        return values + t * (highs - values) if t >= 0 else values + t * (values - lows)

    lo_t, hi_t = -1.0, 1.0
    for _ in range(_BISECTION_STEPS):
        mid_t = (lo_t + hi_t) / 2
        lo_t, hi_t = (mid_t, hi_t) if at(mid_t).mean() < mean else (lo_t, mid_t)
    return at((lo_t + hi_t) / 2)


def _round_to_sum(values: np.ndarray, target_sum: float) -> np.ndarray:
    """Integers within one of `values` (floor or ceil) summing to round(target_sum) where reachable."""
    floors = np.floor(values)
    num_up = int(round(target_sum - floors.sum()))
    fractions = values - floors
    num_up = min(max(num_up, 0), int(np.count_nonzero(fractions > 0)))
    up = np.argsort(-fractions, kind="stable")[:num_up]
    floors[up] += 1
    return floors.astype(np.int64)


def _requests(prompts: np.ndarray, outputs: np.ndarray, hit_ratio: float | None, notes: list[str]) -> tuple[Request, ...]:
    num_prefix = _shared_prefix_tokens(prompts, hit_ratio or 0.0)
    if hit_ratio:
        shared = int(np.count_nonzero(prompts > num_prefix)) if num_prefix else 0
        share = num_prefix * shared / prompts.sum()
        notes.append(f"prefix cache: {100 * hit_ratio:.1f}% of queried prompt tokens were hits; replayed as one "
                     f"prefix of {num_prefix} tokens shared by the {shared} requests longer than it "
                     f"({100 * share:.1f}% of prompt tokens): an assumption, the server's hits may come from many prefixes")
    return tuple(
        Request(f"server-{j}", 0.0, int(p), int(o), prefix_id=SHARED_PREFIX_ID if num_prefix and p > num_prefix else None,
                num_prefix_tokens=num_prefix if num_prefix and p > num_prefix else 0)
        for j, (p, o) in enumerate(zip(prompts, outputs, strict=True))
    )


def _shared_prefix_tokens(prompts: np.ndarray, hit_ratio: float) -> int:
    """P whose share of prompt tokens, P x #(prompts > P) / all prompt tokens, is closest to hit_ratio."""
    if hit_ratio <= 0:
        return 0
    ordered = np.sort(prompts)
    candidates = np.arange(int(ordered[-1]))  # P = 0 .. longest - 1
    num_longer = ordered.size - np.searchsorted(ordered, candidates, side="right")
    share = candidates * num_longer / ordered.sum()
    return int(candidates[np.argmin(np.abs(share - hit_ratio))])


def _trace_notes(replica: ReplicaWorkload, num_requests: int) -> list[str]:
    return [f"{num_requests} synthetic requests following the server's {replica.num_requests_observed} finished "
            "requests' prompt and generation length histograms (exact means, quantiles interpolated inside "
            "buckets); prompt and output lengths paired at random"]
