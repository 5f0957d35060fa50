"""Timing the calibration grid on the hf executor: the runtime's own iterations, forward by forward.

`vtoken compare --executor hf` advances its clock by what `HFExecutor.execute` measures (the
iteration's prefills, one forward each, then one batched decode forward; engine/hf.py), so that
is what is timed here: each scenario is replayed by the same `Runtime`, and a recorder in front
of the executor keeps every iteration's `StepLoad` and measured seconds. The load is the one
the runtime counted for the sim, so the features cannot drift from what the sim is fed.

Relocation copies are timed through the hf copy engine's own move of N token slots in the
model's paged KV tensor (`PagedKVCache`, synchronous as in the replays).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np

from vtoken.calibration.fit import MeasuredStep, step_kind
from vtoken.calibration.grid import CalibrationGrid, Scenario, scenarios, warmup_scenario
from vtoken.engine.experiment import Experiment
from vtoken.engine.executor import SCORE_FIELDS, StepLoad, copy_load
from vtoken.engine.hf import HFExecutor, prepare_requests, whole_prompts
from vtoken.engine.runtime import Runtime
from vtoken.hardware import resolve_gpu
from vtoken.models import LoadedModel

OnScenario = Callable[[str], None]
BLOCK_SIZE = 16


class RecordingExecutor:
    """An executor in front of another that keeps every iteration's load and duration."""

    def __init__(self, inner: HFExecutor) -> None:
        self.inner = inner
        self.name = inner.name
        self.runs_prompt_chunks = inner.runs_prompt_chunks
        self.steps: list[MeasuredStep] = []

    def execute(self, batch, load: StepLoad) -> float:
        elapsed_s = self.inner.execute(batch, load)
        self.steps.append(MeasuredStep(step_kind(load), load, elapsed_s))
        return elapsed_s

    def attention_stats(self, req_idx, token_ids, num_tokens, fields=SCORE_FIELDS):
        return self.inner.attention_stats(req_idx, token_ids, num_tokens, fields)

    def forget(self, req_idx: int) -> None:
        self.inner.forget(req_idx)


def measure_hf(model: LoadedModel, grid: CalibrationGrid, on_scenario: OnScenario | None = None) -> list[MeasuredStep]:
    """Every round of the grid, the warm-up replay left out."""
    replay_timed(model, warmup_scenario(grid))
    time_copies(model, grid.copy_tokens[:1], seed=-1)
    steps: list[MeasuredStep] = []
    for round_idx in range(grid.num_rounds):
        for scenario in scenarios(grid):
            if on_scenario is not None:
                on_scenario(f"round {round_idx + 1}: {scenario.name}")
            steps += replay_timed(model, scenario)
        steps += time_copies(model, grid.copy_tokens, seed=round_idx)
    return steps


def replay_timed(model: LoadedModel, scenario: Scenario) -> list[MeasuredStep]:
    requests = scenario.requests
    longest = max(r.num_prompt_tokens + r.num_output_tokens for r in requests)
    num_blocks = scenario.concurrency * -(-longest // BLOCK_SIZE) + 1
    experiment = Experiment(model.spec, resolve_gpu("a100-80gb"), num_blocks, BLOCK_SIZE)  # the GPU is unused
    prepared = prepare_requests(requests, model.tokenizer, experiment.seed)
    experiment = whole_prompts(experiment, prepared.requests)
    executor = RecordingExecutor(HFExecutor(model, prepared, num_blocks, BLOCK_SIZE, collect_scores=False))
    Runtime(experiment.run("native", scenario.concurrency), prepared.requests, executor).run()
    return executor.steps


def time_copies(model: LoadedModel, sizes: Sequence[int], seed: int) -> list[MeasuredStep]:
    """The copy engine's move of N random distinct token slots to N others, for each N."""
    import torch

    from vtoken.kv.kv_cache import KVShape, PagedKVCache

    spec = model.spec
    parameter = next(model.model.parameters())
    num_blocks = -(-2 * max(sizes) // BLOCK_SIZE) + 1
    kv = PagedKVCache(KVShape(spec.num_layers, num_blocks, BLOCK_SIZE, spec.num_kv_heads, spec.head_dim),
                      dtype=parameter.dtype, device=parameter.device)
    rng = np.random.default_rng([abs(seed), 7])
    steps = []
    for n in sizes:
        slots = torch.as_tensor(rng.permutation(num_blocks * BLOCK_SIZE)[: 2 * n], device=kv.device)
        started = time.perf_counter()
        kv.copy_slots(slots[:n], slots[n:])
        if kv.device.type == "cuda":
            torch.cuda.synchronize(kv.device)
        steps.append(MeasuredStep("copy", copy_load(n), time.perf_counter() - started))
    return steps
