"""`vtoken calibrate`: fit the sim's step model to a real engine on this machine.

    report = calibrate("vllm", "smollm2-135m")      # or "hf"; a model name or folder
    profile_to_toml(report.profile)                 # what --sim-profile reads

The engine replays the designed grid (calibration/grid.py: decode batches x contexts, prompt
lengths, mixed steps, relocation copies), warm-up left out and every point repeated over
rounds; the step model is fitted by NNLS (calibration/fit.py) and written with the grid, the
engine settings, the machine and the fit's error per kind of step.
"""

from __future__ import annotations

import os
import platform
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import datetime, timezone

from vtoken.calibration.fit import MeasuredStep, StepFit, fit_step_model
from vtoken.calibration.grid import CalibrationGrid
from vtoken.calibration.model import Provenance
from vtoken.calibration.profile import CalibrationProfile
from vtoken.engine.sim import SimProfile
from vtoken.errors import ConfigError
from vtoken.jsonsafe import make_json_safe

CALIBRATED_EXECUTORS = ("vllm", "hf")
OnStatus = Callable[[str], None]


@dataclass(frozen=True)
class CalibrationReport:
    profile: CalibrationProfile
    steps: tuple[MeasuredStep, ...]  # every timed step the fit used, in the order measured
    predicted_s: tuple[float, ...]  # the fitted model's time for each


def calibrate(executor: str, model: str, grid: CalibrationGrid | None = None,
              on_status: OnStatus | None = None) -> CalibrationReport:
    """Time the grid on `executor` ("vllm" or "hf") running `model`, fit, and build the profile.
    `on_status(message)`: one line per scenario as it starts, and while the model loads."""
    if executor not in CALIBRATED_EXECUTORS:
        raise ConfigError(f"--executor {executor!r}: calibrate runs a real engine, one of "
                          f"{', '.join(CALIBRATED_EXECUTORS)}")
    grid = grid or CalibrationGrid()
    if executor == "vllm":
        steps, engine, model_name, device = _measure_vllm(model, grid, on_status)
    else:
        steps, engine, model_name, device = _measure_hf(model, grid, on_status)
    fit = fit_step_model(steps, machine_provenance(executor, model_name, device))
    sim = SimProfile(sync_copy=device == "cpu", step_model=fit.model)
    profile = CalibrationProfile(sim, grid, engine, fit.errors, len(steps))
    return CalibrationReport(profile, tuple(steps), fit.predicted_s)


def _measure_vllm(model: str, grid: CalibrationGrid, on_status: OnStatus | None):
    from vtoken.replay import model_folder, require_vllm

    require_vllm()
    from vtoken.calibration.vllm_steps import engine_spec, measure_vllm

    folder = model_folder("vllm", model, on_status)
    spec = engine_spec(str(folder), grid)
    steps = measure_vllm(str(folder), grid, on_status)
    engine = {"block_size": spec.block_size, "max_model_len": spec.max_model_len, "max_num_seqs": spec.max_num_seqs,
              "dtype": spec.dtype, "enforce_eager": True, "variant": "native"}
    return steps, engine, folder.name, _device()


def _measure_hf(model: str, grid: CalibrationGrid, on_status: OnStatus | None):
    from vtoken.calibration.hf_steps import BLOCK_SIZE, measure_hf
    from vtoken.models import load_model

    loaded = load_model(model, on_status=on_status)
    steps = measure_hf(loaded, grid, on_status)
    device = next(loaded.model.parameters()).device
    engine = {"block_size": BLOCK_SIZE, "dtype": "float32", "variant": "native"}
    return steps, engine, loaded.name, _device() if device.type == "cpu" else str(device)


def _device() -> str:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def machine_provenance(engine: str, model_name: str, device: str) -> Provenance:
    import torch

    vllm_version = ""
    if engine == "vllm":
        import vllm

        vllm_version = vllm.__version__
    return Provenance(engine, model_name, cpu_model(), os.cpu_count() or 0, torch.__version__, vllm_version, device,
                      datetime.now(timezone.utc).isoformat(timespec="seconds"))


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo on Linux), else what platform knows."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def report_to_json(report: CalibrationReport) -> dict:
    """The `--json` object: the profile's values and every timed step with its prediction."""
    profile = report.profile
    return make_json_safe({
        "sim_profile": profile.sim.as_dict(),
        "step_times": profile.sim.describe_step_times(),
        "grid": profile.grid.as_dict(),
        "engine": profile.engine,
        "fit_error": {kind: asdict(e) for kind, e in profile.fit_errors.items()},
        "steps": [{"kind": s.kind, **s.load.counts(), "measured_s": s.measured_s, "predicted_s": p}
                  for s, p in zip(report.steps, report.predicted_s)],
    })


__all__ = ["CALIBRATED_EXECUTORS", "CalibrationReport", "StepFit", "calibrate", "report_to_json"]
