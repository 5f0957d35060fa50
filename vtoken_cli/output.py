"""What a command writes besides its stdout: the `--output DIR` files and the progress bar on
stderr.

`--output DIR`: everything is written into a temporary sibling directory first and renamed
into place at the end, so an error never leaves a half-written DIR behind.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from vtoken.errors import ConfigError

Writer = Callable[[Path], None]  # writes one or more files into the directory it is given


def check_output_dir(path: Path, force: bool) -> None:
    """Fail early (before any long work) when DIR exists with content and --force is not set."""
    if path.exists() and (not path.is_dir() or any(path.iterdir())) and not force:
        raise ConfigError(f"--output {path}: exists and is not empty (pass --force to replace it)")


def write_output_dir(path: Path, writers: list[Writer], force: bool) -> None:
    check_output_dir(path, force)
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        for write in writers:
            write(staging)
        if path.exists():
            shutil.rmtree(path) if path.is_dir() else path.unlink()
        staging.rename(path)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def json_writer(payload: dict, name: str = "report.json") -> Writer:
    """A writer of `payload` as indented JSON into DIR/`name`."""

    def write_json(directory: Path) -> None:
        (directory / name).write_text(json.dumps(payload, indent=2) + "\n")

    return write_json


def progress_bar(console: Console, description_width: int) -> Progress:
    """A transient progress bar (stage, bar, done/total, time) on `console`; use it as a context."""
    return Progress(TextColumn(f"{{task.description:<{description_width}}}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), console=console, transient=True)
