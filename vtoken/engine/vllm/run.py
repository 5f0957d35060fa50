"""Replay a trace on vLLM, per variant over rounds, and report it like the sim does (`RunResult`).

    run_variants_on_vllm(experiment, requests, concurrency, spec, progress, num_rounds, num_warmup)
                                                  -> Rounds[RunResult] (vtoken.rounds)
    replay(llm, run, requests)                    one run (variant, concurrency) on a built engine

`vtoken compare --executor vllm` reaches these through `vtoken.replay.VllmReplayer`;
`check-invariants --executor vllm` through `vtoken.checker.vllm` (one engine, every check on).

One in-process engine for the whole measurement: between replays the scheduler is reconfigured
for the next variant (`VTokenScheduler.reconfigure`; the model runner only applies plans), so
every variant runs on the same engine, warmed up alike. Each variant is replayed `num_warmup`
times first (dropped), then `num_rounds` rounds alternate the variants. The replay is closed
loop at the run's concurrency: each client submits its next request when the previous one
finished. Prompts are random token ids seeded by (seed, request index), of the trace's prompt
length; generation is greedy for exactly the trace's output length (EOS ignored). Times are
wall-clock seconds on this machine.

Memory is sampled after every engine step from the scheduler (`held_memory`: the blocks vLLM
holds for each request and the live tokens) into the same time-weighted `Recorder` the sim
uses, and the result is built by the same `RunResult.from_recording`. The KV
block budget is vLLM's pool (`experiment.num_blocks`; one block is vLLM's null block).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import replace

import numpy as np

from vtoken.engine.experiment import VARIANTS, Experiment, Run
from vtoken.engine.vllm.engine import EngineSpec, open_llm, scheduler_of
from vtoken.engine.vllm.settings import VllmSettings
from vtoken.errors import ConfigError
from vtoken.metrics import MemorySample, Recorder, RunResult
from vtoken.rounds import Rounds, run_rounds
from vtoken.trace import Request

Progress = Callable[[str, int], None]


def held_memory(scheduler) -> MemorySample:
    """The memory vLLM holds for the requests: the token tables' blocks (the ledger) plus the
    blocks a variant keeps beyond them, which hold no live token (naive-evict's dead blocks,
    vtoken's blocks between reclamation rounds)."""
    tracker = scheduler.vtoken
    ledger = tracker.ledger
    manager = scheduler.kv_cache_manager.coordinator.single_type_managers[0]
    num_held = sum(len(manager.req_to_blocks.get(r, ())) for r in tracker.requests)
    num_spare = max(0, num_held - ledger.num_allocated_blocks)
    histogram = ledger.utilization_histogram()
    histogram[0] += num_spare
    return MemorySample(ledger.num_allocated_blocks + num_spare, ledger.num_live_tokens, ledger.block_size, histogram,
                        ledger.num_blocks_le_half + num_spare)


def settings_for(experiment: Experiment, variant: str) -> VllmSettings:
    return VllmSettings(variant, experiment.eviction, experiment.reclaim, experiment.seed)


def prompt_ids(request_idx: int, num_tokens: int, seed: int, vocab_size: int) -> list[int]:
    """Random prompt token ids of one request (ids 0..2 are left out: special tokens)."""
    rng = np.random.default_rng([seed, request_idx])
    return rng.integers(3, vocab_size, num_tokens).tolist()


def preemptions_by_id(scheduler) -> dict[str, int]:
    """Preemptions so far of every request vLLM holds (running or waiting), by the id it was
    added with. vLLM counts them on its `Request` (`Scheduler._preempt_request`) and adds 8
    random characters to the ids it is given (`InputProcessor.assign_request_id`: "{id}-{random}").
    Read after every step: a preempted request runs again before it can finish, so no count is missed."""
    return {req_id.rpartition("-")[0] or req_id: request.num_preemptions
            for req_id, request in scheduler.requests.items() if request.num_preemptions}


def replay(llm, run: Run, requests: Sequence[Request], on_done: Callable[[int], None] | None = None,
           check_invariants: bool = False, on_step: Callable[[float], None] | None = None) -> RunResult:
    """Closed-loop replay of `requests` on a built engine with `run`'s variant settings.
    `on_step(seconds)`: after each iteration of the loop (`engine.step()`, the stamps, the
    memory sample and the next submissions: what calibration times as one step)."""
    from vllm import SamplingParams

    experiment, spec = run.experiment, run.spec
    scheduler = scheduler_of(llm)
    scheduler.reconfigure(replace(settings_for(experiment, spec.variant), check_invariants=check_invariants))
    engine = llm.llm_engine
    vocab_size = llm.llm_engine.model_config.get_vocab_size()
    max_len = llm.llm_engine.model_config.max_model_len
    recorder = Recorder(experiment.model.kv_bytes_per_token)
    skipped, pending = [], list(enumerate(requests))
    in_flight: dict[str, tuple[int, float, float | None]] = {}  # id -> (num output tokens, arrival, first token)
    num_preemptions: dict[str, int] = {}  # id -> preemptions so far, read from vLLM's requests
    started = time.perf_counter()
    num_iterations = 0

    def submit() -> None:
        while pending and len(in_flight) < (spec.concurrency or len(requests)):
            idx, request = pending.pop(0)
            if request.num_prompt_tokens + request.num_output_tokens > max_len:
                skipped.append((request.request_id, f"needs {request.num_prompt_tokens + request.num_output_tokens} "
                                f"tokens, max_model_len is {max_len}"))
                continue
            params = SamplingParams(temperature=0.0, max_tokens=request.num_output_tokens, ignore_eos=True)
            engine.add_request(str(idx), {"prompt_token_ids": prompt_ids(idx, request.num_prompt_tokens, experiment.seed,
                                                                          vocab_size)}, params)
            now_s = time.perf_counter() - started
            in_flight[str(idx)] = (request.num_output_tokens, now_s, None)
            recorder.record_arrival(now_s)

    submit()
    while in_flight:
        step_started = time.perf_counter()
        outputs = engine.step()
        num_iterations += 1
        now_s = time.perf_counter() - started
        num_preemptions.update(preemptions_by_id(scheduler))
        for output in outputs:
            num_out, arrival_s, first_s = in_flight[output.request_id]
            if first_s is None and output.outputs and output.outputs[0].token_ids:
                first_s = now_s
                in_flight[output.request_id] = (num_out, arrival_s, first_s)
            if output.finished:
                del in_flight[output.request_id]
                recorder.record_finish(requests[int(output.request_id)], arrival_s,
                                       first_s if first_s is not None else now_s, now_s,
                                       num_preemptions=num_preemptions.pop(output.request_id, 0))
                if on_done is not None:
                    on_done(requests[int(output.request_id)].num_output_tokens)
        recorder.sample(now_s, len(scheduler.vtoken.requests), held_memory(scheduler))
        submit()
        if on_step is not None:
            on_step(time.perf_counter() - step_started)
    return RunResult.from_recording(
        recorder, scheduler.vtoken.counters, variant=spec.variant,
        policy=experiment.eviction.policy if spec.evicts else "none", num_requests=len(requests),
        skipped=tuple(skipped), num_iterations=num_iterations, num_decode_steps=num_iterations,
        host_time_s=time.perf_counter() - started,
    )


def run_variants_on_vllm(experiment: Experiment, requests: Sequence[Request], concurrency: int | None,
                         spec: EngineSpec, progress: Progress | None = None, num_rounds: int = 1,
                         num_warmup: int = 0) -> Rounds:
    """The three variants on one engine: `num_warmup` dropped replays of each, then `num_rounds`
    rounds, the variants rotated each round (vtoken.rounds)."""
    with open_llm(spec, settings_for(experiment, VARIANTS[0])) as llm:
        def replay_one(variant: str, round_idx: int | None) -> RunResult:
            stage = f"{variant} (vllm, {'warm-up' if round_idx is None else f'round {round_idx + 1}'})"
            on_done = (lambda n: progress(stage, n)) if progress else None
            return replay(llm, experiment.run(variant, concurrency), requests, on_done)

        return run_rounds(VARIANTS, replay_one, num_rounds, num_warmup)


def engine_spec_for(experiment: Experiment, concurrency: int | None, model: str,
                    max_model_len: int = 2048) -> EngineSpec:
    """The vLLM engine of a compare: the experiment's block size and block budget, fp32, eager,
    and the experiment's scheduler limits (vtoken's flags; those not given, vLLM's own defaults on
    this machine: `with_engine_defaults`, which the replayer's `resolve` applies first so that the
    header and a validation's sim state the same ones), so that vLLM's scheduler and the sim's
    run the same token budget, chunking and chunk cap. `max_num_seqs` is at most `concurrency`
    (closed loop: no more requests exist at once)."""
    if experiment.block_size % 32:
        raise ConfigError(f"--executor vllm on CPU needs a block size that is a multiple of 32, got {experiment.block_size}")
    limits = with_engine_defaults(experiment)[0].scheduler
    max_model_len = min(max_model_len, (experiment.num_blocks - 1) * experiment.block_size)
    if not limits.enable_chunked_prefill and limits.max_num_batched_tokens < max_model_len:
        raise ConfigError(f"with chunked prefill off, --max-num-batched-tokens ({limits.max_num_batched_tokens}) must "
                          f"hold the longest request vLLM admits (max_model_len {max_model_len})")
    max_num_seqs = min(limits.max_num_seqs, concurrency) if concurrency else limits.max_num_seqs
    return EngineSpec(model, block_size=experiment.block_size, num_gpu_blocks_override=experiment.num_blocks,
                      kv_cache_memory_bytes=64 << 20, max_model_len=max_model_len,
                      max_num_seqs=max_num_seqs, max_num_batched_tokens=limits.max_num_batched_tokens,
                      seed=experiment.seed,
                      extra_llm_kwargs={"enable_chunked_prefill": limits.enable_chunked_prefill,
                                        "long_prefill_token_threshold": limits.long_prefill_token_threshold})


def with_engine_defaults(experiment: Experiment) -> tuple[Experiment, str]:
    """The experiment with each scheduler limit it leaves None set to what vLLM takes on this
    machine's device (engine_batch_defaults: the engine the vllm executor runs, not the catalog
    GPU a sim run models), and a note naming them ("" when every limit was given)."""
    from vtoken.engine.batch_limits import engine_batch_defaults

    limits = experiment.scheduler
    if limits.max_num_batched_tokens is not None and limits.max_num_seqs is not None:
        return experiment, ""
    engine = engine_batch_defaults()
    filled = replace(limits, max_num_batched_tokens=limits.max_num_batched_tokens or engine.max_num_batched_tokens,
                     max_num_seqs=limits.max_num_seqs or engine.max_num_seqs)
    names = [n for n in ("max_num_batched_tokens", "max_num_seqs") if getattr(limits, n) is None]
    note = (f"scheduler: {' and '.join(f'{n} {getattr(filled, n):,}' for n in names)} as vLLM takes them on this "
            f"machine ({engine.source}); --max-num-batched-tokens and --max-num-seqs set them")
    return replace(experiment, scheduler=filled), note


def default_num_blocks(requests: Sequence[Request], concurrency: int | None, block_size: int) -> int:
    """Enough blocks for `concurrency` of the longest requests at full length, plus the null block."""
    longest = max(r.num_prompt_tokens + r.num_output_tokens for r in requests)
    return (concurrency or len(requests)) * -(-longest // block_size) + 1
