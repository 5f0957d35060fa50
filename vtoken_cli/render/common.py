"""Renderables more than one command shows: the utilization histogram and the definitions table."""

from __future__ import annotations

from collections.abc import Sequence

from rich.table import Table
from rich.text import Text

BAR_WIDTH = 24
BIN_LABELS = [f"{10 * i:>3}-{10 * (i + 1)}%" for i in range(10)]


def histogram(values: Sequence[float], title: str) -> Table:
    """A 10-bin utilization histogram drawn with unicode bars (values are fractions)."""
    table = Table(title=title, show_header=False, box=None, pad_edge=False)
    peak = max(max(values), 1e-12)
    for label, value in zip(BIN_LABELS, values):
        filled = value / peak * BAR_WIDTH
        bar = "█" * int(filled) + ("▌" if filled - int(filled) >= 0.5 else "")
        table.add_row(label, Text(bar.ljust(BAR_WIDTH), style="cyan"), f"{100 * value:5.1f}%")
    return table


def definitions_table(definitions: Sequence[tuple[str, str]], title: str) -> Table:
    """(name, definition) rows under `title`."""
    table = Table(title=title, title_justify="left", show_header=False, box=None)
    for name, text in definitions:
        table.add_row(Text(name, style="bold"), text)
    return table
