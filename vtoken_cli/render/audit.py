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
from vtoken.audit.workload import LengthDistribution
from vtoken.hardware import GiB
from vtoken_cli.render.common import definitions_table, histogram


def audit_report(report: AuditReport) -> Group:
    parts: list[RenderableType] = [_deployment_panel(report)]
    if report.live is not None:
        parts.append(_live_panel(report))
    parts += [_workload_panel(report), _policy_table(report), _variant_table(report)]
    parts += [_histograms(report, p) for p in report.policies]
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
    table = Table(title="Deployment total (sums over replicas; each has its own pool)", title_justify="left")
    table.add_column("policy", min_width=12, no_wrap=True)
    for column in ("trapped GiB", "reclaim GiB", "room for", *(f"max C {v}" for v in AUDIT_VARIANTS)):
        table.add_column(column, justify="right")
    for policy, total in totals["policies"].items():
        ranges = total.get("ranges", {})
        table.add_row(
            policy_title(policy), _ranged(total["trapped_bytes"] / GiB, _scaled(ranges.get("trapped_bytes")), "{:.2f}"),
            _ranged(total["reclaimable_bytes"] / GiB, _scaled(ranges.get("reclaimable_bytes")), "{:.2f}"),
            _ranged(total["room_for_more_requests"], ranges.get("room_for_more_requests"), "{}"),
            *(_ranged(total["max_concurrency"][v], ranges.get("max_concurrency", {}).get(v), "{}") for v in AUDIT_VARIANTS),
        )
    parts += [Panel("\n".join(lines), title="Deployment", title_align="left"), table]
    return Group(*parts)


def _scaled(bounds: object) -> tuple[float, float] | None:
    return None if bounds is None else (bounds[0] / GiB, bounds[1] / GiB)


def _deployment_panel(report: AuditReport) -> Panel:
    d = report.deployment
    lines = [
        f"source      {d.source}",
        f"model       {d.model.name}: {d.model.num_layers} layers x {d.model.num_kv_heads} KV heads x "
        f"{d.model.head_dim}, {d.model.kv_bytes_per_token:,} KV bytes/token",
        f"KV budget   {d.num_blocks:,} blocks of {d.block_size} tokens = "
        f"{d.num_blocks * d.kv_bytes_per_block / GiB:.2f} GiB",
        f"eviction    {', '.join(d.policies)}; {d.budget.describe()}, every {d.interval_tokens} tokens",
        f"simulated   sim executor on {d.gpu.name}, seed {d.seed}",
    ]
    lines += [f"note        {n}" for n in d.notes]
    lines += [f"GPU {g.index} here  {g.name}: {g.memory_used_bytes / GiB:.1f} of {g.memory_total_bytes / GiB:.1f} GiB used "
              "(NVML)" for g in report.gpus.devices]
    if report.gpus.reason is not None:
        lines.append(f"GPUs here   {report.gpus.reason}")
    return Panel("\n".join(lines), title="Deployment", title_align="left")


def _live_panel(report: AuditReport) -> Panel:
    live = report.live
    cache = live.cache_config
    lines = [
        f"server      {live.url}  model {live.model_name}" + (f", max_model_len {live.max_model_len}" if live.max_model_len else ""),
        f"cache       block size {_show(cache.block_size)}, {_show(cache.num_gpu_blocks)} GPU blocks, dtype "
        f"{_show(cache.cache_dtype)}, prefix caching {_show(cache.enable_prefix_caching)}, "
        f"gpu_memory_utilization {_show(cache.gpu_memory_utilization)}",
        f"load        KV usage {_percent(live.metrics.kv_cache_usage)}, {_show(live.metrics.num_requests_running)} running, "
        f"{_show(live.metrics.num_requests_waiting)} waiting, {_show(live.metrics.num_preemptions)} preemptions so far",
    ]
    lines += [f"note        {n}" for n in live.notes]
    parts: list[RenderableType] = [Text("\n".join(lines))]
    if report.is_waste_measured:
        metrics = Table("vtoken metric", "value", title_justify="left")
        for name, value in sorted(live.metrics.vtoken_metrics.items()):
            metrics.add_row(name, f"{value:g}")
        parts += [Text("The server runs vToken: its waste is measured, not simulated.", style="bold green"), metrics]
    return Panel(Group(*parts), title="Live server", title_align="left")


def _workload_panel(report: AuditReport) -> Panel:
    w = report.deployment.workload
    trace = report.trace
    lines = [f"source      {w.source}: {trace.source} ({trace.format}), {len(trace.requests)} requests replayed, "
             f"closed loop with {w.concurrency} clients"]
    if w.is_bundled_sample:
        why = "the server has finished no request yet" if report.live is not None else "no workload given"
        lines.append(f"{why}: using the bundled sample, Azure LLM inference trace 2023 (conversation), "
                     "Azure Public Dataset, CC-BY 4.0")
    replica = w.replica
    if replica is not None:
        reasons = ", ".join(f"{r} {n:g}" for r, n in replica.num_requests_by_reason.items() if n)
        lines.append(f"observed    {replica.num_requests_observed:,} finished requests" + (f" ({reasons})" if reasons else ""))
        lines += [_lengths_line("prompt", replica.prompt_tokens), _lengths_line("output", replica.output_tokens)]
        if replica.request_rate_per_s is not None:
            lines.append(f"rate        {replica.request_rate_per_s:.2f} requests/s over {w.server.window_s:.1f} s")
        else:
            lines.append("rate        not sampled (--window SECONDS scrapes twice)")
        if replica.prefix_cache_hit_ratio is not None:
            lines.append(f"prefix hit  {100 * replica.prefix_cache_hit_ratio:.1f}% of queried prompt tokens")
    lines += [f"note: {n}" for n in dict.fromkeys([*w.notes, *trace.notes])]
    return Panel("\n".join(lines), title="Workload", title_align="left")


def _lengths_line(name: str, dist: LengthDistribution) -> str:
    """`prompt  mean 4.0 (3-5), p50 4.0 (3-5), p90 4.8 (3-5)`: ranges from every request at its bucket's edges."""
    parts = [f"{stat} {getattr(dist.mid, stat):,.1f} ({getattr(dist.low, stat):,.0f}-{getattr(dist.high, stat):,.0f})"
             for stat in ("mean", "p50", "p90")]
    return f"{name + ' tokens':<11} " + ", ".join(parts) + "  (bucket edges in brackets)"


def _ranged(value: float, bounds: tuple[float, float] | None, fmt: str) -> str:
    """`value`, with `(lo-hi)` below it when the figure has a range that is not one point."""
    text = fmt.format(value)
    if bounds is None or fmt.format(bounds[0]) == fmt.format(bounds[1]):
        return text
    return f"{text}\n({fmt.format(bounds[0])}-{fmt.format(bounds[1])})"


def _policy_table(report: AuditReport) -> Table:
    table = Table(title="Waste per policy (naive-evict: token-level eviction on the paged cache as it is)",
                  title_justify="left")
    table.add_column("policy", min_width=12, no_wrap=True)
    for column in ("F", "u <= 50%", "trapped GiB", "reclaim GiB", "reclaim blocks", "room for"):
        table.add_column(column, justify="right")
    for idx, p in enumerate(report.policies):
        run, ranges = p.evicted, report.ranges(idx) or {}
        table.add_row(
            policy_title(p.policy), _ranged(run.waste_ratio, ranges.get("waste_ratio"), "{:.3f}"),
            f"{100 * run.frac_blocks_le_half:.1f}%",
            _ranged(run.trapped_bytes / GiB, _scaled(ranges.get("trapped_bytes")), "{:.2f}"),
            _ranged(p.reclaimable_bytes / GiB, _scaled(ranges.get("reclaimable_bytes")), "{:.2f}"),
            f"{p.reclaimable_blocks:,.0f}", _ranged(p.room_for_more_requests, ranges.get("room_for_more_requests"), "{}"),
        )
    if report.edges:
        table.caption = "(lo-hi): over replays with every length at its histogram bucket's lower and upper edge"
    skipped = {p.policy: len(p.evicted.skipped) for p in report.policies if p.evicted.skipped}
    if skipped:
        table.caption = (table.caption + "; " if table.caption else "") + "requests larger than the whole budget were skipped: " + ", ".join(f"{k} {n}" for k, n in skipped.items())
    return table


def _variant_table(report: AuditReport) -> Table:
    cap = report.deployment.frontier_max_concurrency
    table = Table(title=f"Per variant (max C: searched up to {cap}; + = at least)", title_justify="left")
    table.add_column("policy", min_width=12, no_wrap=True)
    table.add_column("variant", min_width=11, no_wrap=True)
    for column in ("F", "blocks per req", "trapped GiB", "max C", "preempt"):
        table.add_column(column, justify="right")
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
    return table


def _histograms(report: AuditReport, p: PolicyAudit) -> Group:
    grid = Table.grid(padding=(0, 2))
    grid.add_row(histogram(p.evicted.utilization_histogram, "naive-evict"),
                 histogram(p.runs["vtoken"].utilization_histogram, "vtoken"))
    title = f"{policy_title(p.policy)}: block utilization u = live / S, share of allocated blocks"
    return Group(Text(title, style="bold"), grid)


def _show(value: object) -> str:
    if value is None:
        return "?"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def _percent(value: float | None) -> str:
    return "?" if value is None else f"{100 * value:.1f}%"
