"""`vtoken paper EXPERIMENT`: one of the vToken paper's serving experiments on the sim, with
the paper's figure next to vtoken's (vtoken.paper).

Every flag not given takes the experiment's own setting (its workload, models, budgets,
concurrencies); the rest are the flags of `vtoken compare` and `vtoken sweep`, read the same way.
"""

from __future__ import annotations

import json
from typing import Annotated, Optional

import typer

from vtoken import defaults, paper
from vtoken.errors import ConfigError
from vtoken.replay import SimReplayer
from vtoken.runners import make_runner
from vtoken_cli.console import stderr, stdout
from vtoken_cli.options import (
    BlockSize, CacheDir, ChunkedPrefill, EvictionInterval, Gpu, GpuMemUtil, JsonOut, MaxNumBatchedTokens,
    MaxRequests, NoCache, RayAddress, ReclaimMode, Seed, ThetaF, Tokenizer, Workers, build_cache,
    build_experiment, build_tokenizer, check_concurrency, parse_int_list, scheduler_flags,
)
from vtoken_cli.output import progress_bar
from vtoken_cli.render.paper import paper_report

EXPERIMENTS = ("fig7", "fig8", "fig9", "fig10", "sensitivity", "prefix-sharing")
# The workload each experiment replays when --trace is not given (vtoken.paper.workloads).
DEFAULT_TRACE = {"fig7": "longbench", "fig8": "sharegpt", "fig9": "frontier", "fig10": "frontier",
                 "sensitivity": "longbench"}
DEFAULT_MAX_REQUESTS = {"fig8": 1000}  # the ShareGPT conversations Fig. 8 replays
DEFAULT_CONCURRENCY = 16  # fig7 and sensitivity: compare's headline concurrency
# The flags that only some experiments take -> those experiments.
ONLY_FOR = {"--policies": ("fig7",), "--models": ("fig8",), "--budget-concurrency": ("fig8",),
            "--block-sizes": ("sensitivity",), "--eviction-ratios": ("sensitivity",), "--theta-fs": ("sensitivity",),
            "--degrees": ("prefix-sharing",), "--output-tokens": ("prefix-sharing",),
            "--concurrencies": ("fig8", "fig9", "fig10"), "--trace": tuple(DEFAULT_TRACE),
            "--tokenizer": tuple(DEFAULT_TRACE), "--max-requests": tuple(DEFAULT_TRACE),
            "--concurrency": ("fig7", "sensitivity"), "--model": ("fig7", "sensitivity", "prefix-sharing")}

Text = Optional[str]


def paper_command(
    experiment: Annotated[str, typer.Argument(help=f"One of: {', '.join(EXPERIMENTS)}.", metavar="EXPERIMENT")],
    trace: Annotated[Text, typer.Option(help=f"Workload: {', '.join(paper.WORKLOADS)} or a trace file "
                                              "(default: the experiment's).")] = None,
    tokenizer: Tokenizer = None,
    max_requests: MaxRequests = None,
    policy: Annotated[str, typer.Option(help="Eviction policy (fig7: --policies).")] = defaults.POLICY,
    policies: Annotated[Text, typer.Option(help="fig7: the policies, comma-separated.")] = None,
    budget: Annotated[Text, typer.Option(help="Tokens each request keeps (default 50%; prefix-sharing: "
                                               f"{paper.PREFIX_BUDGET}, the prefix and half the suffix).")] = None,
    model: Annotated[Text, typer.Option(help="Catalog model (fig7, sensitivity, prefix-sharing).")] = None,
    models: Annotated[Text, typer.Option(help="fig8: the models, comma-separated.")] = None,
    gpu: Gpu = defaults.GPU,
    num_blocks: Annotated[Text, typer.Option(help="KV block budget (fig9: one per budget, comma-separated; "
                                                   "default: the experiment's, see its settings).")] = None,
    gpu_mem_util: GpuMemUtil = defaults.GPU_MEMORY_UTILIZATION,
    block_size: BlockSize = defaults.BLOCK_SIZE,
    concurrency: Annotated[Optional[int], typer.Option(help="Closed-loop clients (fig7, sensitivity).")] = None,
    concurrencies: Annotated[Text, typer.Option(help="fig8: the sweep's; fig9, fig10: the frontier's.")] = None,
    budget_concurrency: Annotated[Optional[int], typer.Option(
        help="fig8: the budget is native's peak block demand at this concurrency, unbounded "
             f"(default {paper.experiments.FIG8_BUDGET_CONCURRENCY}).")] = None,
    block_sizes: Annotated[Text, typer.Option(help="sensitivity: block sizes.")] = None,
    eviction_ratios: Annotated[Text, typer.Option(help="sensitivity: eviction ratios in (0, 1).")] = None,
    theta_fs: Annotated[Text, typer.Option("--theta-fs", help="sensitivity: theta_F values.")] = None,
    degrees: Annotated[Text, typer.Option(help="prefix-sharing: sharing degrees.")] = None,
    output_tokens: Annotated[Optional[int], typer.Option(help="prefix-sharing: output tokens per request.")] = None,
    reclaim_mode: ReclaimMode = defaults.RECLAIM_MODE,
    theta_f: ThetaF = defaults.THETA_F,
    eviction_interval: EvictionInterval = defaults.EVICTION_INTERVAL_TOKENS,
    seed: Seed = defaults.SEED,
    max_num_batched_tokens: MaxNumBatchedTokens = None,
    chunked_prefill: ChunkedPrefill = None,
    workers: Workers = None,
    ray: RayAddress = None,
    cache_dir: CacheDir = None,
    no_cache: NoCache = False,
    json_out: JsonOut = False,
) -> None:
    """Run one of the vToken paper's serving experiments and print vtoken's figures next to
    the paper's.

    \b
    Experiments
      fig7            memory utilization, retained blocks: H2O, Scissorhands, Random
      fig8            SLA-constrained throughput and p95: Llama-3.1-8B, Mistral-7B
      fig9            capacity frontier, Llama-3.1-8B at 5,427 and 11,519 blocks
      fig10           capacity frontier, Qwen2.5-14B
      sensitivity     block size, eviction ratio, theta_F (section 4.5)
      prefix-sharing  8K shared prefix + 8K private suffix, degrees 1-8 (4.6)

    \b
    Examples
      vtoken paper fig7
      vtoken paper fig8 --tokenizer smollm2-135m
      vtoken paper fig9 --json

    \b
    Exit codes
      0  the experiment ran
      2  bad input (a flag, the trace) or nothing measured
    """
    if experiment not in EXPERIMENTS:
        raise ConfigError(f"unknown experiment '{experiment}'; choose one of: {', '.join(EXPERIMENTS)}")
    given = {"--policies": policies, "--models": models, "--budget-concurrency": budget_concurrency,
             "--block-sizes": block_sizes, "--eviction-ratios": eviction_ratios, "--theta-fs": theta_fs,
             "--degrees": degrees, "--output-tokens": output_tokens, "--concurrencies": concurrencies,
             "--trace": trace, "--tokenizer": tokenizer, "--max-requests": max_requests,
             "--concurrency": concurrency, "--model": model}
    for flag, value in given.items():
        if value is not None and experiment not in ONLY_FOR[flag]:
            raise ConfigError(f"{flag} applies to {', '.join(ONLY_FOR[flag])}, not to {experiment}")
    block_budget = parse_int_list(num_blocks, "--num-blocks") if num_blocks else None
    if block_budget and len(block_budget) > 1 and experiment not in ("fig9", "fig10"):
        raise ConfigError(f"--num-blocks takes one value for {experiment}, got '{num_blocks}'")
    base = build_experiment(
        model=model or defaults.MODEL, gpu=gpu, num_blocks=None, gpu_mem_util=gpu_mem_util, block_size=block_size,
        policy=policy, budget=budget or (paper.PREFIX_BUDGET if experiment == "prefix-sharing" else defaults.BUDGET),
        eviction_interval=eviction_interval, reclaim_mode=reclaim_mode, theta_f=theta_f, seed=seed, sim_profile=None,
        scheduler=scheduler_flags(max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=None,
                                  chunked_prefill=chunked_prefill, long_prefill_token_threshold=None,
                                  evict_every_chunk=False),
    ).run("vtoken", check_concurrency(concurrency or DEFAULT_CONCURRENCY))
    runner = make_runner(workers, ray)  # closed, its worker processes ended, after the replays
    replayer = SimReplayer(gpu_mem_util=gpu_mem_util, runner=runner,
                           cache=build_cache(cache_dir, no_cache))
    loaded = None
    if experiment in DEFAULT_TRACE:
        loaded = paper.load_workload(trace or DEFAULT_TRACE[experiment],
                                     max_requests=max_requests or DEFAULT_MAX_REQUESTS.get(experiment),
                                     tokenizer=build_tokenizer(tokenizer))
    one_budget = block_budget[0] if block_budget else None
    with runner, progress_bar(stderr, 22, f"paper {experiment}") as bar:
        task = bar.add_task("replaying", total=None)
        progress = lambda stage, n: bar.update(task, advance=n, description=stage)  # noqa: E731
        if experiment == "fig7":
            ids = tuple(p.strip() for p in policies.split(",")) if policies else paper.FIG7_POLICIES
            figure = paper.fig7(loaded, base, replayer, progress, policies=_policies(ids), num_blocks=one_budget)
        elif experiment == "fig8":
            figure = paper.fig8(
                loaded, base, replayer, progress,
                models=tuple(m.strip() for m in models.split(",")) if models else paper.FIG8_MODELS,
                concurrencies=parse_int_list(concurrencies, "--concurrencies") if concurrencies
                else paper.experiments.FIG8_CONCURRENCIES, num_blocks=one_budget,
                budget_concurrency=budget_concurrency or paper.experiments.FIG8_BUDGET_CONCURRENCY)
        elif experiment in ("fig9", "fig10"):
            cases = paper.FIG9_CASES if experiment == "fig9" else paper.FIG10_CASES
            if block_budget and len(block_budget) != len(cases):
                raise ConfigError(f"--num-blocks: {experiment} has {len(cases)} budget(s), got '{num_blocks}'")
            figure = paper.frontier(loaded, base, replayer, cases, progress, experiment=experiment,
                                    num_blocks=block_budget,
                                    concurrencies=parse_int_list(concurrencies, "--concurrencies") if concurrencies
                                    else None)
        elif experiment == "sensitivity":
            values = {key: parse(text, flag) for key, text, flag, parse in (
                ("block_size", block_sizes, "--block-sizes", parse_int_list),
                ("eviction_ratio", eviction_ratios, "--eviction-ratios", _parse_ratios),
                ("theta_f", theta_fs, "--theta-fs", _parse_ratios)) if text}
            figure = paper.sensitivity(loaded, base, replayer, progress, values=values, num_blocks=one_budget)
        else:
            figure = paper.prefix_sharing(
                base, replayer, progress,
                degrees=parse_int_list(degrees, "--degrees") if degrees else paper.PREFIX_DEGREES,
                num_output_tokens=output_tokens, num_blocks=one_budget)
    if json_out:
        stdout.print_json(json.dumps(paper.figure_to_json(figure)))
    else:
        stdout.print(paper_report(figure))


def _policies(names: tuple[str, ...]) -> tuple[str, ...]:
    from vtoken_cli.options import resolve_policies

    return resolve_policies(list(names), "--policies")


def _parse_ratios(text: str, flag: str) -> tuple[float, ...]:
    try:
        values = tuple(float(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise ConfigError(f"{flag} must be comma-separated numbers, got '{text}'") from None
    if not values or not all(0 < v < 1 for v in values):
        raise ConfigError(f"{flag} must be numbers in (0, 1), got '{text}'")
    return values
