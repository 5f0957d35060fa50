"""rich renderables of `vtoken check-invariants`: the report of every executor (`check_report`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.console import Group, RenderableType
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from vtoken.checker.names import FAULT_DETECTED_BY, INVARIANT_NAMES, INVARIANTS
from vtoken_cli.render.common import fields_panel, titled

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


def _header(report: CheckReport) -> Panel:
    """What was checked: traces, model, GPU, KV budgets, eviction, reclaim, concurrency, seed,
    executor, then the notes."""
    runs, base, options = report.runs, report.base, report.options
    scenarios = list(dict.fromkeys(r.scenario for r in runs))
    budgets = list(dict.fromkeys((r.num_blocks, r.block_size) for r in runs))
    kv = ", ".join(f"{n:,} blocks of {s} tokens" for n, s in budgets[:4]) + (", ..." if len(budgets) > 4 else "")
    rows = [
        ("runs", f"{len(runs)} over {len(scenarios)} scenarios"),
        ("traces", ", ".join(scenarios[:4]) + (", ..." if len(scenarios) > 4 else "")),
        ("model", base.model.name + _model_part(report)),
        ("GPU", base.gpu.name),
        ("KV cache", f"{kv} (block size {', '.join(str(s) for s in dict.fromkeys(s for _, s in budgets))})"),
        ("policies", ", ".join(options.policies)),
        ("budget", base.eviction.budget.describe()),
        ("eviction", f"every {base.eviction.interval_tokens} tokens"),
        ("reclaim", f"{', '.join(options.reclaim_modes)}; theta_F {base.reclaim.theta_f:g}, eligibility every "
                    f"{base.reclaim.check_interval_steps} iterations"),
        ("arrivals", "open loop (trace timestamps)" if options.concurrency is None else
                     f"closed loop, concurrency {options.concurrency}"),
        ("seed", str(base.seed)),
        ("executor", f"{options.executor}; KV materialized on {report.device}, copy engine '{report.copy_mode}'"
                     + (" (each copy stays in flight across the next forward)" if report.copy_mode == "deferred" else "")),
    ]
    if options.fault is not None:
        rows.append(("fault", options.fault))
    rows += [("note", note) for note in report.notes]
    return fields_panel(rows, f"vtoken check-invariants ({options.executor} executor)")


def _model_part(report: CheckReport) -> str:
    """hf, vllm: which model wrote the K/V and its geometry; sim: nothing (its K/V is synthetic)."""
    if not report.model_kv:
        return ""
    kv = report.kv_layout
    return (f" (K/V of {kv.num_layers} layers x {kv.num_kv_heads} KV heads x {kv.head_dim} dims {kv.dtype}, "
            "written by its forward)")


def _invariant_table(report: CheckReport) -> Group:
    caption = "; ".join(f"{name}: {unit}" for name, unit in report.check_units.items())
    table = Table()
    table.add_column("", no_wrap=True)
    table.add_column("invariant", no_wrap=True)
    table.add_column("checked", justify="right", no_wrap=True)
    table.add_column("violations", justify="right", no_wrap=True)
    table.add_column("first violation", overflow="fold")
    for name, tally in report.tallies.items():
        v = tally.first_violation
        first = "-" if v is None else (
            f"request {_show(v.request_id)} (#{_show(v.req_idx)}), token {_show(v.token_id)}, block {_show(v.block_id)}, "
            f"offset {_show(v.offset)}"
            f" ({v.scenario} {v.policy}/{v.reclaim_mode})"
        )
        table.add_row(_mark(tally), f"{name} {INVARIANT_NAMES[name]}", f"{tally.checked:,}",
                      Text(f"{tally.violations:,}", style="red" if tally.violations else ""), first)
    return titled("Invariants", table, f"one check = {caption}")


def _policy_mode_table(report: CheckReport) -> Group:
    table = Table()
    for column in ("policy", "mode", "relocation events", "tokens moved", *INVARIANTS):
        is_label = column in ("policy", "mode")
        table.add_column(column, justify="left" if is_label else "right", no_wrap=is_label, overflow="fold")
    for group in report.by_policy_mode():
        tallies = group.tallies
        table.add_row(group.policy, group.reclaim_mode, f"{group.relocation_events:,}", f"{group.tokens_moved:,}",
                      *(_cell(tallies[name]) for name in INVARIANTS))
    return titled("Per policy and reclaim mode (all scenarios)", table)


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
