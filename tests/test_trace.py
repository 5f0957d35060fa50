"""Trace readers: each format on hand-written files, auto-detection, options, every error path."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from vtoken.errors import TraceError
from vtoken.trace import Request, detect_format, load_trace, within_context

DATA = Path(__file__).parent / "data"
REPO_ROOT = Path(__file__).resolve().parent.parent
AZURE_CONV = REPO_ROOT.parent / "shared" / "traces" / "azure_llm_2023_conv.csv"
SAMPLE_TRACES = REPO_ROOT / "sample_traces"


def write(tmp_path: Path, text: str, name: str = "trace.jsonl") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def line(**fields) -> str:
    record = {"timestamp": 0.0, "input_length": 100, "output_length": 10} | fields
    return json.dumps({key: value for key, value in record.items() if value is not None})


# --- native JSONL -----------------------------------------------------------------------------


def test_native_jsonl_sorted_rebased_with_defaults_and_prefixes():
    trace = load_trace(DATA / "native.jsonl")
    assert trace.format == "jsonl"
    assert trace.source == str(DATA / "native.jsonl")
    assert trace.notes == ()
    assert trace.requests == (
        Request("2", 0.0, 50, 5),
        Request("a", 0.5, 100, 20, prompt="hello"),
        Request("7", 2.25, 3000, 64, prefix_id="sys", num_prefix_tokens=1024),
        Request("d", 2.25, 2000, 32, prefix_id="sys", num_prefix_tokens=1024),
    )


def test_time_unit_ms_scales_native_timestamps():
    trace = load_trace(DATA / "native.jsonl", time_unit="ms")
    assert [req.arrival_s for req in trace.requests] == [0.0, 0.0005, 0.00225, 0.00225]


def test_native_timestamps_that_look_like_ms_get_a_note(tmp_path):
    path = write(tmp_path, "\n".join(line(request_id=idx, timestamp=idx * 250) for idx in range(4)))
    trace = load_trace(path)
    assert [req.arrival_s for req in trace.requests] == [0.0, 250.0, 500.0, 750.0]
    assert len(trace.notes) == 1 and "--time-unit ms" in trace.notes[0]
    assert load_trace(path, time_unit="s").notes == ()


def test_max_requests_keeps_the_first_by_arrival():
    trace = load_trace(DATA / "native.jsonl", max_requests=2)
    assert [req.request_id for req in trace.requests] == ["2", "a"]


def test_loading_20k_lines(tmp_path):
    path = write(tmp_path, "\n".join(line(request_id=idx, timestamp=idx * 0.01) for idx in range(20_000)))
    trace = load_trace(path)
    assert len(trace.requests) == 20_000
    assert trace.requests[-1].arrival_s == pytest.approx(199.99)


# --- Mooncake ---------------------------------------------------------------------------------


def test_mooncake_derives_prefixes_from_hash_ids():
    trace = load_trace(DATA / "mooncake.jsonl")
    assert trace.format == "mooncake"
    assert any("milliseconds" in note for note in trace.notes)
    assert trace.requests == (
        Request("1", 0.0, 1200, 10),
        Request("2", 0.25, 1100, 20, prefix_id="mc:1-2", num_prefix_tokens=1024),
        Request("3", 0.5, 2000, 30, prefix_id="mc:1-2-3", num_prefix_tokens=1536),
        Request("4", 1.5, 300, 40),
    )


def test_mooncake_prefix_capped_below_the_prompt_gets_its_own_id(tmp_path):
    path = write(tmp_path, "\n".join([
        line(hash_ids=[1, 2, 3], input_length=1200),
        line(hash_ids=[1, 2, 3], input_length=1200, timestamp=1),
        line(hash_ids=[1, 2], input_length=1024, timestamp=2),
        line(hash_ids=[1], input_length=1, timestamp=3),
    ]))
    requests = load_trace(path).requests
    assert [(req.prefix_id, req.num_prefix_tokens) for req in requests] == [
        (None, 0), ("mc:1-2-3@1199", 1199), ("mc:1-2@1023", 1023), (None, 0)]


def test_mooncake_prefixes_follow_arrival_order_not_file_order(tmp_path):
    path = write(tmp_path, "\n".join([
        line(request_id="late", hash_ids=[1, 2, 3], input_length=1500, timestamp=900),
        line(request_id="early", hash_ids=[1, 2, 4], input_length=1500, timestamp=100),
    ]))
    requests = load_trace(path).requests
    assert [(req.request_id, req.prefix_id) for req in requests] == [("early", None), ("late", "mc:1-2")]


def test_mooncake_time_unit_override():
    trace = load_trace(DATA / "mooncake.jsonl", time_unit="s")
    assert [req.arrival_s for req in trace.requests] == [0.0, 250.0, 500.0, 1500.0]
    assert not any("milliseconds" in note for note in trace.notes)


# --- Azure CSV --------------------------------------------------------------------------------


def test_azure_timestamps_keep_all_7_fractional_digits_and_zero_rows_are_counted():
    trace = load_trace(DATA / "azure.csv")
    assert trace.format == "azure"
    assert [req.arrival_s for req in trace.requests] == [0.0, 1e-7, 4.314579, 77.29937]
    assert [req.request_id for req in trace.requests] == ["2", "3", "4", "7"]
    assert [(req.num_prompt_tokens, req.num_output_tokens) for req in trace.requests] == [
        (374, 44), (396, 109), (879, 55), (1020, 129)]
    assert "skipped 2 Azure rows with 0 ContextTokens or 0 GeneratedTokens" in trace.notes


def test_azure_rejects_time_unit():
    with pytest.raises(TraceError, match=r"time unit \(--time-unit\) applies only to jsonl and mooncake"):
        load_trace(DATA / "azure.csv", time_unit="ms")


@pytest.mark.skipif(not AZURE_CONV.exists(), reason="shared Azure trace not present")
def test_full_azure_conv_trace_loads_every_row():
    trace = load_trace(AZURE_CONV)
    # The real trace has no zero-length rows, so nothing is skipped.
    assert len(trace.requests) == 19_366
    assert not any("skipped" in note for note in trace.notes)
    assert trace.requests[1].arrival_s == pytest.approx(4.314579, abs=1e-9)
    assert trace.requests[-1].arrival_s == pytest.approx(3501.721937, abs=1e-9)


# --- ShareGPT ---------------------------------------------------------------------------------


def test_sharegpt_pairs_skips_and_estimates():
    trace = load_trace(DATA / "sharegpt.json")
    assert trace.format == "sharegpt"
    assert trace.requests == (
        Request("c1", 0.0, 2, 1, prompt="12345678"),
        Request("c3", 0.0, 2, 3, prompt="hi there"),
        Request("c1#5", 0.0, 2, 1, prompt="again"),
    )
    assert set(trace.notes) == {
        "ShareGPT lengths estimated at 4 characters per token (no tokenizer given)",
        "ShareGPT has no timestamps: every request arrives at 0 s (closed-loop replay)",
        "skipped 1 ShareGPT entries with fewer than 2 turns",
        "skipped 1 ShareGPT entries without a human turn followed by a gpt turn",
        "skipped 1 ShareGPT entries with an empty prompt or reply",
        "1 duplicate ShareGPT ids made unique as '<id>#<entry index>'",
    }


class CharTokenizer:
    def encode(self, text: str) -> list[int]:
        return [ord(char) for char in text]


def test_sharegpt_uses_the_tokenizer_when_given():
    trace = load_trace(DATA / "sharegpt.json", tokenizer=CharTokenizer(), max_requests=2)
    assert [(req.num_prompt_tokens, req.num_output_tokens) for req in trace.requests] == [(8, 3), (8, 9)]
    assert not any("characters per token" in note for note in trace.notes)


# --- detection and options --------------------------------------------------------------------


@pytest.mark.parametrize("name, expected", [
    ("native.jsonl", "jsonl"), ("mooncake.jsonl", "mooncake"), ("azure.csv", "azure"),
    ("sharegpt.json", "sharegpt"),
])
def test_detect_format(name, expected):
    assert detect_format((DATA / name).read_text()) == expected
    assert load_trace(DATA / name).format == expected


def test_explicit_format_overrides_detection():
    # A Mooncake file read as native JSONL: hash_ids ignored, timestamps in seconds.
    trace = load_trace(DATA / "mooncake.jsonl", format="jsonl")
    assert trace.format == "jsonl"
    assert all(req.prefix_id is None for req in trace.requests)
    assert trace.requests[-1].arrival_s == 1500.0


@pytest.mark.parametrize("options, message", [
    ({"format": "csv"}, r"unknown trace format 'csv'; choose one of auto, jsonl, mooncake, azure, sharegpt"),
    ({"time_unit": "us"}, r"unknown time unit 'us'; choose one of s, ms"),
    ({"max_requests": 0}, r"max_requests \(--max-requests\) must be > 0, got 0"),
])
def test_bad_options(options, message):
    with pytest.raises(TraceError, match=message):
        load_trace(DATA / "native.jsonl", **options)


# --- errors with file and line ----------------------------------------------------------------


def test_truncated_last_line():
    path = DATA / "native_truncated.jsonl"
    with pytest.raises(TraceError, match=rf"^{re.escape(str(path))} line 3: malformed JSON \(truncated line\?\), got '{{\"request_id\""):
        load_trace(path)


@pytest.mark.parametrize("bad_line, message", [
    ('{"timestamp": 1.0, "input_length": 5}', r"line 2: missing field 'output_length', got \['input_length', 'timestamp'\]"),
    (line(output_length=-3), r"line 2: output_length must be > 0, got -3"),
    (line(input_length=0), r"line 2: input_length must be > 0, got 0"),
    (line(input_length="512"), r"line 2: input_length must be an integer, got '512'"),
    (line(input_length=12.5), r"line 2: input_length must be an integer, got 12.5"),
    (line(input_length=True), r"line 2: input_length must be an integer, got True"),
    (line(timestamp="noon"), r"line 2: timestamp must be a finite number, got 'noon'"),
    (line(request_id=[1]), r"line 2: request_id must be a string or an integer, got \[1\]"),
    (line(request_id="2"), r"line 2: duplicate request_id \(first on line 1\), got '2'"),
    (line(prompt=5), r"line 2: prompt must be a string, got 5"),
    (line(prefix_id="p", prefix_length=100), r"line 2: prefix_length must be < input_length \(100\), got 100"),
    (line(prefix_id="p"), r"line 2: missing field 'prefix_length'"),
    (line(prefix_length=10), r"line 2: prefix_length needs a prefix_id, got 10"),
    (line(prefix_id="p", prefix_length=0), r"line 2: prefix_length must be > 0, got 0"),
    ("[1, 2]", r"line 2: expected a JSON object, got '\[1, 2\]'"),
    ("{not json}", r"line 2: malformed JSON \(truncated line\?\), got '{not json}'"),
])
def test_native_line_errors(tmp_path, bad_line, message):
    path = write(tmp_path, line(request_id="2") + "\n" + bad_line + "\n")
    with pytest.raises(TraceError, match=rf"^{re.escape(str(path))} {message}"):
        load_trace(path, format="jsonl")


def test_prefix_length_must_agree_across_lines(tmp_path):
    path = write(tmp_path, "\n".join([
        line(request_id="x", prefix_id="p", prefix_length=10),
        line(request_id="y", prefix_id="p", prefix_length=20, timestamp=1),
    ]))
    with pytest.raises(TraceError, match=rf"^{re.escape(str(path))} line 2: prefix_length of prefix_id 'p' must match line 1 \(10\), got 20"):
        load_trace(path)


def test_mooncake_bad_hash_ids(tmp_path):
    path = write(tmp_path, line(hash_ids=[1]) + "\n" + line(request_id="b", hash_ids=[1, "x"]) + "\n")
    with pytest.raises(TraceError, match=rf"^{re.escape(str(path))} line 2: hash_ids must be a list of integers, got \[1, 'x'\]"):
        load_trace(path)


def test_mooncake_missing_hash_ids(tmp_path):
    path = write(tmp_path, line(hash_ids=[1]) + "\n" + line(request_id="b") + "\n")
    with pytest.raises(TraceError, match=rf"^{re.escape(str(path))} line 2: missing field 'hash_ids'"):
        load_trace(path)


def test_azure_bad_timestamp():
    path = DATA / "azure_bad_timestamp.csv"
    with pytest.raises(TraceError, match=rf"^{re.escape(str(path))} line 4: TIMESTAMP must be a datetime .*, got 'yesterday at noon'"):
        load_trace(path)


@pytest.mark.parametrize("bad_row, message", [
    ("2023-11-16 18:15:47.0000000,12x,5", r"line 3: ContextTokens must be an integer >= 0, got '12x'"),
    ("2023-11-16 18:15:47.0000000,12,-5", r"line 3: GeneratedTokens must be an integer >= 0, got '-5'"),
    ("2023-11-16 18:15:47.0000000,12", r"line 3: GeneratedTokens must be an integer >= 0, got ''"),
    ("2023-11-16 18:15:47.0000000,12,5,9", r"line 3: expected 3 comma-separated fields, got '2023-11-16 18:15:47.0000000,12,5,9'"),
])
def test_azure_row_errors(tmp_path, bad_row, message):
    path = write(tmp_path, f"TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.0000000,10,5\n{bad_row}\n",
                 "trace.csv")
    with pytest.raises(TraceError, match=rf"^{re.escape(str(path))} {message}"):
        load_trace(path)


def test_azure_blank_lines_keep_line_numbers(tmp_path):
    path = write(tmp_path, "TIMESTAMP,ContextTokens,GeneratedTokens\n\n2023-11-16 18:15:46.0,10,5\n\n"
                 "2023-11-16 18:15:47.0,-1,5\n", "trace.csv")
    with pytest.raises(TraceError, match=rf"^{re.escape(str(path))} line 5: ContextTokens must be an integer >= 0, got '-1'"):
        load_trace(path)


def test_azure_missing_column(tmp_path):
    path = write(tmp_path, "TIMESTAMP,ContextTokens,Output\n2023-11-16 18:15:46.0,10,5\n", "trace.csv")
    with pytest.raises(TraceError, match=rf"^{re.escape(str(path))} line 1: a CSV trace is an Azure LLM inference trace with the columns TIMESTAMP, "
                                              "ContextTokens, GeneratedTokens; missing GeneratedTokens in the header"):
        load_trace(path)


@pytest.mark.parametrize("text, message", [
    ('[{"id": 1, "conversations": "hi"}]', r"entry 0: expected an object with a 'conversations' list"),
    ('[{"id": 1, "conversations": [{"from": "human"}, {"from": "gpt", "value": "x"}]}]',
     r"entry 0: each turn needs string 'from' and 'value'"),
    ('[{"id": 1,\n "conversations": [}]', r"line 2: malformed JSON \(Expecting value\), got ' \"conversations\": \[}\]'"),
    ('{"id": 1}', r"ShareGPT trace must be a JSON array, got dict"),
])
def test_sharegpt_errors(tmp_path, text, message):
    path = write(tmp_path, text, "trace.json")
    with pytest.raises(TraceError, match=rf"^{re.escape(str(path))}:? {message}"):
        load_trace(path, format="sharegpt")


def test_missing_file_names_the_path(tmp_path):
    with pytest.raises(TraceError, match=rf"^{re.escape(str(tmp_path / 'nope.jsonl'))}: trace file not found"):
        load_trace(tmp_path / "nope.jsonl")


@pytest.mark.parametrize("text, name", [
    ("", "empty.jsonl"), ("\n  \n", "blank.jsonl"), ("TIMESTAMP,ContextTokens,GeneratedTokens\n", "header.csv"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.0,0,5\n", "zeros.csv"),
    ("[]", "empty.json"), ('[{"id": 1, "conversations": []}]', "short.json"),
])
def test_trace_without_requests_names_the_path(tmp_path, text, name):
    path = write(tmp_path, text, name)
    with pytest.raises(TraceError, match=rf"^{re.escape(str(path))}: trace has no requests"):
        load_trace(path)


def test_binary_file(tmp_path):
    path = tmp_path / "trace.jsonl"
    path.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(TraceError, match=rf"^{re.escape(str(path))}: not a UTF-8 text file"):
        load_trace(path)


def test_request_rejects_inconsistent_prefix_fields():
    with pytest.raises(TraceError, match="num_prefix_tokens must be in"):
        Request("r", 0.0, 10, 1, prefix_id="p", num_prefix_tokens=10)
    with pytest.raises(TraceError, match="prefix_id and num_prefix_tokens go together"):
        Request("r", 0.0, 10, 1, prefix_id="p")


# --- the sample traces ------------------------------------------------------------------------


@pytest.mark.parametrize("name, fmt, num_requests, num_prefixed", [
    ("azure_conv_sample.csv", "azure", 240, 0),
    ("longbench_like.jsonl", "jsonl", 24, 0),
    ("shared_prefix.jsonl", "jsonl", 64, 56),
])
def test_sample_traces_load(name, fmt, num_requests, num_prefixed):
    trace = load_trace(SAMPLE_TRACES / name)
    assert (trace.format, len(trace.requests)) == (fmt, num_requests)
    assert sum(req.prefix_id is not None for req in trace.requests) == num_prefixed


@pytest.mark.skipif(not AZURE_CONV.exists(), reason="shared Azure trace not present")
def test_sample_trace_script_rewrites_identical_bytes(tmp_path, capsys):
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_sample_traces", REPO_ROOT / "scripts" / "make_sample_traces.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    script.main(["--out-dir", str(tmp_path), "--examples-dir", str(tmp_path), "--azure-source", str(AZURE_CONV)])
    for name in ("azure_conv_sample.csv", "longbench_like.jsonl", "shared_prefix.jsonl"):
        assert (tmp_path / name).read_bytes() == (SAMPLE_TRACES / name).read_bytes(), name
    validation = REPO_ROOT / "examples" / "validation_trace.jsonl"
    assert (tmp_path / validation.name).read_bytes() == validation.read_bytes()
    printed = capsys.readouterr().out
    readme = (SAMPLE_TRACES / "README.md").read_text()
    for stats in ("240 requests over 41.9 s (5.73 req/s)", "24 requests over 115.7 s (0.21 req/s)",
                  "64 requests over 32.2 s (1.98 req/s)"):
        assert stats in printed and stats in readme


# --- the model's context, and a file of another format --------------------------------------


def test_within_context_skips_longer_requests_with_a_note(tmp_path):
    path = write(tmp_path, "\n".join([line(request_id="a", input_length=90, output_length=10),
                                      line(request_id="b", timestamp=1, input_length=95, output_length=10),
                                      line(request_id="c", timestamp=2, input_length=20, output_length=5)]))
    trace = load_trace(path)
    assert within_context(trace, None) is trace and within_context(trace, 105) is trace
    kept = within_context(trace, 100)
    assert [r.request_id for r in kept.requests] == ["a", "c"]
    assert kept.notes == ("1 request longer than the model's context of 100 tokens skipped",)
    with pytest.raises(TraceError, match=r"every request is longer than the model's context of 10 tokens"):
        within_context(trace, 10)


def test_a_csv_with_other_columns_names_the_expected_ones(tmp_path):
    path = write(tmp_path, "a,b,c\n1,2,3\n", "trace.csv")
    assert detect_format(path.read_text()) == "azure"
    with pytest.raises(TraceError, match=rf"^{re.escape(str(path))} line 1: .*columns TIMESTAMP, ContextTokens, "
                                         r"GeneratedTokens; missing TIMESTAMP, ContextTokens, GeneratedTokens"):
        load_trace(path)


@pytest.mark.parametrize("name, text, guessed", [
    ("trace.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.0,10,5\n", "azure"),
    ("trace.json", '[\n{"conversations": []}\n]', "sharegpt"),
])
def test_jsonl_format_on_another_format_says_which(tmp_path, name, text, guessed):
    path = write(tmp_path, text, name)
    with pytest.raises(TraceError, match=rf"^{re.escape(str(path))} line 1: not JSON, so not a JSONL trace .*"
                                         rf"read it with format '{guessed}' or 'auto'"):
        load_trace(path, "jsonl")
