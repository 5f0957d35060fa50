"""What the trace-replay benchmarks (bench_variants.py, bench_instructions.py) check of their
arguments before anything runs. A bad one is one line on stderr, `SCRIPT: message`, and exit
code 2."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import NoReturn

from vtoken.engine import VARIANTS


def fail(script: str, message: str) -> NoReturn:
    print(f"{script}: {message}", file=sys.stderr)
    raise SystemExit(2)


def checked_replay(script: str, variants: str, azure: str, max_requests: int | None) -> list[str]:
    """The variants `variants` names (comma-separated), once the names, the request count
    (None: every request) and the trace's path are checked."""
    names = variants.split(",")
    unknown = [name for name in names if name not in VARIANTS]
    if unknown:
        fail(script, f"--variants: unknown variant '{unknown[0]}'; known: {', '.join(VARIANTS)}")
    if max_requests is not None and max_requests < 1:
        fail(script, f"--max-requests must be at least 1, got {max_requests}")
    if not Path(azure).is_file():
        fail(script, f"--azure: no trace at {azure}")
    return names
