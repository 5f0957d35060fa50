"""`vtoken check-invariants [TRACE]`: relocations on materialized KV, I1-I4 checked on every event.

The command parses flags into an `Experiment` and `CheckOptions`, calls
`vtoken.checker.check_invariants` (which runs the executor `--executor` names, with `--model`)
and prints render/check.py's report. Exit code 0 when every invariant held, 1 on any violation,
2 on bad input.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from vtoken import defaults
from vtoken.checker.names import FAULT_DETECTED_BY, FAULT_KINDS, HF_LIMITS, PRESSURE, TraceLimits, default_limits
from vtoken.errors import ConfigError
from vtoken.kv.reclaim import RECLAIM_MODES
from vtoken.measured import require_measured_check
from vtoken.policies import DEFAULT_AUDIT_POLICIES
from vtoken.trace import load_trace
from vtoken_cli.console import stderr, stdout
from vtoken_cli.options import (
    EXECUTORS, MODEL_NAMES, POLICY_NAMES, RECLAIM_MODE_NAMES, Budget, Concurrency, EvictionInterval, Force, Gpu, JsonOut,
    Output, ReclaimInterval, Seed, ThetaF, TraceFormat, build_experiment, check_concurrency, resolve_policies,
)
from vtoken_cli.output import check_output_dir, json_writer, progress_bar, write_output_dir
from vtoken_cli.render.check import check_report

SIM_LIMITS = default_limits("sim")


def check_command(
    trace: Annotated[Optional[Path], typer.Argument(
        help="Trace to replay. Default: every bundled sample trace (sample_traces/).", metavar="TRACE",
        show_default=False)] = None,
    policy: Annotated[str, typer.Option(
        help=f"Policy, comma-separated policies, or 'all' ({', '.join(DEFAULT_AUDIT_POLICIES)}). "
             f"Known: {POLICY_NAMES}.")] = "all",
    reclaim_mode: Annotated[str, typer.Option(help=f"Reclaim planning mode: {RECLAIM_MODE_NAMES} or 'both'.")] = "both",
    executor: Annotated[str, typer.Option(
        help=f"Executor: {', '.join(EXECUTORS)}. sim: the cost model, synthetic K/V written by the checker; "
             "hf: a real transformers model, the K/V its forward wrote (traces cut down harder); "
             "vllm: vToken inside vLLM (needs vLLM and --model FOLDER; checks run in its scheduler and worker).")
    ] = defaults.EXECUTOR,
    inject_fault: Annotated[Optional[str], typer.Option(
        help="Inject a fault the checker must catch, and the invariant that catches it: "
             + ", ".join(f"{kind} ({FAULT_DETECTED_BY[kind]})" for kind in FAULT_KINDS) + ". vllm: inside vLLM's "
             "worker and scheduler, every kind but shared-block (no block is shared there).", show_default=False)] = None,
    fuzz: Annotated[int, typer.Option(
        help="Also run N random scenarios (requests, shared prefixes, budgets, policies, block sizes); "
             "without TRACE, only those.")] = 0,
    seed: Seed = defaults.SEED,
    num_blocks: Annotated[Optional[int], typer.Option(
        help=f"KV block budget. Default: per trace, {PRESSURE:.0%} of the peak blocks of the `concurrency` largest "
             "requests (pressure: relocation, preemption, block reuse), at most what the model leaves on the GPU.",
        show_default=False)] = None,
    block_size: Annotated[Optional[int], typer.Option(
        help=f"Tokens per KV block. Default {defaults.BLOCK_SIZE} (fuzz: drawn from 4, 8, 16, 32; "
             f"vllm: {defaults.VLLM_BLOCK_SIZE}).", show_default=False)] = None,
    model: Annotated[Optional[str], typer.Option(
        help=f"sim: catalog model ({MODEL_NAMES}) or HF config.json, the cost model and the GPU block cap "
             f"(default {defaults.MODEL}). hf: smollm2-135m or a local Llama/Mistral/Qwen2 folder (default: a tiny "
             "random Llama built in a temporary directory). vllm: a local model folder.", show_default=False)] = None,
    gpu: Gpu = defaults.GPU,
    budget: Budget = defaults.BUDGET,
    eviction_interval: EvictionInterval = defaults.EVICTION_INTERVAL_TOKENS,
    concurrency: Concurrency = defaults.CHECK_CONCURRENCY,
    theta_f: ThetaF = defaults.CHECK_THETA_F,
    reclaim_interval: ReclaimInterval = defaults.CHECK_RECLAIM_INTERVAL_STEPS,
    max_requests: Annotated[Optional[int], typer.Option(
        help=f"Replay the first N requests of each trace (0: all). Default {SIM_LIMITS.max_requests} "
             f"(hf: {HF_LIMITS.max_requests}).", show_default=False)] = None,
    max_prompt_tokens: Annotated[Optional[int], typer.Option(
        help=f"Cap prompts at N tokens (0: no cap). Default {SIM_LIMITS.max_prompt_tokens} "
             f"(hf: {HF_LIMITS.max_prompt_tokens}).", show_default=False)] = None,
    max_output_tokens: Annotated[Optional[int], typer.Option(
        help=f"Cap outputs at N tokens (0: no cap). Default {SIM_LIMITS.max_output_tokens} "
             f"(hf: {HF_LIMITS.max_output_tokens}).", show_default=False)] = None,
    trace_format: TraceFormat = defaults.TRACE_FORMAT,
    json_out: JsonOut = False,
    output: Output = None,
    force: Force = False,
) -> None:
    """Replay TRACE (default: every bundled sample trace) through the vtoken runtime with
    materialized KV and check the substrate invariants I1-I4 on every relocation event.

    \b
    Examples
      vtoken check-invariants
      vtoken check-invariants trace.jsonl --inject-fault stale-slot

    \b
    Exit codes
      0  every invariant held
      1  an invariant was violated (with --inject-fault: the fault was caught)
      2  bad input, or nothing was checked

    TRACE: any format `vtoken compare --help` describes (native JSONL and others).
    """
    from vtoken.checker import CheckOptions, check_invariants, num_progress_units, report_to_json

    limits = default_limits(executor)
    options = CheckOptions(
        policies=parse_policies(policy), reclaim_modes=_reclaim_modes(reclaim_mode), executor=executor, fault=inject_fault,
        num_fuzz_scenarios=fuzz, num_blocks=num_blocks, block_size=block_size, concurrency=check_concurrency(concurrency),
        limits=TraceLimits(_limit(max_requests, limits.max_requests), _limit(max_prompt_tokens, limits.max_prompt_tokens),
                           _limit(max_output_tokens, limits.max_output_tokens)),
    )
    if output is not None:
        check_output_dir(output, force)
    experiment = build_experiment(  # the executor's --model replaces defaults.MODEL's geometry where it runs one
        model=defaults.MODEL, gpu=gpu, num_blocks=num_blocks,
        gpu_mem_util=defaults.GPU_MEMORY_UTILIZATION, block_size=block_size or defaults.BLOCK_SIZE,
        policy=options.policies[0], budget=budget, eviction_interval=eviction_interval,
        reclaim_mode=options.reclaim_modes[0], theta_f=theta_f, seed=seed, sim_profile=None,
        reclaim_interval=reclaim_interval,
    )
    traces = [load_trace(trace, trace_format)] if trace is not None else None  # None: the executor's default
    with progress_bar(stderr, 40, "check-invariants") as bar:
        task = bar.add_task("checking", total=num_progress_units(traces, experiment, options, model=model))
        report = check_invariants(traces, experiment, options,
                                  lambda stage, n: bar.update(task, advance=n, description=stage), model=model,
                                  on_status=lambda message: stderr.print(message, highlight=False))
    require_measured_check(report)
    payload = report_to_json(report)
    if output is not None:
        write_output_dir(output, _writers(payload), force)
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
    return resolve_policies([part.strip() for part in text.split(",") if part.strip()])


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
