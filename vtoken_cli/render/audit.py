"""rich renderables of `vtoken audit`: the deployment, the live server, the workload (for a
server's: its length distributions with their bucket ranges, its rate), waste per policy and per
variant (with ranges over the bucket-edge replays), the histograms, the definitions and the
verdict; `deployment_report` for several replicas, each and in total."""

from __future__ import annotations

from rich.console import Group, RenderableType
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from vtoken.audit import AUDIT_VARIANTS, DEFINITIONS, AuditReport, DeploymentAudit, PolicyAudit, policy_title
from vtoken.audit.measurement import experiment_of
from vtoken.audit.report import room_for_more
from vtoken.audit.workload import LengthDistribution
from vtoken.hardware import GiB
from vtoken_cli.render.common import (
    WideOrNarrow, definitions_table, fields_grid, fields_panel, figure_table, histogram, histogram_scale, histograms,
    titled,
)


def audit_report(report: AuditReport) -> Group:
    parts: list[RenderableType] = [_deployment_panel(report)]
    if report.live is not None:
        parts.append(_live_panel(report))
    parts += [_workload_panel(report)]
    if report.loop is not None:
        parts.append(_loop_table(report))
    parts += [_policy_table(report), _variant_table(report)]
    scale = histogram_scale([r.utilization_histogram for p in report.policies for r in (p.evicted, p.runs["vtoken"])])
    parts += [_histograms(p, scale) for p in report.policies]
    definitions = [(name, text) for _, name, text in DEFINITIONS]
    parts += [definitions_table(definitions, "Definitions (time-weighted means over each run)"),
              Panel(report.verdict, title="Verdict", title_align="left", border_style="bold")]
    return Group(*parts)


def deployment_report(result: DeploymentAudit) -> Group:
    """Each replica's report, then the replicas that did not answer and the deployment's sums."""
    parts: list[RenderableType] = []
    for report in result.replicas:
        parts += [Text(f"Replica {report.deployment.source}", style="bold reverse"), audit_report(report)]
    lines = [f"{len(result.replicas)} replicas audited" + (f", {len(result.failures)} did not answer" if result.failures else "")]
    lines += [f"failed      {f.target}: {f.reason}" for f in result.failures]
    totals = result.totals()
    if totals["num_requests_observed"] is not None:
        lines.append(f"observed    {totals['num_requests_observed']:,} finished requests"
                     + (f", {totals['request_rate_per_s']:.2f} requests/s" if totals["request_rate_per_s"] is not None else ""))
    rows = {}
    for policy, total in totals["policies"].items():
        ranges = total.get("ranges", {})
        rows[policy_title(policy)] = [
            _ranged(total["trapped_bytes"] / GiB, _scaled(ranges.get("trapped_bytes")), "{:.2f}"),
            _ranged(total["reclaimable_bytes"] / GiB, _scaled(ranges.get("reclaimable_bytes")), "{:.2f}"),
            _ranged(total["room_for_more_requests"], ranges.get("room_for_more_requests"), "{}"),
            *(_ranged(total["max_concurrency"][v], ranges.get("max_concurrency", {}).get(v), "{}") for v in AUDIT_VARIANTS),
        ]
    columns = [("trapped GiB", "trapped GiB"), ("reclaim GiB", "reclaimable GiB"), ("room for", "room for more req"),
               *((f"max C {v}", f"max C {v}") for v in AUDIT_VARIANTS)]
    table = titled("Deployment total (sums over replicas; each has its own pool)", figure_table("policy", columns, rows))
    parts += [Panel(Text("\n".join(lines)), title="Deployment", title_align="left"), table]
    return Group(*parts)


def _scaled(bounds: object) -> tuple[float, float] | None:
    return None if bounds is None else (bounds[0] / GiB, bounds[1] / GiB)


def _deployment_panel(report: AuditReport) -> Panel:
    d = report.deployment
    reclaim = experiment_of(d, d.policies[0]).reclaim
    rows = [
        ("source", d.source),
        ("model", f"{d.model.name}: {d.model.num_layers} layers x {d.model.num_kv_heads} KV heads x {d.model.head_dim}, "
                  f"{d.model.kv_bytes_per_token:,} KV bytes/token"),
        ("KV budget", f"{d.num_blocks:,} blocks of {d.block_size} tokens (block size {d.block_size}) = "
                      f"{d.num_blocks * d.kv_bytes_per_block / GiB:.2f} GiB"),
        ("policies", ", ".join(d.policies)),
        ("budget", d.budget.describe()),
        ("eviction", f"every {d.interval_tokens} tokens"),
        ("reclaim", f"vtoken: {reclaim.mode}, theta_F {reclaim.theta_f:g}"),
        ("executor", f"sim, cost model of {d.gpu.name}"),
        ("GPU", d.gpu.name),
        ("seed", str(d.seed)),
    ]
    rows += [("note", n) for n in d.notes]
    rows += [(f"GPU {g.index} here", f"{g.name}: {g.memory_used_bytes / GiB:.1f} of {g.memory_total_bytes / GiB:.1f} "
              "GiB used (NVML)") for g in report.gpus.devices]
    if report.gpus.reason is not None:
        rows.append(("GPUs here", report.gpus.reason))
    return fields_panel(rows, "Deployment")


def _live_panel(report: AuditReport) -> Panel:
    live = report.live
    cache = live.cache_config
    rows = [
        ("server", f"{live.url}  model {live.model_name}"
                   + (f", max_model_len {live.max_model_len}" if live.max_model_len else "")),
        ("cache", f"block size {_show(cache.block_size)}, {_show(cache.num_gpu_blocks)} GPU blocks, dtype "
                  f"{_show(cache.cache_dtype)}, prefix caching {_show(cache.enable_prefix_caching)}, "
                  f"gpu_memory_utilization {_show(cache.gpu_memory_utilization)}"),
        ("load", f"KV usage {_percent(live.metrics.kv_cache_usage)}, {_show(live.metrics.num_requests_running)} running, "
                 f"{_show(live.metrics.num_requests_waiting)} waiting, {_show(live.metrics.num_preemptions)} "
                 "preemptions so far"),
    ]
    rows += [("note", n) for n in live.notes]
    parts: list[RenderableType] = [fields_grid(rows)]
    if report.is_waste_measured:
        metrics = Table("vtoken metric", "value", title_justify="left")
        for name, value in sorted(live.metrics.vtoken_metrics.items()):
            metrics.add_row(name, f"{value:g}")
        parts += [Text("The server runs vToken: its waste is measured, not simulated.", style="bold green"), metrics]
    return Panel(Group(*parts), title="Live server", title_align="left")


def _loop_table(report: AuditReport) -> Group:
    """The server's measured waste beside the sim's run of the same variant and policy."""
    loop, m = report.loop, report.loop.measured
    p = loop.predicted
    table = Table()
    for column in ("figure", "measured on the server", "sim predicts", "difference"):
        table.add_column(column, justify="left" if column == "figure" else "right")
    table.add_row("F (waste ratio)", _with_span(m.waste_ratio, "{:.3f}", m.waste_ratio_span),
                  _fmt(p.waste_ratio if p else None, "{:.3f}"), _fmt(loop.waste_ratio_difference, "{:+.3f}"))
    table.add_row("trapped GiB", _with_span(_gib(m.trapped_bytes), "{:.3f}", m.trapped_span),
                  _fmt(_gib(p.trapped_bytes) if p else None, "{:.3f}"), _fmt(_gib(loop.trapped_bytes_difference), "{:+.3f}"))
    table.add_row("trapped blocks", _with_span(m.trapped_blocks, "{:,.1f}", m.trapped_span),
                  _fmt(loop.predicted_trapped_blocks, "{:,.1f}"), _fmt(loop.trapped_blocks_difference, "{:+,.1f}"))
    server = m.server
    title = (f"Closing the loop: the server's vToken ({server.variant}"
             + (f", {policy_title(server.policy)}" if server.policy else "") + ") measured, beside the sim's "
             + (f"{loop.variant} run of {policy_title(loop.policy)}" if loop.policy else "prediction"))
    parts: list[RenderableType] = [table]
    named = [(name, values) for name, values in (("measured (now)", m.utilization_histogram),
                                                 ("sim predicts", p.utilization_histogram if p else None)) if values]
    if len(named) == 2:
        parts.append(histograms(named, "block utilization u = live / S, share of allocated blocks"))
    elif m.utilization_histogram is None:
        parts.append(Text("the server exports no utilization histogram (vtoken_block_utilization_blocks)", style="dim"))
    return titled(title, Group(*parts), "; ".join([*m.notes, *loop.notes]))


def _with_span(value: float | None, fmt: str, span: str) -> str:
    return "-" if value is None else f"{fmt.format(value)} ({span})"


def _fmt(value: float | None, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def _gib(num_bytes: float | None) -> float | None:
    return None if num_bytes is None else num_bytes / GiB


def _workload_panel(report: AuditReport) -> Panel:
    w = report.deployment.workload
    trace = report.trace
    rows = [("source", f"{w.source}: {trace.source} ({trace.format}), {len(trace.requests)} requests replayed"),
            ("arrivals", f"closed loop, concurrency {w.concurrency}")]
    if w.is_bundled_sample:
        why = "the server has finished no request yet" if report.live is not None else "no workload given"
        rows.append(("sample", f"{why}: using the bundled sample, Azure LLM inference trace 2023 (conversation), "
                               "Azure Public Dataset, CC-BY 4.0"))
    replica = w.replica
    if replica is not None:
        reasons = ", ".join(f"{r} {n:g}" for r, n in replica.num_requests_by_reason.items() if n)
        rows.append(("observed", f"{replica.num_requests_observed:,} finished requests" + (f" ({reasons})" if reasons else "")))
        rows += [_lengths_row("prompt", replica.prompt_tokens), _lengths_row("output", replica.output_tokens)]
        if replica.request_rate_per_s is not None:
            rows.append(("rate", f"{replica.request_rate_per_s:.2f} requests/s over {w.server.window_s:.1f} s"))
        else:
            rows.append(("rate", "not sampled (--window SECONDS scrapes twice)"))
        if replica.prefix_cache_hit_ratio is not None:
            rows.append(("prefix hit", f"{100 * replica.prefix_cache_hit_ratio:.1f}% of queried prompt tokens"))
    rows += [("note", n) for n in dict.fromkeys([*w.notes, *trace.notes])]
    return fields_panel(rows, "Workload")


def _lengths_row(name: str, dist: LengthDistribution) -> tuple[str, str]:
    """`prompt tokens  mean 4.0 (3-5), p50 4.0 (3-5), p90 4.8 (3-5)`: ranges from every request at its bucket's edges."""
    parts = [f"{stat} {getattr(dist.mid, stat):,.1f} ({getattr(dist.low, stat):,.0f}-{getattr(dist.high, stat):,.0f})"
             for stat in ("mean", "p50", "p90")]
    return f"{name} tokens", ", ".join(parts) + "  (bucket edges in brackets)"


def _ranged(value: float, bounds: tuple[float, float] | None, fmt: str) -> str:
    """`value`, with `(lo-hi)` below it when the figure has a range that is not one point."""
    text = fmt.format(value)
    if bounds is None or fmt.format(bounds[0]) == fmt.format(bounds[1]):
        return text
    return f"{text}\n({fmt.format(bounds[0])}-{fmt.format(bounds[1])})"


POLICY_COLUMNS = (("F", "F (waste ratio)"), ("u <= 50%", "blocks u <= 50%"), ("trapped GiB", "trapped GiB"),
                  ("reclaim GiB", "reclaimable GiB"), ("reclaim blocks", "reclaimable blocks"),
                  ("room for", "room for more req"))


def _room_cell(p: PolicyAudit, bounds: tuple[int, int] | None) -> str:
    num_more, is_at_least = room_for_more(p)
    return _ranged(num_more, bounds, "{}" + ("+" if is_at_least else ""))


def _policy_table(report: AuditReport) -> Group:
    rows = {}
    for idx, p in enumerate(report.policies):
        run, ranges = p.evicted, report.ranges(idx) or {}
        rows[policy_title(p.policy)] = [
            _ranged(run.waste_ratio, ranges.get("waste_ratio"), "{:.3f}"), f"{100 * run.frac_blocks_le_half:.1f}%",
            _ranged(run.trapped_bytes / GiB, _scaled(ranges.get("trapped_bytes")), "{:.2f}"),
            _ranged(p.reclaimable_bytes / GiB, _scaled(ranges.get("reclaimable_bytes")), "{:.2f}"),
            f"{p.reclaimable_blocks:,.0f}", _room_cell(p, ranges.get("room_for_more_requests")),
        ]
    captions = ["room for = max C(vtoken) - max C(naive-evict) in the per-variant table"]
    if report.edges:
        captions.append("(lo-hi): over replays with every length at its histogram bucket's lower and upper edge")
    skipped = {p.policy: len(p.evicted.skipped) for p in report.policies if p.evicted.skipped}
    if skipped:
        captions.append("requests larger than the whole budget were skipped: "
                        + ", ".join(f"{k} {n}" for k, n in skipped.items()))
    return titled("Waste per policy (naive-evict: token-level eviction on the paged cache as it is)",
                  figure_table("policy", POLICY_COLUMNS, rows), "; ".join(captions))


def _variant_table(report: AuditReport) -> Group:
    cap = report.deployment.frontier_max_concurrency
    table = Table()
    table.add_column("policy", no_wrap=True)
    table.add_column("variant", no_wrap=True)
    for column in ("F", "blocks per req", "trapped GiB", "max C", "preempt"):
        table.add_column(column, justify="right", overflow="fold")
    for idx, p in enumerate(report.policies):
        max_c_ranges = (report.ranges(idx) or {}).get("max_concurrency", {})
        for variant in AUDIT_VARIANTS:
            run, capacity = p.runs[variant], p.capacity[variant]
            table.add_row(
                policy_title(p.policy) if variant == AUDIT_VARIANTS[0] else "", variant, f"{run.waste_ratio:.3f}",
                f"{run.retained_blocks_per_request:.1f}", f"{run.trapped_bytes / GiB:.2f}",
                _ranged(capacity.max_concurrency, max_c_ranges.get(variant), "{}" + ("+" if capacity.is_lower_bound else "")),
                str(run.preemptions),
                end_section=variant == AUDIT_VARIANTS[-1],
            )
    return titled(f"Per variant (max C: searched up to {cap}; + = at least)", table)


def _histograms(p: PolicyAudit, scale: float) -> Group:
    """naive-evict next to vtoken where both fit, one above the other where not; every policy's
    histograms on one scale."""
    panels = [histogram(p.evicted.utilization_histogram, "naive-evict", scale),
              histogram(p.runs["vtoken"].utilization_histogram, "vtoken", scale)]
    side_by_side = Table.grid(padding=(0, 3))
    side_by_side.add_row(*panels)
    stacked = Group(*[histogram(run.utilization_histogram, name, scale)
                      for name, run in (("naive-evict", p.evicted), ("vtoken", p.runs["vtoken"]))])
    title = f"{policy_title(p.policy)}: block utilization u = live / S, share of allocated blocks"
    return titled(title, WideOrNarrow(side_by_side, stacked), f"one scale: a full bar is {100 * scale:.1f}% of blocks")


def _show(value: object) -> str:
    if value is None:
        return "?"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def _percent(value: float | None) -> str:
    return "?" if value is None else f"{100 * value:.1f}%"
