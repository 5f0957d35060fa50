"""`vtoken check-invariants` as one library call: relocations on materialized KV, with I1-I4
(DESIGN.md §3) checked on every event, optionally with one fault injected.

Each scenario (a trace x policy x reclaim mode, or a fuzz draw) runs the real runtime with a
real copy engine over a materialized KV tensor, and an observer that sees every event:

    check_invariants(traces, base, options, model=None)
        build_scenarios             scenarios.py  traces cut down, x policies x reclaim modes, fuzz
        per scenario: check_scenario (sim executor)
            PagedKVCache + KVBook   contents.py   every token's K/V, a pure function of its owner
        or check_hf_scenario        hf.py         a real model (load_check_model) writes the K/V
            ModelKVSnapshots        snapshots.py  each relocated request's K/V before the launch
        and in both:
            make_copy_engine        copies.py     every copy stays in flight across the next forward
            make_fault              faults.py     wraps the copy engine, the planner or the tables
            CheckingObserver        observer.py   I1-I4 on every event; violations recorded
        -> CheckReport              report.py     tallies per run and in all; report_to_json()

The names (invariants, fault kinds, executors, trace limits) live in vtoken/checker_names.py,
outside this package, so that the CLI renders `--help` without importing torch.

This module holds the entry points and re-exports the names the CLI and the tests use.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from vtoken.analysis import Progress
from vtoken.checker.contents import KV_DTYPE, KV_HEAD_DIM, KV_NUM_HEADS, KV_NUM_LAYERS, KVBook, KVContents, kv_content
from vtoken.checker.copies import (
    OverlappingDeferredCopyEngine, ReportAfterForwardCopyEngine, copy_mode_for, make_copy_engine,
)
from vtoken.checker.faults import FAULTS, DoubleMap, DropCopy, EarlyRead, Fault, SharedBlock, StaleSlot, make_fault
from vtoken.checker.hf import (
    TINY_MODEL_NAME, check_hf_scenario, check_on_model, load_check_model,
)
from vtoken.checker.observer import I2_EVERY_NUM_FORWARDS, CheckingObserver, check_plan_independently, run_checked, torch_threads
from vtoken.checker.report import (
    SYNTHETIC_KV_LAYOUT, CheckReport, GroupTotal, KVLayout, RunCheck, Tally, Violation, report_to_json,
)
from vtoken.checker.scenarios import (
    SAMPLE_TRACES_DIR, TRACE_SUFFIXES, CheckOptions, Scenario, build_scenarios, bundled_sample_traces, fuzz_scenario,
    pressure_num_blocks, scale_requests,
)
from vtoken.checker.snapshots import ModelKVSnapshots
from vtoken.checker_names import (
    CHECK_UNITS, EXECUTORS, FAULT_DETECTED_BY, FAULT_KINDS, HF_LIMITS, INVARIANT_NAMES, INVARIANTS, PRESSURE,
    TraceLimits, default_limits,
)
from vtoken.engine.config import RunConfig
from vtoken.engine.runtime import Runtime
from vtoken.engine.sim import SimExecutor
from vtoken.errors import ConfigError
from vtoken.kv.kv_cache import KVShape, PagedKVCache
from vtoken.models import LoadedModel
from vtoken.trace import Trace

__all__ = [
    "CHECK_UNITS", "EXECUTORS", "FAULTS", "FAULT_DETECTED_BY", "FAULT_KINDS", "HF_LIMITS",
    "I2_EVERY_NUM_FORWARDS", "INVARIANTS", "INVARIANT_NAMES", "KV_DTYPE", "KV_HEAD_DIM", "KV_NUM_HEADS", "KV_NUM_LAYERS",
    "PRESSURE", "SAMPLE_TRACES_DIR", "SYNTHETIC_KV_LAYOUT", "TINY_MODEL_NAME", "TRACE_SUFFIXES",
    "CheckOptions", "CheckReport", "CheckingObserver", "DoubleMap", "DropCopy", "EarlyRead", "Fault", "GroupTotal",
    "KVBook", "KVContents", "KVLayout", "ModelKVSnapshots", "OverlappingDeferredCopyEngine", "Progress",
    "ReportAfterForwardCopyEngine", "RunCheck", "Scenario", "SharedBlock", "StaleSlot", "Tally", "TraceLimits",
    "Violation",
    "build_scenarios", "bundled_sample_traces", "check_hf_scenario", "check_invariants", "check_on_model", "check_plan_independently",
    "check_scenario", "copy_mode_for", "default_limits", "fuzz_scenario", "kv_content",
    "load_check_model", "make_copy_engine", "make_fault", "num_progress_units", "pressure_num_blocks", "report_to_json",
    "run_checked", "scale_requests",
]


def check_invariants(traces: Sequence[Trace], base: RunConfig, options: CheckOptions,
                     progress: Progress | None = None, *, model: LoadedModel | None = None) -> CheckReport:
    """Run every scenario of `traces` (x policies x reclaim modes) and `options.num_fuzz_scenarios`
    random ones with materialized KV, checking I1-I4 on every event. `base` gives the model, GPU,
    budget, eviction interval, concurrency and seed; `base.num_blocks` caps the block budget.

    `options.executor` "hf" runs `model` instead of the sim (`check_on_model`, hf.py).
    """
    if options.executor == "hf":
        if model is None:
            raise ConfigError("check-invariants on the hf executor needs a model (load_check_model)")
        return check_on_model(traces, base, options, model, progress)
    started = time.perf_counter()
    scenarios, notes = build_scenarios(traces, base, options)
    device = options.device or ("cuda" if torch.cuda.is_available() else "cpu")
    books: dict[int, KVBook] = {}  # id(requests) -> book; scenarios of one trace share their requests
    runs = []
    for scenario in scenarios:
        book = books.setdefault(id(scenario.requests), KVBook(scenario.requests))
        on_progress = (lambda n, s=scenario: progress(s.label, n)) if progress else None
        runs.append(check_scenario(scenario, options.fault, device, book, on_progress))
    elapsed_s = time.perf_counter() - started
    return CheckReport(tuple(runs), base, options, device, copy_mode_for(device), tuple(notes), elapsed_s)


def num_progress_units(traces: Sequence[Trace], base: RunConfig, options: CheckOptions) -> int:
    """Requests `check_invariants` replays in all (its progress unit)."""
    scenarios, _ = build_scenarios(traces, base, options)
    return sum(len(s.requests) for s in scenarios)


def check_scenario(scenario: Scenario, fault: str | None = None, device: str = "cpu", book: KVBook | None = None,
                   on_progress: Callable[[int], None] | None = None) -> RunCheck:
    """Run one scenario on the sim executor under the checker; returns what was checked and what failed."""
    config = scenario.config
    shape = KVShape(KV_NUM_LAYERS, config.num_blocks, config.block_size, KV_NUM_HEADS, KV_HEAD_DIM)
    kv_cache = PagedKVCache(shape, KV_DTYPE, device)
    injector = make_fault(fault)
    copy_engine = injector.wrap_copy_engine(make_copy_engine(kv_cache))
    observer = CheckingObserver(scenario, injector)
    executor = SimExecutor(config.model, config.gpu, config.sim, config.seed)
    runtime = Runtime(config, scenario.requests, executor, copy_engine=copy_engine, observer=observer)
    injector.wrap_runtime(runtime)
    observer.bind(runtime, KVContents(book or KVBook(scenario.requests), kv_cache))
    with torch_threads(1):  # the KV tensors are tiny: see `torch_threads`
        return run_checked(observer, on_progress)
