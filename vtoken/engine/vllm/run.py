"""Replay a trace on vLLM, once per variant, and report it like the sim does (`RunResult`).

    compare_vllm(trace, config, options, spec)   -> vtoken.compare.CompareReport (executor "vllm")

One in-process engine per variant, built, replayed and shut down in turn. The replay is closed
loop at `config.concurrency`: each client submits its next request when the previous one
finished. Prompts are random token ids seeded by (seed, request index), of the trace's prompt
length; generation is greedy for exactly the trace's output length (EOS ignored). Times are
wall-clock seconds on this machine.

Memory is sampled after every engine step from the scheduler: the blocks vLLM holds for each
request (the token table's blocks plus the blocks a variant keeps beyond them, which hold no
live token) and the live tokens, into the same time-weighted `Recorder` the sim uses. The KV
block budget is vLLM's pool (`config.num_blocks`; one block is vLLM's null block).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from vtoken.engine.config import VARIANTS, RunConfig
from vtoken.engine.vllm.engine import EngineSpec, open_llm, scheduler_of
from vtoken.engine.vllm.settings import VllmSettings
from vtoken.errors import ConfigError
from vtoken.kv.block_pool import NUM_HISTOGRAM_BINS
from vtoken.metrics import LatencyStats, Recorder, RunResult
from vtoken.model_spec import model_spec_from_hf_config
from vtoken.trace import Request, Trace

Progress = Callable[[str, int], None]
VLLM_SKIPPED_NOTE = ("--executor vllm measures the three variants only: the concurrency sweep and the capacity "
                     "frontier need dozens of replays and are skipped (run them with --executor sim)")


class _HeldBlocks:
    """What `Recorder` reads from a pool, computed over the blocks vLLM holds for the requests."""

    def __init__(self, scheduler) -> None:
        tracker = scheduler.vtoken
        ledger = tracker.ledger
        manager = scheduler.kv_cache_manager.coordinator.single_type_managers[0]
        num_held = sum(len(manager.req_to_blocks.get(r, ())) for r in tracker.requests)
        num_spare = max(0, num_held - ledger.num_allocated_blocks)
        self.block_size = ledger.block_size
        self.num_allocated_blocks = ledger.num_allocated_blocks + num_spare
        self.num_live_tokens = ledger.num_live_tokens
        self._histogram = ledger.utilization_histogram()
        self._histogram[0] += num_spare
        self._num_le_half = ledger.num_blocks_le_half + num_spare

    def utilization_histogram(self) -> np.ndarray:
        return self._histogram

    def waste_ratio(self) -> float:
        if self.num_allocated_blocks == 0:
            return 0.0
        return 1.0 - self.num_live_tokens / (self.num_allocated_blocks * self.block_size)

    def frac_blocks_le_half(self) -> float:
        return self._num_le_half / self.num_allocated_blocks if self.num_allocated_blocks else 0.0


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
    recorder = Recorder(_HeldBlocks(scheduler), config.model.kv_bytes_per_token)
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
        recorder.pool = _HeldBlocks(scheduler)
        recorder.sample(now_s, len(scheduler.vtoken.requests))
        submit()
    return _result(config, scheduler.vtoken, recorder, len(requests), tuple(skipped), num_iterations,
                   time.perf_counter() - started)


def _result(config: RunConfig, tracker, rec: Recorder, num_requests: int, skipped: tuple, num_iterations: int,
            host_time_s: float) -> RunResult:
    means, histogram = rec.means()
    counters = tracker.counters
    makespan_s = rec.makespan_s
    return RunResult(
        variant=config.variant, policy=config.eviction.policy if config.evicts else "none",
        num_requests=num_requests, num_completed=len(rec.latencies_s), skipped=skipped,
        waste_ratio=float(means[0]), frac_blocks_le_half=float(means[1]),
        utilization_histogram=tuple(float(x) for x in histogram) if len(histogram) else (0.0,) * NUM_HISTOGRAM_BINS,
        retained_blocks_per_request=float(means[2]), peak_allocated_blocks=rec.peak_allocated_blocks,
        memory_utilization=float(means[4]), trapped_bytes=float(means[3]), peak_trapped_bytes=rec.peak_trapped_bytes,
        throughput_tok_s=rec.num_output_tokens / makespan_s if makespan_s > 0 else 0.0,
        latency=LatencyStats.of(rec.latencies_s), ttft=LatencyStats.of(rec.ttfts_s), tpot=LatencyStats.of(rec.tpots_s),
        makespan_s=makespan_s, preemptions=counters["preemptions"], tokens_evicted=counters["tokens_evicted"],
        tokens_moved=counters["tokens_moved"], blocks_reclaimed=counters["blocks_reclaimed"],
        relocation_events=counters["relocation_events"], num_iterations=num_iterations,
        num_decode_steps=num_iterations, host_time_s=host_time_s, timeline=rec.timeline(),
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


@dataclass(frozen=True)
class VllmCheckReport:
    """`check-invariants --executor vllm`: what was checked, per (variant, reclaim mode).

    Every eviction is followed by I1 (live ids kept), I2 (one slot per live token over all
    tables, pool counts agree) and density (attention reads exactly the live tokens: I3 for a
    kernel that reads slots 0..seq_len-1), in the scheduler; every KV copy is read back byte
    for byte in the worker (I1 on the data). A violation raises InvariantError out of the
    replay; a report means every check passed.
    """

    runs: dict[str, dict[str, int]]  # "vtoken/hole-fill" -> counters of that replay

    @property
    def num_evictions_checked(self) -> int:
        return sum(r["eviction_events"] for r in self.runs.values())

    @property
    def num_copies_verified(self) -> int:
        return sum(r["relocation_events"] for r in self.runs.values())


def check_invariants_on_vllm(trace: Trace, config: RunConfig, model: str, num_blocks: int | None = None,
                             progress: Progress | None = None) -> VllmCheckReport:
    """Replay `trace` with naive-evict and vtoken, both reclaim modes, every check on."""
    folder = Path(model).expanduser()
    if num_blocks is None:
        num_blocks = default_num_blocks(trace.requests, config.concurrency, config.block_size)
    config = replace(config, model=replace(model_spec_from_hf_config(folder), dtype_bytes=4), num_blocks=num_blocks)
    runs = {}
    with open_llm(engine_spec_for(config, str(folder)), settings_for(config, "vtoken")) as llm:
        for variant in ("naive-evict", "vtoken"):
            for mode in ("hole-fill", "ordered"):
                checked = replace(config, variant=variant, reclaim=replace(config.reclaim, mode=mode))
                scheduler_of(llm).reconfigure(replace(settings_for(checked, variant), check_invariants=True))
                on_done = (lambda n, v=f"{variant}/{mode}": progress(v, n)) if progress else None
                replay(llm, checked, trace.requests, on_done, check_invariants=True)
                runs[f"{variant}/{mode}"] = dict(scheduler_of(llm).vtoken.counters)
    return VllmCheckReport(runs)
