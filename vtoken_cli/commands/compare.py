"""`vtoken compare TRACE`: replay a trace with native, naive-evict and vtoken.

`--executor sim` (default) replays on the cost model; `--executor hf` runs a real model
(`--model smollm2-135m` or a local Llama/Mistral/Qwen2 folder) and measures it; `--executor
vllm` runs in-process vLLM engines, one per variant.
"""

from __future__ import annotations

import json
from dataclasses import asdict
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
    BlockSize, Budget, CacheDir, ChunkedPrefill, Concurrency, EvictEveryChunk, EvictionInterval, Executor, Force, Gpu,
    GpuMemUtil, JsonOut, LongPrefillTokenThreshold, MaxNumBatchedTokens, MaxNumSeqs, MaxRequests, Model, NoCache,
    NumBlocks, Output, Policy, RayAddress, ReclaimBatchBlocks, ReclaimBudget, ReclaimInterval, ReclaimMode, Rounds,
    Seed, SimProfilePath, ThetaF, TimeUnit, Tokenizer, TraceFormat, Variants, Warmup, Workers, build_cache,
    build_experiment, build_tokenizer, check_concurrency, parse_int_list, parse_variants, scheduler_flags,
)
from vtoken_cli.output import check_output_dir, json_writer, progress_bar, write_output_dir
from vtoken_cli.render.compare import compare_report, hf_report


def compare_command(
    trace: Annotated[Path, typer.Argument(
        help="Request trace: native JSONL (above), Mooncake JSONL, Azure CSV or ShareGPT JSON.", metavar="TRACE")],
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
    reclaim_budget: ReclaimBudget = str(defaults.RECLAIM_MOVES_PER_STEP),
    reclaim_interval: ReclaimInterval = defaults.RECLAIM_INTERVAL_STEPS,
    reclaim_batch_blocks: ReclaimBatchBlocks = defaults.RECLAIM_BATCH_BLOCKS,
    eviction_interval: EvictionInterval = defaults.EVICTION_INTERVAL_TOKENS,
    sla_metric: Annotated[str, typer.Option(help="Latency the SLA is set on: e2e, ttft or tpot.")] = defaults.SLA_METRIC,
    sla_factor: Annotated[float, typer.Option(help="SLA = factor x naive-evict p95 at --sla-ref-concurrency.")] = defaults.SLA_FACTOR,
    sla_ref_concurrency: Annotated[int, typer.Option(help="Reference concurrency C_ref of the SLA.")] = defaults.SLA_REF_CONCURRENCY,
    executor: Executor = defaults.EXECUTOR,
    seed: Seed = defaults.SEED,
    repeats: Annotated[int, typer.Option(help="Seeds seed..seed+N-1; headline figures get a 95% CI.")] = defaults.REPEATS,
    rounds: Rounds = None,
    warmup: Warmup = None,
    trace_format: TraceFormat = defaults.TRACE_FORMAT,
    time_unit: TimeUnit = None,
    max_requests: MaxRequests = None,
    tokenizer: Tokenizer = None,
    sim_profile: SimProfilePath = None,
    max_num_batched_tokens: MaxNumBatchedTokens = None,
    max_num_seqs: MaxNumSeqs = None,
    chunked_prefill: ChunkedPrefill = None,
    long_prefill_token_threshold: LongPrefillTokenThreshold = None,
    evict_every_chunk: EvictEveryChunk = False,
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
    waste, throughput, latency percentiles, SLA-feasible concurrency and the capacity frontier.

    \b
    Examples
      vtoken compare sample_traces/azure_conv_sample.csv --num-blocks 2000
      vtoken compare trace.jsonl --policy tova --budget 1024 --output runs/tova

    \b
    Exit codes
      0  the comparison ran
      2  bad input (a flag, the trace, the output directory) or nothing measured

    \b
    Native JSONL trace (--trace-format jsonl; auto: JSON lines without hash_ids)
      One JSON object a line; blank lines are skipped, other keys ignored.
      timestamp      number, required  arrival, seconds (--time-unit ms: milli-
                                       seconds); rebased: the first arrives at 0
      input_length   int > 0, required prompt tokens
      output_length  int > 0, required tokens to generate
      request_id     string or int     unique; default: the line number
      prompt         string            prompt text (hf encodes it; else random)
      prefix_id      string or int     requests with one prefix_id share their
      prefix_length  int               first prefix_length prompt tokens: 0 <
                                       prefix_length < input_length, the same for
                                       every request of the prefix_id
      {"timestamp": 0.0, "input_length": 812, "output_length": 128}
      {"request_id": "b", "timestamp": 0.4, "input_length": 900,
       "output_length": 64, "prefix_id": "sys", "prefix_length": 512}   (one line)
    """
    runner = make_runner(workers, ray)  # closed, its worker processes ended, after the replays
    replayer = make_replayer(executor, model=model, gpu_mem_util=gpu_mem_util,
                             on_status=lambda message: stderr.print(message, highlight=False),
                             runner=runner, cache=build_cache(cache_dir, no_cache))
    if output is not None:
        check_output_dir(output, force)
    check_concurrency(concurrency)
    experiment = build_experiment(
        model=model, gpu=gpu, num_blocks=num_blocks, gpu_mem_util=gpu_mem_util, block_size=block_size,
        policy=policy, budget=budget, eviction_interval=eviction_interval, reclaim_mode=reclaim_mode,
        theta_f=theta_f, seed=seed, sim_profile=sim_profile, reclaim_budget=reclaim_budget,
        reclaim_interval=reclaim_interval, reclaim_batch_blocks=reclaim_batch_blocks,
        scheduler=scheduler_flags(max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                                  chunked_prefill=chunked_prefill,
                                  long_prefill_token_threshold=long_prefill_token_threshold,
                                  evict_every_chunk=evict_every_chunk),
    )
    options = CompareOptions(parse_int_list(concurrencies, "--concurrencies"), sla_metric, sla_factor,
                             sla_ref_concurrency, repeats, sweep, frontier, parse_variants(variants),
                             concurrency=None if open_loop else concurrency, rounds=rounds, warmup=warmup)
    loaded = within_context(load_trace(trace, trace_format, time_unit=time_unit, max_requests=max_requests,
                                       tokenizer=build_tokenizer(tokenizer)), experiment.model.max_model_len)
    with runner, progress_bar(stderr, 22, "compare") as bar:
        task = bar.add_task("replaying", total=num_progress_units(loaded, options, replayer))
        report = compare(loaded, experiment, options, replayer, lambda stage, n: bar.update(task, advance=n, description=stage),
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
    """report.json; variants.csv, utilization_histogram.csv (bin edges in %), sweep.csv,
    frontier.csv and requests_<variant>.csv (one row per finished request): counts are
    integers, every column names its unit as the terminal shows it; the plots."""

    def write_csv(d: Path) -> None:
        import pandas as pd

        pd.DataFrame([_variant_row(name, r) for name, r in report.runs.items()]).to_csv(d / "variants.csv", index=False)
        hist = [{"variant": name, "bin_low_pct": 10 * i, "bin_high_pct": 10 * (i + 1), "share_of_blocks": x}
                for name, r in report.runs.items() for i, x in enumerate(r.utilization_histogram)]
        pd.DataFrame(hist).to_csv(d / "utilization_histogram.csv", index=False)
        for name, r in report.runs.items():
            requests = pd.DataFrame([_request_row(record) for record in r.requests], columns=REQUEST_COLUMNS)
            requests.to_csv(d / f"requests_{name}.csv", index=False)
        if report.sweep:
            latency = f"p95_{report.sla.metric}_latency_s" if report.sla is not None else "p95_latency_s"
            pd.DataFrame([{"variant": p.variant, "concurrency": p.concurrency, "throughput_tok_s": p.throughput_tok_s,
                           latency: p.p95_s, "preemptions": p.preemptions} for p in report.sweep]
                         ).to_csv(d / "sweep.csv", index=False)
        if report.frontier is not None:
            fr = report.frontier
            pd.DataFrame([{"variant": p.variant, "concurrency": p.concurrency, "peak_blocks": p.peak_blocks,
                           "budget_blocks": fr.budget_blocks, "demand_over_budget": p.normalized_demand,
                           "is_feasible": p.is_feasible} for p in fr.points]).to_csv(d / "frontier.csv", index=False)

    def write_plots(d: Path) -> None:
        from vtoken_cli import plots  # matplotlib: imported when a plot is drawn, not at start-up

        plots.plot_histograms(report, d / "utilization_histograms.png")
        if report.sla is not None:
            plots.plot_sweep(report, d / "sweep.png")
        if report.frontier is not None:
            plots.plot_frontier(report, d / "frontier.png")

    return [json_writer(payload), write_csv, write_plots]


REQUEST_COLUMNS = ("request_id", "arrival_s", "first_token_s", "finish_s", "ttft_s", "e2e_s", "num_prompt_tokens",
                   "num_output_tokens", "num_preemptions")


def _request_row(record) -> dict:
    return {"request_id": record.request_id, "arrival_s": record.arrival_s, "first_token_s": record.first_token_s,
            "finish_s": record.finish_s, "ttft_s": record.ttft_s, "e2e_s": record.e2e_s,
            "num_prompt_tokens": record.num_prompt_tokens, "num_output_tokens": record.num_output_tokens,
            "num_preemptions": record.num_preemptions}


def _variant_row(name: str, r) -> dict:
    """variants.csv: the terminal's figures in its units (TPOT in ms, trapped in GiB and bytes)."""
    return {
        "variant": name, "waste_ratio": r.waste_ratio, "frac_blocks_le_half": r.frac_blocks_le_half,
        "retained_blocks_per_request": r.retained_blocks_per_request, "peak_allocated_blocks": r.peak_allocated_blocks,
        "memory_utilization": r.memory_utilization, "trapped_gib": r.trapped_bytes / 2**30,
        "trapped_bytes": r.trapped_bytes, "tokens_moved": r.tokens_moved, "blocks_reclaimed": r.blocks_reclaimed,
        "relocation_events": r.relocation_events, "tokens_evicted": r.tokens_evicted,
        "throughput_tok_s": r.throughput_tok_s, "latency_p50_s": r.latency.p50_s, "latency_p95_s": r.latency.p95_s,
        "latency_p99_s": r.latency.p99_s, "ttft_p50_s": r.ttft.p50_s, "ttft_p95_s": r.ttft.p95_s,
        "tpot_p50_ms": 1000 * r.tpot.p50_s, "tpot_p95_ms": 1000 * r.tpot.p95_s, "preemptions": r.preemptions,
        "num_requests": r.num_requests, "num_completed": r.num_completed, "num_skipped": len(r.skipped),
        "makespan_s": r.makespan_s,
    }
