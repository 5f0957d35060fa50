"""Request traces: the `Request` record every later stage consumes, and the readers that make them.

Five on-disk formats, one output shape:

    format      file                             time                    prefix sharing
    jsonl       native JSONL, one object a line  `timestamp`, seconds    `prefix_id` + `prefix_length`
    mooncake    Mooncake FAST'25 JSONL           `timestamp`, ms         from `hash_ids` (512-token blocks)
    azure       Azure LLM inference 2023 CSV     wall-clock datetimes    none
    sharegpt    ShareGPT JSON array              none: all arrive at 0   none
    vllm-bench  `vllm bench serve --save-result  `start_times`, s        none
                --save-detailed` JSON object     (vtoken.vllm_bench, which also reads what it measured)

Arrival times are rebased so that the first request arrives at 0 s, and requests are sorted by
arrival (ties keep file order). Every problem with the file is a `TraceError` that names the file
and, where there is one, the line: "trace.jsonl line 17: output_length must be > 0, got -3".
Anything the reader had to assume or skip is returned in `Trace.notes` for the caller to show.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from pathlib import Path
from collections.abc import Sequence
from typing import Any

from vtoken.errors import TraceError

TRACE_FORMATS = ("auto", "jsonl", "mooncake", "azure", "sharegpt", "vllm-bench")
TIME_UNITS = {"s": 1, "ms": 1000}  # units per second
MOONCAKE_BLOCK_TOKENS = 512
SHAREGPT_CHARS_PER_TOKEN = 4


@dataclass(frozen=True, slots=True)
class Request:
    """One request of a trace; lengths are in tokens, times in seconds from the first arrival."""

    request_id: str
    arrival_s: float
    num_prompt_tokens: int
    num_output_tokens: int
    prompt: str | None = None
    # Requests with the same prefix_id share their first num_prefix_tokens prompt tokens.
    prefix_id: str | None = None
    num_prefix_tokens: int = 0

    def __post_init__(self) -> None:
        if self.num_prompt_tokens <= 0 or self.num_output_tokens <= 0:
            raise TraceError(
                f"request {self.request_id}: token counts must be > 0, got "
                f"{self.num_prompt_tokens} prompt / {self.num_output_tokens} output"
            )
        if not 0 <= self.num_prefix_tokens < self.num_prompt_tokens:
            raise TraceError(
                f"request {self.request_id}: num_prefix_tokens must be in "
                f"[0, {self.num_prompt_tokens}), got {self.num_prefix_tokens}"
            )
        if (self.prefix_id is None) != (self.num_prefix_tokens == 0):
            raise TraceError(
                f"request {self.request_id}: prefix_id and num_prefix_tokens go together, got "
                f"{self.prefix_id!r} with {self.num_prefix_tokens} tokens"
            )


@dataclass(frozen=True)
class Trace:
    """A loaded trace: requests sorted by arrival, and what the user must be told about it."""

    requests: tuple[Request, ...]
    source: str
    format: str
    notes: tuple[str, ...] = ()


def load_trace(
    path: str | Path,
    format: str = "auto",
    *,
    time_unit: str | None = None,
    max_requests: int | None = None,
    tokenizer: Any = None,
) -> Trace:
    """Read a trace file into a `Trace`.

    `format` is one of TRACE_FORMATS; "auto" looks at the content (see `detect_format`).
    `time_unit` ("s" or "ms") overrides the format's default for numeric timestamps (jsonl: s,
    mooncake: ms); it does not apply to azure (datetimes) or sharegpt (no times).
    `max_requests` keeps the first N requests by arrival. `tokenizer` (anything with
    `.encode(str) -> list`) measures ShareGPT texts; without one they are estimated at 4
    characters per token. Raises TraceError for any unreadable file or value.
    """
    from vtoken import trace_readers as readers  # the readers import Request from here
    from vtoken.trace_parse import Options, check_options, read_text

    source = str(path)
    check_options(format, time_unit, max_requests)
    text = read_text(source)
    fmt = detect_format(text) if format == "auto" else format
    if time_unit is not None and fmt not in readers.DEFAULT_TIME_UNIT:
        raise TraceError(f"{source}: a time unit (--time-unit) applies only to jsonl and mooncake timestamps, "
                         f"not to {fmt}, got {time_unit!r}")
    options = Options(source, time_unit or readers.DEFAULT_TIME_UNIT.get(fmt, "s"), time_unit is None,
                      max_requests, tokenizer)
    parsed = readers.READERS[fmt](text, options)
    requests = parsed.requests[:max_requests]
    if not requests:
        raise TraceError(f"{source}: trace has no requests")
    return Trace(tuple(requests), source, fmt, tuple(parsed.notes))


def num_output_tokens(requests: Sequence[Request]) -> int:
    """Tokens a replay of `requests` generates: the unit of progress of every replay."""
    return sum(r.num_output_tokens for r in requests)


def within_context(trace: Trace, max_model_len: int | None) -> Trace:
    """`trace` without the requests longer (prompt + output tokens) than `max_model_len`, with a
    note saying how many were skipped; the trace itself when none is (or the length is None).

    A server refuses such a request, so a replay would measure something no deployment runs.
    Raises TraceError when no request fits.
    """
    if max_model_len is None:
        return trace
    kept = tuple(r for r in trace.requests if r.num_prompt_tokens + r.num_output_tokens <= max_model_len)
    num_skipped = len(trace.requests) - len(kept)
    if num_skipped == 0:
        return trace
    if not kept:
        raise TraceError(f"{trace.source}: every request is longer than the model's context of {max_model_len} "
                         "tokens (prompt + output)")
    note = (f"{num_skipped} request{'s' if num_skipped > 1 else ''} longer than the model's context of "
            f"{max_model_len} tokens skipped")
    return replace(trace, requests=kept, notes=(*trace.notes, note))


def detect_format(text: str) -> str:
    """Guess the format from the content: '[' starts ShareGPT, a whole text that is one JSON
    object with a vllm bench serve result's keys is vllm-bench, a TIMESTAMP/ContextTokens header
    (or any first line of comma-separated non-JSON) is Azure, a first JSON object with
    `hash_ids` is Mooncake, anything else native JSONL."""
    from vtoken.vllm_bench import is_bench_result

    start = re.search(r"\S", text)
    if start is None:
        return "jsonl"
    if text[start.start()] == "[":
        return "sharegpt"
    if text[start.start()] == "{" and is_bench_result(text):
        return "vllm-bench"
    end = text.find("\n", start.start())
    first_line = text[start.start():end if end >= 0 else len(text)].strip()
    header = {cell.strip().strip('"') for cell in first_line.split(",")}
    if {"TIMESTAMP", "ContextTokens"} <= header:
        return "azure"
    try:
        first = json.loads(first_line)
    except json.JSONDecodeError:
        # Not JSON: a comma-separated first line is a CSV header, which the Azure reader checks.
        return "azure" if "," in first_line and not first_line.startswith("{") else "jsonl"
    return "mooncake" if isinstance(first, dict) and "hash_ids" in first else "jsonl"
