"""The sim profile a calibration writes, and reading its calibration record back.

    [sim]                          SimProfile fields (what `load_sim_profile` and --sim-profile read)
    [sim.step_model]               the fitted StepTimeModel
    [sim.step_model.provenance]    engine, model, machine, versions, date
    [calibration]                  what the fit was made from (ignored by the sim):
    [calibration.grid]               the designed grid
    [calibration.engine]             the engine settings the grid ran with
    [calibration.fit_error.KIND]     the fit's error per kind of step (decode, prefill, mixed, copy)

    profile_to_toml(profile) -> str          load_calibration(path) -> CalibrationProfile
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import asdict, dataclass
from pathlib import Path

from vtoken.calibration.fit import KindError
from vtoken.calibration.grid import CalibrationGrid
from vtoken.engine.sim import SimProfile, load_sim_profile
from vtoken.errors import ConfigError


@dataclass(frozen=True)
class CalibrationProfile:
    sim: SimProfile  # its step_model is the fit
    grid: CalibrationGrid
    engine: dict[str, int | str]  # block_size, max_num_batched_tokens, ... as the grid ran
    fit_errors: dict[str, KindError]
    num_steps: int  # timed steps the fit used, warm-up left out


def profile_to_toml(profile: CalibrationProfile) -> str:
    sim = asdict(profile.sim)
    document = {
        "sim": sim,
        "calibration": {
            "num_steps": profile.num_steps,
            "grid": profile.grid.as_dict(),
            "engine": dict(profile.engine),
            "fit_error": {kind: asdict(error) for kind, error in profile.fit_errors.items()},
        },
    }
    header = ("# vtoken sim profile written by `vtoken calibrate`: step times fitted to "
              f"{profile.sim.describe_step_times().removeprefix('calibrated against ')}\n")
    return header + _dumps(document)


def load_calibration(path: str | Path) -> CalibrationProfile:
    """A profile written by `profile_to_toml`, with its calibration record; ConfigError naming
    the file when it is not one."""
    sim = load_sim_profile(path)
    data = tomllib.loads(Path(path).read_text())  # valid: load_sim_profile read it
    record = data.get("calibration")
    if sim.step_model is None or not isinstance(record, dict):
        raise ConfigError(f"{path}: not a calibrated profile (no [sim.step_model] and [calibration]); "
                          "write one with vtoken calibrate")
    try:
        grid = CalibrationGrid(**{k: tuple(v) if isinstance(v, list) else v for k, v in record["grid"].items()})
        errors = {kind: KindError(**values) for kind, values in record["fit_error"].items()}
        return CalibrationProfile(sim, grid, dict(record["engine"]), errors, int(record["num_steps"]))
    except (KeyError, TypeError) as exc:
        raise ConfigError(f"{path}: [calibration] is incomplete or malformed: {exc}") from None


def calibration_grid(path: str | Path) -> CalibrationGrid | None:
    """The grid a profile was calibrated on; None for a profile without a [calibration] record
    (a hand-written step model). A malformed record is a ConfigError, as in `load_calibration`."""
    if "calibration" not in tomllib.loads(Path(path).read_text()):
        return None
    return load_calibration(path).grid


def _dumps(document: dict) -> str:
    """TOML for nested tables of strings, booleans, numbers and lists of them; None values left out."""
    lines: list[str] = []

    def table(name: str, values: dict) -> None:
        scalars = {k: v for k, v in values.items() if not isinstance(v, dict) and v is not None}
        if scalars or not any(isinstance(v, dict) for v in values.values()):
            lines.append(f"\n[{name}]")
            lines.extend(f"{k} = {_value(v)}" for k, v in scalars.items())
        for k, v in values.items():
            if isinstance(v, dict):
                table(f"{name}.{k}", v)

    for name, values in document.items():
        table(name, values)
    return "\n".join(lines).lstrip("\n") + "\n"


def _value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"TOML has no {value}")
        return repr(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    raise TypeError(f"no TOML for {value!r}")

