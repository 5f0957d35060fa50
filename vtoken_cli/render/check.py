"""rich renderables of `vtoken check-invariants`: the report of the sim and hf executors
(`check_report`) and that of `--executor vllm` (`vllm_check_report`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from vtoken.checker_names import CHECK_UNITS, FAULT_DETECTED_BY, INVARIANT_NAMES, INVARIANTS

if TYPE_CHECKING:  # vtoken.checker imports torch, vtoken.engine.vllm.run vLLM's engine helpers: not at start-up
    from vtoken.checker import CheckReport, Tally
    from vtoken.engine.vllm.run import VllmCheckReport

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
    """hf: which model wrote the K/V and its geometry; sim: nothing (its K/V is synthetic)."""
    if report.options.executor != "hf":
        return ""
    kv = report.kv_layout
    return (f" (model {report.base.model.name}: K/V of {kv.num_layers} layers x {kv.num_kv_heads} KV heads x "
            f"{kv.head_dim} dims {kv.dtype}, written by its forward)")


def _invariant_table(report: CheckReport) -> Table:
    caption = "; ".join(f"{name}: {unit}" for name, unit in CHECK_UNITS.items())
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


# ---- --executor vllm ---------------------------------------------------------------------------

VLLM_INVARIANTS = ("I1", "I2", "I3")
VLLM_CHECK_UNITS = {
    "I1": "live ids after an eviction, or a step's KV copies read back byte for byte",
    "I2": "a scan of all tables and the pool after an eviction",
    "I3": "dense live layout after an eviction, what one request reads and writes in one forward, "
          "or a step's copies landed before its forward",
}
VLLM_NO_I4 = ("I4 has nothing to check on vLLM: a compaction is applied when it is planned, and with prefix "
              "caching off no block is shared")


def vllm_check_report(report: VllmCheckReport, trace_name: str, policy: str, notes: list[str]) -> Group:
    """Header, the invariant table, the violation and the fault line, the verdict."""
    violation = report.violation
    header = Text(f"checked on vLLM: {trace_name}; policy {policy}; naive-evict and vtoken x hole-fill and ordered, "
                  "every check inside vLLM's scheduler and worker" + "".join(f"\nnote: {n}" for n in notes))
    caption = "; ".join(f"{name}: {unit}" for name, unit in VLLM_CHECK_UNITS.items())
    table = Table(title="Invariants", title_justify="left", caption=f"one check = {caption}. {VLLM_NO_I4}",
                  caption_justify="left")
    for column in ("", "invariant", "checked", "violations", "first violation"):
        table.add_column(column, justify="right" if column in ("checked", "violations") else "left")
    for name in VLLM_INVARIANTS:
        failed = violation is not None and violation.invariant == name
        first = "-" if not failed else (
            (f"vLLM block {violation.block_id}, offset {violation.offset} " if violation.block_id is not None else "")
            + f"({violation.run})")
        table.add_row(Text("✗", style="bold red") if failed else Text("✓", style="bold green"),
                      f"{name} {INVARIANT_NAMES[name]}", f"{report.num_checks.get(name, 0):,}",
                      Text(str(int(failed)), style="red" if failed else ""), first)
    parts: list[RenderableType] = [header, table]
    if violation is not None:
        parts.append(Text(violation.message, style="red"))
    if report.fault is not None:
        parts.append(fault_line(report.fault, report.num_faults_injected, [violation.invariant] if violation else []))
    parts.append(_vllm_verdict(report))
    return Group(*parts)


def _vllm_verdict(report: VllmCheckReport) -> Text:
    from vtoken.engine.vllm.run import CHECK_RUNS  # with the report: not at start-up

    counts = (f"{report.num_evictions_checked:,} evictions and {report.num_copies_verified:,} relocations checked "
              f"in {len(report.runs)} of {len(CHECK_RUNS)} runs, {report.elapsed_s:.1f} s")
    violation = report.violation
    if violation is None:
        return Text.assemble(("PASSED ", "bold green"), f"I1-I3 held on every check: {counts}")
    return Text.assemble(("FAILED ", "bold red"), f"{violation.invariant} violated in {violation.run}; the check "
                         f"stopped there (a violation is raised inside vLLM's step): {counts}")
