"""Per-iteration recording of memory state and per-request latencies -> `RunResult`.

Definitions (also printed by `vtoken compare --explain`):

- waste ratio F (Eq. 1): 1 - live tokens / (allocated blocks x S), time-weighted over the run.
- utilization histogram: fraction of allocated blocks whose u = live/S falls in each tenth,
  time-weighted; `frac_blocks_le_half` is the fraction with u <= 0.5.
- retained blocks per request: allocated blocks / resident requests, time-weighted.
- memory utilization: live tokens / allocated token capacity (= 1 - F), time-weighted.
- trapped bytes: (allocated capacity - live tokens) x KV bytes per token, time-weighted mean.
- throughput: output tokens / makespan (first arrival to last completion).
- latency: per-request end-to-end (arrival to last token), TTFT (arrival to first token),
  TPOT ((end - first token) / (output tokens - 1), requests with more than one output token).
- percentiles: numpy's linear interpolation between closest ranks ("linear" method).

Samples are taken at the end of each iteration and weighted by the time until the next one:
the state the memory sits in during the next forward.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from vtoken.kv.block_pool import NUM_HISTOGRAM_BINS, BlockPool

PERCENTILE_METHOD = "linear"
MAX_TIMELINE_POINTS = 2000


@dataclass(frozen=True)
class LatencyStats:
    p50_s: float
    p95_s: float
    p99_s: float
    mean_s: float

    @classmethod
    def of(cls, values_s: list[float]) -> "LatencyStats":
        if not values_s:
            return cls(float("nan"), float("nan"), float("nan"), float("nan"))
        p50, p95, p99 = np.percentile(values_s, [50, 95, 99], method=PERCENTILE_METHOD)
        return cls(float(p50), float(p95), float(p99), float(np.mean(values_s)))


@dataclass(frozen=True)
class Timeline:
    """Downsampled memory state over simulated time (for plots and `--output`)."""

    time_s: np.ndarray
    waste_ratio: np.ndarray
    allocated_blocks: np.ndarray
    live_tokens: np.ndarray
    running_requests: np.ndarray


@dataclass(frozen=True)
class RunResult:
    variant: str
    policy: str
    num_requests: int
    num_completed: int
    skipped: tuple[tuple[str, str], ...]
    waste_ratio: float
    frac_blocks_le_half: float
    utilization_histogram: tuple[float, ...]
    retained_blocks_per_request: float
    peak_allocated_blocks: int
    memory_utilization: float
    trapped_bytes: float
    peak_trapped_bytes: float
    throughput_tok_s: float
    latency: LatencyStats
    ttft: LatencyStats
    tpot: LatencyStats
    makespan_s: float
    preemptions: int
    tokens_evicted: int
    tokens_moved: int
    blocks_reclaimed: int
    relocation_events: int
    num_iterations: int
    num_decode_steps: int
    host_time_s: float
    timeline: Timeline = field(repr=False, compare=False)

    def headline(self) -> dict[str, float]:
        """The figures `compare --json` reports per variant (and repeats average)."""
        return {
            "waste_ratio": self.waste_ratio,
            "frac_blocks_le_half": self.frac_blocks_le_half,
            "retained_blocks_per_request": self.retained_blocks_per_request,
            "memory_utilization": self.memory_utilization,
            "trapped_bytes": self.trapped_bytes,
            "throughput_tok_s": self.throughput_tok_s,
            "latency_p50_s": self.latency.p50_s,
            "latency_p95_s": self.latency.p95_s,
            "latency_p99_s": self.latency.p99_s,
            "ttft_p95_s": self.ttft.p95_s,
            "tpot_p95_s": self.tpot.p95_s,
            "preemptions": float(self.preemptions),
            "tokens_moved": float(self.tokens_moved),
            "blocks_reclaimed": float(self.blocks_reclaimed),
        }


class Recorder:
    """Accumulates time-weighted memory state and request completions during a run."""

    def __init__(self, pool: BlockPool, kv_bytes_per_token: int) -> None:
        self.pool = pool
        self.kv_bytes_per_token = kv_bytes_per_token
        self._last: tuple | None = None
        self._weight_s = 0.0
        self._sums = np.zeros(5)  # F, le_half, blocks per request, trapped bytes, memory utilization
        self._weighted_histogram = np.zeros(NUM_HISTOGRAM_BINS)
        self._timeline: list[tuple[float, float, int, int, int]] = []
        self.peak_allocated_blocks = 0
        self.peak_trapped_bytes = 0.0
        self.latencies_s: list[float] = []
        self.ttfts_s: list[float] = []
        self.tpots_s: list[float] = []
        self.num_output_tokens = 0
        self.first_arrival_s: float | None = None
        self.last_finish_s = 0.0
        self.tokens_evicted = 0
        self.tokens_moved = 0
        self.blocks_reclaimed = 0
        self.relocation_events = 0

    def sample(self, now_s: float, num_running: int) -> None:
        """Close the previous sample's interval at `now_s` and open a new one."""
        pool = self.pool
        if self._last is not None:
            self._accumulate(now_s)
        num_allocated = pool.num_allocated_blocks
        trapped = (num_allocated * pool.block_size - pool.num_live_tokens) * self.kv_bytes_per_token
        histogram = pool.utilization_histogram()
        fractions = histogram / num_allocated if num_allocated else np.zeros(NUM_HISTOGRAM_BINS)
        values = np.array([
            pool.waste_ratio(),
            pool.frac_blocks_le_half(),
            num_allocated / num_running if num_running else 0.0,
            trapped,
            1.0 - pool.waste_ratio() if num_allocated else 0.0,
        ])
        self._last = (now_s, values, fractions, num_running > 0)
        self.peak_allocated_blocks = max(self.peak_allocated_blocks, num_allocated)
        self.peak_trapped_bytes = max(self.peak_trapped_bytes, float(trapped))
        self._timeline.append((now_s, float(values[0]), num_allocated, pool.num_live_tokens, num_running))

    def _accumulate(self, now_s: float) -> None:
        start_s, values, fractions, is_busy = self._last
        duration_s = now_s - start_s
        if duration_s > 0 and is_busy:  # idle gaps (no resident request) do not dilute averages
            self._weight_s += duration_s
            self._sums += duration_s * values
            self._weighted_histogram += duration_s * fractions

    def record_finish(self, arrival_s: float, first_token_s: float, finish_s: float, num_output_tokens: int) -> None:
        self.latencies_s.append(finish_s - arrival_s)
        self.ttfts_s.append(first_token_s - arrival_s)
        if num_output_tokens > 1:
            self.tpots_s.append((finish_s - first_token_s) / (num_output_tokens - 1))
        self.num_output_tokens += num_output_tokens
        self.last_finish_s = max(self.last_finish_s, finish_s)

    def record_arrival(self, arrival_s: float) -> None:
        if self.first_arrival_s is None or arrival_s < self.first_arrival_s:
            self.first_arrival_s = arrival_s

    def timeline(self) -> Timeline:
        points = np.array(self._timeline, dtype=np.float64).reshape(-1, 5)
        if len(points) > MAX_TIMELINE_POINTS:
            points = points[np.linspace(0, len(points) - 1, MAX_TIMELINE_POINTS).astype(int)]
        return Timeline(points[:, 0], points[:, 1], points[:, 2].astype(int), points[:, 3].astype(int), points[:, 4].astype(int))

    def means(self) -> tuple[np.ndarray, np.ndarray]:
        """Time-weighted (F, le_half, blocks/request, trapped bytes, memory util) and histogram."""
        if self._weight_s == 0:
            return np.zeros(5), np.zeros(NUM_HISTOGRAM_BINS)
        return self._sums / self._weight_s, self._weighted_histogram / self._weight_s

    @property
    def makespan_s(self) -> float:
        return self.last_finish_s - (self.first_arrival_s or 0.0)
