"""`vtoken compare TRACE`: replay a trace with native, naive-evict and vtoken.

`--executor sim` (default) replays on the cost model; `--executor hf` runs a real model
(`--model smollm2-135m` or a local Llama/Mistral/Qwen2 folder) and measures it; `--executor
vllm` runs in-process vLLM engines, one per variant.
"""

from __future__ import annotations

import json
from dataclasses import asdict, replace
from pathlib import Path
from typing import Annotated, Optional

import typer

from vtoken import defaults
from vtoken.engine import VARIANTS
from vtoken.compare import CompareOptions, compare, num_progress_units, report_to_json
from vtoken.measured import require_measured_compare
from vtoken.replay import make_replayer
from vtoken.runners import make_runner
from vtoken.trace import load_trace, within_context
from vtoken_cli.console import stderr, stdout
from vtoken_cli.options import (
    BlockSize, Budget, CacheDir, Concurrency, EvictionInterval, Executor, Force, Gpu, GpuMemUtil, JsonOut,
    MaxRequests, Model, NoCache, NumBlocks, Output, Policy, RayAddress, ReclaimMode, Seed, ThetaF, TimeUnit,
    TraceFormat, Variants, Workers, build_cache, build_run_config, parse_int_list, parse_variants,
)
from vtoken_cli.output import check_output_dir, json_writer, progress_bar, write_output_dir
from vtoken_cli.render.compare import compare_report, hf_report


def compare_command(
    trace: Annotated[Path, typer.Argument(help="Request trace: native JSONL, Mooncake JSONL, Azure CSV or ShareGPT JSON.")],
    policy: Policy = defaults.POLICY,
    budget: Budget = defaults.BUDGET,
    model: Model = defaults.MODEL,
    gpu: Gpu = defaults.GPU,
    num_blocks: NumBlocks = None,
    gpu_mem_util: GpuMemUtil = defaults.GPU_MEMORY_UTILIZATION,
    block_size: BlockSize = defaults.BLOCK_SIZE,
    concurrency: Concurrency = defaults.CONCURRENCY,
    open_loop: Annotated[bool, typer.Option("--open-loop", help="Headline run: requests arrive at their trace timestamps instead of from --concurrency closed-loop clients (the sweep and frontier stay closed-loop).")] = False,
    concurrencies: Annotated[str, typer.Option(help="Concurrencies of the sweep and the frontier.")] = ",".join(map(str, defaults.CONCURRENCIES)),
    reclaim_mode: ReclaimMode = defaults.RECLAIM_MODE,
    theta_f: ThetaF = defaults.THETA_F,
    reclaim_budget: Annotated[Optional[int], typer.Option(help="Tokens one reclamation round may move (default: no limit); bounds the relocation work of a single step.")] = None,
    eviction_interval: EvictionInterval = defaults.EVICTION_INTERVAL_TOKENS,
    sla_metric: Annotated[str, typer.Option(help="Latency the SLA is set on: e2e, ttft or tpot.")] = defaults.SLA_METRIC,
    sla_factor: Annotated[float, typer.Option(help="SLA = factor x naive-evict p95 at --sla-ref-concurrency.")] = defaults.SLA_FACTOR,
    sla_ref_concurrency: Annotated[int, typer.Option(help="Reference concurrency C_ref of the SLA.")] = defaults.SLA_REF_CONCURRENCY,
    executor: Executor = defaults.EXECUTOR,
    seed: Seed = defaults.SEED,
    repeats: Annotated[int, typer.Option(help="Seeds seed..seed+N-1; headline figures get a 95% CI.")] = defaults.REPEATS,
    trace_format: TraceFormat = defaults.TRACE_FORMAT,
    time_unit: TimeUnit = None,
    max_requests: MaxRequests = None,
    sim_profile: Annotated[Optional[Path], typer.Option(help="TOML file overriding sim cost-model and attention-model parameters.")] = None,
    sweep: Annotated[bool, typer.Option("--sweep/--no-sweep", help="Run the concurrency sweep and SLA selection.")] = True,
    frontier: Annotated[bool, typer.Option("--frontier/--no-frontier", help="Run the capacity frontier.")] = True,
    json_out: JsonOut = False,
    output: Output = None,
    force: Force = False,
    explain: Annotated[bool, typer.Option(help="Print the definition of every metric.")] = False,
    variants: Variants = ",".join(VARIANTS),
    workers: Workers = None,
    ray: RayAddress = None,
    cache_dir: CacheDir = None,
    no_cache: NoCache = False,
) -> None:
    """Replay TRACE with the three variants (native, naive-evict, vtoken) and compare memory
    waste, throughput, latency percentiles, SLA-feasible concurrency and the capacity frontier."""
    replayer = make_replayer(executor, model=model, gpu_mem_util=gpu_mem_util,
                             on_status=lambda message: stderr.print(message, highlight=False),
                             runner=make_runner(workers, ray), cache=build_cache(cache_dir, no_cache))
    if output is not None:
        check_output_dir(output, force)
    config = build_run_config(
        model=model, gpu=gpu, num_blocks=num_blocks, gpu_mem_util=gpu_mem_util, block_size=block_size,
        policy=policy, budget=budget, eviction_interval=eviction_interval, reclaim_mode=reclaim_mode,
        theta_f=theta_f, concurrency=concurrency, seed=seed, sim_profile=sim_profile, reclaim_budget=reclaim_budget,
    )
    if open_loop:
        config = replace(config, concurrency=None)
    options = CompareOptions(parse_int_list(concurrencies, "--concurrencies"), sla_metric, sla_factor,
                             sla_ref_concurrency, repeats, sweep, frontier, parse_variants(variants))
    loaded = within_context(load_trace(trace, trace_format, time_unit=time_unit, max_requests=max_requests),
                            config.model.max_model_len)
    with progress_bar(stderr, 22) as bar:
        task = bar.add_task("replaying", total=num_progress_units(loaded, options, replayer))
        report = compare(loaded, config, options, replayer, lambda stage, n: bar.update(task, advance=n, description=stage),
                         num_blocks=num_blocks)
    require_measured_compare(report)
    payload = report_to_json(report)
    if output is not None:
        write_output_dir(output, _writers(report, payload), force)
    if json_out:
        stdout.print_json(json.dumps(payload))
    else:
        stdout.print(hf_report(report, explain) if report.measured is not None else compare_report(report, explain))


def _writers(report, payload: dict) -> list:
    def write_csv(d: Path) -> None:
        import pandas as pd

        rows = [{"variant": v, **{k: x for k, x in e.items() if not isinstance(x, (list, dict))}} for v, e in payload["variants"].items()]
        pd.DataFrame(rows).to_csv(d / "variants.csv", index=False)
        hist = [{"variant": v, "bin": i, "fraction": x} for v, e in payload["variants"].items() for i, x in enumerate(e["utilization_histogram"])]
        pd.DataFrame(hist).to_csv(d / "utilization_histogram.csv", index=False)
        if report.sweep:
            pd.DataFrame([asdict(p) for p in report.sweep]).to_csv(d / "sweep.csv", index=False)
        if report.frontier is not None:
            pd.DataFrame([asdict(p) for p in report.frontier.points]).to_csv(d / "frontier.csv", index=False)

    def write_plots(d: Path) -> None:
        from vtoken_cli import plots  # matplotlib: imported when a plot is drawn, not at start-up

        plots.plot_histograms(report, d / "utilization_histograms.png")
        if report.sla is not None:
            plots.plot_sweep(report, d / "sweep.png")
        if report.frontier is not None:
            plots.plot_frontier(report, d / "frontier.png")

    return [json_writer(payload), write_csv, write_plots]
