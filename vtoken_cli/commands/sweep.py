"""`vtoken sweep TRACE --vary KEY=V1,V2,... [--vary ...] [--grid]`: the variants over a sweep of
run parameters on one trace (the sim executor), one factor at a time or as a grid.

Each `--vary` value is parsed as the flag of the same name is (`--block-size`, `--budget`,
...): the base flags with that one value put in, through `build_experiment`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from vtoken import defaults
from vtoken.engine import VARIANTS, Run
from vtoken.errors import ConfigError
from vtoken.replay import SimReplayer
from vtoken.runners import make_runner
from vtoken.sweep import PARAMETERS, SweepOptions, SweepReport, Vary, num_progress_units, report_to_json, sweep
from vtoken.trace import load_trace
from vtoken_cli.console import stderr, stdout
from vtoken_cli.options import (
    BlockSize, Budget, CacheDir, ChunkedPrefill, Concurrency, EvictEveryChunk, EvictionInterval, Force, Gpu, GpuMemUtil,
    JsonOut, LongPrefillTokenThreshold, MaxNumBatchedTokens, MaxNumSeqs, MaxRequests, Model, NoCache, NumBlocks, Output,
    Policy, RayAddress, ReclaimBatchBlocks, ReclaimBudget, ReclaimInterval, ReclaimMode, Seed, SimProfilePath, ThetaF,
    TimeUnit, Tokenizer, TraceFormat, Variants, Workers, build_cache, build_experiment, build_tokenizer,
    check_concurrency, parse_variants, scheduler_flags,
)
from vtoken_cli.output import check_output_dir, json_writer, progress_bar, write_output_dir
from vtoken_cli.render.sweep import sweep_table

# --vary KEY -> (the flag argument it replaces, how its text becomes that argument)
VARY_FLAGS = {
    "block_size": ("block_size", int), "budget": ("budget", str), "theta_f": ("theta_f", float),
    "policy": ("policy", str), "eviction_interval": ("eviction_interval", int), "model": ("model", str),
    "gpu": ("gpu", str), "concurrency": ("concurrency", int), "num_blocks": ("num_blocks", int),
    "reclaim_mode": ("reclaim_mode", str), "reclaim_budget": ("reclaim_budget", str),
    "reclaim_interval": ("reclaim_interval", int), "reclaim_batch_blocks": ("reclaim_batch_blocks", int),
}
assert set(VARY_FLAGS) == set(PARAMETERS)
_KIND = {int: "an integer", float: "a number"}  # what a value that fails its conversion is not
assert {convert for _, convert in VARY_FLAGS.values()} <= {str, *_KIND}  # str takes any value


def sweep_command(
    trace: Annotated[Path, typer.Argument(help="Request trace: native JSONL, Mooncake JSONL, Azure CSV or ShareGPT JSON.")],
    vary: Annotated[list[str], typer.Option(
        help=f"KEY=V1,V2,...: a run parameter and its values; repeat for several. Keys: {', '.join(PARAMETERS)}.")],
    grid: Annotated[bool, typer.Option("--grid", help="Every combination of the values (default: one factor at a time, the others at the base flags).")] = False,
    policy: Policy = defaults.POLICY,
    budget: Budget = defaults.BUDGET,
    model: Model = defaults.MODEL,
    gpu: Gpu = defaults.GPU,
    num_blocks: NumBlocks = None,
    gpu_mem_util: GpuMemUtil = defaults.GPU_MEMORY_UTILIZATION,
    block_size: BlockSize = defaults.BLOCK_SIZE,
    concurrency: Concurrency = defaults.CONCURRENCY,
    reclaim_mode: ReclaimMode = defaults.RECLAIM_MODE,
    theta_f: ThetaF = defaults.THETA_F,
    reclaim_budget: ReclaimBudget = str(defaults.RECLAIM_MOVES_PER_STEP),
    reclaim_interval: ReclaimInterval = defaults.RECLAIM_INTERVAL_STEPS,
    reclaim_batch_blocks: ReclaimBatchBlocks = defaults.RECLAIM_BATCH_BLOCKS,
    eviction_interval: EvictionInterval = defaults.EVICTION_INTERVAL_TOKENS,
    seed: Seed = defaults.SEED,
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
    variants: Variants = ",".join(VARIANTS),
    workers: Workers = None,
    ray: RayAddress = None,
    cache_dir: CacheDir = None,
    no_cache: NoCache = False,
    json_out: JsonOut = False,
    output: Output = None,
    force: Force = False,
) -> None:
    """Replay TRACE with the variants at every point of a sweep of run parameters: one table,
    and with --output a CSV and a plot per varied key."""
    if output is not None:
        check_output_dir(output, force)
    flags = dict(model=model, gpu=gpu, num_blocks=num_blocks, gpu_mem_util=gpu_mem_util, block_size=block_size,
                 policy=policy, budget=budget, eviction_interval=eviction_interval, reclaim_mode=reclaim_mode,
                 theta_f=theta_f, reclaim_budget=reclaim_budget, reclaim_interval=reclaim_interval,
                 reclaim_batch_blocks=reclaim_batch_blocks, concurrency=concurrency, seed=seed, sim_profile=sim_profile,
                 scheduler=scheduler_flags(max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                                           chunked_prefill=chunked_prefill,
                                           long_prefill_token_threshold=long_prefill_token_threshold,
                                           evict_every_chunk=evict_every_chunk))
    options = SweepOptions(tuple(parse_vary(text, flags) for text in vary), grid, parse_variants(variants))
    base = base_run(flags, options.variants[-1])
    runner = make_runner(workers, ray)  # closed, its worker processes ended, after the replays
    replayer = SimReplayer(gpu_mem_util=gpu_mem_util, runner=runner,
                           cache=build_cache(cache_dir, no_cache))
    loaded = load_trace(trace, trace_format, time_unit=time_unit, max_requests=max_requests,
                        tokenizer=build_tokenizer(tokenizer))
    with runner, progress_bar(stderr, 22, "sweep") as bar:
        task = bar.add_task("replaying", total=num_progress_units(loaded, base, options))
        report = sweep(loaded, base, options, replayer, lambda stage, n: bar.update(task, advance=n, description=stage),
                       num_blocks=num_blocks)
    payload = report_to_json(report)
    if output is not None:
        write_output_dir(output, _writers(report, payload), force)
    if json_out:
        stdout.print_json(json.dumps(payload))
    else:
        stdout.print(sweep_table(report))


def parse_vary(text: str, flags: dict) -> Vary:
    """`KEY=V1,V2,...` -> a Vary of parsed values; each value is checked as its flag would be."""
    key, sep, values = text.partition("=")
    key = key.strip().replace("-", "_")
    if not sep:
        raise ConfigError(f"--vary {text}: expected KEY=V1,V2,... with KEY one of: {', '.join(PARAMETERS)}")
    if key not in VARY_FLAGS:
        raise ConfigError(f"--vary: unknown key '{key}'; choose one of: {', '.join(PARAMETERS)}")
    argument, convert = VARY_FLAGS[key]
    parsed = []
    for part in (p.strip() for p in values.split(",") if p.strip()):
        try:
            value = convert(part)
        except ValueError:
            raise ConfigError(f"--vary {key}: '{part}' is not {_KIND[convert]}") from None
        try:
            run = base_run({**flags, argument: value})
        except ConfigError as exc:
            raise ConfigError(f"--vary {key}={part}: {exc}") from None
        parsed.append(PARAMETERS[key].get(run))
    return Vary(key, tuple(parsed))


def base_run(flags: dict, variant: str = VARIANTS[-1]) -> Run:
    """The run of the flags: their experiment with `--concurrency` clients (a point's variants
    replace `variant`)."""
    experiment_flags = {k: v for k, v in flags.items() if k != "concurrency"}
    return build_experiment(**experiment_flags).run(variant, check_concurrency(flags["concurrency"]))


def _writers(report: SweepReport, payload: dict) -> list:
    def write_csv(d: Path) -> None:
        import pandas as pd

        rows = [{**point["params"], "num_blocks_used": point["num_blocks"], "variant": variant,
                 **{k: x for k, x in entry.items() if not isinstance(x, (list, dict))}}
                for point in payload["points"] for variant, entry in point["variants"].items()]
        pd.DataFrame(rows).to_csv(d / "sweep.csv", index=False)

    def write_plots(d: Path) -> None:
        for key in report.options.keys:
            _plot_along(report, key, d / f"sweep_{key}.png")

    return [json_writer(payload), write_csv, write_plots]


def _plot_along(report: SweepReport, key: str, path: Path) -> None:
    """F and throughput per variant along `key` (the other keys at their anchor values)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = report.along(key)
    labels = [str(p.params[key]) for p in points]
    fig, (ax_waste, ax_tput) = plt.subplots(1, 2, figsize=(10, 3.8))
    for variant in report.options.variants:
        ax_waste.plot(labels, [p.runs[variant].waste_ratio for p in points], marker="o", label=variant)
        ax_tput.plot(labels, [p.runs[variant].throughput_tok_s for p in points], marker="o", label=variant)
    ax_waste.set_ylabel("waste ratio F")
    ax_tput.set_ylabel("throughput (tok/s)")
    for ax in (ax_waste, ax_tput):
        ax.set_xlabel(key)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
