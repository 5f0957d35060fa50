"""A `vllm bench serve --save-result --save-detailed` result as a trace and as measurements.

The fixture is a real run (vLLM 0.32 CPU, SmolLM2-135M-Instruct, random dataset, 24 prompts,
2 requests/s, max concurrency 4; `scripts/vllm_bench_serve.py`). The summary figures vLLM
printed for it are in the file too; the per-request reader must agree with them.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from vtoken.errors import TraceError
from vtoken.trace import detect_format, load_trace
from vtoken.vllm_bench import load_bench_result

FIXTURE = Path(__file__).parent / "data" / "vllm-0.32-bench-serve.json"
RAW = json.loads(FIXTURE.read_text())


def test_the_fixture_is_a_trace_by_autodetection():
    trace = load_trace(FIXTURE)
    assert trace.format == "vllm-bench" and len(trace.requests) == 24
    by_idx = {int(r.request_id): r for r in trace.requests}
    assert [by_idx[i].num_prompt_tokens for i in range(24)] == RAW["input_lens"]
    assert [by_idx[i].num_output_tokens for i in range(24)] == RAW["output_lens"]
    assert by_idx[0].num_prompt_tokens == 87 and by_idx[0].num_output_tokens == 14
    # arrivals: the client's send times, rebased to the first, in arrival order
    starts = np.asarray(RAW["start_times"])
    assert [r.arrival_s for r in trace.requests] == pytest.approx(sorted(starts - starts.min()))
    assert trace.requests[0].arrival_s == 0.0 and trace.requests[1].arrival_s == pytest.approx(0.48967716500010283)
    assert any("arrivals are when the client sent" in n for n in trace.notes)
    assert load_trace(FIXTURE, "vllm-bench").requests == trace.requests
    assert len(load_trace(FIXTURE, max_requests=5).requests) == 5


def test_the_measured_side_agrees_with_what_vllm_printed():
    result = load_bench_result(str(FIXTURE))
    assert len(result.requests) == 24 and result.num_failed == 0
    assert result.model_id == "smollm2" and result.max_concurrency == 4 and result.request_rate == 2.0
    first = result.requests[0]
    assert first.ttft_s == RAW["ttfts"][0] == pytest.approx(10.534911464999823)
    assert first.e2e_s == RAW["latencies"][0] and len(first.itls_s) == first.num_output_tokens - 1 == 13
    assert first.tpot_s == pytest.approx((first.e2e_s - first.ttft_s) / 13)
    figures = result.figures()
    # vLLM's own summary (milliseconds, the same requests): medians of TTFT and TPOT
    assert figures["ttft_p50_s"] * 1000 == pytest.approx(RAW["median_ttft_ms"])
    assert figures["tpot_p50_s"] * 1000 == pytest.approx(RAW["median_tpot_ms"])
    assert figures["ttft_p95_s"] == pytest.approx(np.percentile(RAW["ttfts"], 95))
    assert figures["latency_p95_s"] == pytest.approx(np.percentile(RAW["latencies"], 95))
    # throughput over vtoken's makespan (first sent to last finished), a little under vLLM's duration
    assert result.makespan_s <= result.duration_s
    assert figures["throughput_tok_s"] == pytest.approx(RAW["total_output_tokens"] / result.makespan_s)
    assert set(figures) == {"throughput_tok_s", "ttft_p50_s", "ttft_p95_s", "tpot_p50_s", "tpot_p95_s",
                            "latency_p50_s", "latency_p95_s"}


def test_failed_requests_are_left_out_with_a_note(tmp_path):
    raw = dict(RAW, output_lens=[0, *RAW["output_lens"][1:]], errors=["timeout", *RAW["errors"][1:]])
    path = tmp_path / "failed.json"
    path.write_text(json.dumps(raw))
    result = load_bench_result(str(path))
    assert result.num_failed == 1 and [r.request_idx for r in result.requests] == list(range(1, 24))
    assert result.requests[0].start_s == 0.0  # rebased to the first request that succeeded
    assert any("1 failed benchmark request left out" in n for n in load_trace(path).notes)


def test_a_pretty_printed_result_is_detected_too(tmp_path):
    path = tmp_path / "indented.json"
    path.write_text(json.dumps(RAW, indent=2))
    assert detect_format(path.read_text()) == "vllm-bench"
    assert len(load_trace(path).requests) == 24


@pytest.mark.parametrize("change, message", [
    ({"input_lens": None}, "input_lens must be a list"),
    ({"latencies": RAW["latencies"][:3]}, "per-request lists of different lengths: input_lens 24, latencies 3"),
    ({"ttfts": [float("nan")] * 24}, "ttfts[0] must be a finite number >= 0"),
    ({"output_lens": [1.5] * 24}, "output_lens[0] must be an integer >= 0, got 1.5"),
])
def test_bad_fields_name_the_field_and_index(tmp_path, change, message):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({**RAW, **change}))
    with pytest.raises(TraceError, match=f"^{path}: ") as caught:
        load_bench_result(str(path))
    assert message in str(caught.value)


def test_a_json_object_of_another_kind_is_not_a_bench_result(tmp_path):
    path = tmp_path / "other.json"
    path.write_text(json.dumps({"timestamp": 0, "input_length": 5, "output_length": 5}))
    assert detect_format(path.read_text()) == "jsonl"
    with pytest.raises(TraceError, match="not a vllm bench serve result: no input_lens"):
        load_bench_result(str(path))
