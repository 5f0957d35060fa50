"""`vtoken check-invariants [TRACE]`: relocations on materialized KV, I1-I4 checked on every event.

The command parses flags into a `RunConfig` and `CheckOptions` (with `--executor hf`, loads the
model), calls `vtoken.checker.check_invariants` and renders the report. `--executor vllm` calls
`vtoken.engine.vllm.run.check_invariants_on_vllm` instead: one engine, the checks (and an
injected fault) inside it. Exit code 0 when every invariant held, 1 on any violation, 2 on bad
input.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer
from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from vtoken.checker_names import (
    CHECK_UNITS, EXECUTORS, FAULT_DETECTED_BY, FAULT_KINDS, HF_LIMITS, INVARIANT_NAMES, INVARIANTS, PRESSURE,
    TraceLimits, default_limits,
)
from vtoken.errors import ConfigError
from vtoken.kv.reclaim import RECLAIM_MODES
from vtoken.policies import DEFAULT_AUDIT_POLICIES, POLICIES
from vtoken.trace import TRACE_FORMATS, load_trace
from vtoken_cli.app import command, stderr, stdout
from vtoken_cli.options import build_run_config
from vtoken_cli.output import check_output_dir, json_writer, progress_bar, write_output_dir

if TYPE_CHECKING:  # vtoken.checker imports torch: the command imports it when it runs, not at start-up
    from vtoken.checker import CheckReport, Tally

SIM_MODEL = "llama-3.1-8b"
SIM_LIMITS = default_limits("sim")


@command("check-invariants")
def check_command(
    trace: Annotated[Optional[Path], typer.Argument(
        help="Trace to replay. Default: every bundled sample trace (sample_traces/).", show_default=False)] = None,
    policy: Annotated[str, typer.Option(
        help=f"Policy, comma-separated policies, or 'all' ({', '.join(DEFAULT_AUDIT_POLICIES)}). "
             f"Known: {', '.join(POLICIES)}.")] = "all",
    reclaim_mode: Annotated[str, typer.Option(help=f"Reclaim planning mode: {', '.join(RECLAIM_MODES)} or 'both'.")] = "both",
    executor: Annotated[str, typer.Option(
        help=f"Executor: {', '.join(EXECUTORS)} or vllm. sim: the cost model, synthetic K/V written by the checker; "
             "hf: a real transformers model, the K/V its forward wrote (traces cut down harder); "
             "vllm: vToken inside vLLM (needs vLLM and --model FOLDER; checks run in its scheduler and worker).")] = "sim",
    inject_fault: Annotated[Optional[str], typer.Option(
        help="Inject a fault the checker must catch, and the invariant that catches it: "
             + ", ".join(f"{kind} ({FAULT_DETECTED_BY[kind]})" for kind in FAULT_KINDS) + ". vllm: inside vLLM's "
             "worker and scheduler, every kind but shared-block (no block is shared there).", show_default=False)] = None,
    fuzz: Annotated[int, typer.Option(
        help="Also run N random scenarios (requests, shared prefixes, budgets, policies, block sizes); "
             "without TRACE, only those.")] = 0,
    seed: Annotated[int, typer.Option(help="Seed of the synthetic attention, the random policy and the fuzz draws.")] = 0,
    num_blocks: Annotated[Optional[int], typer.Option(
        help=f"KV block budget. Default: per trace, {PRESSURE:.0%} of the peak blocks of the `concurrency` largest "
             "requests (pressure: relocation, preemption, block reuse), at most what the model leaves on the GPU.",
        show_default=False)] = None,
    block_size: Annotated[Optional[int], typer.Option(
        help="Tokens per KV block. Default 16 (fuzz: drawn from 4, 8, 16, 32).", show_default=False)] = None,
    model: Annotated[Optional[str], typer.Option(
        help=f"sim: catalog model or HF config.json, the cost model and the GPU block cap (default {SIM_MODEL}). "
             "hf: smollm2-135m or a local Llama/Mistral/Qwen2 folder (default: a tiny random Llama built in a "
             "temporary directory).", show_default=False)] = None,
    gpu: Annotated[str, typer.Option(help="GPU from the catalog: h100-80gb, h200, a100-80gb, l40s.")] = "h100-80gb",
    budget: Annotated[str, typer.Option(help="Tokens each request keeps: a ratio ('50%', '0.5') or a count ('512').")] = "50%",
    eviction_interval: Annotated[int, typer.Option(help="Run the policy after prefill and every N generated tokens.")] = 32,
    concurrency: Annotated[int, typer.Option(help="Closed-loop clients.")] = 8,
    theta_f: Annotated[float, typer.Option(
        "--theta-f", help="Reclaim when the waste ratio F is at least this (low: many relocations).")] = 0.05,
    reclaim_interval: Annotated[int, typer.Option(help="Check reclaim eligibility every N iterations.")] = 1,
    max_requests: Annotated[Optional[int], typer.Option(
        help=f"Replay the first N requests of each trace (0: all). Default {SIM_LIMITS.max_requests} "
             f"(hf: {HF_LIMITS.max_requests}).", show_default=False)] = None,
    max_prompt_tokens: Annotated[Optional[int], typer.Option(
        help=f"Cap prompts at N tokens (0: no cap). Default {SIM_LIMITS.max_prompt_tokens} "
             f"(hf: {HF_LIMITS.max_prompt_tokens}).", show_default=False)] = None,
    max_output_tokens: Annotated[Optional[int], typer.Option(
        help=f"Cap outputs at N tokens (0: no cap). Default {SIM_LIMITS.max_output_tokens} "
             f"(hf: {HF_LIMITS.max_output_tokens}).", show_default=False)] = None,
    trace_format: Annotated[str, typer.Option("--format", help=f"Trace format: {', '.join(TRACE_FORMATS)}.")] = "auto",
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout instead of tables.")] = False,
    output: Annotated[Optional[Path], typer.Option(help="Write report.json and runs.csv into this directory.")] = None,
    force: Annotated[bool, typer.Option(help="Replace a non-empty --output directory.")] = False,
) -> None:
    """Replay traces through the vtoken runtime with materialized KV and check the substrate
    invariants I1-I4 on every relocation event; exit 1 on any violation."""
    if executor not in (*EXECUTORS, "vllm"):
        raise ConfigError(f"unknown executor '{executor}'; check-invariants runs on: {', '.join(EXECUTORS)}, vllm")
    if executor == "vllm":
        from vtoken_cli.cmd_check_vllm import check_on_vllm

        check_on_vllm(trace, model, policy, budget, eviction_interval, theta_f, concurrency, seed, num_blocks,
                      block_size, max_requests, json_out, fault_kind=inject_fault)
        return
    from vtoken.checker import (
        CheckOptions, bundled_sample_traces, check_invariants, load_check_model, num_progress_units, report_to_json,
    )

    limits = default_limits(executor)
    options = CheckOptions(
        policies=parse_policies(policy), reclaim_modes=_reclaim_modes(reclaim_mode), executor=executor, fault=inject_fault,
        num_fuzz_scenarios=fuzz, num_blocks=num_blocks, block_size=block_size,
        limits=TraceLimits(_limit(max_requests, limits.max_requests), _limit(max_prompt_tokens, limits.max_prompt_tokens),
                           _limit(max_output_tokens, limits.max_output_tokens)),
    )
    if output is not None:
        check_output_dir(output, force)
    if reclaim_interval <= 0:
        raise ConfigError(f"--reclaim-interval must be > 0 iterations, got {reclaim_interval}")
    config = build_run_config(  # hf: the loaded model's KV geometry replaces SIM_MODEL's (check_on_model)
        model=(model or SIM_MODEL) if executor == "sim" else SIM_MODEL, gpu=gpu, num_blocks=num_blocks,
        gpu_mem_util=0.9, block_size=block_size or 16,
        policy=options.policies[0], budget=budget, eviction_interval=eviction_interval,
        reclaim_mode=options.reclaim_modes[0], theta_f=theta_f, concurrency=concurrency, seed=seed, sim_profile=None,
    )
    config = replace(config, reclaim=replace(config.reclaim, check_interval_steps=reclaim_interval))
    paths = [trace] if trace is not None else ([] if fuzz else bundled_sample_traces())
    traces = [load_trace(path, trace_format) for path in paths]
    with progress_bar(stderr, 40) as bar:
        task = bar.add_task("checking", total=num_progress_units(traces, config, options))
        loaded_model = None
        if executor == "hf":
            bar.update(task, description=f"loading {model or 'a tiny random Llama'}")
            loaded_model = load_check_model(model, options.device,
                                            on_status=lambda message: stderr.print(message, highlight=False))
        report = check_invariants(traces, config, options,
                                  lambda stage, n: bar.update(task, advance=n, description=stage), model=loaded_model)
    payload = report_to_json(report)
    if output is not None:
        write_output_dir(output, _writers(payload), force)
        stderr.print(f"wrote {output}/ (report.json, runs.csv)", highlight=False)
    if json_out:
        typer.echo(json.dumps(payload, indent=2))
    else:
        stdout.print(check_report(report), soft_wrap=False)
    if not report.passed:
        raise typer.Exit(1)


def _limit(value: int | None, default: int | None) -> int | None:
    """A trace limit flag: None (not given) -> the executor's default; 0 -> no limit."""
    if value is None:
        return default
    return value or None


def parse_policies(text: str) -> tuple[str, ...]:
    if text.strip() == "all":
        return DEFAULT_AUDIT_POLICIES
    return tuple(part.strip() for part in text.split(",") if part.strip())


def _reclaim_modes(text: str) -> tuple[str, ...]:
    if text.strip() == "both":
        return RECLAIM_MODES
    if text.strip() not in RECLAIM_MODES:
        raise ConfigError(f"unknown reclaim mode '{text}'; choose one of: {', '.join(RECLAIM_MODES)} or 'both'")
    return (text.strip(),)


def _writers(payload: dict) -> list:
    def write_csv(d: Path) -> None:
        import pandas as pd

        rows = []
        for run in payload["runs"]:
            row = {k: v for k, v in run.items() if k != "invariants"}
            for name, tally in run["invariants"].items():
                row[f"{name}_checked"], row[f"{name}_violations"] = tally["checked"], tally["violations"]
            rows.append(row)
        pd.DataFrame(rows).to_csv(d / "runs.csv", index=False)

    return [json_writer(payload), write_csv]


# ---- rendering ----------------------------------------------------------------------------------


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
