"""What a check found: per invariant a `Tally` (checks run, violations, the first one), per run
a `RunCheck`, totals per (policy, reclaim mode) and over all (`CheckReport`), and the `--json`
object (`report_to_json`). One report type for every executor (sim, hf, vllm); importable
without torch."""

from __future__ import annotations

from dataclasses import dataclass, field

from vtoken.checker.names import CHECK_UNITS, FAULT_DETECTED_BY, INVARIANT_NAMES, INVARIANTS
from vtoken.checker.scenarios import CheckOptions
from vtoken.engine.experiment import Experiment

@dataclass(frozen=True)
class KVLayout:
    """Per-token K/V geometry of the checked KV cache: [num_layers, 2, slots, num_kv_heads, head_dim]."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # torch dtype name: float32, bfloat16, float16


@dataclass(frozen=True)
class Violation:
    invariant: str
    message: str
    scenario: str
    policy: str
    reclaim_mode: str
    request_id: str | None = None
    req_idx: int | None = None
    token_id: int | None = None
    block_id: int | None = None
    offset: int | None = None


@dataclass(frozen=True)
class Tally:
    """Checks of one invariant: how many ran, how many failed, and the first failure."""

    checked: int = 0
    violations: int = 0
    first_violation: Violation | None = None

    def plus(self, other: Tally) -> Tally:
        return Tally(self.checked + other.checked, self.violations + other.violations,
                     self.first_violation or other.first_violation)


@dataclass(frozen=True)
class RunCheck:
    scenario: str
    policy: str
    reclaim_mode: str
    block_size: int
    num_blocks: int
    num_requests: int
    num_completed: int
    relocation_events: int
    tokens_moved: int
    preemptions: int
    faults_injected: int
    stopped: str | None  # why the run ended early, or None
    tallies: dict[str, Tally]
    elapsed_s: float

    @property
    def passed(self) -> bool:
        return all(t.violations == 0 for t in self.tallies.values())


class _Totals:
    """Totals over `self.runs`."""

    runs: tuple[RunCheck, ...]

    @property
    def tallies(self) -> dict[str, Tally]:
        total = {name: Tally() for name in INVARIANTS}
        for run in self.runs:
            total = {name: total[name].plus(run.tallies[name]) for name in INVARIANTS}
        return total

    @property
    def passed(self) -> bool:
        return all(run.passed for run in self.runs)

    @property
    def relocation_events(self) -> int:
        return sum(run.relocation_events for run in self.runs)

    @property
    def tokens_moved(self) -> int:
        return sum(run.tokens_moved for run in self.runs)


@dataclass(frozen=True)
class GroupTotal(_Totals):
    """The runs of one (policy, reclaim mode) over every scenario."""

    policy: str
    reclaim_mode: str
    runs: tuple[RunCheck, ...]


@dataclass(frozen=True)
class CheckReport(_Totals):
    runs: tuple[RunCheck, ...]
    base: Experiment  # what every trace scenario starts from (fuzz draws replace most of it)
    options: CheckOptions
    device: str
    copy_mode: str
    notes: tuple[str, ...]  # how the traces were cut down; hf, vllm: which model and prompts, what is not checked
    elapsed_s: float
    kv_layout: KVLayout  # sim: the synthetic K/V's (contents.py); hf, vllm: the model's
    check_units: dict[str, str] = field(default_factory=lambda: dict(CHECK_UNITS))  # invariant -> what one check is
    model_kv: bool = False  # the K/V checked is what a model's forward wrote (hf, vllm), not the synthetic K/V

    @property
    def relocation_events_per_s(self) -> float:
        return self.relocation_events / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def by_policy_mode(self) -> list[GroupTotal]:
        """Totals per (policy, reclaim mode) over every scenario, in run order."""
        groups: dict[tuple[str, str], list[RunCheck]] = {}
        for run in self.runs:
            groups.setdefault((run.policy, run.reclaim_mode), []).append(run)
        return [GroupTotal(policy, mode, tuple(runs)) for (policy, mode), runs in groups.items()]


# ---- JSON ------------------------------------------------------------------------------------------


def report_to_json(report: CheckReport) -> dict:
    """The `--json` object."""
    return {
        "passed": report.passed,
        "invariants": _tallies_json(report.tallies),
        "relocation_events": report.relocation_events,
        "tokens_moved": report.tokens_moved,
        "elapsed_s": report.elapsed_s,
        "relocation_events_per_s": report.relocation_events_per_s,
        "by_policy_mode": [
            {"policy": g.policy, "reclaim_mode": g.reclaim_mode, "num_runs": len(g.runs), "passed": g.passed,
             "relocation_events": g.relocation_events, "tokens_moved": g.tokens_moved, "invariants": _tallies_json(g.tallies)}
            for g in report.by_policy_mode()
        ],
        "runs": [_run_json(run) for run in report.runs],
        "fault": None if report.options.fault is None else {
            "kind": report.options.fault, "expected_invariant": FAULT_DETECTED_BY[report.options.fault],
            "num_injected": sum(r.faults_injected for r in report.runs),
        },
        "config": _config_json(report),
        "notes": list(report.notes),
    }


def _config_json(report: CheckReport) -> dict:
    base, options = report.base, report.options
    return {
        "executor": options.executor, "device": report.device, "copy_mode": report.copy_mode,
        "kv_shape": vars(report.kv_layout).copy(),
        "model": base.model.name, "gpu": base.gpu.name, "block_size": options.block_size or base.block_size,
        "num_blocks": options.num_blocks, "budget": base.eviction.budget.describe(),
        "eviction_interval_tokens": base.eviction.interval_tokens, "concurrency": options.concurrency,
        "theta_f": base.reclaim.theta_f, "reclaim_check_interval_steps": base.reclaim.check_interval_steps,
        "seed": base.seed, "policies": list(options.policies), "reclaim_modes": list(options.reclaim_modes),
        "num_fuzz_scenarios": options.num_fuzz_scenarios, "limits": vars(options.limits).copy(),
    }


def _tallies_json(tallies: dict[str, Tally]) -> dict:
    return {name: {"name": INVARIANT_NAMES[name], "checked": t.checked, "violations": t.violations,
                   "first_violation": None if t.first_violation is None else vars(t.first_violation).copy()}
            for name, t in tallies.items()}


def _run_json(run: RunCheck) -> dict:
    out = {k: v for k, v in vars(run).items() if k != "tallies"}
    out["passed"] = run.passed
    out["invariants"] = _tallies_json(run.tallies)
    return out
