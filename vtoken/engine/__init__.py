"""The serving runtime: scheduler, step loop, executors."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from vtoken.engine.config import VARIANTS, EvictionConfig, RunConfig
from vtoken.engine.runtime import Runtime
from vtoken.engine.sim import SimExecutor, SimProfile
from vtoken.metrics import RunResult
from vtoken.trace import Request

__all__ = ["VARIANTS", "EvictionConfig", "RunConfig", "Runtime", "SimExecutor", "SimProfile", "run_sim"]


def run_sim(config: RunConfig, requests: Sequence[Request], on_progress: Callable[[int], None] | None = None) -> RunResult:
    """Replay `requests` through one variant with the `sim` executor."""
    executor = SimExecutor(config.model, config.gpu, config.sim, config.seed)
    return Runtime(config, requests, executor).run(on_progress)
