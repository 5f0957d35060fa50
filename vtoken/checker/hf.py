"""`check-invariants --executor hf`: the same scenarios, faults and checks on a real model.

The runtime is `build_hf_runtime`'s: the model's forward writes every token's K/V into the
executor's paged KV tensor and reads exactly `table.slots()`, and the checked copy engine
(copies.py) moves that tensor, each copy in flight across the model's next forward. The
observer is the sim path's; only its `contents` differ (`ModelKVSnapshots`, snapshots.py: I1
compares every relocated request's K/V with a snapshot taken before the launch, bit for bit).

    HFChecker.check             every scenario on the model -> CheckReport
        load_check_model        smollm2-135m, a local folder, or (default) a tiny random Llama
                                built in a temporary directory (when not given one loaded)
        check_hf_scenario       one scenario -> RunCheck
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import torch

from vtoken import defaults
from vtoken.checker.copies import copy_mode_for, make_copy_engine
from vtoken.checker.faults import make_fault
from vtoken.checker.observer import CheckingObserver, run_checked, torch_threads
from vtoken.checker.report import CheckReport, KVLayout, RunCheck
from vtoken.checker.scenarios import CheckOptions, Scenario, build_scenarios, bundled_sample_traces
from vtoken.checker.snapshots import ModelKVSnapshots
from vtoken.engine.experiment import Experiment
from vtoken.hardware import num_blocks_for_gpu
from vtoken.models import LoadedModel, load_model
from vtoken.trace import Trace, load_trace, num_output_tokens

Progress = Callable[[str, int], None]  # (stage description, units done), as vtoken.analysis

TINY_MODEL_NAME = "tiny-random-llama"


def load_check_model(name_or_path: str | None, device: str | None = None,
                     on_status: Callable[[str], None] | None = None) -> LoadedModel:
    """`smollm2-135m` or a local model folder (`load_model`), in float32 on `device` (None: cuda
    when available, else cpu); `name_or_path` None: a tiny random Llama (2 layers, 2 KV heads of
    16 dims) built in a temporary directory, about a second, removed once loaded."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    with _quiet_transformers():
        if name_or_path is not None:
            return load_model(name_or_path, device=device, on_status=on_status)
        from vtoken.models.tiny import build_tiny_model

        with tempfile.TemporaryDirectory(prefix="vtoken-check-") as folder:
            model = load_model(str(build_tiny_model(Path(folder) / "llama")), device=device)
    return replace(model, name=TINY_MODEL_NAME, spec=replace(model.spec, name=TINY_MODEL_NAME))


class HFChecker:
    """The hf executor's checker. `model`: a `LoadedModel`, or what `load_check_model` loads
    (smollm2-135m, a local folder, None: a tiny random Llama), loaded when the check runs."""

    def __init__(self, model: LoadedModel | str | None = None, on_status: Callable[[str], None] | None = None) -> None:
        self.model = model
        self.on_status = on_status

    def default_traces(self, options: CheckOptions) -> list[Trace]:
        """Every bundled sample trace (cut down harder: `HF_LIMITS`); none when fuzz draws are asked for."""
        return [] if options.num_fuzz_scenarios else [load_trace(p) for p in bundled_sample_traces()]

    def num_progress_units(self, traces: Sequence[Trace], base: Experiment, options: CheckOptions) -> int:
        scenarios, _ = build_scenarios(traces, base, options)
        return sum(num_output_tokens(s.requests) for s in scenarios)

    def check(self, traces: Sequence[Trace], base: Experiment, options: CheckOptions,
              progress: Progress | None = None) -> CheckReport:
        model = self.model
        if not isinstance(model, LoadedModel):
            if progress is not None:
                progress(f"loading {model or 'a tiny random Llama'}", 0)
            model = load_check_model(model, options.device, self.on_status)
        return check_on_model(traces, base, options, model, progress)


def check_on_model(traces: Sequence[Trace], base: Experiment, options: CheckOptions, model: LoadedModel,
                   progress: Progress | None = None) -> CheckReport:
    """The check on `model`: its KV geometry replaces `base.model`, the block cap is what
    `base.gpu` leaves for it, and the KV lives where the model does (`options.device` is the
    sim's)."""
    started = time.perf_counter()
    block_size = options.block_size or base.block_size
    base = replace(base, model=model.spec, num_blocks=num_blocks_for_gpu(model.spec, base.gpu, defaults.GPU_MEMORY_UTILIZATION, block_size))
    scenarios, notes = build_scenarios(traces, base, options)
    runs = []
    for scenario in scenarios:
        on_progress = (lambda n, s=scenario: progress(s.label, n)) if progress else None
        runs.append(check_hf_scenario(scenario, model, options.fault, on_progress))
    device = next(model.model.parameters()).device.type
    return CheckReport(tuple(runs), base, options, device, copy_mode_for(device), tuple(notes) + _notes(model, base.seed),
                       time.perf_counter() - started, _kv_layout(model), model_kv=True)


def check_hf_scenario(scenario: Scenario, model: LoadedModel, fault: str | None = None,
                      on_progress: Callable[[int], None] | None = None) -> RunCheck:
    """Run one scenario on `model` under the checker; returns what was checked and what failed.

    Prompt text is dropped: every prompt is `num_prompt_tokens` seeded random ids, so that the
    scenario's lengths (and the block budget sized from them) are the ones replayed.
    """
    from vtoken.engine.hf import build_hf_runtime  # imports transformers: only when a model runs

    scenario = replace(scenario, requests=tuple(replace(r, prompt=None) for r in scenario.requests))
    injector = make_fault(fault)
    observer = CheckingObserver(scenario, injector)
    runtime = build_hf_runtime(scenario.run, scenario.requests, model, observer=observer,
                               make_copy_engine=lambda kv_cache: injector.copy_engine(make_copy_engine(kv_cache)),
                               planner_factory=injector.planner_factory(), table_factory=injector.table_factory())
    observer.bind(runtime, ModelKVSnapshots(runtime.executor.kv_cache))
    # One thread: a decode step's matrices are small, and on a busy two-core machine two
    # OpenMP threads wait on each other (SmolLM2's [2, 576] x [576, 1536]: 0.12 ms on one, 14 ms on two).
    with torch_threads(1):
        return run_checked(observer, on_progress)


def _notes(model: LoadedModel, seed: int) -> tuple[str, ...]:
    """What the report says about the model and the prompts."""
    notes = [f"prompts are seeded random token ids (seed {seed}); the K/V checked is what the model's forward wrote"]
    if model.name == TINY_MODEL_NAME:
        notes.insert(0, f"model: {TINY_MODEL_NAME}, a random 2-layer Llama built in a temporary directory "
                        "(no --model given): real forwards and K/V, meaningless text")
    return tuple(notes)


def _kv_layout(model: LoadedModel) -> KVLayout:
    spec, dtype = model.spec, next(model.model.parameters()).dtype
    return KVLayout(spec.num_layers, spec.num_kv_heads, spec.head_dim, str(dtype).removeprefix("torch."))


@contextmanager
def _quiet_transformers() -> Iterator[None]:
    """No transformers progress bars (saving and loading shards) while the model loads: the
    CLI shows its own. Restored after."""
    from transformers.utils import logging

    was_enabled = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            logging.enable_progress_bar()
