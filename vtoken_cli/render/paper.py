"""`vtoken paper EXPERIMENT`: the settings, one row per configuration, and the paper's figures
next to vtoken's. Rows are laid out wide where they fit and one row per figure where they do
not (`figure_table`), so nothing is cut at 80 columns."""

from __future__ import annotations

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from vtoken.paper import PaperFigure
from vtoken_cli.render.common import fields_panel, figure_table, titled


def paper_report(figure: PaperFigure) -> Group:
    parts: list[RenderableType] = [fields_panel(_settings_rows(figure), figure.title)]
    parts.append(titled("measured", _rows_table(figure)))
    parts.append(titled("the paper and vtoken", _claims_table(figure)))
    parts += [Text(note, style="yellow") for note in figure.notes]
    return Group(*parts)


def _settings_rows(figure: PaperFigure) -> list[tuple[str, str]]:
    rows = []
    for key, value in figure.settings.items():
        if isinstance(value, dict):
            value = "; ".join(f"{k}: {_plain(v)}" for k, v in value.items())
        elif isinstance(value, list):
            value = ", ".join(str(v) for v in value)
        rows.append((key.replace("_", " "), str(value)))
    return rows


def _plain(value: object) -> str:
    if isinstance(value, dict):
        return ", ".join(f"{k} {_cell(v)}" for k, v in value.items())
    return _cell(value)


def _rows_table(figure: PaperFigure) -> RenderableType:
    keys = list(figure.rows[0])
    name_keys = [k for k in keys if isinstance(figure.rows[0][k], str) or k in ("degree", "concurrency", "value")]
    name_keys = name_keys[:2] if figure.experiment != "fig8" else ["model", "concurrency"]
    figure_keys = [k for k in keys if k not in name_keys]
    columns = [(k.replace("_", " "), k.replace("_", " ")) for k in figure_keys]
    rows = {" ".join(_cell(row[k]) for k in name_keys): [_cell(row[k], k) for k in figure_keys]
            for row in figure.rows}
    return figure_table(" ".join(name_keys), columns, rows)


def _claims_table(figure: PaperFigure) -> Table:
    table = Table()
    table.add_column("figure", overflow="fold")
    table.add_column("paper", overflow="fold")
    table.add_column("vtoken", overflow="fold")
    for claim in figure.claims:
        table.add_row(claim.figure, claim.paper, claim.vtoken)
    return table


def _cell(value: object, key: str = "") -> str:
    if value is None:
        return "-"
    if isinstance(value, bool) or isinstance(value, str):
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if key.endswith(("_pct", "_pts")):
            return f"{value:+.1f}"
        if key.endswith("utilization") or key.endswith("waste"):
            return f"{value:.3f}"
        return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.2f}" if abs(value) >= 1 else f"{value:.3g}"
    return str(value)
