"""`vtoken audit`: the KV memory token-level eviction would trap on one deployment, and what
vToken would recover.

    audit(target) = resolve_deployment(target)      TOML file, or a running vLLM server's /metrics
                  -> load_workload(...)             the deployment's trace, or the bundled sample
                  -> measure(...)                   per policy: native / naive-evict / vtoken
                  -> AuditReport (+ NVML, verdict)  report_to_json() is the `--json` object

The stages, in the order the data flows:

    settings.py     the deployment TOML and the command-line flags, parsed and type-checked
    deployment.py   settings + the live server -> `Deployment` (defaults, notes); its workload
    measurement.py  the replays, what vToken recovers, the capacity search (the definitions)
    report.py       `AuditReport`, the verdict, the JSON object and the CSV rows

This module holds the one entry point and re-exports the names the CLI and the tests use.
"""

from __future__ import annotations

from vtoken.audit.deployment import (
    DEFAULT_BLOCK_SIZE, DEFAULT_BUDGET, DEFAULT_CONCURRENCY, DEFAULT_FRONTIER_MAX_CONCURRENCY, DEFAULT_GPU,
    DEFAULT_GPU_MEMORY_UTILIZATION, DEFAULT_INTERVAL_TOKENS, KV_BYTES_MISMATCH, MAX_RESERVE_BYTES, SAMPLE_TRACE,
    Deployment, Workload, bundled_sample_path, load_workload, resolve_deployment,
)
from vtoken.audit.measurement import (
    AUDIT_VARIANTS, AuditProgress, Capacity, PolicyAudit, _largest_feasible, measure, num_progress_units, run_config,
)
from vtoken.audit.report import (
    DEFINITIONS, SAMPLE_ATTRIBUTION, AuditReport, budget_phrase, policy_title, report_rows, report_to_json, verdict,
)
from vtoken.audit.settings import DEFAULT_TIMEOUT_S, Overrides, Settings, load_settings
from vtoken.nvml import probe_gpus

__all__ = [
    "AUDIT_VARIANTS", "DEFAULT_BLOCK_SIZE", "DEFAULT_BUDGET", "DEFAULT_CONCURRENCY", "DEFAULT_FRONTIER_MAX_CONCURRENCY",
    "DEFAULT_GPU", "DEFAULT_GPU_MEMORY_UTILIZATION", "DEFAULT_INTERVAL_TOKENS", "DEFAULT_TIMEOUT_S", "DEFINITIONS",
    "KV_BYTES_MISMATCH", "MAX_RESERVE_BYTES", "SAMPLE_ATTRIBUTION", "SAMPLE_TRACE",
    "AuditProgress", "AuditReport", "Capacity", "Deployment", "Overrides", "PolicyAudit", "Settings", "Workload",
    "_largest_feasible", "audit", "budget_phrase", "bundled_sample_path", "load_settings", "load_workload", "measure",
    "num_progress_units", "policy_title", "probe_gpus", "report_rows", "report_to_json", "resolve_deployment",
    "run_config", "verdict",
]


def audit(target: str, overrides: Overrides | None = None, progress: AuditProgress | None = None) -> AuditReport:
    """Audit the deployment `target` (a TOML path or an http(s):// URL); see the module docstring.

    Raises ConfigError / TraceError / EndpointError (all VTokenError) for any bad input.
    """
    deployment, live = resolve_deployment(target, overrides or Overrides())
    trace = load_workload(deployment.workload)
    policies = measure(deployment, trace.requests, progress)
    return AuditReport(deployment, live, probe_gpus(), trace, policies, verdict(deployment, policies, live))
