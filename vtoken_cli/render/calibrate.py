"""`vtoken calibrate`: the fitted coefficients and the fit's error per kind of step."""

from __future__ import annotations

from rich.console import Group
from rich.table import Table

from vtoken.calibrate import CalibrationReport
from vtoken.calibration.model import FEATURES
from vtoken_cli.render.common import fields_panel, titled

UNITS = {"overhead_s": "per forward", "per_decode_token_s": "per decode token", "per_kv_slot_s": "per KV slot read",
         "per_prefill_token_s": "per prompt token", "per_prefill_request_s": "per prompt",
         "per_prefill_kv_pair_s": "per prompt query-key pair", "per_copied_token_s": "per copied token"}


def calibration_report(report: CalibrationReport) -> Group:
    profile = report.profile
    model = profile.sim.step_model
    rows = [("step times", profile.sim.describe_step_times()), ("steps timed", f"{profile.num_steps:,} "
            f"({profile.grid.num_rounds} rounds, warm-up left out)")]
    coefficients = Table()
    coefficients.add_column("coefficient")
    coefficients.add_column("value", justify="right")
    coefficients.add_column("unit")
    for name in (*FEATURES, "per_copied_token_s"):
        coefficients.add_row(name, _seconds(getattr(model, name)), UNITS[name])
    errors = Table()
    for header in ("kind of step", "steps", "mean |error|", "max |error|"):
        errors.add_column(header, justify="right" if header != "kind of step" else "left")
    for kind, e in profile.fit_errors.items():
        errors.add_row(kind, str(e.num_steps), f"{100 * e.mean_abs_rel_error:.1f}%", f"{100 * e.max_abs_rel_error:.1f}%")
    return Group(fields_panel(rows, "vtoken calibrate"), titled("Fitted step model", coefficients),
                 titled("Fit error (predicted vs measured step time)", errors))


def _seconds(value: float) -> str:
    if value == 0:
        return "0"
    if value >= 1e-3:
        return f"{1e3 * value:.3f} ms"
    if value >= 1e-6:
        return f"{1e6 * value:.3f} us"
    return f"{1e9 * value:.3f} ns"
