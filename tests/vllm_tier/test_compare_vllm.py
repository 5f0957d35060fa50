"""`compare` and `check_invariants` on vLLM as library calls: three variants replayed on vLLM,
measured; the checks inside vLLM reported as every executor's are."""

from __future__ import annotations

import io
import json
from dataclasses import replace

import pytest

from tests.vllm_tier.conftest import VLLM_MISSING, VLLM_PROBE

pytest.importorskip(VLLM_PROBE, reason=VLLM_MISSING)

from vtoken.checker import CheckOptions, TraceLimits, check_invariants  # noqa: E402
from vtoken.checker.vllm import VLLM_NO_I4  # noqa: E402
from vtoken.compare import CompareOptions, compare, report_to_json  # noqa: E402
from vtoken.engine.experiment import EvictionConfig, Experiment  # noqa: E402
from vtoken.replay import make_replayer  # noqa: E402
from vtoken.hardware import resolve_gpu  # noqa: E402
from vtoken.kv.reclaim import ReclaimConfig  # noqa: E402
from vtoken.model_spec import resolve_model  # noqa: E402
from vtoken.policies.base import Budget  # noqa: E402
from vtoken.trace import load_trace  # noqa: E402
from vtoken_cli.render.compare import compare_report, hf_report  # noqa: E402
from rich.console import Console  # noqa: E402

LENGTHS = [(60, 40), (90, 50), (40, 60), (120, 30), (70, 45), (50, 55)]


@pytest.fixture()
def trace(tmp_path):
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps({"timestamp": i, "input_length": p, "output_length": o}) + "\n"
                            for i, (p, o) in enumerate(LENGTHS)))
    return load_trace(path, "auto")


def test_three_variants_on_vllm(trace, tiny_model_dir):
    experiment = Experiment(
        model=resolve_model("smollm2-135m"), gpu=resolve_gpu("h100-80gb"), num_blocks=16,
        block_size=32, eviction=EvictionConfig("streaming_llm", Budget(num_tokens=48, num_recent_tokens=16), 8),
        reclaim=ReclaimConfig(theta_f=0.05, check_interval_steps=1))
    progress = []
    report = compare(trace, experiment, CompareOptions((3,), concurrency=3, rounds=2, warmup=1),
                     make_replayer("vllm", model=tiny_model_dir), lambda stage, n: progress.append(stage))
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
    assert report.measured.engine == "vllm" and set(payload["vllm"]["speed"]) == set(runs)
    # a measurement: one warm-up replay of each variant (dropped), then two rounds, rotated
    variants = ["native", "naive-evict", "vtoken"]
    assert payload["vllm"]["rounds"] == {"num_rounds": 2, "num_warmup": 1,
                                         "order": [variants, ["naive-evict", "vtoken", "native"]]}
    assert list(dict.fromkeys(progress)) == [f"{v} (vllm, warm-up)" for v in variants] + [
        f"{v} (vllm, round {r})" for r, order in ((1, variants), (2, variants[1:] + variants[:1])) for v in order]
    for variant, figures in payload["vllm"]["spread"].items():
        shown = payload["vllm"]["shown_round"][variant]
        assert len(figures["throughput_tok_s"]["values"]) == 2
        assert figures["throughput_tok_s"]["values"][shown] == payload["variants"][variant]["throughput_tok_s"]
        assert figures["tokens_moved"]["min"] == figures["tokens_moved"]["max"]  # the same decisions every round
    # naive-evict inside vLLM compacts like vtoken (it moves the same tokens): its speed is not Naive-Evict's
    assert runs["naive-evict"].tokens_moved == runs["vtoken"].tokens_moved > 0
    assert "compacts like vtoken" in payload["vllm"]["naive_evict_speed"]
    assert report.sweep == () and report.frontier is None and any("skipped" in n for n in report.trace.notes)
    # the scheduler limits vLLM ran with are those --json states: none given, vLLM's own on this machine
    from vtoken.engine.batch_limits import engine_batch_defaults

    engine = engine_batch_defaults()
    scheduler = payload["config"]["scheduler"]
    assert (scheduler["max_num_batched_tokens"], scheduler["max_num_seqs"]) == \
        (engine.max_num_batched_tokens, engine.max_num_seqs)
    assert any(n.startswith("scheduler: max_num_batched_tokens") for n in report.trace.notes), \
        report.trace.notes
    # the CLI's renderer takes the report as it takes a sim report without sweep and frontier
    console = Console(file=io.StringIO(), width=160)
    console.print(compare_report(report, False))
    assert "vtoken" in console.file.getvalue()
    console = Console(file=io.StringIO(), width=80)
    console.print(hf_report(report, False))
    text = " ".join(console.file.getvalue().replace("│", " ").split())
    assert "2 rounds after 1 warm-up replay of each variant, dropped" in text and "compacts like vtoken" in text
    assert "[min-max] over 2 rounds" in text


def test_check_invariants_on_vllm(trace, tiny_model_dir):
    experiment = Experiment(
        model=resolve_model("smollm2-135m"), gpu=resolve_gpu("h100-80gb"), num_blocks=16,
        block_size=32, eviction=EvictionConfig("h2o", Budget(num_tokens=48, num_recent_tokens=16), 8),
        reclaim=ReclaimConfig(theta_f=0.05, check_interval_steps=1))
    short = replace(trace, requests=trace.requests[:4])
    options = CheckOptions(policies=("h2o",), executor="vllm", limits=TraceLimits(None, None, None), concurrency=3)
    report = check_invariants([short], experiment, options, model=tiny_model_dir)
    assert [(r.scenario, r.reclaim_mode) for r in report.runs] == [
        ("trace.jsonl naive-evict", "hole-fill"), ("trace.jsonl naive-evict", "ordered"),
        ("trace.jsonl vtoken", "hole-fill"), ("trace.jsonl vtoken", "ordered")]
    assert report.passed and report.relocation_events > 0
    assert all(report.tallies[name].checked > 0 for name in ("I1", "I2", "I3")) and report.tallies["I4"].checked == 0
    assert VLLM_NO_I4 in report.notes and report.base.block_size == 32 and report.runs[0].num_blocks == 16
