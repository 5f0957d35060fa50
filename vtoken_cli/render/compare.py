"""rich renderables of `vtoken compare`: the header, the memory and performance tables, the
histograms, the sweep and the frontier; `hf_report` for the measured run of `--executor hf`."""

from __future__ import annotations

from rich.console import Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from vtoken.compare import CompareReport
from vtoken.hardware import GiB
from vtoken_cli.render.common import definitions_table, histogram

DEFINITIONS = (
    ("F (waste ratio)", "1 - live tokens / (allocated blocks x S), time-weighted (Eq. 1)"),
    ("<=50% blocks", "fraction of allocated blocks with at most half of their slots live"),
    ("blocks/req", "allocated blocks per resident request, time-weighted"),
    ("mem util", "live tokens / allocated token capacity (1 - F)"),
    ("trapped", "(allocated capacity - live tokens) x KV bytes per token, time-weighted mean"),
    ("throughput", "output tokens / makespan (first arrival to last completion)"),
    ("p50/p95/p99", "per-request end-to-end latency; numpy 'linear' percentiles"),
    ("TTFT / TPOT", "arrival to first token / (end - first token) / (output tokens - 1)"),
    ("SLA", "factor x Naive-Evict p95 at C_ref; C_sel = highest-throughput C within it"),
    ("frontier", "C requests resident at t=0; feasible when peak block demand <= budget"),
)


def histograms_side_by_side(report: CompareReport) -> Table:
    grid = Table.grid(padding=(0, 3))
    runs = report.runs
    grid.add_row(*(histogram(r.utilization_histogram, f"{name}: block utilization") for name, r in runs.items()))
    return grid


def summary_tables(report: CompareReport) -> Group:
    memory = Table(title="Memory (same trace, same eviction decisions)", title_justify="left")
    for column in ("variant", "F", "<=50% blocks", "blocks/req", "peak blocks", "mem util", "trapped GiB", "moved", "reclaimed"):
        memory.add_column(column, justify="left" if column == "variant" else "right")
    speed = Table(title="Performance", title_justify="left")
    for column in ("variant", "tok/s", "p50 s", "p95 s", "p99 s", "TTFT p95 s", "TPOT p95 ms", "preempted"):
        speed.add_column(column, justify="left" if column == "variant" else "right")
    for name, r in report.runs.items():
        memory.add_row(
            name, f"{r.waste_ratio:.3f}", f"{100 * r.frac_blocks_le_half:.1f}%", f"{r.retained_blocks_per_request:.1f}",
            str(r.peak_allocated_blocks), f"{100 * r.memory_utilization:.1f}%", f"{r.trapped_bytes / GiB:.2f}",
            str(r.tokens_moved), str(r.blocks_reclaimed),
        )
        speed.add_row(
            name, _with_ci(report, name, "throughput_tok_s", "{:.0f}"), f"{r.latency.p50_s:.2f}",
            _with_ci(report, name, "latency_p95_s", "{:.2f}"), f"{r.latency.p99_s:.2f}", f"{r.ttft.p95_s:.3f}",
            f"{1000 * r.tpot.p95_s:.1f}", str(r.preemptions),
        )
    return Group(memory, speed)


def _with_ci(report: CompareReport, variant: str, key: str, fmt: str) -> str:
    ci = report.headline_ci[variant][key]
    text = fmt.format(report.runs[variant].headline()[key])
    if report.options.repeats > 1:
        text += " ±" + fmt.format((ci.high - ci.low) / 2)
    return text


def sweep_table(report: CompareReport) -> Table | Text:
    if report.sla is None:
        return Text("sweep skipped (--no-sweep, or an executor other than sim)")
    sla = report.sla
    title = (f"Concurrency sweep: SLA = {sla.factor} x naive-evict p95 {sla.metric} at C={sla.reference_concurrency}"
             f" = {sla.threshold_s:.2f} s   (* = C_sel, ✗ = over SLA)")
    table = Table(title=title, title_justify="left")
    table.add_column("C", justify="right")
    variants = list(dict.fromkeys(p.variant for p in report.sweep))
    for variant in variants:
        table.add_column(f"{variant} tok/s", justify="right")
        table.add_column(f"p95 s", justify="right")
    for c in sorted({p.concurrency for p in report.sweep}):
        row = [str(c)]
        for variant in variants:
            p = next(p for p in report.sweep if p.variant == variant and p.concurrency == c)
            star = " *" if sla.c_sel.get(variant) == c else ""
            over = " ✗" if p.p95_s > sla.threshold_s else ""
            row += [f"{p.throughput_tok_s:.0f}{star}", f"{p.p95_s:.2f}{over}"]
        table.add_row(*row)
    return table


def frontier_table(report: CompareReport) -> Table | Text:
    fr = report.frontier
    if fr is None:
        return Text("frontier skipped (--no-frontier, or an executor other than sim)")
    title = (f"Capacity frontier: budget {fr.budget_blocks} blocks; max feasible C: "
             + ", ".join(f"{v} {c}" for v, c in fr.max_feasible_concurrency.items())
             + f"; ideal packing {fr.ideal_max_concurrency}")
    table = Table(title=title, title_justify="left")
    table.add_column("C", justify="right")
    variants = list(fr.max_feasible_concurrency)
    for variant in variants:
        table.add_column(f"{variant} demand/budget", justify="right")
    for c in sorted({p.concurrency for p in fr.points}):
        row = [str(c)]
        for variant in variants:
            p = next(p for p in fr.points if p.variant == variant and p.concurrency == c)
            row.append(Text(f"{p.normalized_demand:.2f}", style="green" if p.is_feasible else "red"))
        table.add_row(*row)
    return table


def arrivals_phrase(cfg) -> str:
    return "open loop (trace timestamps)" if cfg.concurrency is None else f"closed loop C={cfg.concurrency}"


def budget_phrase(cfg) -> str:
    budget = cfg.reclaim.max_moves_per_round
    return "" if budget is None else f", at most {budget:,} tokens moved per round"


def header_panel(report: CompareReport) -> Panel:
    cfg = report.config
    lines = [
        f"trace {report.trace.source} ({report.trace.format}, {len(report.trace.requests)} requests)",
        f"model {cfg.model.name} ({cfg.model.kv_bytes_per_token} KV bytes/token) on {cfg.gpu.name}; "
        f"{cfg.num_blocks} blocks of {cfg.block_size} tokens",
        f"policy {cfg.eviction.policy}, {cfg.eviction.budget.describe()}, every {cfg.eviction.interval_tokens} tokens; "
        f"reclaim {cfg.reclaim.mode} (theta_F {cfg.reclaim.theta_f}{budget_phrase(cfg)}); {arrivals_phrase(cfg)}; seed {cfg.seed}"
        + (f", {report.options.repeats} repeats (95% CI)" if report.options.repeats > 1 else ""),
    ]
    lines += [f"note: {n}" for n in report.trace.notes]
    skipped = {name: len(r.skipped) for name, r in report.runs.items() if r.skipped}
    if skipped:
        lines.append("skipped requests (do not fit the budget): " + ", ".join(f"{v} {n}" for v, n in skipped.items()))
    return Panel("\n".join(lines), title="vtoken compare (sim executor)", title_align="left")


def compare_report(report: CompareReport, explain: bool) -> Group:
    parts = [header_panel(report), summary_tables(report), histograms_side_by_side(report), sweep_table(report),
             frontier_table(report)]
    if explain:
        parts.append(definitions_table(DEFINITIONS, "Definitions"))
    return Group(*parts)


def hf_report(report: CompareReport, explain: bool) -> Group:
    """The measured run: the memory figures next to speed and quality, then the usual tables."""
    hf = report.measured
    cfg = report.config
    lines = [f"trace {report.trace.source} ({report.trace.format}, {len(report.trace.requests)} requests)",
             f"model {hf.model} ({hf.engine}, {cfg.model.kv_bytes_per_token} KV bytes/token); "
             f"{cfg.num_blocks} blocks of {cfg.block_size} tokens",
             f"policy {cfg.eviction.policy}, {cfg.eviction.budget.describe()}, every {cfg.eviction.interval_tokens} tokens; "
             f"reclaim {cfg.reclaim.mode} (theta_F {cfg.reclaim.theta_f}{budget_phrase(cfg)}); {arrivals_phrase(cfg)}; seed {cfg.seed}"]
    lines += [f"note: {n}" for n in report.trace.notes]
    if hf.naive_vs_vtoken is not None:
        a = hf.naive_vs_vtoken
        lines.append(f"naive-evict vs vtoken (same eviction decisions): identical tokens in {a.num_identical}/{a.num_requests} "
                     f"requests, max |Δ logprob| {a.max_abs_logprob_diff:.2e}")
    table = Table(title="Measured on the model (memory | speed | quality vs native)", title_justify="left")
    for column in ("variant", "F", "peak blocks", "mem util", "tok/s", "ms/token", "x native", "engine wall s",
                   "ROUGE-L", "length ratio"):
        table.add_column(column, justify="left" if column == "variant" else "right")
    for name, run in report.runs.items():
        speed, quality = hf.speed[name], hf.quality.get(name)
        table.add_row(name, f"{run.waste_ratio:.3f}", str(run.peak_allocated_blocks), f"{100 * run.memory_utilization:.1f}%",
                      f"{speed.tok_s:.1f}", f"{1000 * speed.per_token_latency_s:.1f}", f"{speed.ratio_to_native:.2f}",
                      f"{speed.engine_wall_s:.1f}", f"{quality.rouge_l_f1:.3f}" if quality else "-",
                      f"{quality.length_ratio:.2f}" if quality else "-")
    parts = [Panel("\n".join(lines), title=f"vtoken compare ({report.executor} executor)", title_align="left"), table,
             summary_tables(report), histograms_side_by_side(report)]
    if explain:
        parts.append(definitions_table(DEFINITIONS, "Definitions"))
    return Group(*parts)
