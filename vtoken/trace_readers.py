"""The trace readers behind `vtoken.trace.load_trace`, by format (`READERS`): native and
Mooncake JSONL here; Azure CSV and ShareGPT JSON in vtoken/trace_datasets.py; a vllm bench
serve result in vtoken/vllm_bench.py; what they share in vtoken/trace_parse.py. Each reader
returns the requests sorted by arrival and the notes the user must see; every problem is a
TraceError naming file and line.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from vtoken.errors import TraceError
from vtoken.trace import MOONCAKE_BLOCK_TOKENS, TIME_UNITS, Request
from vtoken.trace_datasets import read_azure, read_sharegpt
from vtoken.trace_parse import Options, Parsed, Where, arrival_order, finite_float, positive_int, required_field
from vtoken.vllm_bench import read_bench_trace

# Native JSONL that is really in milliseconds shows up as minutes between requests.
_SUSPICIOUS_MEDIAN_GAP_S = 60.0


# --- native and Mooncake JSONL ----------------------------------------------------------------


def _json_objects(text: str, source: str) -> Iterator[tuple[Where, dict]]:
    """Yield (where, object) for each non-blank line; one json.loads per line keeps it fast."""
    for line_no, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = Where(source, line_no)
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            raise _not_json(text, where, line) from None
        if not isinstance(obj, dict):
            raise where.error("expected a JSON object", line)
        yield where, obj


def _not_json(text: str, where: Where, line: str) -> TraceError:
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


def _request_id(obj: dict, where: Where) -> str:
    value = obj.get("request_id", where.line_no)
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise where.error("request_id must be a string or an integer", value)
    return str(value)


@dataclass
class _Row:
    """A parsed line before arrival times are rebased and prefixes resolved."""

    where: Where
    request_id: str
    time: float
    num_prompt_tokens: int
    num_output_tokens: int
    prompt: str | None
    prefix: Any  # native: (prefix_id, prefix_length) or None; mooncake: the hash_ids list


def _parse_row(obj: dict, where: Where, prefix_of: Callable[[dict, Where, int], Any]) -> _Row:
    num_prompt_tokens = positive_int(obj, "input_length", where)
    prompt = obj.get("prompt")
    if prompt is not None and not isinstance(prompt, str):
        raise where.error("prompt must be a string", prompt)
    return _Row(where, _request_id(obj, where), finite_float(obj, "timestamp", where),
                num_prompt_tokens, positive_int(obj, "output_length", where), prompt,
                prefix_of(obj, where, num_prompt_tokens))


def _native_prefix(obj: dict, where: Where, num_prompt_tokens: int) -> tuple[str, int] | None:
    if "prefix_id" not in obj:
        if "prefix_length" in obj:
            raise where.error("prefix_length needs a prefix_id", obj["prefix_length"])
        return None
    prefix_id = obj["prefix_id"]
    if isinstance(prefix_id, bool) or not isinstance(prefix_id, (str, int)):
        raise where.error("prefix_id must be a string or an integer", prefix_id)
    num_prefix_tokens = positive_int(obj, "prefix_length", where)
    if num_prefix_tokens >= num_prompt_tokens:
        raise where.error(f"prefix_length must be < input_length ({num_prompt_tokens})", num_prefix_tokens)
    return str(prefix_id), num_prefix_tokens


def _mooncake_hash_ids(obj: dict, where: Where, num_prompt_tokens: int) -> list[int]:
    hash_ids = required_field(obj, "hash_ids", where)
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
    ordered = [rows[idx] for idx in arrival_order([row.time for row in rows])]
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


def _read_native(text: str, options: Options) -> Parsed:
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
    return Parsed(requests, notes)


def _read_mooncake(text: str, options: Options) -> Parsed:
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
    return Parsed(requests, notes)


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


READERS: dict[str, Callable[[str, Options], Parsed]] = {
    "jsonl": _read_native,
    "mooncake": _read_mooncake,
    "azure": read_azure,
    "sharegpt": read_sharegpt,
    "vllm-bench": read_bench_trace,
}
DEFAULT_TIME_UNIT = {"jsonl": "s", "mooncake": "ms"}
