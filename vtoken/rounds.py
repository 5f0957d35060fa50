"""Measured runs as measurements: warm-up dropped, variants alternated over rounds, and the
spread of every figure across rounds.

    run_rounds(variants, replay, num_rounds, num_warmup)  -> Rounds
    spread_of(values)                                      -> Spread (min, median, max, values)
    figure_spreads(results)                                -> {figure: Spread} over RunResults
    median_round(values)                                   the round whose value is the median

A real engine's first replays pay for what later ones find ready (oneDNN primitives and
allocator pools on CPU, kernels and CUDA graphs on a GPU), and a shared machine's load drifts
over minutes. So the variants are never timed once each in sequence:

    warm-up   every variant `num_warmup` times, in round 0's order; results dropped
    round 0   A B C
    round 1   B C A        round r runs the variants rotated left by r, so that no variant
    round 2   C A B        always runs first, or right after the same one
    ...

and every figure is reported with its spread over the rounds (`Spread`: min, median, max).
The sim is deterministic: one round, no warm-up.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

import numpy as np

from vtoken.errors import ConfigError
from vtoken.metrics import RunResult

R = TypeVar("R")
Replay = Callable[[str, int | None], R]  # (variant, round index; None: warm-up) -> that replay's result


@dataclass(frozen=True)
class Spread:
    """One figure over rounds: `values` in round order; `median` numpy's (the mean of the two
    middle values for an even count)."""

    min: float
    median: float
    max: float
    values: tuple[float, ...]


@dataclass(frozen=True)
class RoundsRecord:
    """How a measurement was taken: the variants' order in every round, and the warm-up."""

    num_rounds: int
    num_warmup: int  # replays of every variant before round 0, dropped
    order: tuple[tuple[str, ...], ...]  # round -> variants in the order they ran


@dataclass(frozen=True)
class Rounds(Generic[R]):
    record: RoundsRecord
    results: dict[str, tuple[R, ...]]  # variant -> one result per round, in round order


def round_order(variants: Sequence[str], round_idx: int) -> tuple[str, ...]:
    """The variants of round `round_idx`: rotated left by `round_idx`."""
    shift = round_idx % len(variants)
    return tuple(variants[shift:]) + tuple(variants[:shift])


def run_rounds(variants: Sequence[str], replay: Replay, num_rounds: int, num_warmup: int) -> Rounds:
    """Warm-up, then `num_rounds` rounds of every variant, alternated (see the module doc).
    `replay(variant, None)` is a warm-up replay, whose result is dropped."""
    if num_rounds <= 0:
        raise ConfigError(f"--rounds must be > 0, got {num_rounds}")
    if num_warmup < 0:
        raise ConfigError(f"--warmup must be >= 0, got {num_warmup}")
    if not variants:
        raise ConfigError("no variant to measure")
    for _ in range(num_warmup):
        for variant in round_order(variants, 0):
            replay(variant, None)
    order = tuple(round_order(variants, r) for r in range(num_rounds))
    results: dict[str, list] = {v: [] for v in variants}
    for round_idx, variants_of_round in enumerate(order):
        for variant in variants_of_round:
            results[variant].append(replay(variant, round_idx))
    return Rounds(RoundsRecord(num_rounds, num_warmup, order), {v: tuple(rs) for v, rs in results.items()})


def spread_of(values: Sequence[float]) -> Spread:
    """min, median and max of `values` (NaN ignored; all NaN gives NaN throughout)."""
    array = np.asarray(values, dtype=float)
    finite = array[~np.isnan(array)]
    if finite.size == 0:
        nan = float("nan")
        return Spread(nan, nan, nan, tuple(float(v) for v in array))
    return Spread(float(finite.min()), float(np.median(finite)), float(finite.max()), tuple(float(v) for v in array))


def run_figures(result: RunResult) -> dict[str, float]:
    """The figures of one replay whose spread a measurement reports: the headline figures, TTFT
    and TPOT medians and the makespan."""
    return {**result.headline(), "ttft_p50_s": result.ttft.p50_s, "tpot_p50_s": result.tpot.p50_s,
            "makespan_s": result.makespan_s}


def figure_spreads(results: Sequence[RunResult]) -> dict[str, Spread]:
    """Every figure of `run_figures` over `results` (one per round)."""
    figures = [run_figures(r) for r in results]
    return {key: spread_of([f[key] for f in figures]) for key in figures[0]}


def median_round(values: Sequence[float]) -> int:
    """The round whose value is the median (the lower of the two middle ones for an even count;
    ties: the earliest round); NaN sorts last."""
    is_nan = [bool(np.isnan(v)) for v in values]
    ranked = sorted(range(len(values)), key=lambda i: (is_nan[i], 0.0 if is_nan[i] else values[i], i))
    return ranked[(len(ranked) - 1) // 2]
