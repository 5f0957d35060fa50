"""`check-invariants --executor sim`: the runtime on the cost model, over a materialized KV
tensor whose contents the checker writes (contents.py), so that I1 and I3 compare every
token's K/V with what it must be.

    SimChecker.check        every scenario -> CheckReport
        check_scenario      one scenario -> RunCheck
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import replace

import torch

from vtoken import defaults
from vtoken.checker.contents import KV_DTYPE, KV_HEAD_DIM, KV_NUM_HEADS, KV_NUM_LAYERS, SYNTHETIC_KV_LAYOUT, KVBook, KVContents
from vtoken.checker.copies import copy_mode_for, make_copy_engine
from vtoken.checker.faults import make_fault
from vtoken.checker.observer import CheckingObserver, run_checked, torch_threads
from vtoken.checker.report import CheckReport, RunCheck
from vtoken.checker.scenarios import CheckOptions, Scenario, build_scenarios, bundled_sample_traces
from vtoken.engine.experiment import Experiment
from vtoken.engine.runtime import Runtime
from vtoken.engine.sim import SimExecutor
from vtoken.hardware import num_blocks_for_gpu
from vtoken.kv.copy_engine import CopyEngine
from vtoken.kv.kv_cache import KVShape, PagedKVCache
from vtoken.model_spec import resolve_model
from vtoken.trace import Trace, load_trace, num_output_tokens

Progress = Callable[[str, int], None]  # (stage description, units done), as vtoken.analysis



class SimChecker:
    """The sim executor's checker. `model`: a catalog model or HF config.json that replaces
    `base.model` (the cost model, and the GPU's block cap); None keeps `base.model`."""

    def __init__(self, model: str | None = None, on_status: Callable[[str], None] | None = None) -> None:
        self.model = model

    def default_traces(self, options: CheckOptions) -> list[Trace]:
        """Every bundled sample trace; none when fuzz draws are asked for."""
        return [] if options.num_fuzz_scenarios else [load_trace(p) for p in bundled_sample_traces()]

    def num_progress_units(self, traces: Sequence[Trace], base: Experiment, options: CheckOptions) -> int:
        scenarios, _ = build_scenarios(traces, self._resolve(base, options), options)
        return sum(num_output_tokens(s.requests) for s in scenarios)

    def check(self, traces: Sequence[Trace], base: Experiment, options: CheckOptions,
              progress: Progress | None = None) -> CheckReport:
        started = time.perf_counter()
        base = self._resolve(base, options)
        scenarios, notes = build_scenarios(traces, base, options)
        device = options.device or ("cuda" if torch.cuda.is_available() else "cpu")
        books: dict[int, KVBook] = {}  # id(requests) -> book; scenarios of one trace share their requests
        runs = []
        for scenario in scenarios:
            book = books.setdefault(id(scenario.requests), KVBook(scenario.requests))
            on_progress = (lambda n, s=scenario: progress(s.label, n)) if progress else None
            runs.append(check_scenario(scenario, options.fault, device, book, on_progress))
        return CheckReport(tuple(runs), base, options, device, copy_mode_for(device), tuple(notes),
                           time.perf_counter() - started, SYNTHETIC_KV_LAYOUT)

    def _resolve(self, base: Experiment, options: CheckOptions) -> Experiment:
        if self.model is None:
            return base
        spec = resolve_model(self.model)
        num_blocks = options.num_blocks or num_blocks_for_gpu(spec, base.gpu, defaults.GPU_MEMORY_UTILIZATION,
                                                              options.block_size or base.block_size)
        return replace(base, model=spec, num_blocks=num_blocks)


def check_scenario(scenario: Scenario, fault: str | None = None, device: str = "cpu", book: KVBook | None = None,
                   on_progress: Callable[[int], None] | None = None, *,
                   copy_engine_for: Callable[[PagedKVCache], CopyEngine] = make_copy_engine) -> RunCheck:
    """Run one scenario on the sim executor under the checker; returns what was checked and what failed.
    `copy_engine_for(kv_cache)`: the copy engine the fault (if any) wraps."""
    experiment = scenario.run.experiment
    shape = KVShape(KV_NUM_LAYERS, experiment.num_blocks, experiment.block_size, KV_NUM_HEADS, KV_HEAD_DIM)
    kv_cache = PagedKVCache(shape, KV_DTYPE, device)
    injector = make_fault(fault)
    observer = CheckingObserver(scenario, injector)
    executor = SimExecutor(experiment.model, experiment.gpu, experiment.sim, experiment.seed)
    runtime = Runtime(scenario.run, scenario.requests, executor, copy_engine=injector.copy_engine(copy_engine_for(kv_cache)),
                      observer=observer, planner_factory=injector.planner_factory(),
                      table_factory=injector.table_factory())
    observer.bind(runtime, KVContents(book or KVBook(scenario.requests), kv_cache))
    with torch_threads(1):  # the KV tensors are tiny: see `torch_threads`
        return run_checked(observer, on_progress)
