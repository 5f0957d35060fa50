"""The serving runtime: scheduler, step loop, executors."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from vtoken.engine.experiment import VARIANTS, EvictionConfig, Experiment, Run, RunSpec, SchedulerConfig
from vtoken.engine.runtime import Runtime
from vtoken.engine.sim import SimExecutor, SimProfile
from vtoken.metrics import RunResult
from vtoken.trace import Request

__all__ = ["VARIANTS", "EvictionConfig", "Experiment", "Run", "RunSpec", "Runtime", "SchedulerConfig", "SimExecutor",
           "SimProfile", "run_sim"]


def run_sim(run: Run, requests: Sequence[Request], on_progress: Callable[[int], None] | None = None) -> RunResult:
    """Replay `requests` through one run with the `sim` executor."""
    experiment = run.experiment
    executor = SimExecutor(experiment.model, experiment.gpu, experiment.sim, experiment.seed)
    return Runtime(run, requests, executor).run(on_progress)
