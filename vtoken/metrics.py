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
- per-request records (`RunResult.requests`): arrival, first token and finish times, TTFT,
  end-to-end, prompt and output tokens and preemptions of every finished request.
- percentiles: numpy's linear interpolation between closest ranks ("linear" method).

Samples are taken at the end of each iteration and weighted by the time until the next one:
the state the memory sits in during the next forward.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING

import numpy as np

from vtoken.kv.block_pool import NUM_HISTOGRAM_BINS, BlockPool, waste_ratio

if TYPE_CHECKING:
    from vtoken.trace import Request

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
class RequestRecord:
    """One finished request. Times are seconds on the run's clock (simulated for the sim, wall
    clock from the replay's start for vLLM); `arrival_s` is when it entered the engine."""

    request_id: str
    arrival_s: float
    first_token_s: float
    finish_s: float
    num_prompt_tokens: int
    num_output_tokens: int
    num_preemptions: int  # times it was preempted (recomputed) before it finished

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.arrival_s

    @property
    def e2e_s(self) -> float:
        return self.finish_s - self.arrival_s


@dataclass(frozen=True)
class Timeline:
    """Downsampled memory state over simulated time (for plots and `--output`)."""

    time_s: np.ndarray
    waste_ratio: np.ndarray
    allocated_blocks: np.ndarray
    live_tokens: np.ndarray
    running_requests: np.ndarray


@dataclass(frozen=True)
class MemorySample:
    """The KV memory state at one instant: what the recorder weighs over time.

    The sim and hf executors sample their block pool (`of_pool`); the vLLM executor counts the
    blocks vLLM holds for its requests, which may be more than the token tables hold.
    """

    num_allocated_blocks: int
    num_live_tokens: int
    block_size: int
    histogram: np.ndarray  # int64 [NUM_HISTOGRAM_BINS]: allocated blocks per tenth of u = live / S
    num_blocks_le_half: int

    @classmethod
    def of_pool(cls, pool: BlockPool) -> "MemorySample":
        return cls(pool.num_allocated_blocks, pool.num_live_tokens, pool.block_size, pool.utilization_histogram(),
                   pool.num_blocks_le_half)

    @property
    def waste_ratio(self) -> float:
        return waste_ratio(self.num_live_tokens, self.num_allocated_blocks, self.block_size)

    @property
    def frac_blocks_le_half(self) -> float:
        return self.num_blocks_le_half / self.num_allocated_blocks if self.num_allocated_blocks else 0.0


@dataclass(frozen=True)
class RunCounters:
    """What a run did to KV memory, counted by whoever owns the token tables (the runtime or
    the vLLM scheduler's tracker). `plus` returns the counters with some incremented."""

    tokens_evicted: int = 0
    eviction_events: int = 0
    tokens_moved: int = 0
    blocks_reclaimed: int = 0
    relocation_events: int = 0
    preemptions: int = 0
    invariant_violations: int = 0

    def plus(self, **deltas: int) -> "RunCounters":
        values = dict(self.__dict__)  # not dataclasses.replace: this runs at every eviction and free
        for name, delta in deltas.items():
            values[name] += delta
        return RunCounters(**values)

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class ReclaimWork:
    """What one reclamation trigger (lazy, pressure or layout: engine/runtime.py) planned over a run.
    `copy_s`: the modelled time of those copies on the HBM, overlapped or not (None where the
    executor does not model it)."""

    num_rounds: int = 0  # times the trigger fired
    num_plans: int = 0
    num_tokens_moved: int = 0
    num_blocks_freed: int = 0
    copy_s: float | None = 0.0

    def plus(self, num_plans: int, num_tokens_moved: int, num_blocks_freed: int, copy_s: float | None) -> "ReclaimWork":
        total_s = None if copy_s is None or self.copy_s is None else self.copy_s + copy_s
        return ReclaimWork(self.num_rounds + 1, self.num_plans + num_plans, self.num_tokens_moved + num_tokens_moved,
                           self.num_blocks_freed + num_blocks_freed, total_s)

    def cost(self, num_generated_tokens: int, num_steps: int) -> dict[str, float | None]:
        """Tokens copied per freed block and per generated token, copy time per step."""
        return {
            "tokens_per_freed_block": self.num_tokens_moved / self.num_blocks_freed if self.num_blocks_freed else None,
            "tokens_per_generated_token": self.num_tokens_moved / num_generated_tokens if num_generated_tokens else None,
            "copy_s_per_step": self.copy_s / num_steps if num_steps and self.copy_s is not None else None,
        }


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
    requests: tuple[RequestRecord, ...] = field(default=(), repr=False, compare=False)  # in order of finish
    lazy_reclaim: ReclaimWork = ReclaimWork()  # what the lazy trigger (F >= theta_F) did
    pressure_reclaim: ReclaimWork = ReclaimWork()  # what packing under memory pressure did
    layout_reclaim: ReclaimWork = ReclaimWork()  # re-packing a request that held more than uncompacted

    @classmethod
    def from_recording(cls, recorder: "Recorder", counters: RunCounters, *, variant: str, policy: str,
                       num_requests: int, skipped: tuple[tuple[str, str], ...], num_iterations: int,
                       num_decode_steps: int, host_time_s: float,
                       reclaim_work: dict[str, ReclaimWork] | None = None) -> "RunResult":
        """The one way a run becomes a result, for every executor."""
        means, histogram = recorder.means()
        makespan_s = recorder.makespan_s
        return cls(
            variant=variant,
            policy=policy,
            num_requests=num_requests,
            num_completed=len(recorder.latencies_s),
            skipped=skipped,
            waste_ratio=float(means[0]),
            frac_blocks_le_half=float(means[1]),
            utilization_histogram=tuple(float(x) for x in histogram),
            retained_blocks_per_request=float(means[2]),
            peak_allocated_blocks=recorder.peak_allocated_blocks,
            memory_utilization=float(means[4]),
            trapped_bytes=float(means[3]),
            peak_trapped_bytes=recorder.peak_trapped_bytes,
            throughput_tok_s=recorder.num_output_tokens / makespan_s if makespan_s > 0 else 0.0,
            latency=LatencyStats.of(recorder.latencies_s),
            ttft=LatencyStats.of(recorder.ttfts_s),
            tpot=LatencyStats.of(recorder.tpots_s),
            makespan_s=makespan_s,
            preemptions=counters.preemptions,
            tokens_evicted=counters.tokens_evicted,
            tokens_moved=counters.tokens_moved,
            blocks_reclaimed=counters.blocks_reclaimed,
            relocation_events=counters.relocation_events,
            num_iterations=num_iterations,
            num_decode_steps=num_decode_steps,
            host_time_s=host_time_s,
            timeline=recorder.timeline(),
            requests=tuple(recorder.finished),
            **({f"{trigger}_reclaim": work for trigger, work in reclaim_work.items()} if reclaim_work else {}),
        )

    def pressure_packing(self) -> dict[str, float | None]:
        """What packing under memory pressure did and cost (compare --json's "pressure_packing")."""
        work = self.pressure_reclaim
        num_generated = sum(r.num_output_tokens for r in self.requests)
        return {"rounds": work.num_rounds, "plans": work.num_plans, "tokens_copied": work.num_tokens_moved,
                "blocks_freed": work.num_blocks_freed, **work.cost(num_generated, self.num_iterations)}

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
    """Accumulates time-weighted memory state and request completions during a run.

    It is handed a `MemorySample` per iteration and reads nothing else: the executor decides
    what memory its engine holds."""

    def __init__(self, kv_bytes_per_token: int) -> None:
        self.kv_bytes_per_token = kv_bytes_per_token
        self._last: tuple | None = None
        self._weight_s = 0.0
        self._sums = np.zeros(5)  # F, le_half, blocks per request, trapped bytes, memory utilization
        self._weighted_histogram = np.zeros(NUM_HISTOGRAM_BINS)
        self._timeline: list[tuple[float, float, int, int, int]] = []
        self.peak_allocated_blocks = 0
        self.peak_trapped_bytes = 0.0
        self.finished: list[RequestRecord] = []
        self.latencies_s: list[float] = []
        self.ttfts_s: list[float] = []
        self.tpots_s: list[float] = []
        self.num_output_tokens = 0
        self.first_arrival_s: float | None = None
        self.last_finish_s = 0.0

    def sample(self, now_s: float, num_running: int, memory: MemorySample) -> None:
        """Close the previous sample's interval at `now_s` and open a new one in state `memory`."""
        if self._last is not None:
            self._accumulate(now_s)
        num_allocated = memory.num_allocated_blocks
        trapped = (num_allocated * memory.block_size - memory.num_live_tokens) * self.kv_bytes_per_token
        fractions = memory.histogram / num_allocated if num_allocated else np.zeros(NUM_HISTOGRAM_BINS)
        waste = memory.waste_ratio
        values = np.array([
            waste,
            memory.frac_blocks_le_half,
            num_allocated / num_running if num_running else 0.0,
            trapped,
            1.0 - waste if num_allocated else 0.0,
        ])
        self._last = (now_s, values, fractions, num_running > 0)
        self.peak_allocated_blocks = max(self.peak_allocated_blocks, num_allocated)
        self.peak_trapped_bytes = max(self.peak_trapped_bytes, float(trapped))
        self._timeline.append((now_s, float(values[0]), num_allocated, memory.num_live_tokens, num_running))

    def _accumulate(self, now_s: float) -> None:
        start_s, values, fractions, is_busy = self._last
        duration_s = now_s - start_s
        if duration_s > 0 and is_busy:  # idle gaps (no resident request) do not dilute averages
            self._weight_s += duration_s
            self._sums += duration_s * values
            self._weighted_histogram += duration_s * fractions

    def record_finish(self, request: Request, arrival_s: float, first_token_s: float, finish_s: float, *,
                      num_preemptions: int) -> None:
        """`request` finished at `finish_s`, after `num_preemptions` preemptions."""
        num_output_tokens = request.num_output_tokens
        self.finished.append(RequestRecord(request.request_id, arrival_s, first_token_s, finish_s,
                                           request.num_prompt_tokens, num_output_tokens, num_preemptions))
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
