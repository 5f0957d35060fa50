"""rich renderables of `vtoken compare`: the header, the memory and performance tables, the
histograms, the sweep and the frontier; `hf_report` for the measured run of a real engine.

Every table has a wide layout (one row per variant) and, where that does not fit, a narrow one
(one row per figure, one column per variant): nothing is cut at 80 columns.
"""

from __future__ import annotations

from collections.abc import Sequence

from rich.console import Group, RenderableType
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from vtoken.analysis import Frontier
from vtoken.compare import CompareReport, step_times_json
from vtoken.engine.batch_limits import vllm_batch_defaults
from vtoken.hardware import GiB
from vtoken.rounds import RoundsRecord, Spread, run_figures
from vtoken_cli.render.common import WideOrNarrow, definitions_table, fields_panel, figure_table, histograms, titled

DEFINITIONS = (
    ("F (waste ratio)", "1 - live tokens / (allocated blocks x S), time-weighted (Eq. 1)"),
    ("<=50% blocks", "fraction of allocated blocks with at most half of their slots live"),
    ("blocks/req", "allocated blocks per resident request, time-weighted"),
    ("mem util", "live tokens / allocated token capacity (1 - F)"),
    ("trapped", "(allocated capacity - live tokens) x KV bytes per token, time-weighted mean"),
    ("moved, reclaimed", "tokens relocated, blocks returned to the free pool by vToken's compaction"),
    ("throughput", "output tokens / makespan (first arrival to last completion)"),
    ("p50/p95/p99", "per-request end-to-end latency; numpy 'linear' percentiles"),
    ("TTFT / TPOT", "arrival to first token / (end - first token) / (output tokens - 1)"),
    ("SLA", "factor x Naive-Evict p95 at C_ref; C_sel = highest-throughput C within it"),
    ("frontier", "C requests resident at t=0; feasible when peak block demand <= budget"),
    ("max feasible C", "largest tried C feasible with every smaller tried C; N+ when the largest tried is feasible"),
)

# (header in the wide table, label in the narrow one)
MEMORY_COLUMNS = (("F", "F (waste ratio)"), ("<=50% blocks", "blocks <=50% live"), ("blocks/req", "blocks per request"),
                  ("peak blocks", "peak blocks"), ("mem util", "memory utilization"), ("trapped GiB", "trapped GiB"),
                  ("moved", "tokens moved"), ("reclaimed", "blocks reclaimed"))
SPEED_COLUMNS = (("tok/s", "throughput tok/s"), ("p50 s", "e2e p50 s"), ("p95 s", "e2e p95 s"), ("p99 s", "e2e p99 s"),
                 ("TTFT p95 s", "TTFT p95 s"), ("TPOT p95 ms", "TPOT p95 ms"), ("preempted", "preemptions"))


def variant_table(title: str, columns: Sequence[tuple[str, str]], rows: dict[str, Sequence[RenderableType]],
                  caption: str | None = None) -> Group:
    return titled(title, figure_table("variant", columns, rows), caption)


def summary_tables(report: CompareReport) -> Group:
    memory, speed = {}, {}
    for name, r in report.runs.items():
        memory[name] = [
            f"{r.waste_ratio:.3f}", f"{100 * r.frac_blocks_le_half:.1f}%", f"{r.retained_blocks_per_request:.1f}",
            f"{r.peak_allocated_blocks:,}", f"{100 * r.memory_utilization:.1f}%", f"{r.trapped_bytes / GiB:.2f}",
            f"{r.tokens_moved:,}", f"{r.blocks_reclaimed:,}",
        ]
        speed[name] = [
            _with_ci(report, name, "throughput_tok_s", "{:.0f}"), _with_spread(report, name, "latency_p50_s", "{:.2f}"),
            _with_ci(report, name, "latency_p95_s", "{:.2f}"), _with_spread(report, name, "latency_p99_s", "{:.2f}"),
            _with_spread(report, name, "ttft_p95_s", "{:.3f}"), _with_spread(report, name, "tpot_p95_s", "{:.1f}", 1000),
            f"{r.preemptions:,}",
        ]
    return Group(variant_table("Memory (same trace, same eviction decisions)", MEMORY_COLUMNS, memory),
                 variant_table("Performance (latencies end-to-end unless named)", SPEED_COLUMNS, speed,
                               spread_caption(report)))


def _with_ci(report: CompareReport, variant: str, key: str, fmt: str) -> str:
    """A headline figure; with repeats, ± half its 95% CI; measured over rounds, [min-max]."""
    if report.options.repeats <= 1:
        return _with_spread(report, variant, key, fmt)
    ci = report.headline_ci[variant][key]
    return fmt.format(report.runs[variant].headline()[key]) + " ±" + fmt.format((ci.high - ci.low) / 2)


def _with_spread(report: CompareReport, variant: str, key: str, fmt: str, scale: float = 1.0) -> str:
    """`report.runs[variant]`'s figure `key` x `scale`, and where it was measured over several
    rounds its [min-max] over them."""
    measured = report.measured
    spread = measured.spread[variant][key] if measured is not None and measured.spread else None
    return value_with_range(run_figures(report.runs[variant])[key], spread, fmt, scale)


def value_with_range(value: float, spread: Spread | None, fmt: str, scale: float = 1.0) -> str:
    """`value [min-max]` of a figure measured over rounds (the value alone for one round)."""
    text = fmt.format(scale * value)
    if spread is None or len(spread.values) <= 1:
        return text
    return f"{text} [{fmt.format(scale * spread.min)}-{fmt.format(scale * spread.max)}]"


def spread_caption(report: CompareReport) -> str | None:
    """What the figures of a measurement over rounds are."""
    measured = report.measured
    if measured is None or measured.rounds is None or measured.rounds.num_rounds <= 1:
        return None
    return (f"each variant's round of median throughput; [min-max] over {measured.rounds.num_rounds} rounds "
            f"(after {rounds_warmup_phrase(measured.rounds)})")


def rounds_warmup_phrase(rounds: RoundsRecord) -> str:
    if rounds.num_warmup == 0:
        return "no warm-up"
    return f"{rounds.num_warmup} warm-up replay{'s' if rounds.num_warmup > 1 else ''} of each variant, dropped"


def rounds_phrase(rounds: RoundsRecord) -> str:
    """The header's line: rounds, warm-up, the order the variants ran in."""
    order = "; ".join(", ".join(variants) for variants in rounds.order)
    return (f"{rounds.num_rounds} round{'s' if rounds.num_rounds > 1 else ''} after {rounds_warmup_phrase(rounds)}; "
            f"order: {order}")


def utilization_histograms(report: CompareReport) -> Group:
    return histograms([(name, r.utilization_histogram) for name, r in report.runs.items()],
                      "Histograms of block utilization u = live / S: share of allocated blocks per tenth, time-weighted")


def sweep_table(report: CompareReport) -> RenderableType:
    if report.sla is None:
        return Text("sweep skipped (--no-sweep, or an executor other than sim)")
    sla = report.sla
    title = (f"Concurrency sweep: SLA = {sla.factor:g} x naive-evict p95 {sla.metric} at C={sla.reference_concurrency}"
             f" = {sla.threshold_s:.2f} s")
    caption = f"* = C_sel (most tok/s within the SLA), ✗ = p95 {sla.metric} over the SLA"
    variants = list(dict.fromkeys(p.variant for p in report.sweep))
    concurrencies = sorted({p.concurrency for p in report.sweep})
    point = {(p.variant, p.concurrency): p for p in report.sweep}

    def cells(variant: str, c: int) -> tuple[str, str]:
        p = point[(variant, c)]
        star = " *" if sla.c_sel.get(variant) == c else ""
        over = " ✗" if p.p95_s > sla.threshold_s else ""
        return f"{p.throughput_tok_s:.0f}{star}", f"{p.p95_s:.2f}{over}"

    wide, narrow = Table(), Table()
    for table in (wide, narrow):
        table.add_column("C", justify="right", no_wrap=True)
    for variant in variants:
        wide.add_column(f"{variant} tok/s", justify="right", no_wrap=True)
        wide.add_column(f"p95 {sla.metric} s", justify="right", no_wrap=True)
        narrow.add_column(f"{variant}\ntok/s | p95 {sla.metric} s", justify="right", no_wrap=True)
    for c in concurrencies:
        pairs = [cells(v, c) for v in variants]
        wide.add_row(str(c), *(cell for pair in pairs for cell in pair))
        narrow.add_row(str(c), *(f"{tput} | {p95}" for tput, p95 in pairs))
    return titled(title, WideOrNarrow(wide, narrow), caption)


def max_feasible_phrase(frontier: Frontier, variant: str) -> str:
    """`22`, or `48+` when the largest concurrency tried is feasible (the true maximum is at least that)."""
    best = frontier.max_feasible_concurrency[variant]
    largest_tried = max((p.concurrency for p in frontier.points if p.variant == variant), default=0)
    return f"{best}+" if best and best == largest_tried else str(best)


def demand_text(demand: float, is_feasible: bool) -> str:
    """Peak demand / budget with as many digits as it takes to tell over the budget from within it
    (1.0032 is `1.003`, not `1.00`)."""
    for digits in range(2, 7):
        text = f"{demand:.{digits}f}"
        if (float(text) > 1.0) == (demand > 1.0) and (float(text) != 1.0 or demand == 1.0):
            break
    return text if is_feasible else f"{text} ✗"


def frontier_table(report: CompareReport) -> RenderableType:
    fr = report.frontier
    if fr is None:
        return Text("frontier skipped (--no-frontier, or an executor other than sim)")
    title = f"Capacity frontier: peak block demand / budget of {fr.budget_blocks:,} blocks"
    caption = (f"✗ = over the budget; max feasible C: N+ = the largest C tried fits; ideal packing (every request "
               f"holds only its kept tokens' blocks) fits {fr.ideal_max_concurrency}")
    table = Table()
    table.add_column("C", justify="right", no_wrap=True)
    variants = list(fr.max_feasible_concurrency)
    for variant in variants:
        table.add_column(variant, justify="right", no_wrap=True)
    point = {(p.variant, p.concurrency): p for p in fr.points}
    concurrencies = sorted({p.concurrency for p in fr.points})
    for c in concurrencies:
        row = [point[(v, c)] for v in variants]
        table.add_row(str(c), *(Text(demand_text(p.normalized_demand, p.is_feasible),
                                     style="green" if p.is_feasible else "red") for p in row),
                      end_section=c == concurrencies[-1])
    table.add_row("max feasible C", *(max_feasible_phrase(fr, v) for v in variants), style="bold")
    return titled(title, table, caption)


def arrivals_phrase(concurrency: int | None) -> str:
    return "open loop (trace timestamps)" if concurrency is None else f"closed loop, concurrency {concurrency}"


def reclaim_phrase(cfg) -> str:
    budget = cfg.reclaim.max_moves_per_step
    moved = "a lazy round in one step" if budget is None else f"a lazy round moves at most {budget:,} tokens a step"
    return f"{cfg.reclaim.mode}, theta_F {cfg.reclaim.theta_f:g}, {moved}"


def scheduler_phrase(experiment) -> str:
    """vLLM V1's limits of the run, and whether they are vLLM's defaults on the GPU."""
    sched, vllm = experiment.scheduler, vllm_batch_defaults(experiment.gpu)
    chunked = "chunked prefill on" if sched.enable_chunked_prefill else "chunked prefill off"
    if sched.long_prefill_token_threshold:
        chunked += f", chunks of at most {sched.long_prefill_token_threshold:,} tokens"
    if sched.evict_every_chunk:
        chunked += ", policy after every chunk"
    is_default = (sched.max_num_batched_tokens, sched.max_num_seqs) == (vllm.max_num_batched_tokens, vllm.max_num_seqs)
    origin = f"vllm serve's defaults on {experiment.gpu.name}" if is_default else "flags, the sim profile or the engine's own defaults: see the notes"
    return (f"vLLM V1: {sched.max_num_batched_tokens:,} tokens a step, at most {sched.max_num_seqs:,} running, "
            f"{chunked} ({origin})")


def header_rows(report: CompareReport, model_line: str) -> list[tuple[str, str]]:
    """The run's configuration, one value per line: trace, model, GPU, KV budget, eviction,
    reclaim, arrivals, seed, executor, then the notes."""
    cfg = report.experiment
    seed = f"{cfg.seed}" + (f" ({report.options.repeats} repeats: seeds {cfg.seed}-{cfg.seed + report.options.repeats - 1},"
                            " 95% CI)" if report.options.repeats > 1 else "")
    rows = [
        ("trace", f"{report.trace.source} ({report.trace.format}, {len(report.trace.requests):,} requests)"),
        ("model", model_line),
        ("GPU", cfg.gpu.name),
        ("KV cache", f"{cfg.num_blocks:,} blocks of {cfg.block_size} tokens (block size {cfg.block_size})"),
        ("policy", f"{cfg.eviction.policy}, {cfg.eviction.budget.describe()}"),
        ("eviction", f"every {cfg.eviction.interval_tokens} tokens"),
        ("reclaim", reclaim_phrase(cfg)),
        ("arrivals", arrivals_phrase(report.options.concurrency)),
        ("scheduler", scheduler_phrase(cfg)),
        ("seed", seed),
        ("executor", report.executor),
        ("step times", step_times_json(cfg.sim, report.executor)["description"]),
    ]
    rows += [("note", n) for n in report.trace.notes]
    skipped = {name: len(r.skipped) for name, r in report.runs.items() if r.skipped}
    if skipped:
        rows.append(("skipped", "requests that do not fit the budget: "
                     + ", ".join(f"{v} {n}" for v, n in skipped.items())))
    return rows


def header_panel(report: CompareReport) -> Panel:
    cfg = report.experiment
    model_line = f"{cfg.model.name} ({cfg.model.kv_bytes_per_token:,} KV bytes/token)"
    return fields_panel(header_rows(report, model_line), f"vtoken compare ({report.executor} executor)")


def compare_report(report: CompareReport, explain: bool) -> Group:
    parts = [header_panel(report), summary_tables(report), utilization_histograms(report), sweep_table(report),
             frontier_table(report)]
    if explain:
        parts.append(definitions_table(DEFINITIONS, "Definitions"))
    return Group(*parts)


HF_COLUMNS = (("F", "F (waste ratio)"), ("peak blocks", "peak blocks"), ("mem util", "memory utilization"),
              ("tok/s", "throughput tok/s"), ("ms/token", "ms per token"), ("x native", "speed x native"),
              ("engine wall s", "engine wall s"), ("ROUGE-L", "ROUGE-L vs native"), ("length ratio", "length ratio"))


def hf_report(report: CompareReport, explain: bool) -> Group:
    """The measured run: the memory figures next to speed and quality, then the usual tables."""
    hf = report.measured
    cfg = report.experiment
    rows = header_rows(report, f"{hf.model} ({hf.engine}, {cfg.model.kv_bytes_per_token:,} KV bytes/token)")
    if hf.rounds is not None:
        rows.append(("rounds", rounds_phrase(hf.rounds)))
    if hf.naive_vs_vtoken is not None:
        a = hf.naive_vs_vtoken
        rows.append(("agreement", f"naive-evict vs vtoken (same eviction decisions): identical tokens in "
                     f"{a.num_identical}/{a.num_requests} requests, max |Δ logprob| {a.max_abs_logprob_diff:.2e}"))
    if hf.naive_evict_speed:
        rows.append(("naive-evict", hf.naive_evict_speed))
    measured = {}
    for name, run in report.runs.items():
        speed, quality = hf.speed[name], hf.quality.get(name)
        measured[name] = [
            f"{run.waste_ratio:.3f}", f"{run.peak_allocated_blocks:,}", f"{100 * run.memory_utilization:.1f}%",
            _speed_text(hf, name, "tok_s", "{:.1f}"), _speed_text(hf, name, "per_token_latency_s", "{:.1f}", 1000),
            _speed_text(hf, name, "ratio_to_native", "{:.2f}"), _speed_text(hf, name, "engine_wall_s", "{:.1f}"),
            f"{quality.rouge_l_f1:.3f}" if quality else "-", f"{quality.length_ratio:.2f}" if quality else "-",
        ]
    caption = spread_caption(report)
    if hf.naive_evict_speed:
        caption = (f"{caption}; " if caption else "") + "naive-evict's speed here is not Naive-Evict's (see above)"
    parts = [fields_panel(rows, f"vtoken compare ({report.executor} executor)"),
             variant_table("Measured on the model (memory | speed | quality vs native)", HF_COLUMNS, measured, caption),
             summary_tables(report), utilization_histograms(report)]
    if explain:
        parts.append(definitions_table(DEFINITIONS, "Definitions"))
    return Group(*parts)


def _speed_text(measured, variant: str, key: str, fmt: str, scale: float = 1.0) -> str:
    """A measured speed figure of the shown round, with its [min-max] over the rounds."""
    spread = measured.spread[variant][key] if measured.spread else None
    return value_with_range(getattr(measured.speed[variant], key), spread, fmt, scale)
