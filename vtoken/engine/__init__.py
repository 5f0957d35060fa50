"""The serving runtime: scheduler, step loop, executors."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from vtoken.engine.experiment import VARIANTS, EvictionConfig, Experiment, Run, RunSpec, SchedulerConfig
from vtoken.engine.runtime import Runtime
from vtoken.engine.sim import SimExecutor, SimProfile
from vtoken.metrics import RunResult
from vtoken.trace import Request

__all__ = ["VARIANTS", "EvictionConfig", "Experiment", "Run", "RunSpec", "Runtime", "SchedulerConfig", "SimExecutor",
           "SimProfile", "run_sim", "sim_runtime"]


def run_sim(run: Run, requests: Sequence[Request], on_progress: Callable[[int], None] | None = None) -> RunResult:
    """Replay `requests` through one run with the `sim` executor."""
    return sim_runtime(run, requests).run(on_progress)


def sim_runtime(run: Run, requests: Sequence[Request]) -> Runtime:
    """The runtime `run_sim` replays `requests` with, for a caller that steps it itself."""
    experiment = run.experiment
    return Runtime(run, requests, SimExecutor(experiment.model, experiment.gpu, experiment.sim, experiment.seed))
