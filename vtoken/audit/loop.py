"""Closing the loop on a vToken server: the waste it measures beside what the sim predicts for
the workload it served.

A vToken-enabled vLLM server exports `vtoken_*` metrics (vtoken/engine/vllm/metrics.py) and
runs one variant with one policy and budget (the `vtoken_info` labels). The audit then replays
that policy, budget and eviction interval (unless flags say otherwise) on the server's block
budget, and here the server's figures are set beside the sim's run of the server's variant:

    measured F        over the window: 1 - d live_token_seconds / d allocated_token_seconds
                      between the two scrapes; from one scrape, since the engines started
                      (vtoken_waste_ratio_mean)
    measured trapped  over the window: (d allocated - d live token-seconds) / window seconds,
                      the mean trapped tokens; from one scrape, now (allocated blocks x S - live
                      tokens); x KV bytes per token, / S for blocks
    utilization       vtoken_block_utilization_blocks of the latest scrape: share of allocated
                      blocks per tenth of u = live / S (now, not time-weighted)
    predicted         the sim run of the same variant and policy: its time-weighted F, trapped
                      bytes and utilization histogram (vtoken.metrics)
    difference        measured - predicted

They differ for reasons the comparison does not remove: the sim replays a synthetic trace from
the server's histograms closed loop at the server's concurrency, the server saw real arrivals,
and a one-scrape figure covers a different span than the sim's whole run.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from vtoken.audit.watch import utilization_histogram, vtoken_series, vtoken_total, waste_ratio_now
from vtoken.audit.workload import counter_delta
from vtoken.endpoint import LiveState
from vtoken.metrics import RunResult
from vtoken.policies.base import Budget

_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
_BUDGET = re.compile(r"keep (\d+(?:\.\d+)?)(%| tokens) \((\d+) sinks, (\d+) recent\)")


@dataclass(frozen=True)
class ServerVToken:
    """What the server's vToken runs, from its `vtoken_info` labels (None: a label it lacks)."""

    variant: str
    policy: str | None  # None for native ("none")
    budget: Budget | None  # parsed back from Budget.describe()
    interval_tokens: int | None
    reclaim_mode: str | None
    theta_f: float | None


@dataclass(frozen=True)
class MeasuredWaste:
    server: ServerVToken
    waste_ratio: float | None
    waste_ratio_span: str  # "window (S s)", "since the engines started" or "now"
    trapped_tokens: float | None  # allocated slots without a live token
    trapped_span: str
    trapped_bytes: float | None
    trapped_blocks: float | None  # trapped tokens / S
    utilization_histogram: tuple[float, ...] | None  # share of allocated blocks, now
    notes: tuple[str, ...]


@dataclass(frozen=True)
class LoopComparison:
    measured: MeasuredWaste
    policy: str | None  # of the sim run compared; None when the server's policy was not audited
    variant: str
    predicted: RunResult | None
    kv_bytes_per_block: int  # of the deployment: trapped bytes -> blocks
    notes: tuple[str, ...]

    @property
    def predicted_trapped_blocks(self) -> float | None:
        return self.predicted.trapped_bytes / self.kv_bytes_per_block if self.predicted else None

    @property
    def trapped_blocks_difference(self) -> float | None:
        return _minus(self.measured.trapped_blocks, self.predicted_trapped_blocks)

    @property
    def waste_ratio_difference(self) -> float | None:
        return _minus(self.measured.waste_ratio, self.predicted.waste_ratio if self.predicted else None)

    @property
    def trapped_bytes_difference(self) -> float | None:
        return _minus(self.measured.trapped_bytes, self.predicted.trapped_bytes if self.predicted else None)

    @property
    def histogram_difference(self) -> tuple[float, ...] | None:
        measured = self.measured.utilization_histogram
        if measured is None or self.predicted is None:
            return None
        return tuple(m - p for m, p in zip(measured, self.predicted.utilization_histogram, strict=True))


def server_vtoken(live: LiveState) -> ServerVToken | None:
    """The server's vToken settings, or None when it exports no `vtoken_info`."""
    key = next((k for k in live.metrics.vtoken_metrics if k.startswith("vtoken_info{")), None)
    if key is None:
        return None
    labels = dict(_LABEL.findall(key))
    policy = labels.get("policy")
    return ServerVToken(
        variant=labels.get("variant", "vtoken"), policy=None if policy in (None, "none") else policy,
        budget=_budget(labels.get("budget", "")), interval_tokens=_int(labels.get("interval_tokens")),
        reclaim_mode=labels.get("reclaim_mode"), theta_f=_float(labels.get("theta_f")),
    )


def measure_server_waste(live: LiveState, later: LiveState | None, kv_bytes_per_token: int) -> MeasuredWaste | None:
    """The waste the server measured (module docstring); None without vtoken_* metrics."""
    latest = later or live
    server = server_vtoken(latest)
    metrics = latest.metrics.vtoken_metrics
    if server is None or not metrics:
        return None
    notes: list[str] = []
    block_size = latest.cache_config.block_size
    waste = trapped = None
    if later is not None:
        window_s = later.scraped_at_s - live.scraped_at_s
        earlier = live.metrics.vtoken_metrics
        live_s, allocated_s = (counter_delta(vtoken_total(metrics, name), vtoken_total(earlier, name), name, notes)
                               for name in ("vtoken_live_token_seconds_total", "vtoken_allocated_token_seconds_total"))
        if live_s is not None and allocated_s:
            waste = 1.0 - live_s / allocated_s
            trapped = (allocated_s - live_s) / window_s
            waste_span = trapped_span = f"window {window_s:.1f} s"
        else:
            notes.append("no KV block was allocated during the window: F and trapped are from the latest scrape")
    if waste is None:
        lifetime = vtoken_total(metrics, "vtoken_waste_ratio_mean") if len(vtoken_series(metrics, "vtoken_waste_ratio_mean")) == 1 else None
        waste, waste_span = (lifetime, "since the engines started") if lifetime is not None else (waste_ratio_now(latest), "now")
        live_tokens, blocks = vtoken_total(metrics, "vtoken_live_tokens"), vtoken_total(metrics, "vtoken_allocated_blocks")
        trapped_span = "now"
        if live_tokens is not None and blocks is not None and block_size is not None:
            trapped = blocks * block_size - live_tokens
    return MeasuredWaste(
        server=server, waste_ratio=waste, waste_ratio_span=waste_span, trapped_tokens=trapped, trapped_span=trapped_span,
        trapped_bytes=trapped * kv_bytes_per_token if trapped is not None else None,
        trapped_blocks=trapped / block_size if trapped is not None and block_size else None,
        utilization_histogram=utilization_histogram(metrics), notes=tuple(notes),
    )


def compare_with_sim(measured: MeasuredWaste, runs_by_policy: Mapping[str, Mapping[str, RunResult]],
                     kv_bytes_per_block: int) -> LoopComparison:
    """`measured` beside the sim's run of the server's variant and policy (`runs_by_policy`:
    policy -> variant -> run, the audit's replays)."""
    server = measured.server
    notes = ["the sim replays the audit's workload closed loop at its concurrency; the server saw its own "
             "arrivals: the difference includes that, not only the model's error"]
    if server.variant == "native":
        policy = next(iter(runs_by_policy), None)
    else:
        policy = server.policy if server.policy in runs_by_policy else None
        if policy is None:
            notes.append(f"the server evicts with {server.policy}, which this audit did not replay "
                         f"(pass --policy {server.policy})")
    predicted = runs_by_policy[policy].get(server.variant) if policy is not None else None
    return LoopComparison(measured, policy, server.variant, predicted, kv_bytes_per_block, tuple(notes))


def _budget(text: str) -> Budget | None:
    match = _BUDGET.fullmatch(text)
    if match is None:
        return None
    amount, unit, sinks, recent = match.groups()
    kept = {"keep_ratio": float(amount) / 100} if unit == "%" else {"num_tokens": int(float(amount))}
    return Budget(**kept, num_sink_tokens=int(sinks), num_recent_tokens=int(recent))


def _int(text: str | None) -> int | None:
    return int(text) if text is not None and text.isdigit() else None


def _float(text: str | None) -> float | None:
    try:
        return float(text) if text is not None else None
    except ValueError:
        return None


def _minus(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b
