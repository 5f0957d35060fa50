"""`vtoken check-invariants` as one library call: relocations on materialized KV, with I1-I4
(DESIGN.md §3) checked on every event, optionally with one fault injected.

    check_invariants(traces, base, options, progress, model=...)
        make_checker(options.executor)      one object per executor, chosen here
            SimChecker          sim.py      the cost model; synthetic K/V written by the checker
            HFChecker           hf.py       a real transformers model writes the K/V
            VllmChecker         vllm.py     vToken inside vLLM; the checks run in its scheduler
                                            and worker
        sim and hf, per scenario (scenarios.py: traces cut down, x policies x reclaim modes, fuzz):
            make_copy_engine    copies.py   every copy stays in flight across the next forward
            make_fault          faults.py   a faulty copy engine, planner or token table, passed in
            CheckingObserver    observer.py I1-I4 on every event; violations recorded
        -> CheckReport          report.py   tallies per run and in all; report_to_json(), every executor

Importing this package imports no torch: the CLI renders `--help` from the names here
(names.py) and the options; the executors' modules are imported when a check runs.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from typing import Protocol

from vtoken.checker.names import (
    CHECK_UNITS, DEFAULT_LIMITS, EXECUTORS, FAULT_DETECTED_BY, FAULT_KINDS, HF_LIMITS, INVARIANT_NAMES, INVARIANTS,
    PRESSURE, VLLM_CHECK_UNITS, VLLM_LIMITS, TraceLimits, default_limits,
)
from vtoken.checker.report import CheckReport, GroupTotal, KVLayout, RunCheck, Tally, Violation, report_to_json
from vtoken.checker.scenarios import (
    SAMPLE_TRACES_DIR, TRACE_SUFFIXES, CheckOptions, Scenario, build_scenarios, bundled_sample_traces, fuzz_scenario,
    pressure_num_blocks, scale_requests,
)
from vtoken.engine.experiment import Experiment
from vtoken.errors import ConfigError
from vtoken.trace import Trace

__all__ = [
    "CHECKERS", "CHECK_UNITS", "DEFAULT_LIMITS", "EXECUTORS", "FAULT_DETECTED_BY", "FAULT_KINDS", "HF_LIMITS",
    "INVARIANTS", "INVARIANT_NAMES", "PRESSURE", "SAMPLE_TRACES_DIR", "TRACE_SUFFIXES", "VLLM_CHECK_UNITS",
    "VLLM_LIMITS",
    "CheckOptions", "CheckReport", "Checker", "GroupTotal", "KVLayout", "Progress", "RunCheck", "Scenario", "Tally",
    "TraceLimits", "Violation",
    "build_scenarios", "bundled_sample_traces", "check_invariants", "default_limits", "fuzz_scenario", "make_checker",
    "num_progress_units", "pressure_num_blocks", "report_to_json", "scale_requests",
]

Progress = Callable[[str, int], None]  # (stage description, units done), as vtoken.analysis


class Checker(Protocol):
    """What runs a check on one executor. Built by `make_checker`; `model` is the executor's
    (sim: a catalog model or config.json for the cost model; hf: a model to load, or a loaded
    one; vllm: a local model folder)."""

    def default_traces(self, options: CheckOptions) -> list[Trace]:
        """The traces checked when the caller gives none."""

    def num_progress_units(self, traces: Sequence[Trace], base: Experiment, options: CheckOptions) -> int:
        """Units `check` reports to `progress` in all (raises ConfigError for options it refuses)."""

    def check(self, traces: Sequence[Trace], base: Experiment, options: CheckOptions,
              progress: Progress | None = None) -> CheckReport:
        """Every run of `traces` under `options`, checked."""


# executor -> (module, class): imported when a check runs, so that this package stays light.
CHECKERS = {
    "sim": ("vtoken.checker.sim", "SimChecker"),
    "hf": ("vtoken.checker.hf", "HFChecker"),
    "vllm": ("vtoken.checker.vllm", "VllmChecker"),
}


def make_checker(executor: str, *, model: object | None = None,
                 on_status: Callable[[str], None] | None = None) -> Checker:
    """The checker of `executor`; `on_status` receives one-line messages (a model loading)."""
    if executor not in CHECKERS:
        raise ConfigError(f"unknown executor '{executor}'; check-invariants runs on: {', '.join(CHECKERS)}")
    module, name = CHECKERS[executor]
    return getattr(importlib.import_module(module), name)(model, on_status)


def check_invariants(traces: Sequence[Trace] | None, base: Experiment, options: CheckOptions,
                     progress: Progress | None = None, *, model: object | None = None,
                     on_status: Callable[[str], None] | None = None) -> CheckReport:
    """Check `traces` (None: the executor's default traces) on `options.executor`, with every
    invariant it can check on every event, and return one `CheckReport`.

    `base` gives the GPU, budget, eviction interval and seed; `base.num_blocks` caps the block
    budget; `options.concurrency` is every trace run's. `model`: see `Checker`.
    """
    checker = make_checker(options.executor, model=model, on_status=on_status)
    traces = checker.default_traces(options) if traces is None else traces
    return checker.check(traces, base, options, progress)


def num_progress_units(traces: Sequence[Trace] | None, base: Experiment, options: CheckOptions, *,
                       model: object | None = None) -> int:
    """Units `check_invariants` reports to its progress callback in all."""
    checker = make_checker(options.executor, model=model)
    traces = checker.default_traces(options) if traces is None else traces
    return checker.num_progress_units(traces, base, options)
