"""What an audit returns and how it reads: `AuditReport`, the verdict sentences, the `--json`
object (`report_to_json`) and the CSV rows of `--output` (`report_rows`); `DeploymentAudit`
and `deployment_to_json` for several replicas.

A server's workload is known from histograms, to within their buckets: the audit replays it
three times (every request at its bucket's lower edge, interpolated, at its upper edge), and
every headline figure then carries `ranges`: its min and max over the three replays."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from vtoken.audit.deployment import Deployment
from vtoken.audit.loop import LoopComparison
from vtoken.audit.measurement import AUDIT_VARIANTS, Capacity, PolicyAudit
from vtoken.audit.workload import LengthDistribution, LengthStats
from vtoken.endpoint import LiveState
from vtoken.hardware import GiB
from vtoken.jsonsafe import make_json_safe
from vtoken.nvml import NvmlReport
from vtoken.policies.base import Budget
from vtoken.trace import Trace

SAMPLE_ATTRIBUTION = ("bundled sample: 240 requests of the Azure LLM inference trace 2023 (conversation), "
                      "Azure Public Dataset, CC-BY 4.0 (Patel et al., Splitwise, ISCA 2024)")

# (JSON key, column name, definition): the CLI prints these, `--json` carries them by key.
DEFINITIONS = (
    ("waste_ratio", "F", "1 - live tokens / (allocated blocks x S), time-weighted (Eq. 1), naive-evict"),
    ("frac_blocks_le_half", "u <= 50%", "fraction of allocated blocks with at most half of their slots live"),
    ("trapped_bytes", "trapped", "naive-evict's (allocated blocks x S - live tokens) x KV bytes per token"),
    ("reclaimable_bytes", "reclaim", "max(0, trapped(naive-evict) - trapped(vtoken)); blocks: / KV bytes per block"),
    ("room_for_more_requests", "room for", "max C(vtoken) - max C(naive-evict), from the per-variant table: the "
                                           "more requests vToken fits all at once (+: at least; the search reached "
                                           "its cap)"),
    ("retained_blocks_per_request", "blocks/req", "allocated blocks per resident request, per variant"),
    ("max_concurrency", "max C", "largest C <= the search cap whose C requests, all resident from t = 0, "
                                 "never need more blocks than the budget (analysis.frontier)"),
    ("ranges", "range", "for a server's workload: min and max of a figure over the replays with every length at "
                        "its histogram bucket's lower edge, interpolated, and at its upper edge"),
)
# The figures that `ranges` covers; max_concurrency per variant.
RANGE_FIGURES = ("waste_ratio", "frac_blocks_le_half", "trapped_bytes", "reclaimable_bytes", "reclaimable_blocks",
                 "room_for_more_requests")

_POLICY_TITLES = {"h2o": "H2O", "streaming_llm": "StreamingLLM", "scissorhands": "Scissorhands",
                  "random": "Random", "tova": "TOVA"}


@dataclass(frozen=True)
class AuditReport:
    deployment: Deployment
    live: LiveState | None  # when read from a server
    gpus: NvmlReport
    trace: Trace
    policies: tuple[PolicyAudit, ...]
    verdict: str
    # "low" / "high": the policies replayed at the buckets' edges (a server's workload only)
    edges: Mapping[str, tuple[PolicyAudit, ...]] = field(default_factory=dict)
    loop: LoopComparison | None = None  # a vToken server: its measured waste beside the sim's

    @property
    def is_waste_measured(self) -> bool:
        """The server exports vToken's own metrics: its waste is measured there, not simulated."""
        return self.live is not None and bool(self.live.metrics.vtoken_metrics)

    def ranges(self, policy_idx: int) -> dict[str, Any] | None:
        """{figure: (min, max)} over the mid and edge replays, max_concurrency per variant; None
        without edge replays."""
        if not self.edges:
            return None
        replays = [self.policies[policy_idx]] + [e[policy_idx] for e in self.edges.values()]
        ranges: dict[str, Any] = {}
        for figure in RANGE_FIGURES:
            values = [_figure(p, figure) for p in replays]
            ranges[figure] = (min(values), max(values))
        ranges["max_concurrency"] = {
            v: (min(p.capacity[v].max_concurrency for p in replays), max(p.capacity[v].max_concurrency for p in replays))
            for v in AUDIT_VARIANTS}
        return ranges


@dataclass(frozen=True)
class ReplicaFailure:
    target: str  # the URL, credentials removed
    reason: str  # the one-line error


@dataclass(frozen=True)
class DeploymentAudit:
    """Several replicas: one report each (a data-parallel server's engines too) and the ones
    that did not answer. The deployment's figures are the replicas' sums (`totals`)."""

    replicas: tuple[AuditReport, ...]
    failures: tuple[ReplicaFailure, ...]

    def totals(self) -> dict[str, Any]:
        """Per policy the sums over replicas of trapped, reclaimable and room-for figures and of
        max_concurrency per variant (each replica has its own pool); with ranges, sums of mins and maxes."""
        by_policy: dict[str, Any] = {}
        for idx, policy in enumerate(self.replicas[0].deployment.policies):
            audits = [(r, r.policies[idx]) for r in self.replicas if idx < len(r.policies) and
                      r.policies[idx].policy == policy]
            total: dict[str, Any] = {f: sum(_figure(p, f) for _, p in audits) for f in RANGE_FIGURES[2:]}
            total["max_concurrency"] = {v: sum(p.capacity[v].max_concurrency for _, p in audits) for v in AUDIT_VARIANTS}
            ranges = [r.ranges(idx) for r, _ in audits]
            if all(rng is not None for rng in ranges):
                total["ranges"] = {f: [sum(rng[f][k] for rng in ranges) for k in (0, 1)] for f in RANGE_FIGURES[2:]}
                total["ranges"]["max_concurrency"] = {
                    v: [sum(rng["max_concurrency"][v][k] for rng in ranges) for k in (0, 1)] for v in AUDIT_VARIANTS}
            by_policy[policy] = total
        observed = [r.deployment.workload.replica for r in self.replicas if r.deployment.workload.replica is not None]
        rates = [w.request_rate_per_s for w in observed]
        return {
            "num_replicas": len(self.replicas), "num_failed": len(self.failures),
            "num_requests_observed": sum(w.num_requests_observed for w in observed) if observed else None,
            "request_rate_per_s": sum(rates) if observed and None not in rates else None,
            "policies": by_policy,
        }


def room_for_more(p: PolicyAudit) -> tuple[int, bool]:
    """The one "room for N more concurrent requests" figure (DEFINITIONS): vtoken's max C minus
    naive-evict's, and whether it is a lower bound (vtoken's search stopped at its cap)."""
    after, before = p.capacity["vtoken"], p.capacity["naive-evict"]
    return after.max_concurrency - before.max_concurrency, after.is_lower_bound


def _figure(p: PolicyAudit, figure: str) -> float:
    if figure == "room_for_more_requests":
        return room_for_more(p)[0]
    return getattr(p, figure) if hasattr(p, figure) else getattr(p.evicted, figure)


# ---- the verdict ---------------------------------------------------------------------------------


def policy_title(policy: str) -> str:
    return _POLICY_TITLES.get(policy, policy)


def budget_phrase(budget: Budget) -> str:
    return f"{budget.keep_ratio * 100:g}%" if budget.keep_ratio is not None else f"{budget.num_tokens} tokens"


def verdict(deployment: Deployment, policies: Sequence[PolicyAudit], live: LiveState | None,
            edges: Mapping[str, Sequence[PolicyAudit]] | None = None, loop: LoopComparison | None = None) -> str:
    """A few plain sentences: the most-trapping policy in the example's words, then the least;
    with edge replays, the worst policy's max C and trapped memory as ranges."""
    worst = max(policies, key=lambda p: (p.evicted.trapped_bytes, p.policy))
    run = worst.evicted
    text = (f"With {policy_title(worst.policy)} at {budget_phrase(deployment.budget)}, "
            f"{100 * run.frac_blocks_le_half:.0f}% of allocated blocks would sit at or below half full; "
            f"{_bytes_phrase(run.trapped_bytes)} trapped")
    if worst.reclaimable_blocks >= 1:
        text += f"; vToken frees {_bytes_phrase(worst.reclaimable_bytes)} ({worst.reclaimable_blocks:.0f} blocks)."
    else:
        text += "; vToken frees less than one block here."
    before, after = worst.capacity["naive-evict"], worst.capacity["vtoken"]
    num_more, is_at_least = room_for_more(worst)
    text += (f" All admitted at once, {_at_least(before)} requests fit without vToken and {_at_least(after)} with it: "
             f"room for {_count(num_more, 'more concurrent request', is_at_least)}.")
    if edges:
        text += _range_sentence(worst, [e[policies.index(worst)] for e in edges.values()])
    if len(policies) > 1:
        best = min(policies, key=lambda p: (p.evicted.trapped_bytes, p.policy))
        text += (f" Least affected: {policy_title(best.policy)} ({_bytes_phrase(best.evicted.trapped_bytes)} "
                 f"trapped, F = {best.evicted.waste_ratio:.2f}).")
    if loop is not None:
        text += _loop_sentence(loop)
    elif live is not None and live.metrics.vtoken_metrics:
        text += " The server runs vToken: its waste is measured there, not simulated (see its vtoken metrics)."
    return text


def _loop_sentence(loop: LoopComparison) -> str:
    m = loop.measured
    what = f"{m.server.variant}" + (f", {policy_title(m.server.policy)}" if m.server.policy else "")
    text = f" The server runs vToken ({what}) and measures its waste:"
    if m.waste_ratio is not None:
        text += f" F = {m.waste_ratio:.3f} ({m.waste_ratio_span})"
        if loop.predicted is not None:
            text += f", the sim predicts {loop.predicted.waste_ratio:.3f} for this workload ({loop.waste_ratio_difference:+.3f})"
    if m.trapped_bytes is not None:
        text += f"; {_bytes_phrase(m.trapped_bytes)} trapped ({m.trapped_span})"
        if loop.predicted is not None:
            text += f", predicted {_bytes_phrase(loop.predicted.trapped_bytes)}"
    return text + "."


def _range_sentence(mid: PolicyAudit, at_edges: Sequence[PolicyAudit]) -> str:
    replays = [mid, *at_edges]

    def span(values: Sequence[float], phrase: Any = str) -> str:
        lo, hi = min(values), max(values)
        return phrase(lo) if lo == hi else f"{phrase(lo)}-{phrase(hi)}"

    before = span([p.capacity["naive-evict"].max_concurrency for p in replays])
    after = span([p.capacity["vtoken"].max_concurrency for p in replays])
    trapped = span([p.evicted.trapped_bytes for p in replays], _bytes_phrase)
    return (f" The server's lengths are known to within their histogram buckets: from the buckets' lower to upper "
            f"edges, {before} requests fit without vToken and {after} with it, {trapped} trapped.")


def _bytes_phrase(num_bytes: float) -> str:
    if num_bytes >= GiB / 100:
        return f"{num_bytes / GiB:.2f} GiB"
    return f"{num_bytes / 2**20:.1f} MiB"


def _at_least(capacity: Capacity) -> str:
    return f"{capacity.max_concurrency}{'+' if capacity.is_lower_bound else ''}"


def _count(number: int, noun: str, is_at_least: bool = False) -> str:
    return f"{number}{'+' if is_at_least else ''} {noun}" + ("" if number == 1 and not is_at_least else "s")


# ---- JSON and CSV rows ---------------------------------------------------------------------------


def report_to_json(report: AuditReport) -> dict:
    """The `--json` object (keys: deployment, live, gpus, workload, policies, definitions, verdict)."""
    d = report.deployment
    return make_json_safe({
        "deployment": {
            "source": d.source, "model": d.model.name, "kv_bytes_per_token": d.model.kv_bytes_per_token,
            "block_size": d.block_size, "num_blocks": d.num_blocks, "kv_bytes_per_block": d.kv_bytes_per_block,
            "kv_cache_bytes": d.num_blocks * d.kv_bytes_per_block, "gpu": d.gpu.name,
            "budget": d.budget.describe(), "interval_tokens": d.interval_tokens,
            "frontier_max_concurrency": d.frontier_max_concurrency, "seed": d.seed, "notes": list(d.notes),
        },
        "live": _live_json(report.live),
        "waste_source": "measured" if report.is_waste_measured else "simulated",
        "gpus": {"devices": [asdict(g) for g in report.gpus.devices], "reason": report.gpus.reason},
        "workload": _workload_json(report),
        "policies": {p.policy: _policy_json(p, report.ranges(idx)) for idx, p in enumerate(report.policies)},
        "edges": {edge: {p.policy: _policy_json(p) for p in audits} for edge, audits in report.edges.items()},
        "closing_the_loop": _loop_json(report.loop) if report.loop else None,
        "definitions": {key: text for key, _, text in DEFINITIONS},
        "verdict": report.verdict,
    })


def _loop_json(loop: LoopComparison) -> dict:
    m, p = loop.measured, loop.predicted
    server = asdict(m.server)
    server["budget"] = m.server.budget.describe() if m.server.budget is not None else None
    predicted = None
    if p is not None:
        predicted = {"waste_ratio": p.waste_ratio, "trapped_bytes": p.trapped_bytes,
                     "trapped_blocks": loop.predicted_trapped_blocks,
                     "utilization_histogram": list(p.utilization_histogram)}
    difference = {"waste_ratio": loop.waste_ratio_difference, "trapped_bytes": loop.trapped_bytes_difference,
                  "trapped_blocks": loop.trapped_blocks_difference,
                  "utilization_histogram": list(loop.histogram_difference) if loop.histogram_difference else None}
    return {
        "server": server, "policy": loop.policy, "variant": loop.variant,
        "measured": {"waste_ratio": m.waste_ratio, "waste_ratio_span": m.waste_ratio_span,
                     "trapped_tokens": m.trapped_tokens, "trapped_bytes": m.trapped_bytes,
                     "trapped_blocks": m.trapped_blocks, "trapped_span": m.trapped_span,
                     "utilization_histogram": list(m.utilization_histogram) if m.utilization_histogram else None},
        "predicted": predicted, "difference": difference, "notes": [*m.notes, *loop.notes],
    }


def deployment_to_json(deployment_audit: DeploymentAudit) -> dict:
    """The `--json` object of several replicas: each replica's report, the failures, the sums."""
    return make_json_safe({
        "replicas": [report_to_json(r) for r in deployment_audit.replicas],
        "failures": [asdict(f) for f in deployment_audit.failures],
        "total": deployment_audit.totals(),
    })


def _workload_json(report: AuditReport) -> dict:
    w = report.deployment.workload
    replica, server = w.replica, w.server
    prompts = np.array([r.num_prompt_tokens for r in report.trace.requests], dtype=float)
    outputs = np.array([r.num_output_tokens for r in report.trace.requests], dtype=float)
    return {
        "source": w.source, "trace": str(report.trace.source), "format": report.trace.format,
        "num_requests": len(report.trace.requests), "concurrency": w.concurrency,
        "is_bundled_sample": w.is_bundled_sample,
        "attribution": SAMPLE_ATTRIBUTION if w.is_bundled_sample else None,
        "num_requests_observed": replica.num_requests_observed if replica is not None else None,
        "num_requests_by_reason": dict(replica.num_requests_by_reason) if replica is not None else None,
        "prompt_tokens": _lengths_json(replica.prompt_tokens) if replica is not None else _trace_lengths(prompts),
        "output_tokens": _lengths_json(replica.output_tokens) if replica is not None else _trace_lengths(outputs),
        "prefix_cache_hit_ratio": replica.prefix_cache_hit_ratio if replica is not None else None,
        "request_rate_per_s": replica.request_rate_per_s if replica is not None else None,
        "window_s": server.window_s if server is not None else None,
        "server_concurrency": replica.concurrency if replica is not None else None,
        "engine": replica.engine if replica is not None else None,
        "notes": list(dict.fromkeys([*w.notes, *report.trace.notes])),
    }


def _lengths_json(dist: LengthDistribution) -> dict:
    return {**_stats_json(dist.mid), "low": _stats_json(dist.low), "high": _stats_json(dist.high),
            "buckets": [{"lo": lo, "hi": hi, "num_requests": n} for (lo, hi), n in
                        zip(dist.bucket_tokens, np.diff(dist.cumulative_counts, prepend=0.0).tolist(), strict=True) if n]}


def _stats_json(stats: LengthStats) -> dict:
    return {"mean": float(stats.mean), "p50": float(stats.p50), "p90": float(stats.p90)}


def _trace_lengths(lengths: np.ndarray) -> dict:
    return {"mean": float(lengths.mean()), "p50": float(np.percentile(lengths, 50)),
            "p90": float(np.percentile(lengths, 90))}


def _policy_json(p: PolicyAudit, ranges: dict[str, Any] | None = None) -> dict:
    run = p.evicted
    return {
        "waste_ratio": run.waste_ratio,
        "frac_blocks_le_half": run.frac_blocks_le_half,
        "utilization_histogram": list(run.utilization_histogram),
        "trapped_bytes": run.trapped_bytes,
        "reclaimable_bytes": p.reclaimable_bytes,
        "reclaimable_blocks": p.reclaimable_blocks,
        "room_for_more_requests": room_for_more(p)[0],
        "retained_blocks_per_request": {v: r.retained_blocks_per_request for v, r in p.runs.items()},
        "max_concurrency": {v: c.max_concurrency for v, c in p.capacity.items()},
        "max_concurrency_is_lower_bound": {v: c.is_lower_bound for v, c in p.capacity.items()},
        "vtoken": {"waste_ratio": p.runs["vtoken"].waste_ratio,
                   "frac_blocks_le_half": p.runs["vtoken"].frac_blocks_le_half,
                   "utilization_histogram": list(p.runs["vtoken"].utilization_histogram),
                   "trapped_bytes": p.runs["vtoken"].trapped_bytes},
        "preemptions": {v: r.preemptions for v, r in p.runs.items()},
        "num_skipped": {v: len(r.skipped) for v, r in p.runs.items()},
        "ranges": ranges,
    }


def _live_json(live: LiveState | None) -> dict | None:
    if live is None:
        return None
    cache = live.cache_config
    return {
        "url": live.url, "model_name": live.model_name, "max_model_len": live.max_model_len,
        "cache_config": {"block_size": cache.block_size, "num_gpu_blocks": cache.num_gpu_blocks,
                         "cache_dtype": cache.cache_dtype, "enable_prefix_caching": cache.enable_prefix_caching,
                         "gpu_memory_utilization": cache.gpu_memory_utilization,
                         "kv_cache_memory_bytes": cache.kv_cache_memory_bytes},
        "kv_cache_usage": live.metrics.kv_cache_usage, "num_requests_running": live.metrics.num_requests_running,
        "num_requests_waiting": live.metrics.num_requests_waiting, "num_preemptions": live.metrics.num_preemptions,
        "vtoken_metrics": dict(live.metrics.vtoken_metrics), "notes": list(live.notes),
    }


def report_rows(report: AuditReport) -> list[dict[str, Any]]:
    """One flat row per policy, for the CSV of `--output`."""
    rows = []
    for p in report.policies:
        row: dict[str, Any] = {"policy": p.policy}
        policy_json = _policy_json(p, report.ranges(report.policies.index(p)))
        for key, value in policy_json.items():
            if key == "ranges":
                row.update(_flat_ranges(value or {}))
            elif isinstance(value, dict):
                row.update({f"{key}.{k}": v for k, v in value.items() if not isinstance(v, list)})
            elif isinstance(value, list):
                row.update({f"{key}.{i}": v for i, v in enumerate(value)})
            else:
                row[key] = value
        rows.append(make_json_safe(row))
    return rows


def _flat_ranges(ranges: Mapping[str, Any], prefix: str = "ranges") -> dict[str, Any]:
    """{"ranges.trapped_bytes.min": ..., "ranges.max_concurrency.vtoken.max": ...}"""
    flat: dict[str, Any] = {}
    for key, value in ranges.items():
        if isinstance(value, Mapping):
            flat.update(_flat_ranges(value, f"{prefix}.{key}"))
        else:
            flat.update({f"{prefix}.{key}.min": value[0], f"{prefix}.{key}.max": value[1]})
    return flat
