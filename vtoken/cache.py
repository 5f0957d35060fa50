"""An on-disk cache of sim replays, addressed by a hash of everything that determines one.

    cache = RunCache(directory)        default_cache_dir(): $VTOKEN_RUN_CACHE_DIR, else
                                       vtoken's cache root (vtoken/paths.py) / runs
    cache.get(job) / cache.put(job, result)

The key is the sha256 of a canonical JSON of:

- the whole `Run`: its experiment and its run spec, every field, nested ones included (model
  spec, GPU, block budget, eviction and its budget, reclamation, scheduler limits, sim profile,
  seed; variant, concurrency, admission), each float written exactly (repr);
- every request, field by field;
- the code: a hash of every source and data file of the `vtoken` package, the vtoken and numpy
  versions, and CACHE_FORMAT. The source hash, not a hand-bumped version constant, because a
  result is a function of the code and an editable checkout changes the code without changing
  the version: a constant someone forgets to bump would hand back results the current code no
  longer gives. Any edit under vtoken/ invalidates everything, which is the safe direction.
  numpy's version is in because the synthetic attention draws from its generators.

The commands refuse a directory vtoken could not write before anything runs
(vtoken_cli.options.build_cache); a write that fails anyway (a full disk) is a VTokenError that
names the directory. A result is
stored as a pickle (the `RunResult`, timeline included), written to a temporary file and
renamed into place, so a run killed mid-write leaves no partial entry and an interrupted sweep
keeps every replay it finished. A result read back keeps the host time it was
measured with. An entry that cannot be read is a miss. The cache holds pickles: point it only
at a directory you own.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import pickle
import tempfile
from pathlib import Path

import numpy as np

from vtoken import __version__
from vtoken.errors import VTokenError
from vtoken.metrics import RunResult
from vtoken.paths import run_cache_dir
from vtoken.runners import ReplayJob
from vtoken.trace import Request

CACHE_FORMAT = 1  # bump when the stored layout (what is pickled) changes
PACKAGE_DIR = Path(__file__).resolve().parent


def default_cache_dir() -> Path:
    return run_cache_dir()


class RunCache:
    """Results of sim replays under `directory` (created on the first write)."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory).expanduser()

    def get(self, job: ReplayJob) -> RunResult | None:
        path = self._path(job_key(job))
        try:
            with path.open("rb") as f:
                result = pickle.load(f)
        except (OSError, pickle.UnpicklingError, EOFError, AttributeError, ImportError, TypeError, ValueError):
            return None
        return result if isinstance(result, RunResult) else None

    def put(self, job: ReplayJob, result: RunResult) -> None:
        path = self._path(job_key(job))
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=path.parent)
        except OSError as exc:
            raise self._unwritable(exc) from None
        try:
            with os.fdopen(fd, "wb") as f:
                pickle.dump(result, f, protocol=pickle.HIGHEST_PROTOCOL)
            os.replace(tmp, path)
        except BaseException as exc:
            Path(tmp).unlink(missing_ok=True)
            if isinstance(exc, OSError):
                raise self._unwritable(exc) from None
            raise

    def _unwritable(self, exc: OSError) -> VTokenError:
        return VTokenError(f"cannot write the run cache at {self.directory}: {exc.strerror or exc} "
                           "(--no-cache runs without it)")

    def _path(self, key: str) -> Path:
        return self.directory / key[:2] / f"{key}.pkl"


def job_key(job: ReplayJob) -> str:
    """sha256 (hex) of everything that determines `job`'s result (module docstring): the JSON
    document {"code", "format", "requests", "run"}, its keys in sorted order, written in parts.
    The requests' part is written once for every job that shares them (`_requests_json`)."""
    text = (f'{{"code":{_json(code_fingerprint())},"format":{_json(CACHE_FORMAT)},'
            f'"requests":{_requests_json(tuple(job.requests))},"run":{_json(_canonical(job.run))}}}')
    return hashlib.sha256(text.encode()).hexdigest()


def _json(value: object) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=True)


@functools.lru_cache(maxsize=4)
def _requests_json(requests: tuple[Request, ...]) -> str:
    """The requests' part of a key. Every job of a comparison or a sweep replays the same
    requests, and writing them costs about 0.2 s on the 19,366-request Azure trace, where
    finding them here again costs a hash of the tuple (about 4 ms)."""
    return _json([_canonical(r) for r in requests])


@functools.cache
def code_fingerprint() -> str:
    """The vtoken and numpy versions and a sha256 over every file of the vtoken package
    (relative path and bytes, in sorted order; bytecode left out). Computed once a process."""
    digest = hashlib.sha256()
    files = sorted(p for p in PACKAGE_DIR.rglob("*")
                   if p.is_file() and "__pycache__" not in p.parts and p.suffix not in (".pyc", ".pyo"))
    for path in files:
        digest.update(str(path.relative_to(PACKAGE_DIR)).encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return f"vtoken {__version__}; numpy {np.__version__}; source {digest.hexdigest()}"


def _canonical(value: object) -> object:
    """A JSON-able tree of `value` that names each dataclass's type and every field, floats
    exactly (repr), so that no two different configs share one."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {f.name: _canonical(getattr(value, f.name)) for f in dataclasses.fields(value)}
        return {"__type__": type(value).__qualname__, **fields}
    if isinstance(value, (list, tuple)):
        return [_canonical(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _canonical(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, float):
        return {"float": repr(value)}
    if isinstance(value, (bool, int, str)) or value is None:
        return value
    if isinstance(value, np.generic):
        return _canonical(value.item())
    raise TypeError(f"cannot key a run on a {type(value).__name__}: {value!r}")
