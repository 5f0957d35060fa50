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

from vtoken.engine.experiment import Experiment, Run
from vtoken.errors import ConfigError
from vtoken.metrics import RunResult
from vtoken.trace import Request

MEASURED_EXECUTORS = ("vllm", "hf")


class VllmEngine:
    """`llm`: an in-process vLLM engine built by `open_llm` with vToken's scheduler."""

    name = "vllm"
    null_blocks = 1  # vLLM's pool keeps block 0 as its null block

    def __init__(self, llm) -> None:
        self.llm = llm

    def replay(self, run: Run, requests: Sequence[Request]) -> RunResult:
        from vtoken.engine.vllm.run import replay

        return replay(self.llm, run, requests)


class HFEngine:
    """`model`: the replayer's `LoadedModel` (`HFReplayer.loaded_model`)."""

    name = "hf"
    null_blocks = 0

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
    from vtoken.engine.vllm.engine import open_llm
    from vtoken.engine.vllm.run import settings_for

    with open_llm(replayer.engine_spec(experiment, concurrency), settings_for(experiment, "native")) as llm:
        yield VllmEngine(llm), experiment
