"""`vtoken validate`: replay a trace on a real engine and on the calibrated sim, and compare.

    report = validate(source, requests, experiment, concurrency, profile, engine, num_rounds)
                                            # engine: a MeasuredEngine (calibration/engines.py)
    report.checks[variant][figure] -> FigureCheck(spread, simulated, rel_error); .measured: the median

Both sides replay the same requests with the same settings: block budget, block size,
concurrency, policy and budget, reclaim settings, seed. The sim gets the calibrated profile;
its budget is the engine's usable blocks (vLLM's pool less its null block).

The measured side is a measurement, taken by `vtoken.rounds.run_rounds` as compare's is: a
warm-up replay of each variant (the first `concurrency` requests, a few tokens each) is left
out, then `num_rounds` rounds replay every variant once, the order rotated from round to round
(native, vtoken; vtoken, native; ...), so that a drift of the machine over time falls on both.
The measured value of a figure is its median over the rounds, its spread the lowest and highest
round (`rounds.spread_of`). rel_error = (simulated - measured) / measured.

Where a figure is off, the report says how much of it is the step times: the profile's step
model on the engine's own steps of the measured native rounds, each timed with the load vLLM
scheduled (`StepCheck`; the vllm engine records them, calibration/engines.py). A step error
close to the figures' says the steps cost what the model does not (the machine since the
calibration, or steps the grid did not cover); the rest is the schedule, which steps the sim
runs.

Only native and vtoken are validated: in vLLM, naive-evict must compact like vToken (the
kernels read slots 0..seq_len-1, engine/vllm/settings.py) and only holds the blocks back, so
its measured speed is not Naive-Evict's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Protocol

from vtoken import defaults
from vtoken.calibration.fit import STEP_KINDS, MeasuredStep
from vtoken.calibration.grid import CalibrationGrid
from vtoken.calibration.model import StepTimeModel
from vtoken.engine.experiment import Experiment, Run
from vtoken.engine.sim import SimProfile
from vtoken.errors import ConfigError
from vtoken.metrics import RunResult
from vtoken.rounds import Rounds, RoundsRecord, Spread, run_rounds, spread_of
from vtoken.trace import Request

FIGURES = ("throughput_tok_s", "ttft_p50_s", "ttft_p95_s", "tpot_p50_s", "tpot_p95_s", "latency_p50_s",
           "latency_p95_s")
VALIDATED_VARIANTS = ("native", "vtoken")
NAIVE_EVICT_NOTE = ("naive-evict is not validated: in vLLM it compacts like vToken and only holds the blocks, so "
                    "its measured speed is not Naive-Evict's")
WARMUP_OUTPUT_TOKENS = 4  # output tokens of a warm-up request: its prefill and a few decode steps
OnRun = Callable[[str], None]  # "round 2: vtoken" (or "warm-up: native") as each replay starts


class MeasuredEngine(Protocol):
    """A real engine that replays one variant at a time, warm, in this process."""

    name: str
    null_blocks: int  # blocks of the budget the engine keeps for itself (vLLM's null block)
    recorded_steps: tuple[MeasuredStep, ...]  # the last native replay's timed steps; () where not recorded

    def replay(self, run: Run, requests: Sequence[Request]) -> RunResult: ...


@dataclass(frozen=True)
class StepCheck:
    """The step model on the engine's own steps of one kind (decode, prefill, mixed, or all)."""

    num_steps: int
    measured_mean_s: float
    predicted_mean_s: float

    @property
    def rel_error(self) -> float:
        """(predicted - measured) / measured, of the mean (so of the steps' total)."""
        return (self.predicted_mean_s - self.measured_mean_s) / self.measured_mean_s


@dataclass(frozen=True)
class FigureCheck:
    spread: Spread  # the measured figure over the rounds, in round order
    simulated: float
    rel_error: float  # (simulated - measured) / measured

    @property
    def measured(self) -> float:
        """The median over the rounds."""
        return self.spread.median


@dataclass(frozen=True)
class ValidationReport:
    source: str
    engine: str
    experiment: Experiment  # the measured side's (the sim's has the profile and num_blocks - null blocks)
    concurrency: int | None
    step_times: str  # SimProfile.describe_step_times() of the profile
    rounds: RoundsRecord  # the measured replays' order, and the warm-up
    checks: dict[str, dict[str, FigureCheck]]  # variant -> figure -> check
    measured: dict[str, tuple[RunResult, ...]]  # variant -> one result per round, in round order
    simulated: dict[str, RunResult]
    notes: tuple[str, ...]
    steps: dict[str, StepCheck]  # kind -> the step model on the measured native steps; {} if not recorded

    @property
    def num_rounds(self) -> int:
        return self.rounds.num_rounds

    @property
    def max_abs_rel_error(self) -> float:
        return max(abs(c.rel_error) for figures in self.checks.values() for c in figures.values())


def figure_of(result: RunResult, figure: str) -> float:
    if figure == "throughput_tok_s":
        return result.throughput_tok_s
    stats, _, quantile = figure.partition("_")
    return getattr(getattr(result, stats), quantile.removesuffix("_s") + "_s")


def validate(source: str, requests: Sequence[Request], experiment: Experiment, concurrency: int | None,
             profile: SimProfile, engine: MeasuredEngine, num_rounds: int = 3,
             on_run: OnRun | None = None, grid: CalibrationGrid | None = None) -> ValidationReport:
    """Measure on `engine` (warm-up, then rounds alternating variants) and simulate with `profile`.
    `grid`: what the profile was calibrated on; a note says when the engine ran larger decode
    batches than it held (the fit extrapolates there)."""
    if profile.step_model is None:
        raise ConfigError("validate needs a calibrated sim profile (one with [sim.step_model]); "
                          "write one with vtoken calibrate")
    steps: list[MeasuredStep] = []
    measured = measure_rounds(engine, experiment, concurrency, requests, num_rounds, on_run, steps)
    simulated = simulate(replace(experiment, sim=profile, num_blocks=experiment.num_blocks - engine.null_blocks),
                         requests, concurrency)
    checks = {v: {f: check(measured.results[v], simulated[v], f) for f in FIGURES} for v in VALIDATED_VARIANTS}
    notes = (NAIVE_EVICT_NOTE, *extrapolation_notes(engine.name, steps, grid))
    return ValidationReport(source, engine.name, experiment, concurrency, profile.describe_step_times(),
                            measured.record, checks, measured.results, simulated, notes,
                            step_checks(profile.step_model, steps))


def measure_rounds(engine: MeasuredEngine, experiment: Experiment, concurrency: int | None,
                   requests: Sequence[Request], num_rounds: int,
                   on_run: OnRun | None = None, steps: list[MeasuredStep] | None = None) -> Rounds[RunResult]:
    """`run_rounds` over the validated variants on `engine`: a warm-up replay of each (of
    `warmup_requests`, dropped), then `num_rounds` rounds of all of `requests`. `steps` gets
    the engine's recorded steps of every measured native replay."""
    warmup = warmup_requests(requests, concurrency)

    def replay(variant: str, round_idx: int | None) -> RunResult:
        if on_run is not None:
            on_run(f"warm-up: {variant}" if round_idx is None else f"round {round_idx + 1}: {variant}")
        result = engine.replay(experiment.run(variant, concurrency), requests if round_idx is not None else warmup)
        if steps is not None and round_idx is not None and variant == "native":
            steps.extend(engine.recorded_steps)
        return result

    return run_rounds(VALIDATED_VARIANTS, replay, num_rounds, defaults.MEASURED_WARMUP)


def step_checks(model: StepTimeModel, steps: Sequence[MeasuredStep]) -> dict[str, StepCheck]:
    """The model's mean step time against the measured one, per kind of step present and over all."""
    by_kind = {kind: [s for s in steps if s.kind == kind] for kind in STEP_KINDS}
    by_kind = {kind: of_kind for kind, of_kind in by_kind.items() if of_kind}
    if by_kind:
        by_kind["all"] = list(steps)
    return {kind: StepCheck(len(of_kind), sum(s.measured_s for s in of_kind) / len(of_kind),
                            sum(model.forward_time_s(s.load) for s in of_kind) / len(of_kind))
            for kind, of_kind in by_kind.items()}


def extrapolation_notes(engine_name: str, steps: Sequence[MeasuredStep], grid: CalibrationGrid | None) -> list[str]:
    """A note when the engine's steps had more decodes than any step of the calibration grid."""
    if grid is None or not steps:
        return []
    largest = max(s.load.num_decoding_requests for s in steps)
    calibrated = max(*grid.decode_batch_sizes, *grid.mixed_batch_sizes)
    if largest <= calibrated:
        return []
    return [f"{engine_name} ran steps of up to {largest} decodes; the profile's grid went to {calibrated}, so the "
            f"fit extrapolates past it: calibrate with --decode-batch-sizes up to {largest}"]


def warmup_requests(requests: Sequence[Request], concurrency: int | None) -> list[Request]:
    """What a warm-up replay runs: the first `concurrency` requests (4 in open loop) at their
    prompt lengths, `WARMUP_OUTPUT_TOKENS` output tokens each: every prompt length and batch
    the rounds start with, in seconds rather than a whole replay."""
    return [replace(r, num_output_tokens=min(r.num_output_tokens, WARMUP_OUTPUT_TOKENS))
            for r in requests[: concurrency or 4]]


def simulate(experiment: Experiment, requests: Sequence[Request], concurrency: int | None) -> dict[str, RunResult]:
    from vtoken.replay import SimReplayer

    return SimReplayer().run_variants(experiment, requests, concurrency, variants=VALIDATED_VARIANTS)


def check(measured: Sequence[RunResult], simulated: RunResult, figure: str) -> FigureCheck:
    """`figure` measured over the rounds (one result each) against the simulated one."""
    spread = spread_of([figure_of(r, figure) for r in measured])
    sim_value = figure_of(simulated, figure)
    rel_error = (sim_value - spread.median) / spread.median if spread.median else float("nan")
    return FigureCheck(spread, sim_value, rel_error)


def report_to_json(report: ValidationReport) -> dict:
    """`{"variants": {VARIANT: {FIGURE: {"measured": x, "simulated": y, "rel_error": e,
    "spread": {"min", "median", "max", "values"}}}}, "steps": {"native": {KIND: {"num_steps",
    "measured_mean_s", "predicted_mean_s", "rel_error"}}}}`: the measured figure's spread over the
    rounds as compare's `--json` gives it (values in round order); the step model on the
    engine's own native steps (`StepCheck`)."""
    from vtoken.jsonsafe import make_json_safe

    return make_json_safe({"variants": {
        variant: {figure: {"measured": c.measured, "simulated": c.simulated, "rel_error": c.rel_error,
                           "spread": asdict(c.spread)}
                  for figure, c in figures.items()}
        for variant, figures in report.checks.items()},
        "steps": {"native": {kind: {**asdict(c), "rel_error": c.rel_error} for kind, c in report.steps.items()}}})
