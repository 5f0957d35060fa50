"""Analyses over runs: the three-variant comparison, the concurrency sweep with the SLA rule,
the capacity frontier, and repeats with confidence intervals.

- SLA threshold = `sla_factor` x the Naive-Evict p95 of `sla_metric` at concurrency C_ref.
- C_sel per variant = the swept concurrency with the highest throughput whose p95 stays within
  the threshold (None when none does).
- Capacity frontier: C requests all resident from t = 0. Their block demand is the peak number
  of allocated blocks in an unbounded pool; C is feasible when demand <= budget (no request
  would have been preempted). A variant that packs under memory pressure (vtoken) only packs
  as far as the budget requires, which an unbounded pool never does: where its unbounded
  demand exceeds the budget but the prompts fit, it is replayed in the budget itself, and C is
  feasible when no request was preempted and every one completed (its demand is then its peak
  in the budget).
  `max_feasible_concurrency` is the largest C such that it and every smaller swept C are feasible.
- Repeats: every headline figure over N seeds, mean and a 95% Student-t interval.

The sweep's replays are independent and go to a replayer's `run_many` as one batch (local
processes or Ray, vtoken.runners); so do the frontier's, in two batches: every point in an
unbounded pool, then in the budget the points that need it (which depends on the first). The
frontier is written as steps (`frontier_steps`, `run_steps`), so that several searches that
each probe one frontier point at a time run their probes together (`run_together`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, replace
from typing import TypeVar

import numpy as np

from vtoken.engine import VARIANTS, Experiment, Run, run_sim
from vtoken.errors import ConfigError
from vtoken.metrics import RunResult
from vtoken.runners import OnDone, OnTokens, ReplayJob, ReplayProgress, SerialRunner, replay_job
from vtoken.trace import Request, num_output_tokens

DEFAULT_CONCURRENCIES = (1, 2, 4, 8, 12, 16, 22, 32, 48)
SLA_METRICS = {"e2e": "latency", "ttft": "ttft", "tpot": "tpot"}

Progress = Callable[[str, int], None]  # (stage description, units done)
Replay = Callable[[Run, Sequence[Request]], RunResult]  # one replay; `run_sim` unless a replayer's
RunMany = Callable[[Sequence[ReplayJob], OnDone | None, OnTokens | None], list[RunResult]]  # a batch of independent replays
T = TypeVar("T")
StepBatch = tuple[Sequence[ReplayJob], OnDone]  # one batch of a computation's steps: its jobs, what each result goes to
Steps = Generator[StepBatch, None, T]  # a computation that needs batches of replays (`run_steps`)


@dataclass(frozen=True)
class SweepPoint:
    variant: str
    concurrency: int
    throughput_tok_s: float
    p95_s: float
    preemptions: int


@dataclass(frozen=True)
class SlaResult:
    metric: str
    factor: float
    reference_concurrency: int
    threshold_s: float
    c_sel: dict[str, int | None]


@dataclass(frozen=True)
class FrontierPoint:
    variant: str
    concurrency: int
    peak_blocks: int
    normalized_demand: float
    is_feasible: bool


@dataclass(frozen=True)
class Frontier:
    budget_blocks: int
    points: tuple[FrontierPoint, ...]
    max_feasible_concurrency: dict[str, int]
    ideal_max_concurrency: int  # if every request held only ceil(kept tokens / S) blocks


@dataclass(frozen=True)
class Interval:
    mean: float
    low: float
    high: float
    num_samples: int


def run_variants(experiment: Experiment, requests: Sequence[Request], concurrency: int | None,
                 variants: Sequence[str] = VARIANTS, progress: Progress | None = None) -> dict[str, RunResult]:
    """Replay the same requests through each variant (same seed, same eviction decisions)."""
    results = {}
    for variant in variants:
        on_progress = (lambda n, v=variant: progress(f"{v}", n)) if progress else None
        results[variant] = run_sim(experiment.run(variant, concurrency), requests, on_progress)
    return results


def sweep(experiment: Experiment, requests: Sequence[Request], concurrencies: Sequence[int],
          variants: Sequence[str] = VARIANTS, sla_metric: str = "e2e",
          progress: Progress | None = None, *, run_many: RunMany | None = None) -> list[SweepPoint]:
    """Every variant at every concurrency, closed loop. `run_many`: how the batch of replays
    runs (a replayer's; default: one after the other in this process)."""
    jobs = sweep_jobs(experiment, requests, concurrencies, variants)
    tracker = ReplayProgress(progress, jobs, lambda idx: f"sweep C={jobs[idx].run.spec.concurrency}") if progress else None
    hooks = (tracker.on_done, tracker.on_tokens) if tracker else ()
    results = run_many(jobs, *hooks) if run_many else SerialRunner().map(replay_job, jobs, *hooks)
    return sweep_points(jobs, results, sla_metric)


def sweep_jobs(experiment: Experiment, requests: Sequence[Request], concurrencies: Sequence[int],
               variants: Sequence[str] = VARIANTS) -> list[ReplayJob]:
    """The sweep's replays, concurrency-major: each variant at each concurrency."""
    return [ReplayJob(experiment.run(variant, concurrency), tuple(requests))
            for concurrency in concurrencies for variant in variants]


def sweep_points(jobs: Sequence[ReplayJob], results: Sequence[RunResult], sla_metric: str = "e2e") -> list[SweepPoint]:
    """One point per sweep job and its result, with the p95 of `sla_metric`."""
    if sla_metric not in SLA_METRICS:
        raise ConfigError(f"unknown SLA metric '{sla_metric}'; choose one of: {', '.join(SLA_METRICS)}")
    points = []
    for job, result in zip(jobs, results, strict=True):
        latency = getattr(result, SLA_METRICS[sla_metric])
        points.append(SweepPoint(job.run.spec.variant, job.run.spec.concurrency, result.throughput_tok_s, latency.p95_s,
                                 result.preemptions))
    return points


def sla_selection(points: Sequence[SweepPoint], metric: str = "e2e", factor: float = 1.05,
                  reference_concurrency: int = 8) -> SlaResult:
    reference = [p for p in points if p.variant == "naive-evict" and p.concurrency == reference_concurrency]
    if not reference:
        raise ConfigError(f"the sweep has no naive-evict point at the reference concurrency {reference_concurrency}")
    threshold_s = factor * reference[0].p95_s
    c_sel: dict[str, int | None] = {}
    for variant in dict.fromkeys(p.variant for p in points):
        within = [p for p in points if p.variant == variant and p.p95_s <= threshold_s]
        best = max(within, key=lambda p: (p.throughput_tok_s, -p.concurrency), default=None)
        c_sel[variant] = best.concurrency if best else None
    return SlaResult(metric, factor, reference_concurrency, threshold_s, c_sel)


def frontier_num_tokens(requests: Sequence[Request], concurrency: int) -> int:
    """Progress units of one frontier point: the output tokens of its C co-resident requests."""
    return sum(requests[i % len(requests)].num_output_tokens for i in range(concurrency))


def frontier(base: Experiment, requests: Sequence[Request], concurrencies: Sequence[int],
             variants: Sequence[str] = VARIANTS, progress: Progress | None = None, *,
             replay: Replay = run_sim, run_many: RunMany | None = None) -> Frontier:
    """Block demand and feasibility of C co-resident requests (the first C of `requests`,
    cycled if fewer), per variant: see the module docstring. `run_many`: how a batch of
    replays runs (a replayer's); default: one after the other in this process through `replay`."""
    if run_many is None:
        run_many = lambda jobs, on_done: SerialRunner().map(lambda job: replay(job.run, job.requests), jobs, on_done)  # noqa: E731
    return run_steps(frontier_steps(base, requests, concurrencies, variants, progress), run_many)


def frontier_steps(base: Experiment, requests: Sequence[Request], concurrencies: Sequence[int],
                   variants: Sequence[str] = VARIANTS, progress: Progress | None = None) -> Steps[Frontier]:
    """`frontier` as steps (`run_steps`): its batches, every point in an unbounded pool, then in
    the budget the points that need it."""
    base = base.with_scheduler_defaults()
    budget = base.num_blocks
    unbounded_jobs, retried = [], {}  # retried: index of a point -> its replay in the budget
    for concurrency in concurrencies:
        batch = [requests[i % len(requests)] for i in range(concurrency)]
        batch = tuple(replace(r, request_id=f"{r.request_id}#{i}", arrival_s=0.0) for i, r in enumerate(batch))
        unbounded = sum(-(-(r.num_prompt_tokens + r.num_output_tokens) // base.block_size) for r in batch) + 1
        scheduler = replace(base.scheduler, max_num_seqs=max(base.scheduler.max_num_seqs, concurrency))
        resident = replace(base, scheduler=scheduler)
        for variant in variants:
            run = replace(resident, num_blocks=max(budget, unbounded)).run(variant, None, admit_all_at_start=True)
            unbounded_jobs.append(ReplayJob(run, batch))

    points: list[FrontierPoint | None] = [None] * len(unbounded_jobs)

    def point_done(idx: int) -> None:
        if progress:
            batch = unbounded_jobs[idx].requests
            progress(f"frontier C={len(batch)}", num_output_tokens(batch))

    def on_unbounded(idx: int, result: RunResult) -> None:
        job = unbounded_jobs[idx]
        peak = result.peak_allocated_blocks
        points[idx] = FrontierPoint(job.run.spec.variant, len(job.requests), peak, peak / budget, peak <= budget)
        if not points[idx].is_feasible and job.run.spec.reclaims and _num_prompt_blocks(job.requests, base.block_size) <= budget:
            in_budget = replace(job.run.experiment, num_blocks=budget).run(job.run.spec.variant, None, admit_all_at_start=True)
            retried[idx] = ReplayJob(in_budget, job.requests)
        else:
            point_done(idx)

    yield unbounded_jobs, on_unbounded
    order = sorted(retried)

    def on_in_budget(k: int, result: RunResult) -> None:
        idx = order[k]
        points[idx] = _in_budget(result, points[idx], budget)
        point_done(idx)

    if order:
        yield [retried[idx] for idx in order], on_in_budget
    return Frontier(budget, tuple(points), _max_feasible(points, variants), _ideal_max(base, requests, budget))


# ---- steps: a computation that needs batches of replays, one after the other -------------------
#
# A generator that yields (jobs, on_done) for each batch it needs, on_done(index in the batch,
# result) called as each job finishes, and returns its answer. `run_steps` runs one; `run_together`
# runs several, one batch of all their next jobs at a time, so that computations that each need
# a batch at a time (the audit's capacity searches: one probe after the other) share the
# workers. Each computation sees the batches and results it would see run alone.


def run_steps(steps: Steps[T], run_many: RunMany) -> T:
    """The answer of `steps`, its batches run by `run_many` one after the other."""
    return run_together([steps], run_many)[0]


def run_together(computations: Sequence[Steps[T]], run_many: RunMany) -> list[T]:
    """The answer of each of `computations`: at each round, the next batch of every one still
    running goes to `run_many` as one batch."""
    answers: list = [None] * len(computations)
    waiting: dict[int, StepBatch] = {}

    def advance(idx: int) -> None:
        try:
            waiting[idx] = next(computations[idx])
        except StopIteration as stop:
            answers[idx] = stop.value
            waiting.pop(idx, None)

    for idx in range(len(computations)):
        advance(idx)
    while waiting:
        owners = [(on_done, k) for jobs, on_done in waiting.values() for k in range(len(jobs))]
        jobs = [job for batch_jobs, _ in waiting.values() for job in batch_jobs]
        run_many(jobs, lambda idx, result: owners[idx][0](owners[idx][1], result))
        for idx in list(waiting):
            advance(idx)
    return answers


def _num_prompt_blocks(batch: Sequence[Request], block_size: int) -> int:
    """Blocks the prompts take at t = 0, each its own (a shared prefix counted per request)."""
    return sum(-(-r.num_prompt_tokens // block_size) for r in batch)


def _in_budget(result: RunResult, unbounded: FrontierPoint, budget: int) -> FrontierPoint:
    """The point of a replay in the budget: feasible when it preempted nothing and completed
    every request; an infeasible one keeps its unbounded demand."""
    if result.preemptions or result.skipped or result.num_completed < result.num_requests:
        return unbounded
    peak = result.peak_allocated_blocks
    return FrontierPoint(unbounded.variant, unbounded.concurrency, peak, peak / budget, True)


def _max_feasible(points: Sequence[FrontierPoint], variants: Sequence[str]) -> dict[str, int]:
    best = {}
    for variant in variants:
        best[variant] = 0
        for point in sorted((p for p in points if p.variant == variant), key=lambda p: p.concurrency):
            if not point.is_feasible:
                break
            best[variant] = point.concurrency
    return best


def _ideal_max(base: Experiment, requests: Sequence[Request], budget: int) -> int:
    """Concurrency if each request's kept tokens were packed perfectly at its final length."""
    budget_spec = base.eviction.budget
    num_blocks = 0
    for count in range(1, 100_000):
        r = requests[(count - 1) % len(requests)]
        num_tokens = r.num_prompt_tokens + r.num_output_tokens - 1
        num_blocks += -(-budget_spec.num_keep_tokens(num_tokens) // base.block_size)
        if num_blocks > budget:
            return count - 1
    return count


def interval(samples: Sequence[float], confidence: float = 0.95) -> Interval:
    values = np.asarray([s for s in samples if not math.isnan(s)], dtype=np.float64)
    if values.size == 0:
        return Interval(float("nan"), float("nan"), float("nan"), 0)
    mean = float(values.mean())
    if values.size == 1:
        return Interval(mean, mean, mean, 1)
    from scipy import stats  # imported here: 0.5 s that only repeats need

    half = float(stats.t.ppf(0.5 + confidence / 2, values.size - 1) * values.std(ddof=1) / math.sqrt(values.size))
    return Interval(mean, mean - half, mean + half, int(values.size))
