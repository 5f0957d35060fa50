"""What every trace reader shares: the options a reader gets, what it returns, and the checks
that turn a bad value into a TraceError naming its file and line (`Where`). The readers:
vtoken/trace_readers.py (native and Mooncake JSONL, and the table of formats),
vtoken/trace_datasets.py (Azure CSV, ShareGPT JSON), vtoken/vllm_bench.py (a vllm bench serve
result).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from vtoken.errors import TraceError
from vtoken.trace import TIME_UNITS, TRACE_FORMATS, Request


@dataclass(frozen=True)
class Options:
    source: str
    time_unit: str
    is_time_unit_default: bool
    max_requests: int | None
    tokenizer: Any


@dataclass
class Parsed:
    requests: list[Request]
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Where:
    """A place in the file, for error messages."""

    source: str
    line_no: int

    def error(self, what: str, value: Any) -> TraceError:
        return TraceError(f"{self.source} line {self.line_no}: {what}, got {clip(value)!r}")


def clip(value: Any, max_chars: int = 80) -> Any:
    if isinstance(value, str) and len(value) > max_chars:
        return value[:max_chars] + "..."
    return value


def check_options(format: str, time_unit: str | None, max_requests: int | None) -> None:
    if format not in TRACE_FORMATS:
        raise TraceError(f"unknown trace format {format!r}; choose one of {', '.join(TRACE_FORMATS)}")
    if time_unit is not None and time_unit not in TIME_UNITS:
        raise TraceError(f"unknown time unit {time_unit!r}; choose one of {', '.join(TIME_UNITS)}")
    if max_requests is not None and max_requests <= 0:
        raise TraceError(f"max_requests (--max-requests) must be > 0, got {max_requests}")


def read_text(source: str) -> str:
    try:
        with open(source, encoding="utf-8-sig") as handle:
            return handle.read()
    except FileNotFoundError:
        raise TraceError(f"{source}: trace file not found") from None
    except UnicodeDecodeError as exc:
        raise TraceError(f"{source}: not a UTF-8 text file ({exc.reason} at byte {exc.start})") from None
    except OSError as exc:
        raise TraceError(f"{source}: cannot read trace file ({exc.strerror})") from None


def arrival_order(times: list[float]) -> list[int]:
    """Indices sorted by time; the sort is stable, so ties keep file order."""
    return sorted(range(len(times)), key=times.__getitem__)


def as_int(value: Any, key: str, where: Where) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    raise where.error(f"{key} must be an integer", value)


def positive_int(obj: dict, key: str, where: Where) -> int:
    num = as_int(required_field(obj, key, where), key, where)
    if num <= 0:
        raise where.error(f"{key} must be > 0", num)
    return num


def finite_float(obj: dict, key: str, where: Where) -> float:
    value = required_field(obj, key, where)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise where.error(f"{key} must be a finite number", value)
    return float(value)


def required_field(obj: dict, key: str, where: Where) -> Any:
    if key not in obj:
        raise where.error(f"missing field {key!r}", sorted(obj))
    return obj[key]
