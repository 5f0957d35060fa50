"""Timing the calibration grid on vLLM: the engine vtoken replays on, step by step.

`vtoken compare --executor vllm` (engine/vllm/run.py) measures what a client of an in-process
engine sees: it calls `engine.step()` in a loop and stamps first tokens and finishes after each
call. A step is therefore the interval between two loop iterations, and that is what is timed
here, in the same loop (submit, step, sample the held memory as the replay does). vLLM's own
per-step figures would be narrower: `ModelRunnerOutput` carries no duration, and the forward
alone leaves out the scheduler and the output processing that every replayed token pays.

What each step ran comes from the scheduler itself: `RecordingScheduler` (a `VTokenScheduler`)
reads `SchedulerOutput.num_scheduled_tokens` against each request's `num_computed_tokens`
before `Scheduler.schedule` advances it (v1/core/sched/scheduler.py): a request whose computed
tokens cover its prompt decodes (its attention reads those tokens), any other runs a prompt
chunk of its scheduled tokens after its computed ones. The engine runs `native` settings: no
eviction, so the KV extent is the computed length.

Relocation copies are timed alone through the runner's own copy (`vtoken_copy_slots`: the
per-ISA slot copy of kv_layout.py on CPU, which vToken runs synchronously before the forward).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np

from vtoken.calibration.fit import MeasuredStep, step_kind
from vtoken.calibration.grid import CalibrationGrid, Scenario, scenarios, warmup_scenario
from vtoken.engine.executor import ChunkLoad, StepLoad, copy_load
from vtoken.engine.vllm.engine import EngineSpec, model_runner_of, open_llm, scheduler_of
from vtoken.engine.vllm.run import held_memory, prompt_ids
from vtoken.engine.vllm.scheduler import VTokenScheduler
from vtoken.engine.vllm.settings import VllmSettings

RECORDING_SCHEDULER_CLS = "vtoken.calibration.vllm_steps.RecordingScheduler"
OnScenario = Callable[[str], None]


class RecordingScheduler(VTokenScheduler):
    """vToken's scheduler that keeps the `StepLoad` of the step it scheduled last."""

    vtoken_last_load: StepLoad | None = None

    def schedule(self, *args, **kwargs):
        num_computed = {req_id: r.num_computed_tokens for req_id, r in self.requests.items()}
        output = super().schedule(*args, **kwargs)
        self.vtoken_last_load = load_of(output.num_scheduled_tokens, num_computed,
                                        {req_id: self.requests[req_id].num_prompt_tokens
                                         for req_id in output.num_scheduled_tokens})
        return output


def load_of(num_scheduled: dict[str, int], num_computed: dict[str, int], num_prompt: dict[str, int]) -> StepLoad | None:
    """The StepLoad of one vLLM step; None when nothing was scheduled."""
    if not num_scheduled:
        return None
    decodes = [r for r in num_scheduled if num_computed[r] >= num_prompt[r]]
    # native vLLM holds no dead slots: a request's KV extent is its computed tokens
    chunks = tuple(ChunkLoad(num_computed[r], num_computed[r], n) for r, n in num_scheduled.items()
                   if num_computed[r] < num_prompt[r])
    num_read = sum(num_computed[r] for r in decodes)
    return StepLoad(num_read, num_read, len(decodes), chunks, 0)


def engine_spec(model_dir: str, grid: CalibrationGrid, block_size: int = 32) -> EngineSpec:
    """An engine with room for every scenario of the grid at once."""
    max_len = -(-grid.max_model_len // block_size) * block_size
    num_seqs = max(max(grid.decode_batch_sizes), max(grid.mixed_batch_sizes) + 1)
    return EngineSpec(model_dir, block_size=block_size, num_gpu_blocks_override=num_seqs * max_len // block_size + 1,
                      max_model_len=max_len, max_num_seqs=num_seqs)


def measure_vllm(model_dir: str, grid: CalibrationGrid, on_scenario: OnScenario | None = None) -> list[MeasuredStep]:
    """Every round of the grid on one engine, the warm-up replay left out."""
    spec = engine_spec(model_dir, grid)
    steps: list[MeasuredStep] = []
    with open_llm(spec, VllmSettings("native"), scheduler_cls=RECORDING_SCHEDULER_CLS) as llm:
        replay_timed(llm, warmup_scenario(grid), "warmup")
        time_copies(llm, grid.copy_tokens[:1], seed=-1)
        for round_idx in range(grid.num_rounds):
            for scenario in scenarios(grid):
                if on_scenario is not None:
                    on_scenario(f"round {round_idx + 1}: {scenario.name}")
                steps += replay_timed(llm, scenario, f"r{round_idx}")
            steps += time_copies(llm, grid.copy_tokens, seed=round_idx)
    return steps


def replay_timed(llm, scenario: Scenario, tag: str) -> list[MeasuredStep]:
    """Closed-loop replay of a scenario; every scheduled step with its interval."""
    from vllm import SamplingParams

    engine = llm.llm_engine
    scheduler = scheduler_of(llm)
    vocab_size = engine.model_config.get_vocab_size()
    pending = list(enumerate(scenario.requests))
    in_flight: set[str] = set()

    def submit() -> None:
        while pending and len(in_flight) < scenario.concurrency:
            idx, request = pending.pop(0)
            params = SamplingParams(temperature=0.0, max_tokens=request.num_output_tokens, ignore_eos=True)
            req_id = f"{tag}-{scenario.name}-{idx}"
            engine.add_request(req_id, {"prompt_token_ids": prompt_ids(idx, request.num_prompt_tokens, 0, vocab_size)},
                               params)
            in_flight.add(req_id)

    steps = []
    submit()
    while in_flight:
        started = time.perf_counter()
        scheduler.vtoken_last_load = None
        for output in engine.step():
            if output.finished:
                in_flight.discard(output.request_id)
        held_memory(scheduler)
        submit()
        elapsed_s = time.perf_counter() - started
        load = scheduler.vtoken_last_load
        if load is not None:
            steps.append(MeasuredStep(step_kind(load), load, elapsed_s))
    return steps


def time_copies(llm, sizes: Sequence[int], seed: int) -> list[MeasuredStep]:
    """The runner's relocation copy of N random distinct slots to N others, for each N."""
    import torch

    runner = model_runner_of(llm)
    num_slots = (scheduler_of(llm).kv_cache_manager.block_pool.num_gpu_blocks - 1) * scheduler_of(llm).block_size
    rng = np.random.default_rng([abs(seed), 7])
    steps = []
    for n in sizes:
        block_size = scheduler_of(llm).block_size  # block 0 is vLLM's null block: slots from block 1 on
        chosen = rng.permutation(num_slots)[: 2 * min(n, num_slots // 2)] + block_size
        slots = torch.from_numpy(chosen.astype(np.int64))
        src, dst = slots[: slots.numel() // 2], slots[slots.numel() // 2 :]
        started = time.perf_counter()
        runner.vtoken_copy_slots(src, dst)
        steps.append(MeasuredStep("copy", copy_load(int(src.numel())), time.perf_counter() - started))
    return steps
