"""`vtoken compare TRACE`: replay a trace with native, naive-evict and vtoken."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Annotated, Optional

import pandas as pd
import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from vtoken.analysis import DEFAULT_CONCURRENCIES
from vtoken.compare import CompareOptions, compare, num_progress_units, report_to_json
from vtoken.errors import ConfigError
from vtoken.kv.reclaim import RECLAIM_MODES
from vtoken.policies import POLICIES
from vtoken.trace import TRACE_FORMATS, load_trace
from vtoken_cli import plots, render
from vtoken_cli.app import command, stderr, stdout
from vtoken_cli.options import build_run_config, parse_int_list
from vtoken_cli.output import check_output_dir, write_output_dir

EXECUTORS = ("sim",)


@command("compare")
def compare_command(
    trace: Annotated[Path, typer.Argument(help="Request trace: native JSONL, Mooncake JSONL, Azure CSV or ShareGPT JSON.")],
    policy: Annotated[str, typer.Option(help=f"Eviction policy: {', '.join(POLICIES)}.")] = "h2o",
    budget: Annotated[str, typer.Option(help="Tokens each request keeps: a ratio ('50%', '0.5') or a count ('512').")] = "50%",
    model: Annotated[str, typer.Option(help="Catalog model (llama-3.1-8b, mistral-7b, qwen2.5-7b, qwen2.5-14b, llama-3.1-70b, smollm2-135m) or a path to an HF config.json.")] = "llama-3.1-8b",
    gpu: Annotated[str, typer.Option(help="GPU from the catalog: h100-80gb, h200, a100-80gb, l40s.")] = "h100-80gb",
    num_blocks: Annotated[Optional[int], typer.Option(help="KV block budget; default: from GPU memory x --gpu-mem-util minus weights and a 2 GiB reserve.")] = None,
    gpu_mem_util: Annotated[float, typer.Option(help="Fraction of GPU memory for weights + KV (as vLLM's gpu_memory_utilization).")] = 0.9,
    block_size: Annotated[int, typer.Option(help="Tokens per KV block.")] = 16,
    concurrency: Annotated[int, typer.Option(help="Closed-loop clients for the headline run.")] = 16,
    concurrencies: Annotated[str, typer.Option(help="Concurrencies of the sweep and the frontier.")] = ",".join(map(str, DEFAULT_CONCURRENCIES)),
    reclaim_mode: Annotated[str, typer.Option(help=f"vToken planning mode: {', '.join(RECLAIM_MODES)}.")] = "hole-fill",
    theta_f: Annotated[float, typer.Option("--theta-f", help="Reclaim only when the waste ratio F is at least this.")] = 0.25,
    eviction_interval: Annotated[int, typer.Option(help="Run the policy after prefill and every N generated tokens.")] = 32,
    sla_metric: Annotated[str, typer.Option(help="Latency the SLA is set on: e2e, ttft or tpot.")] = "e2e",
    sla_factor: Annotated[float, typer.Option(help="SLA = factor x naive-evict p95 at --sla-ref-concurrency.")] = 1.05,
    sla_ref_concurrency: Annotated[int, typer.Option(help="Reference concurrency C_ref of the SLA.")] = 8,
    executor: Annotated[str, typer.Option(help="Executor: 'sim' (cost model, no model weights).")] = "sim",
    seed: Annotated[int, typer.Option(help="Seed of the synthetic attention and the random policy.")] = 0,
    repeats: Annotated[int, typer.Option(help="Seeds seed..seed+N-1; headline figures get a 95% CI.")] = 1,
    trace_format: Annotated[str, typer.Option("--format", help=f"Trace format: {', '.join(TRACE_FORMATS)}.")] = "auto",
    time_unit: Annotated[Optional[str], typer.Option(help="Timestamp unit of the trace: s or ms (default per format).")] = None,
    max_requests: Annotated[Optional[int], typer.Option(help="Replay only the first N requests.")] = None,
    sim_profile: Annotated[Optional[Path], typer.Option(help="TOML file overriding sim cost-model and attention-model parameters.")] = None,
    sweep: Annotated[bool, typer.Option("--sweep/--no-sweep", help="Run the concurrency sweep and SLA selection.")] = True,
    frontier: Annotated[bool, typer.Option("--frontier/--no-frontier", help="Run the capacity frontier.")] = True,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout instead of tables.")] = False,
    output: Annotated[Optional[Path], typer.Option(help="Write JSON, CSV tables and PNG plots into this directory.")] = None,
    force: Annotated[bool, typer.Option(help="Replace a non-empty --output directory.")] = False,
    explain: Annotated[bool, typer.Option(help="Print the definition of every metric.")] = False,
) -> None:
    """Replay TRACE with the three variants (native, naive-evict, vtoken) and compare memory
    waste, throughput, latency percentiles, SLA-feasible concurrency and the capacity frontier."""
    if executor not in EXECUTORS:
        raise ConfigError(f"unknown executor '{executor}'; available here: {', '.join(EXECUTORS)}")
    if output is not None:
        check_output_dir(output, force)
    config = build_run_config(
        model=model, gpu=gpu, num_blocks=num_blocks, gpu_mem_util=gpu_mem_util, block_size=block_size,
        policy=policy, budget=budget, eviction_interval=eviction_interval, reclaim_mode=reclaim_mode,
        theta_f=theta_f, concurrency=concurrency, seed=seed, sim_profile=sim_profile,
    )
    options = CompareOptions(parse_int_list(concurrencies, "--concurrencies"), sla_metric, sla_factor,
                             sla_ref_concurrency, repeats, sweep, frontier)
    loaded = load_trace(trace, trace_format, time_unit=time_unit, max_requests=max_requests)
    with Progress(TextColumn("{task.description:<22}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=stderr, transient=True) as bar:
        task = bar.add_task("replaying", total=num_progress_units(loaded, options))
        report = compare(loaded, config, options, lambda stage, n: bar.update(task, advance=n, description=stage))
    payload = report_to_json(report)
    if output is not None:
        write_output_dir(output, _writers(report, payload), force)
    if json_out:
        stdout.print_json(json.dumps(payload))
    else:
        stdout.print(render.compare_report(report, explain))
        if output is not None:
            stdout.print(f"wrote {output}/ (report.json, variants.csv, sweep.csv, frontier.csv, *.png)")


def _writers(report, payload: dict) -> list:
    def write_json(d: Path) -> None:
        (d / "report.json").write_text(json.dumps(payload, indent=2) + "\n")

    def write_csv(d: Path) -> None:
        rows = [{"variant": v, **{k: x for k, x in e.items() if not isinstance(x, (list, dict))}} for v, e in payload["variants"].items()]
        pd.DataFrame(rows).to_csv(d / "variants.csv", index=False)
        hist = [{"variant": v, "bin": i, "fraction": x} for v, e in payload["variants"].items() for i, x in enumerate(e["utilization_histogram"])]
        pd.DataFrame(hist).to_csv(d / "utilization_histogram.csv", index=False)
        if report.sweep:
            pd.DataFrame([asdict(p) for p in report.sweep]).to_csv(d / "sweep.csv", index=False)
        if report.frontier is not None:
            pd.DataFrame([asdict(p) for p in report.frontier.points]).to_csv(d / "frontier.csv", index=False)

    def write_plots(d: Path) -> None:
        plots.plot_histograms(report, d / "utilization_histograms.png")
        if report.sla is not None:
            plots.plot_sweep(report, d / "sweep.png")
        if report.frontier is not None:
            plots.plot_frontier(report, d / "frontier.png")

    return [write_json, write_csv, write_plots]
