"""`vtoken audit`: the KV memory token-level eviction would trap on one deployment, and what
vToken would recover.

    audit(target) = resolve_deployment(target)      TOML file, or a running vLLM server's /metrics
                  -> workload_traces(...)           the trace given, the server's workload, or the
                                                    bundled sample
                  -> measure(...)                   per policy: native / naive-evict / vtoken; for a
                                                    server's workload also at the buckets' low and
                                                    high edges (the headline figures' ranges)
                  -> AuditReport (+ NVML, verdict)  report_to_json() is the `--json` object

    audit_deployment(targets)                       several replicas (URLs, and the engines of a
                                                    data-parallel server): one AuditReport each, the
                                                    replicas that did not answer, and the sums

The stages, in the order the data flows:

    settings.py     the deployment TOML and the command-line flags, parsed and type-checked
    workload.py     a server's /metrics -> the workload it served, and a synthetic trace of it
    watch.py        `--watch`: every replica's live load, tick by tick (and scrape_all)
    loop.py         a vToken server's measured waste beside the sim's prediction
    deployment.py   settings + the live server -> `Deployment` (defaults, notes); its workload
    measurement.py  the replays, what vToken recovers, the capacity search (the definitions)
    report.py       `AuditReport`, the verdict, the JSON object and the CSV rows

This module holds the one entry point and re-exports the names the CLI and the tests use.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from vtoken.audit.deployment import (
    DEFAULT_BLOCK_SIZE, DEFAULT_BUDGET, DEFAULT_CONCURRENCY, DEFAULT_FRONTIER_MAX_CONCURRENCY, DEFAULT_GPU,
    DEFAULT_GPU_MEMORY_UTILIZATION, DEFAULT_INTERVAL_TOKENS, KV_BYTES_MISMATCH, MAX_RESERVE_BYTES, SAMPLE_TRACE,
    Deployment, Scrapes, Workload, bundled_sample_path, load_workload, resolve_deployment, resolve_replicas, workload_traces,
)
from vtoken.audit.loop import LoopComparison, MeasuredWaste, compare_with_sim
from vtoken.audit.measurement import (
    AUDIT_VARIANTS, AuditProgress, Capacity, PolicyAudit, _largest_feasible, measure, num_progress_units, experiment_of,
)
from vtoken.audit.report import (
    DEFINITIONS, SAMPLE_ATTRIBUTION, AuditReport, DeploymentAudit, ReplicaFailure, budget_phrase, deployment_to_json,
    policy_title, report_rows, report_to_json, verdict,
)
from vtoken.audit.settings import DEFAULT_TIMEOUT_S, Overrides, Settings, load_settings
from vtoken.audit.watch import scrape_all
from vtoken.audit.workload import EDGES, MAX_SYNTHETIC_REQUESTS, ReplicaWorkload, ServerWorkload
from vtoken.cache import RunCache
from vtoken.endpoint import LiveState
from vtoken.http_get import redact_url
from vtoken.errors import EndpointError
from vtoken.nvml import NvmlReport, probe_gpus
from vtoken.runners import Runner

__all__ = [
    "AUDIT_VARIANTS", "DEFAULT_BLOCK_SIZE", "DEFAULT_BUDGET", "DEFAULT_CONCURRENCY", "DEFAULT_FRONTIER_MAX_CONCURRENCY",
    "DEFAULT_GPU", "DEFAULT_GPU_MEMORY_UTILIZATION", "DEFAULT_INTERVAL_TOKENS", "DEFAULT_TIMEOUT_S", "DEFINITIONS",
    "KV_BYTES_MISMATCH", "MAX_RESERVE_BYTES", "SAMPLE_ATTRIBUTION", "SAMPLE_TRACE",
    "EDGES", "MAX_SYNTHETIC_REQUESTS",
    "AuditProgress", "AuditReport", "Capacity", "Deployment", "DeploymentAudit", "LoopComparison", "MeasuredWaste",
    "Overrides", "PolicyAudit",
    "ReplicaFailure", "ReplicaWorkload", "Scrapes", "ServerWorkload", "Settings", "Workload",
    "_largest_feasible", "audit", "audit_deployment", "budget_phrase", "bundled_sample_path", "deployment_to_json",
    "load_settings", "load_workload", "measure", "num_progress_units", "policy_title", "probe_gpus", "report_rows",
    "report_to_json", "resolve_deployment", "resolve_replicas", "experiment_of", "verdict", "window_scrapes",
    "workload_traces",
]


def audit(target: str, overrides: Overrides | None = None, progress: AuditProgress | None = None,
          runner: Runner | None = None, cache: RunCache | None = None) -> AuditReport:
    """Audit the deployment `target` (a TOML path or an http(s):// URL); see the module docstring.
    `runner`: where the replays run (vtoken.runners; default: this process); `cache`: the replays
    kept on disk (vtoken.cache; default: none).

    Raises ConfigError / TraceError / EndpointError (all VTokenError) for any bad input.
    """
    deployment, live = resolve_deployment(target, overrides or Overrides())
    return _audit_one(deployment, live, probe_gpus(), progress, runner, cache)


def audit_deployment(targets: Sequence[str], overrides: Overrides | None = None, progress: AuditProgress | None = None,
                     runner: Runner | None = None, cache: RunCache | None = None) -> DeploymentAudit:
    """Audit every replica: each target, and each engine of a data-parallel server, on its own.

    A server that does not answer (EndpointError) is a `ReplicaFailure` and the others are
    audited; when none answers, raises EndpointError naming each (a single target: its own
    error). Bad input (ConfigError, TraceError) raises at once. With a window (`overrides.window_s`)
    every URL is scraped at the same moments, its first scrapes together and its second ones
    together (`window_scrapes`), so that all replicas' rates cover the same seconds.
    """
    overrides = overrides or Overrides()
    gpus = probe_gpus()
    reports: list[AuditReport] = []
    failures: list[ReplicaFailure] = []
    scrapes = window_scrapes(targets, overrides)
    for target in targets:
        try:
            deployments, live = resolve_replicas(target, overrides, scrapes=scrapes.get(target))
        except EndpointError as exc:
            failures.append(ReplicaFailure(redact_url(target), str(exc)))
            continue
        for deployment in deployments:
            reports.append(_audit_one(deployment, live, gpus, _prefixed(progress, deployment.source), runner, cache))
    if not reports:
        if len(failures) == 1:
            raise EndpointError(failures[0].reason)
        raise EndpointError("no replica answered: " + "; ".join(f.reason for f in failures))
    return DeploymentAudit(tuple(reports), tuple(failures))


def window_scrapes(targets: Sequence[str], overrides: Overrides) -> dict[str, Scrapes]:
    """With a window and several URLs: each URL's two scrapes, all first ones at once, then all
    second ones `window_s` after the last first one came back; else {} (each scraped when resolved)."""
    urls = list(dict.fromkeys(t for t in targets if "://" in t))
    if overrides.window_s is None or len(urls) < 2:
        return {}
    timeout_s = overrides.timeout_s or DEFAULT_TIMEOUT_S
    firsts = scrape_all(urls, timeout_s)
    answered = [s.scraped_at_s for s in firsts if isinstance(s, LiveState)]
    if answered:
        time.sleep(max(0.0, max(answered) + overrides.window_s - time.monotonic()))
    live_urls = [url for url, s in zip(urls, firsts, strict=True) if isinstance(s, LiveState)]
    laters = dict(zip(live_urls, scrape_all(live_urls, timeout_s), strict=True)) if live_urls else {}
    return {url: Scrapes(first, laters.get(url)) for url, first in zip(urls, firsts, strict=True)}


def _audit_one(deployment: Deployment, live: LiveState | None, gpus: NvmlReport,
               progress: AuditProgress | None, runner: Runner | None = None, cache: RunCache | None = None) -> AuditReport:
    traces = workload_traces(deployment.workload)
    edges = [edge for edge in EDGES if edge != "mid" and edge in traces]
    num_replays = 1 + len(edges)
    policies = measure(deployment, traces["mid"].requests, _offset(progress, 0, num_replays, ""), runner, cache)
    at_edges = {edge: measure(deployment, traces[edge].requests, _offset(progress, k + 1, num_replays, f"{edge} edge: "),
                              runner, cache)
                for k, edge in enumerate(edges)}
    loop = (compare_with_sim(deployment.measured, {p.policy: p.runs for p in policies},
                                    deployment.kv_bytes_per_block)
            if deployment.measured is not None else None)
    return AuditReport(deployment, live, gpus, traces["mid"], policies,
                       verdict(deployment, policies, live, at_edges, loop), at_edges, loop)


def _offset(progress: AuditProgress | None, replay_idx: int, num_replays: int, prefix: str) -> AuditProgress | None:
    """Progress of replay `replay_idx` of `num_replays` equal ones as one stream: done and total
    count all of them."""
    if progress is None or num_replays == 1:
        return progress

    def report(stage: str, num_done: int, num_total: int) -> None:
        progress(prefix + stage, replay_idx * num_total + num_done, num_replays * num_total)

    return report


def _prefixed(progress: AuditProgress | None, replica: str) -> AuditProgress | None:
    if progress is None:
        return None
    return lambda stage, num_done, num_total: progress(f"{replica}: {stage}", num_done, num_total)
