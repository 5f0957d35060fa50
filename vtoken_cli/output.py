"""What a command writes besides its stdout: the `--output DIR` files and the progress bar on
stderr.

`--output DIR` rules, the same for every command:

- DIR is checked before any work (`check_output_dir`): a new path, an empty directory, or, with
  `--force`, a directory vtoken wrote earlier. A directory vtoken wrote holds a manifest,
  `.vtoken-output.json`, naming every file it wrote and the vtoken version; `--force` replaces
  such a directory only when it holds nothing but those files (anything else in it, a user's
  file, refuses the run: vtoken never deletes what it did not write). Never replaced, with or
  without `--force`: a file, a symbolic link, the working directory, one of its parents, the
  home directory (or a parent of it) and `/`. The parent must be writable: a probe directory is
  created and removed in the nearest existing ancestor, so a read-only directory, `/proc/x` or a
  parent that is a file fails at once instead of after the replay.
- Everything is written into a staging sibling first and renamed into place at the end, so an
  error never leaves a half-written DIR behind. The directory gets the permissions the umask
  gives (as `mkdir` would), not tempfile's 0700. A replaced directory is moved aside, and only
  the files its manifest lists are removed from it.
- `report.json` carries `provenance`: the vtoken version, the command line and the time it was
  written. Where the files went is said on stderr.
"""

from __future__ import annotations

import json
import os
import secrets
import shlex
import shutil
import sys
import time
import tempfile
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from vtoken import __version__
from vtoken.errors import ConfigError
from vtoken_cli.console import stderr

Writer = Callable[[Path], None]  # writes one or more files into the directory it is given

MANIFEST_NAME = ".vtoken-output.json"


def check_output_dir(path: Path, force: bool) -> None:
    """Refuse, before any long work, an `--output` vtoken may not write or replace (module
    docstring); raises ConfigError naming the path and why, and changes nothing on disk."""
    _refuse_protected(path)
    if path.is_symlink():
        raise ConfigError(f"--output {path}: is a symbolic link; give the directory itself")
    if path.exists():
        _check_existing(path, force)
    require_writable(path.absolute().parent, f"--output {path}")


def write_output_dir(path: Path, writers: list[Writer], force: bool) -> list[str]:
    """Run `writers` into a staging directory, add the manifest, then put it at `path`.

    Checks `path` again first (see `check_output_dir`). Returns the names of the files written
    (relative to `path`, the manifest left out) and says on stderr where they went.
    """
    check_output_dir(path, force)
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = _make_sibling(path, "new")
    try:
        for write in writers:
            write(staging)
        names = sorted(str(p.relative_to(staging)) for p in staging.rglob("*") if p.is_file())
        (staging / MANIFEST_NAME).write_text(json.dumps(
            {"written_by": "vtoken", **provenance(), "files": names}, indent=2) + "\n")
        _put_in_place(staging, path)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    stderr.print(f"wrote {path}/ ({', '.join(names)})", highlight=False, markup=False)
    return names


def provenance() -> dict[str, str]:
    """What wrote a report: the vtoken version, the command line, the UTC time."""
    return {
        "vtoken_version": __version__,
        "command_line": shlex.join(["vtoken", *sys.argv[1:]]),
        "written_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


def json_writer(payload: dict, name: str = "report.json") -> Writer:
    """A writer of `payload` as indented JSON into DIR/`name`, with a `provenance` key added."""

    def write_json(directory: Path) -> None:
        (directory / name).write_text(json.dumps({**payload, "provenance": provenance()}, indent=2) + "\n")

    return write_json


PLAIN_INTERVAL_S = 10.0  # a non-terminal stderr gets a progress line at most this often


def progress_bar(console: Console, description_width: int, label: str = "vtoken") -> Progress | PlainProgress:
    """A transient progress bar (stage, bar, done/total, elapsed, ETA) on a terminal `console`;
    elsewhere a `PlainProgress` line now and then. Use it as a context."""
    if not console.is_terminal:
        return PlainProgress(console, label)
    return Progress(TextColumn(f"{{task.description:<{description_width}}}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), TimeRemainingColumn(), console=console, transient=True)


class PlainProgress:
    """Progress for a non-terminal stderr: one plain line at most every `interval_s`, none in
    the first `interval_s` (a short run prints nothing). The subset of rich's Progress the
    commands use: add_task, update, and the context."""

    def __init__(self, console: Console, label: str, interval_s: float = PLAIN_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.console, self.label, self.interval_s, self.clock = console, label, interval_s, clock
        self.started_s = self.last_line_s = clock()
        self.num_done, self.num_total = 0.0, None

    def __enter__(self) -> PlainProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def add_task(self, description: str, total: float | None = None, **_: object) -> int:
        self.num_total = total
        return 0

    def update(self, task_id: int, *, advance: float | None = None, completed: float | None = None,
               total: float | None = None, **_: object) -> None:
        if total is not None:
            self.num_total = total
        self.num_done = completed if completed is not None else self.num_done + (advance or 0)
        now_s = self.clock()
        if now_s - self.last_line_s >= self.interval_s:
            self.last_line_s = now_s
            self.console.print(self.line(now_s - self.started_s), highlight=False, markup=False)

    def line(self, elapsed_s: float) -> str:
        if not self.num_total:
            return f"{self.label}: {self.num_done:,.0f} done, {elapsed_s:.0f} s elapsed"
        share = min(self.num_done / self.num_total, 1.0)
        left = f", about {elapsed_s * (1 - share) / share:.0f} s left" if share > 0 else ""
        return (f"{self.label}: {share:.0%} of {_compact(self.num_total)} tokens, {elapsed_s:.0f} s elapsed{left}")


def _compact(num: float) -> str:
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if num >= scale:
            return f"{num / scale:.1f}{suffix}"
    return f"{num:.0f}"


# ---- the checks ---------------------------------------------------------------------------------


def _refuse_protected(path: Path) -> None:
    target = path.resolve()
    cwd = Path.cwd().resolve()
    if target == cwd:
        raise ConfigError(f"--output {path}: is the working directory; give a new directory (vtoken replaces "
                          "only a directory it wrote)")
    if target in cwd.parents:
        raise ConfigError(f"--output {path}: is a parent of the working directory; give a new directory")
    home = Path(os.path.expanduser("~")).resolve()
    if target == home or target in home.parents:
        raise ConfigError(f"--output {path}: is the home directory or a parent of it; give a new directory")


def _check_existing(path: Path, force: bool) -> None:
    if not path.is_dir():
        raise ConfigError(f"--output {path}: is a file, not a directory; vtoken writes a directory and never "
                          "replaces a file")
    entries = _relative_entries(path)
    if not entries:
        return
    listed = _manifest_files(path)
    if listed is None:
        raise ConfigError(f"--output {path}: exists and is not empty, and vtoken did not write it (no "
                          f"{MANIFEST_NAME}); give a new or empty directory")
    if not force:
        raise ConfigError(f"--output {path}: exists and is not empty (vtoken wrote it: pass --force to replace it)")
    foreign = sorted(entries - _allowed_entries(listed))
    if foreign:
        raise ConfigError(f"--output {path}: holds {len(foreign)} file(s) vtoken did not write ({foreign[0]}"
                          f"{', ...' if len(foreign) > 1 else ''}); --force replaces only what vtoken wrote")


def require_writable(directory: Path, label: str) -> None:
    """Refuse (ConfigError, `label` first) a `directory` that vtoken could not make or write
    into, before any work: a probe directory is made and removed in it, or in its nearest
    existing ancestor, so a read-only directory, `/proc/x` or a file on the way fails at once.
    For `--output`'s parent and the run cache (options.build_cache)."""
    ancestor = directory
    while not ancestor.exists() and not ancestor.is_symlink():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise ConfigError(f"{label}: {ancestor} is a file, not a directory")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".vtoken-probe-", dir=ancestor))
    except OSError as exc:
        raise ConfigError(f"{label}: cannot create a directory in {ancestor} ({exc.strerror})") from None


def _relative_entries(directory: Path) -> set[str]:
    """Every file, link and folder under `directory`, as paths relative to it."""
    return {str(p.relative_to(directory)) for p in directory.rglob("*")}


def _manifest_files(directory: Path) -> set[str] | None:
    """The files the manifest lists; None when there is no readable vtoken manifest."""
    try:
        manifest = json.loads((directory / MANIFEST_NAME).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    files = manifest.get("files") if isinstance(manifest, dict) and manifest.get("written_by") == "vtoken" else None
    if not isinstance(files, list) or not all(isinstance(name, str) for name in files):
        return None
    return set(files)


def _allowed_entries(listed: set[str]) -> set[str]:
    """The listed files, the folders holding them, and the manifest."""
    folders = {str(parent) for name in listed for parent in Path(name).parents if str(parent) != "."}
    return listed | folders | {MANIFEST_NAME}


# ---- the writes ---------------------------------------------------------------------------------


def _make_sibling(path: Path, role: str) -> Path:
    """A new hidden directory next to `path`, with the umask's permissions (mkdtemp's are 0700)."""
    while True:
        sibling = path.parent / f".{path.name}.{role}-{secrets.token_hex(4)}"
        try:
            sibling.mkdir()
            return sibling
        except FileExistsError:
            continue


def _put_in_place(staging: Path, path: Path) -> None:
    """Rename `staging` to `path`; an existing (empty, or vtoken-written) `path` is moved aside
    first and then only its listed files and their folders are removed."""
    if not path.exists():
        staging.rename(path)
        return
    listed = _manifest_files(path) or set()
    old = _make_sibling(path, "old")
    old.rmdir()
    path.rename(old)
    try:
        staging.rename(path)
    except BaseException:
        old.rename(path)
        raise
    _remove_written(old, _allowed_entries(listed))


def _remove_written(directory: Path, allowed: set[str]) -> None:
    """Remove the entries of `directory` that vtoken wrote (files first, then emptied folders)."""
    entries = sorted(directory.rglob("*"), key=lambda p: len(p.parts), reverse=True)
    for entry in entries:
        if str(entry.relative_to(directory)) not in allowed:
            continue
        if entry.is_dir() and not entry.is_symlink():
            entry.rmdir()
        else:
            entry.unlink()
    try:
        directory.rmdir()
    except OSError:  # something appeared in it after the check: it stays, hidden, with that
        pass
