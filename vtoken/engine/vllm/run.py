"""Replay a trace on vLLM, once per variant, and report it like the sim does (`RunResult`).

    compare_vllm(trace, config, options, spec)   -> vtoken.compare.CompareReport (executor "vllm")
    check_invariants_on_vllm(trace, config, model, fault=None)
                                                 -> VllmCheckReport (one engine, every check on,
                                                    optionally a checker fault inside it)

One in-process engine per variant, built, replayed and shut down in turn. The replay is closed
loop at `config.concurrency`: each client submits its next request when the previous one
finished. Prompts are random token ids seeded by (seed, request index), of the trace's prompt
length; generation is greedy for exactly the trace's output length (EOS ignored). Times are
wall-clock seconds on this machine.

Memory is sampled after every engine step from the scheduler (`held_memory`: the blocks vLLM
holds for each request and the live tokens) into the same time-weighted `Recorder` the sim
uses, and the result is built by the same `RunResult.from_recording`. The KV
block budget is vLLM's pool (`config.num_blocks`; one block is vLLM's null block).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from vtoken.engine.config import VARIANTS, RunConfig
from vtoken.engine.vllm.engine import EngineSpec, model_runner_of, open_llm, scheduler_of
from vtoken.engine.vllm.settings import VllmSettings
from vtoken.errors import ConfigError, InvariantError
from vtoken.metrics import MemorySample, Recorder, RunResult
from vtoken.model_spec import model_spec_from_hf_config
from vtoken.trace import Request, Trace

Progress = Callable[[str, int], None]
VLLM_SKIPPED_NOTE = ("--executor vllm measures the three variants only: the concurrency sweep and the capacity "
                     "frontier need dozens of replays and are skipped (run them with --executor sim)")


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


def settings_for(config: RunConfig, variant: str) -> VllmSettings:
    return VllmSettings(variant, config.eviction, config.reclaim, config.seed)


def prompt_ids(request_idx: int, num_tokens: int, seed: int, vocab_size: int) -> list[int]:
    """Random prompt token ids of one request (ids 0..2 are left out: special tokens)."""
    rng = np.random.default_rng([seed, request_idx])
    return rng.integers(3, vocab_size, num_tokens).tolist()


def replay(llm, config: RunConfig, requests: Sequence[Request], on_done: Callable[[int], None] | None = None,
           check_invariants: bool = False) -> RunResult:
    """Closed-loop replay of `requests` on a built engine with `config.variant`'s settings."""
    from vllm import SamplingParams

    scheduler = scheduler_of(llm)
    scheduler.reconfigure(replace(settings_for(config, config.variant), check_invariants=check_invariants))
    engine = llm.llm_engine
    vocab_size = llm.llm_engine.model_config.get_vocab_size()
    max_len = llm.llm_engine.model_config.max_model_len
    recorder = Recorder(config.model.kv_bytes_per_token)
    skipped, pending = [], list(enumerate(requests))
    in_flight: dict[str, tuple[int, float, float | None]] = {}  # id -> (num output tokens, arrival, first token)
    started = time.perf_counter()
    num_iterations = 0

    def submit() -> None:
        while pending and len(in_flight) < (config.concurrency or len(requests)):
            idx, request = pending.pop(0)
            if request.num_prompt_tokens + request.num_output_tokens > max_len:
                skipped.append((request.request_id, f"needs {request.num_prompt_tokens + request.num_output_tokens} "
                                f"tokens, max_model_len is {max_len}"))
                continue
            params = SamplingParams(temperature=0.0, max_tokens=request.num_output_tokens, ignore_eos=True)
            engine.add_request(str(idx), {"prompt_token_ids": prompt_ids(idx, request.num_prompt_tokens, config.seed,
                                                                          vocab_size)}, params)
            now_s = time.perf_counter() - started
            in_flight[str(idx)] = (request.num_output_tokens, now_s, None)
            recorder.record_arrival(now_s)

    submit()
    while in_flight:
        outputs = engine.step()
        num_iterations += 1
        now_s = time.perf_counter() - started
        for output in outputs:
            num_out, arrival_s, first_s = in_flight[output.request_id]
            if first_s is None and output.outputs and output.outputs[0].token_ids:
                first_s = now_s
                in_flight[output.request_id] = (num_out, arrival_s, first_s)
            if output.finished:
                del in_flight[output.request_id]
                recorder.record_finish(arrival_s, first_s if first_s is not None else now_s, now_s, num_out)
                if on_done is not None:
                    on_done(1)
        recorder.sample(now_s, len(scheduler.vtoken.requests), held_memory(scheduler))
        submit()
    return RunResult.from_recording(
        recorder, scheduler.vtoken.counters, variant=config.variant,
        policy=config.eviction.policy if config.evicts else "none", num_requests=len(requests),
        skipped=tuple(skipped), num_iterations=num_iterations, num_decode_steps=num_iterations,
        host_time_s=time.perf_counter() - started,
    )


def run_variants_on_vllm(config: RunConfig, requests: Sequence[Request], spec: EngineSpec,
                         progress: Progress | None = None) -> dict[str, RunResult]:
    """One engine per variant, built and shut down in turn (one engine in memory at a time)."""
    runs = {}
    for variant in VARIANTS:
        with open_llm(spec, settings_for(config, variant)) as llm:
            on_done = (lambda n, v=variant: progress(f"{v} (vllm)", n)) if progress else None
            runs[variant] = replay(llm, replace(config, variant=variant), requests, on_done)
    return runs


def engine_spec_for(config: RunConfig, model: str, max_model_len: int = 2048) -> EngineSpec:
    """The vLLM engine of a compare: the run's block size and block budget, fp32, eager."""
    if config.block_size % 32:
        raise ConfigError(f"--executor vllm on CPU needs a block size that is a multiple of 32, got {config.block_size}")
    max_model_len = min(max_model_len, (config.num_blocks - 1) * config.block_size)
    return EngineSpec(model, block_size=config.block_size, num_gpu_blocks_override=config.num_blocks,
                      kv_cache_memory_bytes=64 << 20, max_model_len=max_model_len,
                      max_num_seqs=max(config.concurrency or 8, 1), seed=config.seed)


def default_num_blocks(requests: Sequence[Request], concurrency: int | None, block_size: int) -> int:
    """Enough blocks for `concurrency` of the longest requests at full length, plus the null block."""
    longest = max(r.num_prompt_tokens + r.num_output_tokens for r in requests)
    return (concurrency or len(requests)) * -(-longest // block_size) + 1


def compare_vllm(trace: Trace, config: RunConfig, options, model: str, progress: Progress | None = None,
                 num_blocks: int | None = None, max_model_len: int = 2048):
    """`vtoken compare --executor vllm`: the three variants on vLLM, measured; no sweep, no frontier.

    `model` is a local model folder; its config.json gives the KV geometry. `num_blocks` None:
    enough for `config.concurrency` requests at full length.
    """
    from vtoken.analysis import interval
    from vtoken.compare import CompareReport

    if options.repeats != 1:
        raise ConfigError(f"--repeats applies to the sim executor; --executor vllm runs once, got --repeats {options.repeats}")
    folder = Path(model).expanduser()
    if not (folder / "config.json").is_file():
        raise ConfigError(f"--executor vllm needs --model to be a local model folder with a config.json, got {model!r}")
    if num_blocks is None:
        num_blocks = default_num_blocks(trace.requests, config.concurrency, config.block_size)
    model_spec = replace(model_spec_from_hf_config(folder), dtype_bytes=4)  # the engine runs fp32
    config = replace(config, model=model_spec, num_blocks=num_blocks)
    runs = run_variants_on_vllm(config, trace.requests, engine_spec_for(config, str(folder), max_model_len), progress)
    headline_ci = {variant: {key: interval([value]) for key, value in run.headline().items()} for variant, run in runs.items()}
    options = replace(options, with_sweep=False, with_frontier=False)
    trace = replace(trace, notes=trace.notes + (VLLM_SKIPPED_NOTE,))
    return CompareReport(trace, config, options, runs, headline_ci, (), None, None, "vllm")


CHECK_RUNS = tuple((variant, mode) for variant in ("naive-evict", "vtoken") for mode in ("hole-fill", "ordered"))


@dataclass(frozen=True)
class VllmViolation:
    """The violation that ended a check run on vLLM; block and offset are vLLM's, when known."""

    invariant: str
    message: str
    run: str  # "vtoken/hole-fill"
    block_id: int | None = None
    offset: int | None = None


@dataclass(frozen=True)
class VllmCheckReport:
    """`check-invariants --executor vllm`: what was checked, per (variant, reclaim mode).

    Every eviction is followed by I1 (live ids kept), I2 (one slot per live token over all
    tables, pool counts agree) and I3 (dense live layout), in the scheduler; in the worker,
    every KV copy is read back byte for byte (I1 on the data) and, before each forward, what
    attention reads and writes is compared with the token tables, and the copies of the step
    must have landed (I3). I4 has nothing to check: a compaction is applied when it is planned
    and no block is shared. A violation is raised inside vLLM's step; the check stops there
    (`violation`, in the run it names) and the runs after it do not run.
    """

    runs: dict[str, dict[str, int]]  # "vtoken/hole-fill" -> counters of that replay
    num_checks: dict[str, int]  # "I1".."I3" -> checks run, over every replay
    elapsed_s: float = 0.0  # engine start-up included
    violation: VllmViolation | None = None
    fault: str | None = None  # the injected fault's kind
    num_faults_injected: int = 0

    @property
    def passed(self) -> bool:
        return self.violation is None

    @property
    def num_evictions_checked(self) -> int:
        return sum(r["eviction_events"] for r in self.runs.values())

    @property
    def num_copies_verified(self) -> int:
        return sum(r["relocation_events"] for r in self.runs.values())


def check_invariants_on_vllm(trace: Trace, config: RunConfig, model: str, num_blocks: int | None = None,
                             progress: Progress | None = None, fault=None) -> VllmCheckReport:
    """Replay `trace` with naive-evict and vtoken, both reclaim modes, every check on.

    `fault`: a `vtoken.checker.faults.Fault`, injected into this engine's model runner and
    the token tables of every replay.
    """
    started = time.perf_counter()
    folder = Path(model).expanduser()
    if num_blocks is None:
        num_blocks = default_num_blocks(trace.requests, config.concurrency, config.block_size)
    config = replace(config, model=replace(model_spec_from_hf_config(folder), dtype_bytes=4), num_blocks=num_blocks)
    runs, num_checks, violation = {}, Counter(I1=0, I2=0, I3=0), None
    with open_llm(engine_spec_for(config, str(folder)), settings_for(config, "vtoken")) as llm:
        runner = model_runner_of(llm)
        if fault is not None:
            inject_fault(llm, fault)
        for variant, mode in CHECK_RUNS:
            label = f"{variant}/{mode}"
            checked = replace(config, variant=variant, reclaim=replace(config.reclaim, mode=mode))
            runner_checks_before = Counter(runner.vtoken_num_checks or {})
            on_done = (lambda n, v=label: progress(v, n)) if progress else None
            try:
                replay(llm, checked, trace.requests, on_done, check_invariants=True)
            except InvariantError as exc:
                violation = VllmViolation(exc.invariant, str(exc), label, exc.where.get("block_id"), exc.where.get("offset"))
            tracker = scheduler_of(llm).vtoken  # replay() reconfigured the scheduler: a new tracker
            runs[label] = tracker.counters.as_dict()
            num_checks.update(tracker.num_checks)
            num_checks.update(Counter(runner.vtoken_num_checks or {}) - runner_checks_before)
            if violation is not None:
                break
    return VllmCheckReport(runs, dict(num_checks), time.perf_counter() - started, violation,
                           fault.kind if fault is not None else None, fault.num_injected if fault is not None else 0)


def inject_fault(llm, fault) -> None:
    """Put `fault` (a `vtoken.checker.faults.Fault`) into an engine for the rest of its life: its
    model runner, and the token tables of the scheduler's tracker and of every tracker it makes
    from now on (one per `reconfigure`)."""
    fault.wrap_vllm_runner(model_runner_of(llm))
    scheduler = scheduler_of(llm)
    _show_new_tables(scheduler.vtoken, fault.adopt_vllm_table)
    make_tracker = scheduler._make_tracker

    def make_tracker_showing_tables():
        tracker = make_tracker()
        _show_new_tables(tracker, fault.adopt_vllm_table)
        return tracker

    scheduler._make_tracker = make_tracker_showing_tables


def _show_new_tables(tracker, adopt: Callable) -> None:
    """Call `adopt(table)` for every token table `tracker` creates, at its first sync (before
    any eviction or relocation touches it)."""
    sync = tracker.sync

    def sync_showing_new_tables(req_id: str, num_new_tokens: int, vllm_block_ids) -> None:
        sync(req_id, num_new_tokens, vllm_block_ids)
        table = tracker.requests[req_id].table
        if table.num_tokens == num_new_tokens:  # new, or rebuilt after a preemption
            adopt(table)

    tracker.sync = sync_showing_new_tables
