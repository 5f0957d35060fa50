"""The audit's measurement: per policy, the three replays and what vToken recovers, then the
largest concurrency each variant fits.

Every figure is a time-weighted mean of one closed-loop replay (vtoken.metrics). The
definitions that are the audit's own (`vtoken.audit.report.DEFINITIONS`, printed by the CLI):

- trapped bytes (of a policy): naive-evict's trapped bytes, (allocated blocks x S - live tokens)
  x KV bytes per token: what the policy "freed" that stays allocated.
- reclaimable bytes = max(0, trapped(naive-evict) - trapped(vtoken)): both runs make the same
  eviction decisions, so this is the memory vToken's compaction returns to the free pool on
  average; reclaimable blocks = reclaimable bytes / KV bytes per block.
- room for more requests: vtoken's max concurrency minus naive-evict's (`report.room_for_more`).
- max concurrency (per variant): the largest C <= frontier_max_concurrency at which C requests
  all resident from t = 0 never need more blocks than the budget (`analysis.frontier`), found
  by a galloping bisection that assumes feasibility is monotone in C.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from vtoken.analysis import Steps, frontier_steps, run_steps, run_together
from vtoken.audit.deployment import Deployment
from vtoken.cache import RunCache
from vtoken.engine import EvictionConfig, Experiment, Run
from vtoken.metrics import RunResult
from vtoken.replay import SimReplayer
from vtoken.runners import ReplayJob, ReplayProgress, Runner
from vtoken.trace import Request, num_output_tokens

AUDIT_VARIANTS = ("native", "naive-evict", "vtoken")

AuditProgress = Callable[[str, int, int], None]  # (stage, units done, units in all)


@dataclass(frozen=True)
class Capacity:
    max_concurrency: int
    is_lower_bound: bool  # feasible at the search cap: the true maximum is at least this


@dataclass(frozen=True)
class PolicyAudit:
    """One policy on the deployment: the three runs and what vToken recovers (module docstring)."""

    policy: str
    runs: Mapping[str, RunResult]  # native, naive-evict, vtoken; native is shared by all policies
    capacity: Mapping[str, Capacity]
    reclaimable_bytes: float
    reclaimable_blocks: float

    @property
    def evicted(self) -> RunResult:
        """The naive-evict run: the waste the policy leaves without vToken."""
        return self.runs["naive-evict"]


class _Tracker:
    """Adapts per-run completions and per-search ends to one (stage, done, total) stream."""

    def __init__(self, progress: AuditProgress | None, num_total: int) -> None:
        self.progress = progress
        self.num_total = num_total
        self.num_done = 0

    def advance(self, stage: str, num_units: int) -> None:
        self.num_done += num_units
        if self.progress is not None:
            self.progress(stage, self.num_done, self.num_total)


def num_progress_units(deployment: Deployment, requests: Sequence[Request]) -> int:
    """Tokens every replay generates plus one unit per capacity search."""
    num_runs = 1 + 2 * len(deployment.policies)
    return num_runs * num_output_tokens(requests) + num_runs


def measure(deployment: Deployment, requests: Sequence[Request], progress: AuditProgress | None = None,
            runner: Runner | None = None, cache: RunCache | None = None) -> tuple[PolicyAudit, ...]:
    """Replay `requests` through native once and naive-evict + vtoken per policy, closed loop at
    the workload's concurrency on the deployment's block budget; then search the capacity.

    The replays are independent: one batch on `runner` (local processes or Ray, vtoken.runners;
    default: one after the other here, reporting progress as they generate). Each capacity
    search bisects, one probe after the other: native's first (its answer is every policy's
    first guess), then every policy's naive-evict and vtoken searches, the policies side by side,
    each round's probes one batch on `runner` (`analysis.run_together`); each search probes what
    it would alone. Every replay, probes included, is read from `cache` when it holds it and
    written there when it does not (vtoken.cache)."""
    tracker = _Tracker(progress, num_progress_units(deployment, requests))
    replayer = SimReplayer(runner=runner, cache=cache)
    concurrency = deployment.workload.concurrency
    base = experiment_of(deployment, deployment.policies[0])
    replayed = _replays(deployment, tuple(requests), tracker, replayer)
    native = replayed[None, "native"]
    native_capacity = run_steps(_capacity(base.run("native", concurrency), requests, deployment, None), replayer.run_many)
    tracker.advance("capacity native", 1)
    searches = [_policy_capacity(experiment_of(deployment, policy), concurrency, requests, deployment,
                                 native_capacity.max_concurrency, tracker) for policy in deployment.policies]
    audits = []
    for policy, capacity in zip(deployment.policies, run_together(searches, replayer.run_many)):
        runs = {"native": native, **{variant: replayed[policy, variant] for variant in ("naive-evict", "vtoken")}}
        audits.append(_policy_audit(policy, runs, {"native": native_capacity, **capacity}, deployment))
    return tuple(audits)


def _policy_capacity(experiment: Experiment, concurrency: int, requests: Sequence[Request], deployment: Deployment,
                     guess: int, tracker: _Tracker) -> Steps[dict[str, Capacity]]:
    """One policy's capacity searches, naive-evict's then vtoken's, each guessing the last answer."""
    capacity = {}
    for variant in ("naive-evict", "vtoken"):
        capacity[variant] = yield from _capacity(experiment.run(variant, concurrency), requests, deployment, guess)
        guess = capacity[variant].max_concurrency
        tracker.advance(f"capacity {experiment.eviction.policy}", 1)
    return capacity


def experiment_of(deployment: Deployment, policy: str) -> Experiment:
    """The deployment as an experiment, evicting with `policy` (its runs: the workload's concurrency)."""
    return Experiment(
        model=deployment.model, gpu=deployment.gpu, num_blocks=deployment.num_blocks, block_size=deployment.block_size,
        eviction=EvictionConfig(policy, deployment.budget, deployment.interval_tokens), reclaim=deployment.reclaim,
        seed=deployment.seed,
    )


def _replays(deployment: Deployment, requests: tuple[Request, ...], tracker: _Tracker,
             replayer: SimReplayer) -> dict[tuple[str | None, str], RunResult]:
    """Native (key (None, "native")) and each policy's naive-evict and vtoken, as one batch."""
    concurrency = deployment.workload.concurrency
    keys: list[tuple[str | None, str]] = [(None, "native")]
    jobs = [ReplayJob(experiment_of(deployment, deployment.policies[0]).run("native", concurrency), requests)]
    for policy in deployment.policies:
        for variant in ("naive-evict", "vtoken"):
            keys.append((policy, variant))
            jobs.append(ReplayJob(experiment_of(deployment, policy).run(variant, concurrency), requests))
    progress = ReplayProgress(tracker.advance, jobs, lambda idx: _stage(jobs[idx].run))
    return dict(zip(keys, replayer.run_many(jobs, progress.on_done, progress.on_tokens)))


def _stage(run: Run) -> str:
    variant = run.spec.variant
    return variant if variant == "native" else f"{run.experiment.eviction.policy} {variant}"


def _policy_audit(policy: str, runs: dict[str, RunResult], capacity: dict[str, Capacity],
                  deployment: Deployment) -> PolicyAudit:
    reclaimable_bytes = max(0.0, runs["naive-evict"].trapped_bytes - runs["vtoken"].trapped_bytes)
    reclaimable_blocks = reclaimable_bytes / deployment.kv_bytes_per_block
    return PolicyAudit(policy, runs, capacity, reclaimable_bytes, reclaimable_blocks)


# ---- capacity: the largest concurrency that fits ------------------------------------------------


def _capacity(run: Run, requests: Sequence[Request], deployment: Deployment, guess: int | None) -> Steps[Capacity]:
    """Largest C <= frontier_max_concurrency with `analysis.frontier` feasible for this variant,
    as steps: a probe's batches (`analysis.frontier_steps`), one probe after the other.

    `guess` (another variant's answer; the cap when None) is probed first.
    """
    cap = deployment.frontier_max_concurrency
    feasible: dict[int, bool] = {}

    def is_feasible(c: int) -> Steps[bool]:
        if c not in feasible:
            found = yield from frontier_steps(run.experiment, requests, (c,), (run.spec.variant,))
            feasible[c] = found.points[0].is_feasible
        return feasible[c]

    found = yield from _largest_feasible(is_feasible, 0, cap + 1, cap if guess is None else guess)
    return Capacity(found, found == cap)


def _largest_feasible(is_feasible: Callable[[int], Steps[bool]], lo: int, hi: int, guess: int) -> Steps[int]:
    """Largest c in [lo, hi) with is_feasible(c), given that lo is feasible (or 0), hi is not,
    and feasibility is monotone. Probes `guess`, gallops away from it, then bisects."""
    if hi - lo <= 1:
        return lo
    guess = min(max(guess, lo + 1), hi - 1)
    if (yield from is_feasible(guess)):
        lo, step = guess, 1
        while lo + step < hi and (yield from is_feasible(lo + step)):
            lo, step = lo + step, step * 2
        hi = min(hi, lo + step)
    else:
        hi, step = guess, 1
        while hi - step > lo and not (yield from is_feasible(hi - step)):
            hi, step = hi - step, step * 2
        lo = max(lo, hi - step)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if (yield from is_feasible(mid)):
            lo = mid
        else:
            hi = mid
    return lo
