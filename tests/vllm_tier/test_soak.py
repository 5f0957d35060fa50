"""A bounded soak: a plain vLLM launch with vToken, prefix caching on, a pool small enough to
force preemption, 24 streaming clients for 60 s with a quarter of them disconnecting mid-stream
(StreamingLLM keeping 75%, shared-prefix protection).

Every request completes or is aborted by its client (none lost, none hung), the server stays
up, `vtoken_invariant_violations_total` stays 0, and once the load stops every block is back
in the free pool (`vllm:kv_cache_usage_perc` 0) and vToken holds no token table. Run with `-s`
to see the load held (the README quotes it).
"""

from __future__ import annotations

import json
import sys
import time

import pytest

from tests.vllm_tier.conftest import VLLM_MISSING, VLLM_PROBE

pytest.importorskip(VLLM_PROBE, reason=VLLM_MISSING)
pytest.importorskip("httpx")

from tests.vllm_tier.soak import Load, run_load  # noqa: E402
from tests.vllm_tier.test_plugin import server_env  # noqa: E402
from tests.vllm_tier.test_serve import free_port, get, launched  # noqa: E402
from vtoken.endpoint import scrape  # noqa: E402

LOAD = Load(output_tokens=(32, 160))
# 640 tokens for up to 16 running requests of 112-176 prompt tokens that keep 75% as they grow: preemption
NUM_BLOCKS = 20
SETTINGS = {"policy": "streaming_llm", "budget": "75%", "num_recent_tokens": 16, "interval_tokens": 8,
            "theta_f": 0.01, "prefix_protection": "shared"}
DRAIN_TIMEOUT_S = 180


@pytest.fixture(scope="module")
def soak_server(tiny_model_dir, tmp_path_factory):
    port = free_port()
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", tiny_model_dir, "--host",
            "127.0.0.1", "--port", str(port), "--dtype", "float32", "--enforce-eager", "--block-size", "32",
            "--kv-cache-memory-bytes", str(8 << 20), "--num-gpu-blocks-override", str(NUM_BLOCKS),
            "--max-model-len", "512", "--max-num-seqs", "16",
            "--additional-config", json.dumps({"vtoken": SETTINGS})]
    with launched(argv, port, tmp_path_factory.mktemp("soak") / "server.log", server_env()) as base_url:
        yield base_url


def drained(base_url: str):
    """The server's state once nothing runs or waits and the pool is empty (or at the deadline)."""
    deadline = time.monotonic() + DRAIN_TIMEOUT_S
    while True:
        live = scrape(base_url)
        metrics = live.metrics
        idle = metrics.num_requests_running == 0 and metrics.num_requests_waiting == 0
        if (idle and metrics.kv_cache_usage == 0.0) or time.monotonic() > deadline:
            return live
        time.sleep(1)


@pytest.mark.timeout(1500)
def test_streaming_clients_disconnects_and_preemption_leave_nothing_behind(soak_server, tiny_model_dir):
    started = time.monotonic()
    tally = run_load(soak_server, tiny_model_dir, LOAD)
    elapsed_s = time.monotonic() - started
    live = drained(soak_server)
    metrics = live.metrics
    vtoken = metrics.vtoken_metrics
    (engine,) = metrics.engines
    print(f"\nsoak: {tally.summary(elapsed_s)}; server: {metrics.num_preemptions:.0f} preemptions, "
          f"{engine.num_prefix_cache_hits:.0f} of {engine.num_prefix_cache_queries:.0f} prompt tokens hit the prefix "
          f"cache, {vtoken['vtoken_tokens_evicted_total']:.0f} tokens evicted, "
          f"{vtoken['vtoken_tokens_moved_total']:.0f} moved, {vtoken['vtoken_blocks_reclaimed_total']:.0f} blocks "
          f"reclaimed, {vtoken['vtoken_invariant_violations_total']:.0f} invariant violations")

    assert tally.failures == [] and tally.num_hung == 0
    assert tally.num_ended == tally.num_started
    assert tally.num_completed > 0 and tally.num_disconnected > 0  # how many depends on the machine
    get(f"{soak_server}/health")  # still up
    assert metrics.kv_cache_usage == 0.0, "blocks are still held after the load stopped"
    assert metrics.num_requests_running == 0 and metrics.num_requests_waiting == 0
    assert vtoken["vtoken_invariant_violations_total"] == 0
    assert metrics.num_preemptions > 0, "the pool should have been small enough to preempt"
    assert engine.num_prefix_cache_hits > 0 and vtoken["vtoken_tokens_evicted_total"] > 0
    assert not any(k.startswith("vtoken_running_requests") and v for k, v in vtoken.items()), \
        "vToken still holds a token table"
    # the server saw every request: those it ran to length are ours, plus disconnects that came too late
    num_length = engine.num_requests_by_reason.get("length", 0)
    assert tally.num_completed <= num_length <= tally.num_completed + tally.num_disconnected
