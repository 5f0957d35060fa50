"""`vtoken validate`: measured (median and spread over the rounds), simulated and the error."""

from __future__ import annotations

from rich.console import Group
from rich.table import Table
from rich.text import Text

from vtoken.validate import ValidationReport
from vtoken_cli.render.common import fields_panel, titled

LABELS = {"throughput_tok_s": ("throughput", "tok/s", 1.0), "ttft_p50_s": ("TTFT p50", "ms", 1e3),
          "ttft_p95_s": ("TTFT p95", "ms", 1e3), "tpot_p50_s": ("TPOT p50", "ms", 1e3),
          "tpot_p95_s": ("TPOT p95", "ms", 1e3), "latency_p50_s": ("e2e p50", "s", 1.0),
          "latency_p95_s": ("e2e p95", "s", 1.0)}


def validation_report(report: ValidationReport) -> Group:
    cfg = report.experiment
    rounds = report.rounds
    order = "; ".join(", ".join(variants) for variants in rounds.order)
    rows = [("trace", report.source),
            ("measured", f"{report.engine}: {rounds.num_warmup} warm-up replay of each variant left out, then "
             f"{rounds.num_rounds} rounds ({order}); median and spread"),
            ("simulated", f"sim, step times {report.step_times}"),
            ("settings", f"{cfg.num_blocks:,} blocks of {cfg.block_size} tokens, C = {report.concurrency}, "
             f"{cfg.eviction.policy} at {cfg.eviction.budget.describe()}, seed {cfg.seed}"),
            ("largest error", f"{100 * report.max_abs_rel_error:.1f}%")]
    parts = [fields_panel(rows, "vtoken validate")]
    for variant, checks in report.checks.items():
        table = Table()
        for header in ("figure", "measured", "spread", "simulated", "error"):
            table.add_column(header, justify="left" if header == "figure" else "right", no_wrap=True)
        for figure, c in checks.items():
            label, unit, scale = LABELS[figure]
            table.add_row(f"{label} ({unit})", _num(scale * c.measured),
                          f"{_num(scale * c.spread.min)}-{_num(scale * c.spread.max)}",
                          _num(scale * c.simulated), f"{100 * c.rel_error:+.1f}%")
        parts.append(titled(variant, table))
    if report.steps:
        table = Table()
        for header in ("kind of step", "steps", "measured mean (ms)", "predicted (ms)", "error"):
            table.add_column(header, justify="left" if header == "kind of step" else "right", no_wrap=True)
        for kind, c in report.steps.items():
            table.add_row(kind, f"{c.num_steps:,}", _num(1e3 * c.measured_mean_s), _num(1e3 * c.predicted_mean_s),
                          f"{100 * c.rel_error:+.1f}%")
        parts.append(titled(f"step model on {report.engine}'s own native steps (the step times' share of the "
                            "error; the rest is the schedule)", table))
    parts.extend(Text(note, style="yellow") for note in report.notes)
    return Group(*parts)


def _num(value: float) -> str:
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"
