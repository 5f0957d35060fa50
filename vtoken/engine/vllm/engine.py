"""One place that builds a vToken-enabled vLLM engine in this process (tests, compare, benchmarks).

    llm = build_llm(EngineSpec(model="/path/to/model"), VllmSettings(variant="vtoken"))
    outputs = llm.generate(...)
    scheduler_of(llm).vtoken.stats(...)

The engine runs in-process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), which makes the scheduler and
the model runner reachable and starts in seconds. `native` can run on stock classes
(`stock=True`), the baseline of the latency benchmark.
"""

from __future__ import annotations

import contextlib
import gc
import os
from dataclasses import dataclass

from vtoken.engine.vllm.settings import CONFIG_KEY, VllmSettings

SCHEDULER_CLS = "vtoken.engine.vllm.scheduler.VTokenScheduler"
WORKER_CLS = "vtoken.engine.vllm.worker.VTokenWorker"

# Environment the integration needs; `vtoken serve` sets the same for its server.
ENGINE_ENV = {
    "VLLM_USE_V2_MODEL_RUNNER": "0",  # the integration hooks the V1 model runner
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",  # pinning to one core crawls on shared CPUs
    "VLLM_LOGGING_STREAM": "ext://sys.stderr",  # stdout is for data (--json)
}


@dataclass(frozen=True)
class EngineSpec:
    """The vLLM side: model and memory. fp32 and eager by default, for exact comparisons."""

    model: str
    block_size: int = 32  # the CPU kernels need a multiple of 32
    kv_cache_memory_bytes: int = 16 << 20
    num_gpu_blocks_override: int | None = None  # a block budget instead of bytes
    max_model_len: int = 2048
    max_num_seqs: int = 8
    max_num_batched_tokens: int | None = None
    dtype: str = "float32"
    seed: int = 0
    enable_prefix_caching: bool = False  # compare and the checkers replay random prompts: nothing to share
    extra_llm_kwargs: dict | None = None  # more vllm.LLM arguments (settings to try)

    def llm_kwargs(self) -> dict:
        kwargs = dict(
            model=self.model, dtype=self.dtype, block_size=self.block_size, enforce_eager=True,
            enable_prefix_caching=self.enable_prefix_caching, async_scheduling=False, kv_cache_memory_bytes=self.kv_cache_memory_bytes,
            max_model_len=self.max_model_len, max_num_seqs=self.max_num_seqs, seed=self.seed,
        )
        if self.num_gpu_blocks_override is not None:
            kwargs["num_gpu_blocks_override"] = self.num_gpu_blocks_override
        if self.max_num_batched_tokens is not None:
            kwargs["max_num_batched_tokens"] = self.max_num_batched_tokens
        return {**kwargs, **(self.extra_llm_kwargs or {})}


def set_engine_env() -> None:
    """Set what the integration needs, keeping anything the user set explicitly."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    for key, value in ENGINE_ENV.items():
        os.environ.setdefault(key, value)


def build_llm(spec: EngineSpec, settings: VllmSettings, stock: bool = False, record_events: bool = False,
              scheduler_cls: str = SCHEDULER_CLS):
    """An in-process `vllm.LLM` with vToken's scheduler (or `scheduler_cls`, a subclass of it) and
    worker (stock classes if `stock`)."""
    set_engine_env()
    from vllm import LLM

    from vtoken.engine.vllm.plugin import RefusedAtStart

    kwargs = spec.llm_kwargs()
    if not stock:
        kwargs.update(scheduler_cls=scheduler_cls, worker_cls=WORKER_CLS,
                      additional_config={CONFIG_KEY: settings.to_dict()})
    try:
        llm = LLM(**kwargs)
    except RefusedAtStart as refusal:  # the plugin's refusal, raised while vLLM builds its config
        raise refusal.error from None
    if not stock:
        scheduler_of(llm).vtoken.record_events = record_events
    return llm


def engine_core_of(llm):
    return llm.llm_engine.engine_core.engine_core


def scheduler_of(llm):
    return engine_core_of(llm).scheduler


def model_runner_of(llm):
    return engine_core_of(llm).model_executor.driver_worker.worker.model_runner


@contextlib.contextmanager
def open_llm(spec: EngineSpec, settings: VllmSettings, stock: bool = False, record_events: bool = False,
             scheduler_cls: str = SCHEDULER_CLS):
    """`build_llm` for a `with` block; the engine is shut down at its end.

    Through the in-process client's `shutdown`, which also detaches its finalizer: otherwise
    the finalizer runs when the old engine is collected, possibly after the next engine was
    built, and tears down the distributed groups that engine runs on.
    """
    llm = build_llm(spec, settings, stock, record_events, scheduler_cls)
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()
        gc.collect()


@dataclass(frozen=True)
class Generation:
    """One request's greedy generation: tokens, their log-probabilities, its evictions."""

    prompt_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    events: tuple  # tracker.EvictionEvent, recorded when the engine was built with record_events
    num_cached_tokens: int = 0  # prompt tokens found in vLLM's prefix cache


def generate(llm, prompts: list[list[int]], max_tokens: int) -> list[Generation]:
    """Greedy generation of `max_tokens` tokens per prompt, all submitted at once."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=0, ignore_eos=True)
    scheduler = scheduler_of(llm)
    tracker = getattr(scheduler, "vtoken", None)
    first_idx = tracker.num_requests_seen if tracker is not None else 0
    outputs = llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)
    generations = []
    for i, (prompt, output) in enumerate(zip(prompts, outputs)):
        completion = output.outputs[0]
        logprobs = tuple(step[token].logprob for step, token in zip(completion.logprobs, completion.token_ids))
        events = tuple(tracker.events_of(first_idx + i)) if tracker is not None else ()
        generations.append(Generation(tuple(prompt), tuple(completion.token_ids), logprobs, events,
                                      output.num_cached_tokens or 0))
    return generations
