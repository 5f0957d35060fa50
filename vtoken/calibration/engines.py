"""The real engines `vtoken validate` measures: one warm engine replaying variant after variant.

    with open_engine("vllm", "smollm2-135m", experiment, requests, concurrency) as (engine, experiment):
        engine.replay(experiment.run("vtoken", concurrency), requests)

`open_engine` resolves the run like `vtoken compare --executor` does (the engine's model
geometry; the default block budget: `concurrency` full-length requests), and keeps one engine
for the whole validation: vLLM's scheduler is reconfigured between variants
(`VTokenScheduler.reconfigure`), the hf model is loaded once. The replayer hands over what it
loaded (`HFReplayer.loaded_model`, `VllmReplayer.engine_spec`), so the engine is compare's, and
the replays are compare's (engine/vllm/run.py `replay`, engine/hf.py `run_hf`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

from vtoken.calibration.fit import MeasuredStep, step_kind
from vtoken.engine.experiment import Experiment, Run
from vtoken.errors import ConfigError
from vtoken.metrics import RunResult
from vtoken.trace import Request

MEASURED_EXECUTORS = ("vllm", "hf")


class VllmEngine:
    """`llm`: an in-process vLLM engine built by `open_llm` with the recording scheduler
    (calibration/vllm_steps.py), so that each step of a native replay is timed with its load."""

    name = "vllm"
    null_blocks = 1  # vLLM's pool keeps block 0 as its null block

    def __init__(self, llm) -> None:
        self.llm = llm
        self.recorded_steps: tuple[MeasuredStep, ...] = ()

    def replay(self, run: Run, requests: Sequence[Request]) -> RunResult:
        """Compare's replay; a native one keeps its steps in `recorded_steps` (the recording
        scheduler counts a request's KV extent as its computed tokens, which holds without
        eviction only)."""
        from vtoken.engine.vllm.engine import scheduler_of
        from vtoken.engine.vllm.run import replay

        scheduler = scheduler_of(self.llm)
        steps: list[MeasuredStep] = []

        def on_step(elapsed_s: float) -> None:
            load = scheduler.vtoken_last_load
            if load is not None:
                steps.append(MeasuredStep(step_kind(load), load, elapsed_s))

        scheduler.vtoken_last_load = None
        result = replay(self.llm, run, requests, on_step=on_step if not run.spec.evicts else None)
        self.recorded_steps = tuple(steps)
        return result


class HFEngine:
    """`model`: the replayer's `LoadedModel` (`HFReplayer.loaded_model`)."""

    name = "hf"
    null_blocks = 0
    recorded_steps: tuple[MeasuredStep, ...] = ()  # the hf replay's steps are not recorded

    def __init__(self, model) -> None:
        self.model = model

    def replay(self, run: Run, requests: Sequence[Request]) -> RunResult:
        from vtoken.engine.hf import run_hf

        return run_hf(run, requests, self.model).result


@contextlib.contextmanager
def open_engine(executor: str, model: str, experiment: Experiment, requests: Sequence[Request],
                concurrency: int | None, num_blocks: int | None = None,
                on_status=None) -> Iterator[tuple[VllmEngine | HFEngine, Experiment]]:
    """The engine and the experiment resolved for it (model geometry, block budget)."""
    from vtoken.replay import make_replayer

    if executor not in MEASURED_EXECUTORS:
        raise ConfigError(f"--executor {executor!r}: validate measures a real engine, one of "
                          f"{', '.join(MEASURED_EXECUTORS)}")
    replayer = make_replayer(executor, model=model, on_status=on_status)
    experiment = replayer.resolve(experiment, requests, concurrency, num_blocks)
    if executor == "hf":
        yield HFEngine(replayer.loaded_model()), experiment
        return
    from vtoken.calibration.vllm_steps import RECORDING_SCHEDULER_CLS
    from vtoken.engine.vllm.engine import open_llm
    from vtoken.engine.vllm.run import settings_for

    with open_llm(replayer.engine_spec(experiment, concurrency), settings_for(experiment, "native"),
                  scheduler_cls=RECORDING_SCHEDULER_CLS) as llm:
        yield VllmEngine(llm), experiment
