"""`vtoken calibrate --executor vllm|hf --model M`: fit the sim's step times to a real engine."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Optional

import typer

from vtoken.calibrate import CALIBRATED_EXECUTORS, calibrate, report_to_json
from vtoken.calibration.grid import QUICK_GRID, CalibrationGrid
from vtoken.calibration.profile import profile_to_toml
from vtoken.errors import ConfigError
from vtoken_cli.console import stderr, stdout
from vtoken_cli.options import Force, JsonOut, parse_int_list
from vtoken_cli.render.calibrate import calibration_report


def calibrate_command(
    executor: Annotated[str, typer.Option(help="Engine to calibrate: vllm (in-process vLLM) or hf (transformers).")],
    model: Annotated[str, typer.Option(help="smollm2-135m or a local Llama/Mistral/Qwen2 folder.")],
    output: Annotated[Optional[Path], typer.Option(
        help="Write the sim profile TOML here, with PROFILE.png (measured vs predicted step time) and "
             "PROFILE.steps.csv (every timed step) beside it; default: print the TOML on stdout.")] = None,
    rounds: Annotated[int, typer.Option(help="Rounds over the grid: each point is timed this many times.")] = CalibrationGrid.num_rounds,
    quick: Annotated[bool, typer.Option(help="A grid of the smallest points only (short contexts and prompts): "
                                             "checks that the engine calibrates in seconds; the fit is coarse.")] = False,
    decode_batch_sizes: Annotated[Optional[str], typer.Option(
        help="Decode batch sizes of the grid, comma-separated (default 1,4,8; --quick 1,4). Cover the "
             "concurrency you validate and deploy at: past the largest, the fit extrapolates.")] = None,
    decode_contexts: Annotated[Optional[str], typer.Option(
        help="Context lengths of the decode points in tokens, comma-separated (default 64,512; --quick "
             "32,128).")] = None,
    force: Force = False,
    json_out: JsonOut = False,
) -> None:
    """Time a real engine over a designed grid of steps (decode batch sizes x context lengths,
    prompt lengths, mixed prefill and decode steps, relocation copies of several sizes), warm-up
    left out and every point repeated, and fit the sim's step-time model by non-negative least
    squares. The profile (fitted values, grid, engine settings, machine, date, fit error per kind
    of step) is what `vtoken compare --sim-profile` and `vtoken validate` read.

    \b
    Examples
      vtoken calibrate --executor vllm --model smollm2-135m --output smollm2-vllm.toml
      vtoken calibrate --executor hf --model smollm2-135m --rounds 2
      vtoken calibrate --executor vllm --model smollm2-135m --decode-batch-sizes 1,8,16,32

    \b
    Exit codes
      0  the profile was written (or printed)
      2  bad input (executor, model, output path)
    """
    if executor not in CALIBRATED_EXECUTORS:
        raise ConfigError(f"--executor {executor!r}: calibrate runs a real engine, one of "
                          f"{', '.join(CALIBRATED_EXECUTORS)}")
    if rounds <= 0:
        raise ConfigError(f"--rounds must be > 0, got {rounds}")
    paths = _output_paths(output, force) if output is not None else None
    grid = QUICK_GRID if quick else CalibrationGrid()
    overrides = {"decode_batch_sizes": (decode_batch_sizes, "--decode-batch-sizes"),
                 "decode_context_tokens": (decode_contexts, "--decode-contexts")}
    grid = replace(grid, num_rounds=rounds, **{field: parse_int_list(text, flag)
                                               for field, (text, flag) in overrides.items() if text is not None})
    report = calibrate(executor, model, grid,
                       on_status=lambda message: stderr.print(message, highlight=False, markup=False))
    text = profile_to_toml(report.profile)
    if paths is not None:
        _write_outputs(report, text, paths)
    if json_out:
        stdout.print_json(json.dumps(report_to_json(report)))
    elif paths is None:
        stdout.print(text, highlight=False, markup=False, end="")
    else:
        stdout.print(calibration_report(report))


def _output_paths(output: Path, force: bool) -> tuple[Path, Path, Path]:
    """PROFILE.toml, PROFILE.png, PROFILE.steps.csv; refused before any timing when a file is
    there (without --force) or the folder is missing."""
    if output.suffix != ".toml":
        raise ConfigError(f"--output {output}: a sim profile is a .toml file")
    paths = (output, output.with_suffix(".png"), output.with_suffix(".steps.csv"))
    if not output.parent.is_dir():
        raise ConfigError(f"--output {output}: folder {output.parent} does not exist")
    for path in paths:
        if path.is_dir():
            raise ConfigError(f"--output {output}: {path} is a directory")
        if path.exists() and not force:
            raise ConfigError(f"--output {output}: {path} exists; give --force to replace it")
    if not os.access(output.parent, os.W_OK):
        raise ConfigError(f"--output {output}: folder {output.parent} is not writable")
    return paths


def _write_outputs(report, text: str, paths: tuple[Path, Path, Path]) -> None:
    """Each file written beside its place and renamed over it: none is ever half-written."""
    import pandas as pd

    from vtoken_cli import plots  # matplotlib only when a plot is drawn

    toml_path, png_path, csv_path = paths
    staged = [path.with_name(f".{path.stem}.new{path.suffix}") for path in paths]
    try:
        staged[0].write_text(text)
        plots.plot_calibration(report, staged[1])
        pd.DataFrame(report_to_json(report)["steps"]).to_csv(staged[2], index=False)
        for new, path in zip(staged, paths):
            os.replace(new, path)
    finally:
        for new in staged:
            new.unlink(missing_ok=True)
    stderr.print(f"wrote {toml_path} ({png_path.name}, {csv_path.name} beside it)", highlight=False, markup=False)
