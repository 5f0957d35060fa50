"""What an audit returns and how it reads: `AuditReport`, the verdict sentences, the `--json`
object (`report_to_json`) and the CSV rows of `--output` (`report_rows`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from vtoken.audit.deployment import Deployment
from vtoken.audit.measurement import PolicyAudit
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
    ("room_for_more_requests", "room for", "floor(reclaimable blocks / vtoken's retained blocks per request)"),
    ("retained_blocks_per_request", "blocks/req", "allocated blocks per resident request, per variant"),
    ("max_concurrency", "max C", "largest C <= the search cap whose C requests, all resident from t = 0, "
                                 "never need more blocks than the budget (analysis.frontier)"),
)

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

    @property
    def is_waste_measured(self) -> bool:
        """The server exports vToken's own metrics: its waste is measured there, not simulated."""
        return self.live is not None and bool(self.live.metrics.vtoken_metrics)


# ---- the verdict ---------------------------------------------------------------------------------


def policy_title(policy: str) -> str:
    return _POLICY_TITLES.get(policy, policy)


def budget_phrase(budget: Budget) -> str:
    return f"{budget.keep_ratio * 100:g}%" if budget.keep_ratio is not None else f"{budget.num_tokens} tokens"


def verdict(deployment: Deployment, policies: Sequence[PolicyAudit], live: LiveState | None) -> str:
    """A few plain sentences: the most-trapping policy in the example's words, then the least."""
    worst = max(policies, key=lambda p: (p.evicted.trapped_bytes, p.policy))
    run = worst.evicted
    text = (f"With {policy_title(worst.policy)} at {budget_phrase(deployment.budget)}, "
            f"{100 * run.frac_blocks_le_half:.0f}% of allocated blocks would sit at or below half full; "
            f"{_bytes_phrase(run.trapped_bytes)} trapped")
    if worst.reclaimable_blocks >= 1:
        text += (f"; vToken frees {_bytes_phrase(worst.reclaimable_bytes)} ({worst.reclaimable_blocks:.0f} blocks), "
                 f"room for {_count(worst.room_for_more_requests, 'more concurrent request')}.")
    else:
        text += "; vToken frees less than one block here."
    before, after = worst.capacity["naive-evict"], worst.capacity["vtoken"]
    if after.max_concurrency != before.max_concurrency:
        text += (f" All admitted at once, {before.max_concurrency} requests fit without vToken and "
                 f"{after.max_concurrency}{'+' if after.is_lower_bound else ''} with it.")
    if len(policies) > 1:
        best = min(policies, key=lambda p: (p.evicted.trapped_bytes, p.policy))
        text += (f" Least affected: {policy_title(best.policy)} ({_bytes_phrase(best.evicted.trapped_bytes)} "
                 f"trapped, F = {best.evicted.waste_ratio:.2f}).")
    if live is not None and live.metrics.vtoken_metrics:
        text += " The server runs vToken: its waste is measured there, not simulated (see its vtoken metrics)."
    return text


def _bytes_phrase(num_bytes: float) -> str:
    if num_bytes >= GiB / 100:
        return f"{num_bytes / GiB:.2f} GiB"
    return f"{num_bytes / 2**20:.1f} MiB"


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}" + ("" if number == 1 else "s")


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
        "workload": {
            "source": str(report.trace.source), "format": report.trace.format,
            "num_requests": len(report.trace.requests), "concurrency": d.workload.concurrency,
            "is_bundled_sample": d.workload.is_bundled_sample,
            "attribution": SAMPLE_ATTRIBUTION if d.workload.is_bundled_sample else None,
            "notes": list(report.trace.notes),
        },
        "policies": {p.policy: _policy_json(p) for p in report.policies},
        "definitions": {key: text for key, _, text in DEFINITIONS},
        "verdict": report.verdict,
    })


def _policy_json(p: PolicyAudit) -> dict:
    run = p.evicted
    return {
        "waste_ratio": run.waste_ratio,
        "frac_blocks_le_half": run.frac_blocks_le_half,
        "utilization_histogram": list(run.utilization_histogram),
        "trapped_bytes": run.trapped_bytes,
        "reclaimable_bytes": p.reclaimable_bytes,
        "reclaimable_blocks": p.reclaimable_blocks,
        "room_for_more_requests": p.room_for_more_requests,
        "retained_blocks_per_request": {v: r.retained_blocks_per_request for v, r in p.runs.items()},
        "max_concurrency": {v: c.max_concurrency for v, c in p.capacity.items()},
        "max_concurrency_is_lower_bound": {v: c.is_lower_bound for v, c in p.capacity.items()},
        "vtoken": {"waste_ratio": p.runs["vtoken"].waste_ratio,
                   "frac_blocks_le_half": p.runs["vtoken"].frac_blocks_le_half,
                   "utilization_histogram": list(p.runs["vtoken"].utilization_histogram),
                   "trapped_bytes": p.runs["vtoken"].trapped_bytes},
        "preemptions": {v: r.preemptions for v, r in p.runs.items()},
        "num_skipped": {v: len(r.skipped) for v, r in p.runs.items()},
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
        for key, value in _policy_json(p).items():
            if isinstance(value, dict):
                row.update({f"{key}.{k}": v for k, v in value.items() if not isinstance(v, list)})
            elif isinstance(value, list):
                row.update({f"{key}.{i}": v for i, v in enumerate(value)})
            else:
                row[key] = value
        rows.append(make_json_safe(row))
    return rows
