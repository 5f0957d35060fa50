"""Fitting a `StepTimeModel` to measured steps: non-negative least squares on relative error.

    fit_step_model(steps, copies) -> StepFit (the model and its error per kind of step)

The fit minimises the squared *relative* error, so that a 5 ms decode step weighs as much as a
500 ms prefill, which is what an error bound in percent on latencies needs. Relative to the
model's time, not to the measured one: weights 1 / measured would weigh a step that ran slow
less than one of the same load that ran fast, which pulls every coefficient low (vLLM-CPU's grid
fitted so predicted its own decode steps' total 2.5% short, reweighted 0.1%, and a latency is
a sum of steps). So each row is divided by the current fit's prediction and the solve
repeats until the weights settle (iteratively reweighted least squares, as for a gamma GLM):
repeated steps of one load then come back at their mean. Columns are scaled to unit maximum for
conditioning (NNLS is scale-equivariant per column, so this changes nothing but round-off). A
coefficient the grid gives no evidence for comes out 0, never negative.

Relocation copies are timed on their own (the engine's copy of N token slots, nothing else
in the step), so the per-token copy price is a one-column fit through the origin.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from vtoken.calibration.model import FEATURES, Provenance, StepTimeModel, step_features
from vtoken.engine.executor import StepLoad
from vtoken.errors import ConfigError

STEP_KINDS = ("decode", "prefill", "mixed", "copy")


@dataclass(frozen=True)
class MeasuredStep:
    """One timed engine step (or, kind "copy", one timed relocation copy) and its load."""

    kind: str  # one of STEP_KINDS
    load: StepLoad
    measured_s: float


@dataclass(frozen=True)
class KindError:
    """How far the fitted model is from the measured steps of one kind."""

    num_steps: int
    mean_abs_rel_error: float
    max_abs_rel_error: float


@dataclass(frozen=True)
class StepFit:
    model: StepTimeModel
    errors: dict[str, KindError]  # by kind, in STEP_KINDS order, kinds measured only
    predicted_s: tuple[float, ...]  # per measured step, in the order given


def step_kind(load: StepLoad) -> str:
    """decode, prefill or mixed (both in one forward), as the load says."""
    if load.num_prefill_tokens and load.num_decoding_requests:
        return "mixed"
    return "prefill" if load.num_prefill_tokens else "decode"


def fit_step_model(steps: Sequence[MeasuredStep], provenance: Provenance | None = None) -> StepFit:
    """NNLS over the forward steps (decode, prefill, mixed) and a through-origin fit of the copies."""
    forwards = [s for s in steps if s.kind != "copy"]
    copies = [s for s in steps if s.kind == "copy"]
    if len(forwards) < len(FEATURES):
        raise ConfigError(f"calibration: {len(forwards)} timed steps cannot fit {len(FEATURES)} coefficients")
    x = np.stack([step_features(s.load) for s in forwards])
    y = np.array([s.measured_s for s in forwards])
    coefficients = nnls_relative(x, y)
    per_copied_token_s = 0.0
    if copies:
        n = np.array([s.load.num_copied_tokens for s in copies], dtype=np.float64)
        t = np.array([s.measured_s for s in copies])
        per_copied_token_s = float(nnls_relative(n[:, None], t)[0])
    model = StepTimeModel(*map(float, coefficients), per_copied_token_s=per_copied_token_s, provenance=provenance)
    predicted = tuple(predict_s(model, s) for s in steps)
    return StepFit(model, kind_errors(steps, predicted), predicted)


def nnls_relative(x: np.ndarray, y: np.ndarray, max_iterations: int = 50, rtol: float = 1e-9) -> np.ndarray:
    """argmin_{c >= 0} sum_i ((x_i . c - y_i) / (x_i . c))^2 by reweighting: start from weights
    1 / y_i, then weigh each row by 1 / its prediction until the coefficients move less than
    `rtol` (relative)."""
    if np.any(y <= 0):
        raise ConfigError("calibration: a measured time is not positive")
    solution = _weighted_nnls(x, y, 1.0 / y)
    for _ in range(max_iterations):
        predicted = x @ solution
        floor = 1e-3 * y  # a row the fit predicts at 0 keeps a finite weight
        previous, solution = solution, _weighted_nnls(x, y, 1.0 / np.maximum(predicted, floor))
        if np.all(np.abs(solution - previous) <= rtol * np.maximum(np.abs(solution), 1e-300)):
            break
    return solution


def _weighted_nnls(x: np.ndarray, y: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """argmin_{c >= 0} sum_i (w_i (x_i . c - y_i))^2."""
    from scipy.optimize import nnls  # scipy only when a fit runs, not at the CLI's start-up

    weighted = x * weights[:, None]
    scale = np.abs(weighted).max(axis=0)
    scale[scale == 0] = 1.0
    solution, _ = nnls(weighted / scale, y * weights, maxiter=50 * x.shape[1])
    return solution / scale


def predict_s(model: StepTimeModel, step: MeasuredStep) -> float:
    if step.kind == "copy":
        return model.copy_time_s(step.load.num_copied_tokens)
    return model.forward_time_s(step.load)


def kind_errors(steps: Sequence[MeasuredStep], predicted_s: Sequence[float]) -> dict[str, KindError]:
    errors = {}
    for kind in STEP_KINDS:
        rel = [abs(p - s.measured_s) / s.measured_s for s, p in zip(steps, predicted_s) if s.kind == kind]
        if rel:
            errors[kind] = KindError(len(rel), float(np.mean(rel)), float(np.max(rel)))
    return errors

