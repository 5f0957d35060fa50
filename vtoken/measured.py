"""Refusing a result that measured nothing, right after the library call that produced it.

A compare or an audit in which some variant completed no request (every request was larger
than the KV budget, say) has only zeros and NaN to show; a check-invariants that ran no check
passes vacuously; an injected fault that was never injected tested nothing. Each function here
takes a library result and raises `NothingMeasuredError` saying why, or returns nothing. They
read only the results' data, so they work on any executor's report.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vtoken.errors import NothingMeasuredError


def require_measured_compare(report: Any) -> None:
    """A CompareReport: every variant's headline run completed at least one request."""
    _require_completed(report.runs, f"{report.trace.source} on {_blocks(report.experiment.num_blocks)} of "
                                    f"{report.experiment.block_size} tokens")


def require_measured_audit(result: Any) -> None:
    """An AuditReport, or a DeploymentAudit of several: every policy's runs completed a request."""
    for report in getattr(result, "replicas", (result,)):
        where = (f"{report.deployment.source} on {_blocks(report.deployment.num_blocks)} of "
                 f"{report.deployment.block_size} tokens")
        for policy_audit in report.policies:
            _require_completed(policy_audit.runs, where)


def require_measured_check(report: Any) -> None:
    """A CheckReport: at least one invariant check ran, and an asked-for fault was injected."""
    num_checks = sum(tally.checked for tally in report.tallies.values())
    if num_checks == 0:
        num_completed = sum(run.num_completed for run in report.runs)
        raise NothingMeasuredError(
            f"nothing checked: 0 invariant checks in {len(report.runs)} runs ({num_completed} requests completed); "
            "give more --num-blocks or a trace that relocates")
    fault = report.options.fault
    if fault is not None and sum(run.faults_injected for run in report.runs) == 0:
        hint = "; it needs shared prefixes: use a trace with prefix_id, or --fuzz N" if fault == "shared-block" else ""
        raise NothingMeasuredError(f"--inject-fault {fault}: never injected in {len(report.runs)} runs, so nothing "
                                   f"was tested{hint}")


def _require_completed(runs: Mapping[str, Any], where: str) -> None:
    empty = [variant for variant, run in runs.items() if run.num_completed == 0]
    if not empty:
        return
    run = runs[empty[0]]
    skipped = f"{len(run.skipped)} of {run.num_requests} requests skipped" if run.skipped else "none skipped"
    reason = f" ({run.skipped[0][1]})" if run.skipped else ""
    raise NothingMeasuredError(f"nothing measured: {', '.join(empty)} completed no request of {where}; "
                               f"{skipped}{reason}")


def _blocks(num_blocks: int) -> str:
    return f"{num_blocks} block{'' if num_blocks == 1 else 's'}"
