"""`vtoken compare --executor hf` through typer's CliRunner, on a tiny model built offline."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from vtoken.compare import CompareOptions, compare, num_progress_units
from vtoken.replay import make_replayer
from vtoken.models import load_model
from vtoken.models.tiny import build_tiny_model
from vtoken.trace import load_trace
from vtoken_cli.app import app
from vtoken_cli.options import build_experiment

runner = CliRunner()


pytestmark = pytest.mark.usefixtures("one_torch_thread")
TRACE_LINES = (
    '{"request_id": "a", "timestamp": 0, "input_length": 20, "output_length": 20, "prompt": "the lazy dog sleeps"}',
    '{"request_id": "b", "timestamp": 0, "input_length": 120, "output_length": 20}',
    '{"request_id": "c", "timestamp": 0, "input_length": 100, "output_length": 20}',
)
OPTIONS = ("--executor", "hf", "--concurrency", "2", "--block-size", "4", "--eviction-interval", "6", "--budget", "70%",
           "--theta-f", "0.05", "--policy", "random")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_cli")
    trace = root / "short.jsonl"
    trace.write_text("\n".join(TRACE_LINES) + "\n")
    return trace, build_tiny_model(root / "tiny")


def flat(text: str) -> str:
    """The terminal's text with panel borders and line breaks as single spaces (values wrap)."""
    return " ".join(text.replace("│", " ").split())


def invoke(*args: str):
    return runner.invoke(app, ["compare", *args])


def test_json_reports_measured_speed_quality_and_memory(setup):
    trace, model_dir = setup
    result = invoke(str(trace), *OPTIONS, "--model", str(model_dir), "--json")  # default: 3 rounds, 1 warm-up
    assert result.exit_code == 0, result.output
    printed = json.loads(result.stdout)
    assert printed["config"]["executor"] == "hf"
    assert printed["sweep"] == [] and printed["sla"] is None and printed["frontier"] is None
    hf = printed["hf"]
    assert set(hf["speed"]) == {"native", "naive-evict", "vtoken"}
    assert hf["speed"]["native"]["ratio_to_native"] == 1.0
    assert all(s["tok_s"] > 0 and s["per_token_latency_s"] > 0 for s in hf["speed"].values())
    assert set(hf["quality"]) == {"naive-evict", "vtoken"}
    assert hf["naive_vs_vtoken"]["num_identical"] == 3
    # a measurement: warm-up dropped, the variants rotated over the rounds, every figure's spread
    variants = ["native", "naive-evict", "vtoken"]
    assert hf["rounds"] == {"num_rounds": 3, "num_warmup": 1, "order": [variants, variants[1:] + variants[:1],
                                                                          variants[2:] + variants[:2]]}
    assert set(hf["spread"]) == set(variants) and set(hf["shown_round"]) == set(variants)
    for variant, figures in hf["spread"].items():
        assert {"throughput_tok_s", "latency_p95_s", "ttft_p95_s", "tpot_p50_s", "tok_s", "ratio_to_native"} <= set(figures)
        for figure in figures.values():
            assert len(figure["values"]) == 3
            assert figure["min"] == min(figure["values"]) and figure["max"] == max(figure["values"])
        # the variant's figures are those of its round of median throughput
        shown = hf["shown_round"][variant]
        assert printed["variants"][variant]["throughput_tok_s"] == figures["throughput_tok_s"]["values"][shown]
        assert figures["throughput_tok_s"]["median"] == printed["variants"][variant]["throughput_tok_s"]
        assert hf["speed"][variant]["tok_s"] == figures["tok_s"]["values"][shown]
    assert hf["spread"]["native"]["ratio_to_native"]["values"] == [1.0] * 3  # each round against its own native
    assert "not Naive-Evict's" in hf["naive_evict_speed"] and "live slots" in hf["naive_evict_speed"]
    notes = " ".join(printed["trace"]["notes"])
    assert "2 of 3 requests have no prompt text" in notes and "sweep" in notes
    # the eviction decisions and relocations are deterministic: the library gives the same
    config = build_experiment(model=str(model_dir), gpu="h100-80gb", num_blocks=None, gpu_mem_util=0.9, block_size=4,
                              policy="random", budget="70%", eviction_interval=6, reclaim_mode="hole-fill", theta_f=0.05,
                              seed=0, sim_profile=None)
    options = CompareOptions((1,), concurrency=2, rounds=1, warmup=0)
    replayer = make_replayer("hf", model=load_model(str(model_dir)))
    units = []
    report = compare(load_trace(trace), config, options, replayer, lambda stage, n: units.append((stage, n)))
    assert report.measured.rounds.order == (tuple(variants),) and report.measured.rounds.num_warmup == 0
    assert sum(n for _, n in units) == num_progress_units(load_trace(trace), options, replayer) == 3 * 60
    assert {stage for stage, _ in units} == {f"{v} (tiny, round 1)" for v in variants}
    for variant, run in report.runs.items():
        assert printed["variants"][variant]["tokens_evicted"] == run.tokens_evicted
        assert printed["variants"][variant]["tokens_moved"] == run.tokens_moved
    assert printed["variants"]["vtoken"]["tokens_moved"] > 0


def test_table_output_and_output_dir(setup, tmp_path):
    trace, model_dir = setup
    result = invoke(str(trace), *OPTIONS, "--model", str(model_dir), "--rounds", "2", "--warmup", "2",
                    "--output", str(tmp_path / "out"))
    assert result.exit_code == 0, result.output
    for text in ("hf executor", "Measured on the model", "naive-evict vs vtoken", "Memory", "Performance",
                 "2 rounds after 2 warm-up replays of each variant, dropped", "[min-max] over 2 rounds",
                 "not Naive-Evict's"):
        assert text in flat(result.stdout), text
    assert "order: native, naive-evict, vtoken; naive-evict, vtoken, native" in flat(result.stdout)
    assert {"report.json", "variants.csv", "utilization_histograms.png"} <= {p.name for p in (tmp_path / "out").iterdir()}


@pytest.mark.parametrize("extra, message", [
    (("--repeats", "2"), "--repeats applies to the sim executor"),
    (("--model", "no-such-model-dir"), "unknown model"),
    (("--executor", "vllm-ish"), "unknown executor"),
    (("--rounds", "0"), "--rounds must be > 0"),
    (("--warmup", "-1"), "--warmup >= 0"),
])
def test_bad_input_is_one_line_and_exit_2(setup, extra, message):
    trace, model_dir = setup
    result = invoke(str(trace), *OPTIONS, "--model", str(model_dir), *extra)
    assert result.exit_code == 2
    assert message in result.output
    assert "Traceback" not in result.output
