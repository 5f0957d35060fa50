"""`vtoken sweep`: one block per point (its parameters as a title line, then the variants'
figures in a table that is wide where it fits and one row per figure where it does not), so
nothing is cut at 80 columns."""

from __future__ import annotations

from rich.console import Group, RenderableType
from rich.text import Text

from vtoken.hardware import GiB
from vtoken.sweep import SweepReport
from vtoken_cli.render.common import figure_table, titled

COLUMNS = (("F", "F (waste ratio)"), ("mem util", "memory utilization"), ("trapped GiB", "trapped GiB"),
           ("tok/s", "throughput tok/s"), ("p95 s", "e2e p95 s"), ("preempted", "preemptions"),
           ("moved", "tokens moved"))


def sweep_table(report: SweepReport) -> Group:
    kind = "grid" if report.options.is_grid else "one factor at a time"
    parts: list[RenderableType] = [Text(note, style="yellow") for note in report.trace.notes]
    parts.append(Text(f"Sweep of {', '.join(report.options.keys)} ({kind}, {len(report.points)} points) on "
                      f"{report.trace.source}", style="bold"))
    for idx, point in enumerate(report.points, start=1):
        params = ", ".join(f"{key}={value}" for key, value in point.params.items())
        rows = {variant: (f"{r.waste_ratio:.3f}", f"{100 * r.memory_utilization:.1f}%", f"{r.trapped_bytes / GiB:.2f}",
                          f"{r.throughput_tok_s:.0f}", f"{r.latency.p95_s:.2f}", str(r.preemptions),
                          f"{r.tokens_moved:,}")
                for variant, r in point.runs.items()}
        parts.append(titled(f"point {idx}: {params} ({point.run.experiment.num_blocks:,} blocks)",
                            figure_table("variant", COLUMNS, rows)))
    return Group(*parts)
