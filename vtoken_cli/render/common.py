"""Renderables more than one command shows: the utilization histograms, a layout that uses the
width it is given, key-value panels and the definitions table.

Everything here fits 80 columns without cutting a word: tables that would not fit are laid out
another way (`WideOrNarrow`), long values wrap inside their panel instead of running off it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from rich.console import Console, ConsoleOptions, Group, RenderableType, RenderResult
from rich.measure import Measurement
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

BAR_WIDTH = 20
BIN_LABELS = [f"{10 * i}-{10 * (i + 1)}%" for i in range(10)]
BIN_EDGES_PERCENT = [10 * i for i in range(11)]


class WideOrNarrow:
    """`wide` where its natural width fits the space given, else `narrow`: the same figures laid
    out for 80 columns (stacked, transposed) instead of cut."""

    def __init__(self, wide: RenderableType, narrow: RenderableType) -> None:
        self.wide = wide
        self.narrow = narrow

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        needed = Measurement.get(console, options.update(width=10_000), self.wide).maximum
        yield self.wide if needed <= options.max_width else self.narrow

    def __rich_measure__(self, console: Console, options: ConsoleOptions) -> Measurement:
        return Measurement.get(console, options, self.narrow)


def figure_table(row_header: str, columns: Sequence[tuple[str, str]],
                 rows: Mapping[str, Sequence[RenderableType]]) -> WideOrNarrow:
    """One row per item (variant, policy) with a column per figure where that fits, else one row
    per figure and a column per item. `columns`: (header in the wide table, label in the narrow)."""
    wide = Table()
    wide.add_column(row_header, no_wrap=True)
    for header, _ in columns:
        wide.add_column(header, justify="right", no_wrap=True)
    for name, cells in rows.items():
        wide.add_row(name, *cells)
    narrow = Table()
    narrow.add_column("", overflow="fold")
    for name in rows:
        narrow.add_column(name, justify="right", overflow="fold")
    for idx, (_, label) in enumerate(columns):
        narrow.add_row(label, *(cells[idx] for cells in rows.values()))
    return WideOrNarrow(wide, narrow)


def histogram_scale(histograms: Sequence[Sequence[float]]) -> float:
    """The one bar scale of histograms that are compared: their largest bin."""
    return max((max(h) for h in histograms if len(h)), default=0.0)


def histogram(values: Sequence[float], title: str, scale: float) -> Table:
    """A 10-bin utilization histogram (values are fractions) with unicode bars; a bar of `scale`
    fills BAR_WIDTH, so histograms drawn with the same `scale` can be compared by eye."""
    table = Table(title=title, title_justify="left", show_header=False, box=None, pad_edge=False)
    table.add_column(no_wrap=True, min_width=max(len(label) for label in BIN_LABELS))
    table.add_column(no_wrap=True, min_width=BAR_WIDTH)
    table.add_column(no_wrap=True, justify="right", min_width=6)
    peak = max(scale, 1e-12)
    for label, value in zip(BIN_LABELS, values):
        filled = value / peak * BAR_WIDTH
        bar = "█" * int(filled) + ("▌" if filled - int(filled) >= 0.5 else "")
        table.add_row(label, Text(bar.ljust(BAR_WIDTH), style="cyan"), f"{100 * value:.1f}%")
    return table


def histograms(named: Sequence[tuple[str, Sequence[float]]], heading: str) -> Group:
    """`heading`, then the histograms side by side where they fit, stacked where they do not; all
    on one scale."""
    scale = histogram_scale([values for _, values in named])
    panels = [histogram(values, title, scale) for title, values in named]
    side_by_side = Table.grid(padding=(0, 3))
    side_by_side.add_row(*panels)
    stacked = Group(*[histogram(values, title, scale) for title, values in named])
    scale_note = Text(f"one scale: a full bar is {100 * scale:.1f}% of allocated blocks", style="dim")
    return Group(Text(heading, style="bold"), scale_note, WideOrNarrow(side_by_side, stacked))


def titled(title: str, body: RenderableType, caption: str | None = None) -> Group:
    """`body` under a bold `title` line and over a dim `caption` line, both as wide as the
    console (a table's own title and caption wrap at the table's width)."""
    parts: list[RenderableType] = [Text(title, style="bold"), body]
    if caption:
        parts.append(Text(caption, style="dim"))
    return Group(*parts)


def fields_grid(rows: Sequence[tuple[str, str]]) -> Table:
    """`name  value` lines; a long value wraps under itself."""
    grid = Table.grid(padding=(0, 2))
    grid.add_column(no_wrap=True, style="bold")
    grid.add_column(overflow="fold")
    for name, value in rows:
        grid.add_row(name, value)
    return grid


def fields_panel(rows: Sequence[tuple[str, str]], title: str) -> Panel:
    """A panel of `name  value` lines (`fields_grid`), never cut at its edge."""
    return Panel(fields_grid(rows), title=title, title_align="left")


def definitions_table(definitions: Sequence[tuple[str, str]], title: str) -> Table:
    """(name, definition) rows under `title`."""
    table = Table(title=title, title_justify="left", show_header=False, box=None)
    table.add_column(no_wrap=True)
    table.add_column(overflow="fold")
    for name, text in definitions:
        table.add_row(Text(name, style="bold"), text)
    return table
