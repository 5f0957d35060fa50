"""`vtoken validate TRACE --executor vllm|hf --model M --sim-profile PROFILE.toml`: how far is the sim?"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from vtoken import defaults
from vtoken.calibration.engines import MEASURED_EXECUTORS, open_engine
from vtoken.calibration.profile import calibration_grid
from vtoken.engine.sim import load_sim_profile
from vtoken.errors import ConfigError
from vtoken.trace import load_trace, within_context
from vtoken.validate import report_to_json, validate
from vtoken_cli.console import stderr, stdout
from vtoken_cli.options import (
    Budget, ChunkedPrefill, Concurrency, EvictEveryChunk, EvictionInterval, JsonOut, LongPrefillTokenThreshold,
    MaxNumBatchedTokens, MaxNumSeqs, MaxRequests, NumBlocks, Policy, ReclaimMode, Seed, ThetaF, TimeUnit,
    TraceFormat, build_experiment, scheduler_flags,
)
from vtoken_cli.render.validate import validation_report


def validate_command(
    trace: Annotated[Path, typer.Argument(help="Request trace (any format compare reads); not one used to calibrate.",
                                          metavar="TRACE")],
    executor: Annotated[str, typer.Option(help="Engine to measure: vllm (in-process vLLM) or hf (transformers).")],
    model: Annotated[str, typer.Option(help="smollm2-135m or a local Llama/Mistral/Qwen2 folder.")],
    sim_profile: Annotated[Path, typer.Option(help="Calibrated sim profile, from vtoken calibrate.")],
    policy: Policy = defaults.VLLM_POLICY,
    budget: Budget = defaults.BUDGET,
    num_blocks: NumBlocks = None,
    block_size: Annotated[int, typer.Option(help="Tokens per KV block (vLLM on CPU: a multiple of 32).")] = 32,
    concurrency: Concurrency = 4,
    eviction_interval: EvictionInterval = defaults.EVICTION_INTERVAL_TOKENS,
    reclaim_mode: ReclaimMode = defaults.RECLAIM_MODE,
    theta_f: ThetaF = defaults.THETA_F,
    max_num_batched_tokens: MaxNumBatchedTokens = None,
    max_num_seqs: MaxNumSeqs = None,
    chunked_prefill: ChunkedPrefill = None,
    long_prefill_token_threshold: LongPrefillTokenThreshold = None,
    evict_every_chunk: EvictEveryChunk = False,
    rounds: Annotated[int, typer.Option(help="Measured rounds; each replays native and vtoken, alternating.")] = 3,
    seed: Seed = defaults.SEED,
    trace_format: TraceFormat = defaults.TRACE_FORMAT,
    time_unit: TimeUnit = None,
    max_requests: MaxRequests = None,
    json_out: JsonOut = False,
) -> None:
    """Replay TRACE on the real engine and on the sim with the calibrated profile, with the same
    settings (block budget, block size, concurrency, policy, seed, scheduler limits: those no
    flag sets are the engine's own defaults on this machine), and report per variant the
    measured figure, the simulated one and the relative error: throughput, TTFT, TPOT and
    end-to-end latency at p50 and p95. Warm-up is left out; the measured rounds alternate the
    variants and their spread is shown. naive-evict is not validated: in vLLM it compacts like
    vToken, so its measured speed is not Naive-Evict's. For vllm, the step model is also checked
    on the engine's own native steps, each timed with the load vLLM scheduled: the step times'
    share of the error.

    \b
    Examples
      vtoken validate examples/validation_trace.jsonl --executor vllm
        --model smollm2-135m --sim-profile smollm2-vllm.toml   (one line)

    \b
    --json prints {"variants": {VARIANT: {FIGURE: {"measured": x, "simulated": y,
    "rel_error": e, "spread": {"min", "median", "max", "values"}}}}, "steps": {"native":
    {KIND: {"num_steps", "measured_mean_s", "predicted_mean_s", "rel_error"}}}}, rel_error =
    (simulated - measured) / measured, the spread over the rounds in round order.

    \b
    Exit codes
      0  the validation ran (whatever the errors)
      2  bad input (trace, executor, model, profile)
    """
    if executor not in MEASURED_EXECUTORS:
        raise ConfigError(f"--executor {executor!r}: validate measures a real engine, one of "
                          f"{', '.join(MEASURED_EXECUTORS)}")
    if rounds <= 0:
        raise ConfigError(f"--rounds must be > 0, got {rounds}")
    profile = load_sim_profile(sim_profile)
    if profile.step_model is None:
        raise ConfigError(f"--sim-profile {sim_profile}: not calibrated (no [sim.step_model]); "
                          "write one with vtoken calibrate")
    grid = calibration_grid(sim_profile)
    provenance = profile.step_model.provenance
    if provenance is not None and provenance.engine != executor:
        raise ConfigError(f"--sim-profile {sim_profile}: calibrated against {provenance.engine}, not --executor "
                          f"{executor}")
    if concurrency <= 0:
        raise ConfigError(f"--concurrency must be > 0, got {concurrency}")
    experiment = build_experiment(model="smollm2-135m", gpu=defaults.GPU, num_blocks=num_blocks,
                                  gpu_mem_util=defaults.GPU_MEMORY_UTILIZATION, block_size=block_size, policy=policy,
                                  budget=budget, eviction_interval=eviction_interval, reclaim_mode=reclaim_mode,
                                  theta_f=theta_f, seed=seed, sim_profile=None,
                                  scheduler=scheduler_flags(max_num_batched_tokens=max_num_batched_tokens,
                                                            max_num_seqs=max_num_seqs, chunked_prefill=chunked_prefill,
                                                            long_prefill_token_threshold=long_prefill_token_threshold,
                                                            evict_every_chunk=evict_every_chunk))
    loaded = load_trace(trace, trace_format, time_unit=time_unit, max_requests=max_requests)
    say = lambda message: stderr.print(message, highlight=False, markup=False)  # noqa: E731
    with open_engine(executor, model, experiment, loaded.requests, concurrency, num_blocks,
                     on_status=say) as (engine, experiment):
        loaded = within_context(loaded, experiment.model.max_model_len)
        report = validate(str(trace), loaded.requests, experiment, concurrency, profile, engine, rounds, on_run=say,
                          grid=grid)
    if json_out:
        stdout.print_json(json.dumps(report_to_json(report)))
    else:
        stdout.print(validation_report(report))
