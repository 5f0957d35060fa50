"""`vtoken audit URL --watch`: a running deployment's load, one scrape of every replica per tick.

    scrape_all(urls, timeout_s)    every replica scraped at the same moment, one thread each
    Watch(urls, timeout_s)
        .ticks(interval_s)         -> WatchTick per interval: each replica's state, and its rates
                                      since its previous answer
        .summary()                 -> WatchSummary: what the whole watch saw, per replica

What a tick shows, per replica (engines of a data-parallel server summed; KV usage their mean):

- gauges as scraped: KV usage, requests running and waiting, preemptions since the start;
- rates between the replica's last two answers: counter deltas (`workload.counter_delta`: a
  counter that fell was reset by a restart, only its later value counts, and the tick says so)
  over the seconds between the two scrapes; prompt and generation tokens per second,
  preemptions in the interval, the prefix-cache hit ratio of the tokens queried in it;
- on a vToken-enabled server (`vtoken_*` metrics, vtoken/engine/vllm/metrics.py): F now
  (1 - live tokens / (allocated blocks x S), over all engines), F over the interval
  (1 - d live_token_seconds / d allocated_token_seconds), the block-utilization histogram when
  the server exports one (`vtoken_block_utilization_blocks{bin}`), tokens moved and blocks
  reclaimed, in all and per second.

A replica that does not answer is a tick with its error; its next answer's rates span the gap.
The summary adds every tick's deltas (so a reset in the middle loses nothing seen before it).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from vtoken.audit.workload import counter_delta
from vtoken.endpoint import LiveState, scrape
from vtoken.http_get import redact_url
from vtoken.errors import EndpointError

UTILIZATION_METRIC = "vtoken_block_utilization_blocks"  # one gauge per bin label "0".."9": tenths of u


def scrape_all(urls: Sequence[str], timeout_s: float) -> list[LiveState | EndpointError]:
    """Scrape every URL at once (one thread each): a LiveState or the EndpointError it raised,
    in the order of `urls`. A ConfigError (a URL unusable before any network access) is raised."""
    if len(urls) == 1:
        return [_try_scrape(urls[0], timeout_s)]
    with ThreadPoolExecutor(max_workers=len(urls), thread_name_prefix="scrape") as pool:
        return list(pool.map(lambda url: _try_scrape(url, timeout_s), urls))


def _try_scrape(url: str, timeout_s: float) -> LiveState | EndpointError:
    try:
        return scrape(url, timeout_s)
    except EndpointError as exc:
        return exc


@dataclass(frozen=True)
class VTokenTick:
    """What a vToken-enabled replica reports (module docstring); counts summed over engines."""

    waste_ratio: float | None  # F now
    waste_ratio_interval: float | None  # F over the interval; None on the first tick
    utilization_histogram: tuple[float, ...] | None  # share of allocated blocks per tenth of u; None: not exported
    num_tokens_moved: float  # since the engine started
    num_blocks_reclaimed: float
    tokens_moved_per_s: float | None
    blocks_reclaimed_per_s: float | None


@dataclass(frozen=True)
class ReplicaTick:
    url: str  # credentials removed
    error: str | None  # why the replica did not answer; None when it did
    interval_s: float | None = None  # seconds since its previous answer; None on its first
    kv_cache_usage: float | None = None  # 0..1
    num_requests_running: float | None = None
    num_requests_waiting: float | None = None
    num_preemptions: float | None = None  # since the server started
    num_preemptions_in_interval: float | None = None
    prompt_tokens_per_s: float | None = None
    generation_tokens_per_s: float | None = None
    prefix_cache_hit_ratio: float | None = None  # hit / queried tokens in the interval; None: none queried
    vtoken: VTokenTick | None = None
    notes: tuple[str, ...] = ()  # counter resets seen at this tick
    # counter deltas over the interval (prompt_tokens, generation_tokens, prefix_cache_queries,
    # prefix_cache_hits, preemptions; on vToken: tokens_moved, blocks_reclaimed, live_token_seconds,
    # allocated_token_seconds): what the summary adds up
    deltas: Mapping[str, float] = field(default_factory=dict)

    @property
    def is_up(self) -> bool:
        return self.error is None


@dataclass(frozen=True)
class WatchTick:
    elapsed_s: float  # since the watch started
    replicas: tuple[ReplicaTick, ...]  # in the order of the URLs


@dataclass(frozen=True)
class ReplicaSummary:
    url: str
    num_ticks: int
    num_answered: int
    is_up_at_end: bool
    last_error: str | None
    observed_s: float  # seconds covered by the rates (sum of the intervals)
    num_prompt_tokens: float  # summed over the intervals
    num_generation_tokens: float
    num_preemptions: float
    prefix_cache_hit_ratio: float | None
    peak_kv_cache_usage: float | None
    max_requests_running: float | None
    max_requests_waiting: float | None
    num_resets: int  # counter resets seen (server restarts)
    num_tokens_moved: float | None  # vToken servers only
    num_blocks_reclaimed: float | None
    waste_ratio: float | None  # F over the watch, from the integrals

    @property
    def prompt_tokens_per_s(self) -> float | None:
        return self.num_prompt_tokens / self.observed_s if self.observed_s > 0 else None

    @property
    def generation_tokens_per_s(self) -> float | None:
        return self.num_generation_tokens / self.observed_s if self.observed_s > 0 else None


@dataclass(frozen=True)
class WatchSummary:
    elapsed_s: float
    num_ticks: int
    replicas: tuple[ReplicaSummary, ...]


@dataclass
class _Totals:
    """One replica's running sums over the watch."""

    num_ticks: int = 0
    num_answered: int = 0
    last_error: str | None = None
    observed_s: float = 0.0
    sums: dict[str, float] = field(default_factory=dict)
    peaks: dict[str, float] = field(default_factory=dict)
    num_resets: int = 0
    is_vtoken: bool = False

    def add(self, key: str, value: float | None) -> None:
        if value is not None:
            self.sums[key] = self.sums.get(key, 0.0) + value

    def peak(self, key: str, value: float | None) -> None:
        if value is not None:
            self.peaks[key] = max(self.peaks.get(key, value), value)


class Watch:
    """The state of one watch: each replica's last answer and its running sums."""

    def __init__(self, urls: Sequence[str], timeout_s: float, clock: Callable[[], float] = time.monotonic,
                 scraper: Callable[[Sequence[str], float], list[LiveState | EndpointError]] | None = None) -> None:
        self.urls, self.timeout_s, self.clock = list(urls), timeout_s, clock
        self.scraper = scraper or scrape_all
        self.started_s = clock()
        self._last: dict[int, LiveState] = {}
        self._totals = [_Totals() for _ in self.urls]
        self.num_ticks = 0

    def ticks(self, interval_s: float, sleep: Callable[[float], None] = time.sleep) -> Iterator[WatchTick]:
        """One tick every `interval_s`, forever (the caller stops it). Raises EndpointError when
        no replica answers the first scrape."""
        while True:
            tick_started_s = self.clock()
            samples = self.scraper(self.urls, self.timeout_s)
            if self.num_ticks == 0 and all(isinstance(s, EndpointError) for s in samples):
                raise EndpointError("no replica answered: " + "; ".join(str(s) for s in samples)
                                    if len(samples) > 1 else str(samples[0]))
            yield self.update(samples)
            sleep(max(0.0, tick_started_s + interval_s - self.clock()))

    def update(self, samples: Sequence[LiveState | EndpointError]) -> WatchTick:
        """The tick of one scrape of every replica (in URL order); updates the sums."""
        self.num_ticks += 1
        replicas = tuple(self._replica_tick(idx, sample) for idx, sample in enumerate(samples))
        return WatchTick(self.clock() - self.started_s, replicas)

    def _replica_tick(self, idx: int, sample: LiveState | EndpointError) -> ReplicaTick:
        totals = self._totals[idx]
        totals.num_ticks += 1
        if isinstance(sample, EndpointError):
            totals.last_error = str(sample)
            return ReplicaTick(redact_url(self.urls[idx]), str(sample))
        totals.num_answered += 1
        totals.last_error = None
        tick = replica_tick(sample, self._last.get(idx))
        self._last[idx] = sample
        _accumulate(totals, tick)
        return tick

    def summary(self) -> WatchSummary:
        return WatchSummary(self.clock() - self.started_s, self.num_ticks,
                            tuple(_summary(redact_url(url), t) for url, t in zip(self.urls, self._totals, strict=True)))


def replica_tick(now: LiveState, before: LiveState | None) -> ReplicaTick:
    """One replica's tick from its scrape `now` and its previous answer `before` (None: first). Pure."""
    m = now.metrics
    if before is None:
        return ReplicaTick(now.url, None, None, m.kv_cache_usage, m.num_requests_running, m.num_requests_waiting,
                           m.num_preemptions, vtoken=_vtoken_tick(now, None, None, {}, []))
    interval_s = now.scraped_at_s - before.scraped_at_s
    notes: list[str] = []
    earlier = {c.engine: c for c in before.metrics.engines}
    deltas: dict[str, float] = {}
    for key, (name, attr) in _ENGINE_COUNTERS.items():
        # Each engine's own delta (an engine new since `before` counts whole), summed.
        values = [counter_delta(getattr(c, attr), getattr(earlier[c.engine], attr) if c.engine in earlier else None,
                                name, notes) for c in m.engines]
        values = [v for v in values if v is not None]
        if values:
            deltas[key] = sum(values)
    preemptions = counter_delta(m.num_preemptions, before.metrics.num_preemptions, "vllm:num_preemptions_total", notes)
    if preemptions is not None:
        deltas["preemptions"] = preemptions
    vtoken = _vtoken_tick(now, before, interval_s, deltas, notes)
    queries = deltas.get("prefix_cache_queries")
    return ReplicaTick(
        now.url, None, interval_s, m.kv_cache_usage, m.num_requests_running, m.num_requests_waiting, m.num_preemptions,
        preemptions, _rate(deltas.get("prompt_tokens"), interval_s), _rate(deltas.get("generation_tokens"), interval_s),
        deltas["prefix_cache_hits"] / queries if queries and "prefix_cache_hits" in deltas else None,
        vtoken, tuple(notes), deltas,
    )


# (vLLM counter, EngineCounters attribute) of each per-engine delta a tick keeps
_ENGINE_COUNTERS = {
    "prompt_tokens": ("vllm:prompt_tokens_total", "num_prompt_tokens"),
    "generation_tokens": ("vllm:generation_tokens_total", "num_generation_tokens"),
    "prefix_cache_queries": ("vllm:prefix_cache_queries_total", "num_prefix_cache_queries"),
    "prefix_cache_hits": ("vllm:prefix_cache_hits_total", "num_prefix_cache_hits"),
}
# (vToken counter) of each delta a vToken server's tick keeps
_VTOKEN_COUNTERS = {
    "tokens_moved": "vtoken_tokens_moved_total",
    "blocks_reclaimed": "vtoken_blocks_reclaimed_total",
    "live_token_seconds": "vtoken_live_token_seconds_total",
    "allocated_token_seconds": "vtoken_allocated_token_seconds_total",
}


# ---- vToken's metrics ------------------------------------------------------------------------------


def vtoken_series(metrics: Mapping[str, float], name: str) -> list[float]:
    """Every series of `name` in `ServerMetrics.vtoken_metrics` (one per engine, or per label set)."""
    return [v for k, v in metrics.items() if k == name or k.startswith(name + "{")]


def vtoken_total(metrics: Mapping[str, float], name: str) -> float | None:
    values = vtoken_series(metrics, name)
    return sum(values) if values else None


def utilization_histogram(metrics: Mapping[str, float]) -> tuple[float, ...] | None:
    """Share of allocated blocks per tenth of u = live / S, from `vtoken_block_utilization_blocks`
    (blocks per bin, summed over engines); None when the server exports none or holds no block."""
    bins = [0.0] * 10
    found = False
    for key, value in metrics.items():
        if key.startswith(UTILIZATION_METRIC + "{") and 'bin="' in key:
            bin_label = key.split('bin="', 1)[1].split('"', 1)[0]
            if bin_label.isdigit() and int(bin_label) < len(bins):
                bins[int(bin_label)] += value
                found = True
    total = sum(bins)
    return tuple(b / total for b in bins) if found and total > 0 else None


def waste_ratio_now(live: LiveState) -> float | None:
    """F = 1 - live tokens / (allocated blocks x S) over every engine of a vToken server; None
    without its gauges or when it holds no block."""
    metrics = live.metrics.vtoken_metrics
    live_tokens = vtoken_total(metrics, "vtoken_live_tokens")
    blocks = vtoken_total(metrics, "vtoken_allocated_blocks")
    block_size = live.cache_config.block_size
    if live_tokens is None or not blocks or block_size is None:
        return None
    return 1.0 - live_tokens / (blocks * block_size)


def _vtoken_tick(now: LiveState, before: LiveState | None, interval_s: float | None, deltas: dict[str, float],
                 notes: list[str]) -> VTokenTick | None:
    """The vToken part of a tick; adds its counters' deltas to `deltas`."""
    metrics = now.metrics.vtoken_metrics
    if not metrics:
        return None
    if before is not None:
        for key, name in _VTOKEN_COUNTERS.items():
            delta = counter_delta(vtoken_total(metrics, name), vtoken_total(before.metrics.vtoken_metrics, name),
                                  name, notes)
            if delta is not None:
                deltas[key] = delta
    allocated_s = deltas.get("allocated_token_seconds")
    return VTokenTick(
        waste_ratio_now(now), 1.0 - deltas["live_token_seconds"] / allocated_s if allocated_s else None,
        utilization_histogram(metrics), vtoken_total(metrics, "vtoken_tokens_moved_total") or 0.0,
        vtoken_total(metrics, "vtoken_blocks_reclaimed_total") or 0.0,
        _rate(deltas.get("tokens_moved"), interval_s), _rate(deltas.get("blocks_reclaimed"), interval_s),
    )


# ---- the summary -----------------------------------------------------------------------------------


def _accumulate(totals: _Totals, tick: ReplicaTick) -> None:
    totals.peak("kv_cache_usage", tick.kv_cache_usage)
    totals.peak("running", tick.num_requests_running)
    totals.peak("waiting", tick.num_requests_waiting)
    totals.num_resets += len(tick.notes)
    totals.is_vtoken = totals.is_vtoken or tick.vtoken is not None
    if tick.interval_s is not None:
        totals.observed_s += tick.interval_s
    for key, value in tick.deltas.items():
        totals.add(key, value)


def _summary(url: str, t: _Totals) -> ReplicaSummary:
    def ratio(numerator: str, denominator: str) -> float | None:
        return t.sums.get(numerator, 0.0) / t.sums[denominator] if t.sums.get(denominator) else None

    live_share = ratio("live_token_seconds", "allocated_token_seconds")
    return ReplicaSummary(
        url, t.num_ticks, t.num_answered, t.num_ticks > 0 and t.last_error is None, t.last_error, t.observed_s,
        t.sums.get("prompt_tokens", 0.0), t.sums.get("generation_tokens", 0.0), t.sums.get("preemptions", 0.0),
        ratio("prefix_cache_hits", "prefix_cache_queries"), t.peaks.get("kv_cache_usage"), t.peaks.get("running"),
        t.peaks.get("waiting"), t.num_resets, t.sums.get("tokens_moved", 0.0) if t.is_vtoken else None,
        t.sums.get("blocks_reclaimed", 0.0) if t.is_vtoken else None,
        1.0 - live_share if t.is_vtoken and live_share is not None else None,
    )


def _rate(amount: float | None, interval_s: float | None) -> float | None:
    if amount is None or not interval_s or interval_s <= 0:
        return None
    return amount / interval_s
