"""`compare --executor vllm` as a library call: three variants replayed on vLLM, measured."""

from __future__ import annotations

import io
import json
from dataclasses import replace

import pytest

from tests.vllm_tier.conftest import VLLM_MISSING, VLLM_PROBE

pytest.importorskip(VLLM_PROBE, reason=VLLM_MISSING)

from vtoken.compare import CompareOptions, report_to_json  # noqa: E402
from vtoken.engine.config import EvictionConfig, RunConfig  # noqa: E402
from vtoken.engine.vllm.run import compare_vllm  # noqa: E402
from vtoken.hardware import resolve_gpu  # noqa: E402
from vtoken.kv.reclaim import ReclaimConfig  # noqa: E402
from vtoken.model_spec import resolve_model  # noqa: E402
from vtoken.policies.base import Budget  # noqa: E402
from vtoken.trace import load_trace  # noqa: E402
from vtoken_cli.render.compare import compare_report  # noqa: E402
from rich.console import Console  # noqa: E402

LENGTHS = [(60, 40), (90, 50), (40, 60), (120, 30), (70, 45), (50, 55)]


@pytest.fixture()
def trace(tmp_path):
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps({"timestamp": i, "input_length": p, "output_length": o}) + "\n"
                            for i, (p, o) in enumerate(LENGTHS)))
    return load_trace(path, "auto")


def test_three_variants_on_vllm(trace, tiny_model_dir):
    config = RunConfig(
        variant="vtoken", model=resolve_model("smollm2-135m"), gpu=resolve_gpu("h100-80gb"), num_blocks=16,
        block_size=32, eviction=EvictionConfig("streaming_llm", Budget(num_tokens=48, num_recent_tokens=16), 8),
        reclaim=ReclaimConfig(theta_f=0.05, check_interval_steps=1), concurrency=3)
    report = compare_vllm(trace, config, CompareOptions((3,)), tiny_model_dir)
    runs = report.runs
    assert set(runs) == {"native", "naive-evict", "vtoken"}
    assert all(r.num_completed == len(LENGTHS) for r in runs.values())
    assert runs["native"].tokens_evicted == 0
    assert runs["vtoken"].tokens_evicted == runs["naive-evict"].tokens_evicted > 0
    # same decisions, different memory: vtoken holds the fewest blocks, naive-evict sits in between
    assert runs["vtoken"].waste_ratio < runs["naive-evict"].waste_ratio
    assert runs["vtoken"].peak_allocated_blocks <= runs["naive-evict"].peak_allocated_blocks <= runs["native"].peak_allocated_blocks
    payload = report_to_json(report)
    assert payload["config"]["executor"] == "vllm" and payload["config"]["num_blocks"] == 16
    assert payload["variants"]["vtoken"]["tokens_moved"] > 0
    # the CLI's renderer takes the report as it takes a sim report without sweep and frontier
    console = Console(file=io.StringIO(), width=160)
    console.print(compare_report(report, False))
    assert "vtoken" in console.file.getvalue()


def test_check_invariants_on_vllm(trace, tiny_model_dir):
    from vtoken.engine.vllm.run import check_invariants_on_vllm

    config = RunConfig(
        variant="vtoken", model=resolve_model("smollm2-135m"), gpu=resolve_gpu("h100-80gb"), num_blocks=16,
        block_size=32, eviction=EvictionConfig("h2o", Budget(num_tokens=48, num_recent_tokens=16), 8),
        reclaim=ReclaimConfig(theta_f=0.05, check_interval_steps=1), concurrency=3)
    short = replace(trace, requests=trace.requests[:4])
    report = check_invariants_on_vllm(short, config, tiny_model_dir)
    assert set(report.runs) == {"naive-evict/hole-fill", "naive-evict/ordered", "vtoken/hole-fill", "vtoken/ordered"}
    assert report.num_evictions_checked > 0 and report.num_copies_verified > 0
    assert all(r["invariant_violations"] == 0 for r in report.runs.values())
