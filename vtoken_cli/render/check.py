"""rich renderables of `vtoken check-invariants`: the report of every executor (`check_report`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from vtoken.checker.names import FAULT_DETECTED_BY, INVARIANT_NAMES, INVARIANTS

if TYPE_CHECKING:
    from vtoken.checker import CheckReport, Tally

def check_report(report: CheckReport) -> Group:
    parts: list[RenderableType] = [_header(report), _invariant_table(report), _policy_mode_table(report)]
    messages = [f"{name}: {t.first_violation.message}" for name, t in report.tallies.items() if t.first_violation]
    if messages:
        parts.append(Text("\n".join(messages), style="red"))
    if report.options.fault is not None:
        caught_by = [name for name, t in report.tallies.items() if t.violations]
        parts.append(fault_line(report.options.fault, sum(r.faults_injected for r in report.runs), caught_by))
    parts.append(_verdict(report))
    return Group(*parts)


def _header(report: CheckReport) -> Text:
    runs = report.runs
    scenarios = list(dict.fromkeys(r.scenario for r in runs))
    lines = [
        f"{len(runs)} runs over {len(scenarios)} scenarios ({', '.join(scenarios[:4])}{', ...' if len(scenarios) > 4 else ''}); "
        f"policies {', '.join(report.options.policies)}; reclaim modes {', '.join(report.options.reclaim_modes)}",
        f"executor {report.options.executor}{_model_part(report)}; KV materialized on {report.device}, "
        f"copy engine '{report.copy_mode}'"
        + (" (each copy stays in flight across the next forward)" if report.copy_mode == "deferred" else ""),
    ]
    lines += [f"note: {note}" for note in report.notes]
    return Text("\n".join(lines))


def _model_part(report: CheckReport) -> str:
    """hf, vllm: which model wrote the K/V and its geometry; sim: nothing (its K/V is synthetic)."""
    if not report.model_kv:
        return ""
    kv = report.kv_layout
    return (f" (model {report.base.model.name}: K/V of {kv.num_layers} layers x {kv.num_kv_heads} KV heads x "
            f"{kv.head_dim} dims {kv.dtype}, written by its forward)")


def _invariant_table(report: CheckReport) -> Table:
    caption = "; ".join(f"{name}: {unit}" for name, unit in report.check_units.items())
    table = Table(title="Invariants", title_justify="left", caption=f"one check = {caption}", caption_justify="left")
    for column in ("", "invariant", "checked", "violations", "first violation"):
        table.add_column(column, justify="right" if column in ("checked", "violations") else "left")
    for name, tally in report.tallies.items():
        v = tally.first_violation
        first = "-" if v is None else (
            f"request {_show(v.request_id)} (#{_show(v.req_idx)}), token {_show(v.token_id)}, block {_show(v.block_id)}, "
            f"offset {_show(v.offset)}"
            f" ({v.scenario} {v.policy}/{v.reclaim_mode})"
        )
        table.add_row(_mark(tally), f"{name} {INVARIANT_NAMES[name]}", f"{tally.checked:,}",
                      Text(f"{tally.violations:,}", style="red" if tally.violations else ""), first)
    return table


def _policy_mode_table(report: CheckReport) -> Table:
    table = Table(title="Per policy and reclaim mode (all scenarios)", title_justify="left")
    for column in ("policy", "mode", "relocations", "tokens moved", *INVARIANTS):
        table.add_column(column, justify="left" if column in ("policy", "mode") else "right")
    for group in report.by_policy_mode():
        tallies = group.tallies
        table.add_row(group.policy, group.reclaim_mode, f"{group.relocation_events:,}", f"{group.tokens_moved:,}",
                      *(_cell(tallies[name]) for name in INVARIANTS))
    return table


def _cell(tally: Tally) -> Text:
    """Checks done, in green; or failed/done in red."""
    if tally.violations:
        return Text(f"{tally.violations:,}✗/{tally.checked:,}", style="bold red")
    return Text(f"{tally.checked:,}", style="green")


def _mark(tally: Tally) -> Text:
    return Text("✗", style="bold red") if tally.violations else Text("✓", style="bold green")


def fault_line(fault: str, num_injected: int, caught_by: list[str]) -> Text:
    expected = FAULT_DETECTED_BY[fault]
    if num_injected == 0:
        return Text(f"fault {fault}: never injected (these scenarios never offered the chance); nothing was tested",
                    style="yellow")
    if not caught_by:
        return Text(f"fault {fault}: injected {num_injected} times and NOT detected (expected {expected})", style="bold red")
    return Text(f"fault {fault}: injected {num_injected} times; detected by {', '.join(caught_by)} (expected {expected})",
                style="green" if caught_by == [expected] else "yellow")


def _verdict(report: CheckReport) -> Text:
    stopped = [r for r in report.runs if r.stopped]
    rate = (f"{report.relocation_events:,} relocation events ({report.tokens_moved:,} tokens moved) in "
            f"{report.elapsed_s:.1f} s, {report.relocation_events_per_s:,.0f} events/s")
    text = Text()
    if report.passed:
        text.append("PASSED ", style="bold green")
        text.append(f"I1-I4 held on every event: {rate}")
    else:
        failed = [name for name, t in report.tallies.items() if t.violations]
        text.append("FAILED ", style="bold red")
        text.append(f"{', '.join(failed)} violated: {rate}")
    if stopped:
        run = stopped[0]
        text.append(f"\n{len(stopped)} runs stopped early, e.g. {run.scenario} {run.policy}/{run.reclaim_mode}: {run.stopped}")
    return text


def _show(value) -> str:
    return "-" if value is None else str(value)
