"""`vtoken sweep`: one table, a row per point and variant."""

from __future__ import annotations

from rich.console import Group
from rich.table import Table
from rich.text import Text

from vtoken.sweep import SweepReport

GiB = 1 << 30


def sweep_table(report: SweepReport) -> Group:
    kind = "grid" if report.options.is_grid else "one factor at a time"
    table = Table(title=f"Sweep of {', '.join(report.options.keys)} ({kind}, {len(report.points)} points) on "
                        f"{report.trace.source}", title_justify="left")
    for column in (*report.options.keys, "blocks", "variant", "F", "mem util", "trapped GiB", "tok/s", "p95 s",
                   "preempted", "tokens moved"):
        table.add_column(column, justify="left" if column == "variant" else "right")
    for point in report.points:
        for i, (variant, r) in enumerate(point.runs.items()):
            params = [str(v) for v in point.params.values()] if i == 0 else [""] * len(point.params)
            table.add_row(*params, str(point.config.num_blocks) if i == 0 else "", variant, f"{r.waste_ratio:.3f}",
                          f"{100 * r.memory_utilization:.1f}%", f"{r.trapped_bytes / GiB:.2f}",
                          f"{r.throughput_tok_s:.0f}", f"{r.latency.p95_s:.2f}", str(r.preemptions),
                          str(r.tokens_moved), end_section=i == len(point.runs) - 1)
    notes = [Text(note, style="yellow") for note in report.trace.notes]
    return Group(*notes, table)
