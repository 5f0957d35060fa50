"""vtoken_* Prometheus metrics of a vToken-enabled vLLM engine. No vLLM import.

The scheduler runs in vLLM's engine-core process while `/metrics` is served by the API server
process, so the metrics travel one of two ways:

- `PROMETHEUS_MULTIPROC_DIR` set before the server starts (`vtoken serve` sets it; vLLM then
  reads that directory for `/metrics`): prometheus_client's multiprocess mode, every value
  written here lands in a file the API server collects;
- otherwise, on a plain launch: the plugin, in the API server process before the engine core
  starts, names a file in `$VTOKEN_METRICS_FILE` and registers a `FileCollector` for it in
  prometheus_client's default registry (the one vLLM's `/metrics` serves without the
  multiprocess directory); the engine core writes the private registry's exposition text there
  (atomically, at most every EXPORT_INTERVAL_S and whenever the last request leaves).

In-process engines (tests) keep the metrics in a private registry, `EngineMetrics.registry`,
and `render()` gives their exposition text.

    vtoken_info{variant,policy,budget,reclaim_mode,theta_f,block_size}   1
    vtoken_waste_ratio           F (Eq. 1) over vLLM's allocated blocks, 0..1
    vtoken_live_tokens           live KV tokens of the running requests
    vtoken_allocated_blocks      blocks allocated in vLLM's pool
    vtoken_running_requests      requests with a token table
    vtoken_waste_ratio_mean      F averaged over the engine's lifetime, weighted by time
    vtoken_block_utilization_blocks{bin}   vLLM's allocated blocks whose u = live / S is in
                                 tenth `bin` ("0": [0, .1), ..., "9": [.9, 1.0]); the blocks vLLM
                                 holds that the compaction emptied count in bin 0
    vtoken_live_token_seconds_total, vtoken_allocated_token_seconds_total
                                 integrals of live tokens and of allocated capacity (blocks x S)
                                 over time: the mean F over any window between two scrapes is
                                 1 - d(live_token_seconds) / d(allocated_token_seconds)
    vtoken_tokens_evicted_total, vtoken_tokens_moved_total, vtoken_blocks_reclaimed_total,
    vtoken_relocation_events_total, vtoken_eviction_events_total, vtoken_preemptions_total,
    vtoken_invariant_violations_total
"""

from __future__ import annotations

import os
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from vtoken.engine.vllm.settings import VllmSettings
from vtoken.engine.vllm.tracker import EngineStats

_GAUGES = {
    "waste_ratio": "Intra-block waste F = 1 - live tokens / (allocated blocks x block size)",
    "live_tokens": "Live KV tokens of the running requests",
    "allocated_blocks": "KV blocks allocated in vLLM's pool",
    "running_requests": "Requests holding a token table",
    "waste_ratio_mean": "Time-weighted mean of the waste ratio F since the engine started",
}
_COUNTERS = {
    "tokens_evicted": "Tokens the eviction policy removed",
    "tokens_moved": "Tokens whose K/V was copied to another slot",
    "blocks_reclaimed": "Blocks handed back to vLLM's pool after eviction",
    "relocation_events": "Compactions that moved at least one token",
    "eviction_events": "Times the policy evicted tokens from a request",
    "preemptions": "Requests whose token table was dropped by a preemption",
    "invariant_violations": "Invariant checks that failed",
}
METRICS_FILE_ENV = "VTOKEN_METRICS_FILE"
EXPORT_INTERVAL_S = 0.5

_INTEGRALS = {
    "live_token_seconds": "Live KV tokens integrated over time (token x seconds)",
    "allocated_token_seconds": "Allocated KV capacity, blocks x block size, integrated over time (token x seconds)",
}


class EngineMetrics:
    def __init__(self, settings: VllmSettings, model_name: object) -> None:
        self.is_multiprocess = "PROMETHEUS_MULTIPROC_DIR" in os.environ
        # In multiprocess mode nothing is registered: the API server collects the files.
        self.registry = None if self.is_multiprocess else CollectorRegistry()
        name = model_name[0] if isinstance(model_name, (list, tuple)) else str(model_name)
        labels = {"model_name": name}
        info = Gauge("vtoken_info", "vToken settings of this engine", list(labels) + _INFO_LABELS,
                     registry=self.registry, multiprocess_mode="livemax")
        info.labels(**labels, **_info_values(settings)).set(1)
        self._gauges = {
            key: Gauge(f"vtoken_{key}", text, list(labels), registry=self.registry,
                       multiprocess_mode="livemostrecent").labels(**labels)
            for key, text in _GAUGES.items()
        }
        self._counters = {
            key: Counter(f"vtoken_{key}", text, list(labels), registry=self.registry).labels(**labels)
            for key, text in _COUNTERS.items()
        }
        self._utilization = Gauge("vtoken_block_utilization_blocks", "Allocated KV blocks per tenth of block "
                                  "utilization u = live / block size", list(labels) + ["bin"], registry=self.registry,
                                  multiprocess_mode="livemostrecent")
        self._labels = labels
        self._integrals = {
            key: Counter(f"vtoken_{key}", text, list(labels), registry=self.registry).labels(**labels)
            for key, text in _INTEGRALS.items()
        }
        self._last_counts = dict.fromkeys(_COUNTERS, 0)
        self._sums = dict.fromkeys(_INTEGRALS, 0.0)
        self._last_time_s: float | None = None
        self.last_stats: EngineStats | None = None
        self.export_path = None if self.is_multiprocess else os.environ.get(METRICS_FILE_ENV)
        self._last_export_s = float("-inf")

    def observe(self, stats: EngineStats, now_s: float | None = None) -> None:
        """Record the state after a step; the previous state is weighted by the time since."""
        now_s = time.monotonic() if now_s is None else now_s
        if self.last_stats is not None and self._last_time_s is not None and now_s > self._last_time_s:
            elapsed_s = now_s - self._last_time_s
            previous = self.last_stats
            self._add_integral("live_token_seconds", previous.num_live_tokens * elapsed_s)
            self._add_integral("allocated_token_seconds", previous.num_allocated_blocks * previous.block_size * elapsed_s)
        if self._sums["allocated_token_seconds"] > 0:
            mean = 1.0 - self._sums["live_token_seconds"] / self._sums["allocated_token_seconds"]
            self._gauges["waste_ratio_mean"].set(mean)
        self._last_time_s = now_s
        self.last_stats = stats
        self._gauges["waste_ratio"].set(stats.waste_ratio)
        self._gauges["live_tokens"].set(stats.num_live_tokens)
        self._gauges["allocated_blocks"].set(stats.num_allocated_blocks)
        self._gauges["running_requests"].set(stats.num_running_requests)
        for bin_idx, num_blocks in enumerate(stats.utilization_histogram):
            self._utilization.labels(**self._labels, bin=str(bin_idx)).set(num_blocks)
        for key, counter in self._counters.items():
            value = getattr(stats.counters, key)
            if value > self._last_counts[key]:
                counter.inc(value - self._last_counts[key])
                self._last_counts[key] = value
        if self.export_path and (now_s - self._last_export_s >= EXPORT_INTERVAL_S or not stats.num_running_requests
                                 or stats.counters.invariant_violations):
            self.export(now_s)

    def export(self, now_s: float) -> None:
        """Write the exposition text to `export_path` (the plain-launch route to `/metrics`)."""
        temporary = f"{self.export_path}.{os.getpid()}.tmp"
        with open(temporary, "w") as out:
            out.write(self.render())
        os.replace(temporary, self.export_path)
        self._last_export_s = now_s

    def _add_integral(self, key: str, amount: float) -> None:
        if amount > 0:
            self._integrals[key].inc(amount)
            self._sums[key] += amount

    def render(self) -> str:
        """Exposition text of the private registry ('' in multiprocess mode)."""
        return generate_latest(self.registry).decode() if self.registry is not None else ""


_INFO_LABELS = ["variant", "policy", "budget", "reclaim_mode", "theta_f", "interval_tokens"]


def _info_values(settings: VllmSettings) -> dict[str, str]:
    return {
        "variant": settings.variant,
        "policy": settings.eviction.policy if settings.evicts else "none",
        "budget": settings.eviction.budget.describe(),
        "reclaim_mode": settings.reclaim.mode,
        "theta_f": f"{settings.reclaim.theta_f:g}",
        "interval_tokens": str(settings.eviction.interval_tokens),
    }


class FileCollector:
    """A prometheus_client collector of the metric families in an exposition-text file (the
    engine core's vtoken_* metrics, for the API server's default registry)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def collect(self):
        try:
            with open(self.path) as source:
                text = source.read()
        except FileNotFoundError:  # the engine has not finished a step yet
            return
        yield from text_string_to_metric_families(text)
