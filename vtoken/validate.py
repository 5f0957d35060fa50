"""`vtoken validate`: replay a trace on a real engine and on the calibrated sim, and compare.

    report = validate(requests, config, profile, engine)    # engine: a MeasuredEngine
    report.checks[variant][figure] -> FigureCheck(measured, simulated, rel_error, spread)

Both sides replay the same requests with the same settings: block budget, block size,
concurrency, policy and budget, reclaim settings, seed. The sim gets the calibrated profile;
its budget is the engine's usable blocks (vLLM's pool less its null block).

The measured side is a measurement: one warm-up replay (the first `concurrency` requests, a
few tokens each) is left out, then `num_rounds` rounds replay every variant once, the order
alternating from round to round (native, vtoken; vtoken, native; ...), so that a drift of the
machine over time falls on both. The measured value of a figure is its median over the rounds,
its spread the lowest and highest round. rel_error = (simulated - measured) / measured.

Only native and vtoken are validated: in vLLM, naive-evict must compact like vToken (the
kernels read slots 0..seq_len-1, engine/vllm/settings.py) and only holds the blocks back, so
its measured speed is not Naive-Evict's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

import numpy as np

from vtoken.engine.experiment import Experiment, Run
from vtoken.engine.sim import SimProfile
from vtoken.errors import ConfigError
from vtoken.metrics import RunResult
from vtoken.trace import Request

FIGURES = ("throughput_tok_s", "ttft_p50_s", "ttft_p95_s", "tpot_p50_s", "tpot_p95_s", "latency_p50_s",
           "latency_p95_s")
VALIDATED_VARIANTS = ("native", "vtoken")
NAIVE_EVICT_NOTE = ("naive-evict is not validated: in vLLM it compacts like vToken and only holds the blocks, so "
                    "its measured speed is not Naive-Evict's")
OnRun = Callable[[str], None]  # "round 2: vtoken" as each measured replay starts


class MeasuredEngine(Protocol):
    """A real engine that replays one variant at a time, warm, in this process."""

    name: str
    null_blocks: int  # blocks of the budget the engine keeps for itself (vLLM's null block)

    def replay(self, run: Run, requests: Sequence[Request]) -> RunResult: ...


@dataclass(frozen=True)
class FigureCheck:
    measured: float  # median over the rounds
    simulated: float
    rel_error: float  # (simulated - measured) / measured
    spread: tuple[float, float]  # lowest and highest measured round


@dataclass(frozen=True)
class ValidationReport:
    source: str
    engine: str
    experiment: Experiment  # the measured side's (the sim's has the profile and num_blocks - null blocks)
    concurrency: int | None
    step_times: str  # SimProfile.describe_step_times() of the profile
    num_rounds: int
    checks: dict[str, dict[str, FigureCheck]]  # variant -> figure -> check
    measured: dict[str, tuple[RunResult, ...]]  # variant -> one result per round
    simulated: dict[str, RunResult]
    notes: tuple[str, ...]

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
             on_run: OnRun | None = None) -> ValidationReport:
    """Measure on `engine` (warm-up, then rounds alternating variants) and simulate with `profile`."""
    if profile.step_model is None:
        raise ConfigError("validate needs a calibrated sim profile (one with [sim.step_model]); "
                          "write one with vtoken calibrate")
    if num_rounds <= 0:
        raise ConfigError(f"--rounds must be > 0, got {num_rounds}")
    measured = measure_rounds(engine, experiment, concurrency, requests, num_rounds, on_run)
    simulated = simulate(replace(experiment, sim=profile, num_blocks=experiment.num_blocks - engine.null_blocks),
                         requests, concurrency)
    checks = {v: {f: check(measured[v], simulated[v], f) for f in FIGURES} for v in VALIDATED_VARIANTS}
    return ValidationReport(source, engine.name, experiment, concurrency, profile.describe_step_times(), num_rounds,
                            checks, measured, simulated, (NAIVE_EVICT_NOTE,))


def measure_rounds(engine: MeasuredEngine, experiment: Experiment, concurrency: int | None,
                   requests: Sequence[Request], num_rounds: int,
                   on_run: OnRun | None = None) -> dict[str, tuple[RunResult, ...]]:
    """A warm-up replay left out, then each round replays every validated variant, alternating."""
    warmup = [replace(r, num_output_tokens=min(r.num_output_tokens, 4)) for r in requests[: concurrency or 4]]
    if on_run is not None:
        on_run("warm-up")
    engine.replay(experiment.run("native", concurrency), warmup)
    runs: dict[str, list[RunResult]] = {v: [] for v in VALIDATED_VARIANTS}
    for round_idx in range(num_rounds):
        order = VALIDATED_VARIANTS if round_idx % 2 == 0 else VALIDATED_VARIANTS[::-1]
        for variant in order:
            if on_run is not None:
                on_run(f"round {round_idx + 1}: {variant}")
            runs[variant].append(engine.replay(experiment.run(variant, concurrency), requests))
    return {v: tuple(r) for v, r in runs.items()}


def simulate(experiment: Experiment, requests: Sequence[Request], concurrency: int | None) -> dict[str, RunResult]:
    from vtoken.replay import SimReplayer

    return SimReplayer().run_variants(experiment, requests, concurrency, variants=VALIDATED_VARIANTS)


def check(measured: Sequence[RunResult], simulated: RunResult, figure: str) -> FigureCheck:
    values = [figure_of(r, figure) for r in measured]
    median = float(np.median(values))
    sim_value = figure_of(simulated, figure)
    rel_error = (sim_value - median) / median if median else float("nan")
    return FigureCheck(median, sim_value, rel_error, (min(values), max(values)))


def report_to_json(report: ValidationReport) -> dict:
    """`{"variants": {VARIANT: {FIGURE: {"measured": x, "simulated": y, "rel_error": e}}}}`."""
    from vtoken.jsonsafe import make_json_safe

    return make_json_safe({"variants": {
        variant: {figure: {"measured": c.measured, "simulated": c.simulated, "rel_error": c.rel_error}
                  for figure, c in figures.items()}
        for variant, figures in report.checks.items()}})
