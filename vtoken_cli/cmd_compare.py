"""`vtoken compare TRACE`: replay a trace with native, naive-evict and vtoken.

`--executor sim` (default) replays on the cost model; `--executor hf` runs a real model
(`--model smollm2-135m` or a local Llama/Mistral/Qwen2 folder) and measures it.
"""

from __future__ import annotations

import json
from dataclasses import asdict, replace
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Group
from rich.panel import Panel
from rich.table import Table

from vtoken.analysis import DEFAULT_CONCURRENCIES
from vtoken.compare import CompareOptions, CompareReport, compare, compare_hf, num_progress_units, report_to_json
from vtoken.errors import ConfigError
from vtoken.kv.reclaim import RECLAIM_MODES
from vtoken.policies import POLICIES
from vtoken.trace import TRACE_FORMATS, load_trace
from vtoken_cli import render
from vtoken_cli.app import command, stderr, stdout
from vtoken_cli.options import build_run_config, parse_int_list, require_vllm
from vtoken_cli.output import check_output_dir, json_writer, progress_bar, write_output_dir

EXECUTORS = ("sim", "hf", "vllm")


@command("compare")
def compare_command(
    trace: Annotated[Path, typer.Argument(help="Request trace: native JSONL, Mooncake JSONL, Azure CSV or ShareGPT JSON.")],
    policy: Annotated[str, typer.Option(help=f"Eviction policy: {', '.join(POLICIES)}.")] = "h2o",
    budget: Annotated[str, typer.Option(help="Tokens each request keeps: a ratio ('50%', '0.5') or a count ('512').")] = "50%",
    model: Annotated[str, typer.Option(help="Catalog model (llama-3.1-8b, mistral-7b, qwen2.5-7b, qwen2.5-14b, llama-3.1-70b, smollm2-135m) or a path to an HF config.json. With --executor hf: smollm2-135m or a local Llama/Mistral/Qwen2 folder.")] = "llama-3.1-8b",
    gpu: Annotated[str, typer.Option(help="GPU from the catalog: h100-80gb, h200, a100-80gb, l40s.")] = "h100-80gb",
    num_blocks: Annotated[Optional[int], typer.Option(help="KV block budget; default: from GPU memory x --gpu-mem-util minus weights and a 2 GiB reserve (--executor hf: enough for --concurrency full-length requests).")] = None,
    gpu_mem_util: Annotated[float, typer.Option(help="Fraction of GPU memory for weights + KV (as vLLM's gpu_memory_utilization).")] = 0.9,
    block_size: Annotated[int, typer.Option(help="Tokens per KV block.")] = 16,
    concurrency: Annotated[int, typer.Option(help="Closed-loop clients for the headline run.")] = 16,
    open_loop: Annotated[bool, typer.Option("--open-loop", help="Headline run: requests arrive at their trace timestamps instead of from --concurrency closed-loop clients (the sweep and frontier stay closed-loop).")] = False,
    concurrencies: Annotated[str, typer.Option(help="Concurrencies of the sweep and the frontier.")] = ",".join(map(str, DEFAULT_CONCURRENCIES)),
    reclaim_mode: Annotated[str, typer.Option(help=f"vToken planning mode: {', '.join(RECLAIM_MODES)}.")] = "hole-fill",
    theta_f: Annotated[float, typer.Option("--theta-f", help="Reclaim only when the waste ratio F is at least this.")] = 0.25,
    reclaim_budget: Annotated[Optional[int], typer.Option(help="Tokens one reclamation round may move (default: no limit); bounds the relocation work of a single step.")] = None,
    eviction_interval: Annotated[int, typer.Option(help="Run the policy after prefill and every N generated tokens.")] = 32,
    sla_metric: Annotated[str, typer.Option(help="Latency the SLA is set on: e2e, ttft or tpot.")] = "e2e",
    sla_factor: Annotated[float, typer.Option(help="SLA = factor x naive-evict p95 at --sla-ref-concurrency.")] = 1.05,
    sla_ref_concurrency: Annotated[int, typer.Option(help="Reference concurrency C_ref of the SLA.")] = 8,
    executor: Annotated[str, typer.Option(help="Executor: 'sim' (cost model, no model weights) or 'hf' (a real transformers model on CPU, measured; short traces).")] = "sim",
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
    if executor == "vllm":
        require_vllm()
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
                             sla_ref_concurrency, repeats, sweep and executor == "sim", frontier and executor == "sim")
    loaded = load_trace(trace, trace_format, time_unit=time_unit, max_requests=max_requests)
    with progress_bar(stderr, 22) as bar:
        task = bar.add_task("replaying", total=num_progress_units(loaded, options))
        on_progress = lambda stage, n: bar.update(task, advance=n, description=stage)  # noqa: E731
        if executor == "hf":
            from vtoken.models import load_model

            bar.update(task, description=f"loading {model}")
            loaded_model = load_model(model, on_status=lambda message: stderr.print(message, highlight=False))
            report = compare_hf(loaded, config, loaded_model, options, on_progress, num_blocks)
        elif executor == "vllm":
            report = _compare_on_vllm(loaded, config, options, model, on_progress, num_blocks)
        else:
            report = compare(loaded, config, options, on_progress)
    payload = report_to_json(report)
    if output is not None:
        write_output_dir(output, _writers(report, payload), force)
    if json_out:
        stdout.print_json(json.dumps(payload))
    else:
        stdout.print(_hf_report(report, explain) if report.hf is not None else render.compare_report(report, explain))
        if output is not None:
            stdout.print(f"wrote {output}/ (report.json, variants.csv, sweep.csv, frontier.csv, *.png)")


def _compare_on_vllm(loaded, config, options, model, on_progress, num_blocks) -> CompareReport:
    """In-process vLLM engines, one per variant; needs vLLM installed (see the README)."""
    from vtoken.engine.vllm.run import compare_vllm

    return compare_vllm(loaded, config, options, model, on_progress, num_blocks)


def _hf_report(report: CompareReport, explain: bool) -> Group:
    """The measured run: the memory figures next to speed and quality, then the usual tables."""
    hf = report.hf
    cfg = report.config
    lines = [f"trace {report.trace.source} ({report.trace.format}, {len(report.trace.requests)} requests)",
             f"model {hf.model} (transformers, {cfg.model.kv_bytes_per_token} KV bytes/token); "
             f"{cfg.num_blocks} blocks of {cfg.block_size} tokens",
             f"policy {cfg.eviction.policy}, {cfg.eviction.budget.describe()}, every {cfg.eviction.interval_tokens} tokens; "
             f"reclaim {cfg.reclaim.mode} (theta_F {cfg.reclaim.theta_f}{render.budget_phrase(cfg)}); {render.arrivals_phrase(cfg)}; seed {cfg.seed}"]
    lines += [f"note: {n}" for n in report.trace.notes]
    if hf.naive_vs_vtoken is not None:
        a = hf.naive_vs_vtoken
        lines.append(f"naive-evict vs vtoken (same eviction decisions): identical tokens in {a.num_identical}/{a.num_requests} "
                     f"requests, max |Δ logprob| {a.max_abs_logprob_diff:.2e}")
    table = Table(title="Measured on the model (memory | speed | quality vs native)", title_justify="left")
    for column in ("variant", "F", "peak blocks", "mem util", "tok/s", "ms/token", "x native", "engine wall s",
                   "ROUGE-L", "length ratio"):
        table.add_column(column, justify="left" if column == "variant" else "right")
    for name, run in report.runs.items():
        speed, quality = hf.speed[name], hf.quality.get(name)
        table.add_row(name, f"{run.waste_ratio:.3f}", str(run.peak_allocated_blocks), f"{100 * run.memory_utilization:.1f}%",
                      f"{speed.tok_s:.1f}", f"{1000 * speed.per_token_latency_s:.1f}", f"{speed.ratio_to_native:.2f}",
                      f"{speed.engine_wall_s:.1f}", f"{quality.rouge_l_f1:.3f}" if quality else "-",
                      f"{quality.length_ratio:.2f}" if quality else "-")
    parts = [Panel("\n".join(lines), title="vtoken compare (hf executor)", title_align="left"), table,
             render.summary_tables(report), render.histograms_side_by_side(report)]
    if explain:
        parts.append(render.definitions_table())
    return Group(*parts)


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
