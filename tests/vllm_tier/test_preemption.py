"""Preemption (recompute) and finish with a pool too small for three requests at once.

A preempted request's table is dropped with its blocks; on resume vLLM recomputes all its
tokens and the tracker evicts the same tokens again before the next decode, so the outputs
still match the reference (rows before the resume length see every token, as the recompute did).
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.vllm_tier.conftest import VLLM_MISSING, VLLM_PROBE, prompts

pytest.importorskip(VLLM_PROBE, reason=VLLM_MISSING)

from vtoken.engine.vllm.engine import EngineSpec, generate, open_llm, scheduler_of  # noqa: E402
from vtoken.engine.vllm.reference import reference_logprobs  # noqa: E402
from vtoken.engine.vllm.settings import settings_from_additional_config  # noqa: E402

NUM_BLOCKS = 6  # 5 usable blocks of 32 tokens (vLLM keeps one null block); three requests need 9 to 13


def settings(variant: str, policy: str = "streaming_llm"):
    return settings_from_additional_config({"vtoken": {
        "variant": variant, "policy": policy, "budget": 64, "num_sink_tokens": 4, "num_recent_tokens": 16,
        "interval_tokens": 8, "theta_f": 0.01, "check_invariants": True}})


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    spec = EngineSpec(tiny_model_dir, num_gpu_blocks_override=NUM_BLOCKS, max_model_len=32 * (NUM_BLOCKS - 1))
    with open_llm(spec, settings("vtoken"), record_events=True) as engine:
        yield engine


@pytest.mark.parametrize("variant, policy", [
    ("native", "streaming_llm"), ("naive-evict", "streaming_llm"), ("vtoken", "streaming_llm"), ("vtoken", "h2o"),
])
def test_preempted_requests_resume_with_the_same_evictions(llm, reference_model, variant, policy):
    scheduler = scheduler_of(llm)
    scheduler.reconfigure(settings(variant, policy))
    generations = generate(llm, prompts(), 48)
    tracker = scheduler.vtoken
    assert tracker.counters.preemptions > 0, "the pool should have forced a preemption"
    for g in generations:
        expected = reference_logprobs(reference_model, g.prompt_ids, g.token_ids, g.events)
        error = np.abs(np.array(g.logprobs) - expected).max()
        assert error < 1e-6, f"{variant}/{policy}: max |log p - reference| = {error:.2e}"
    if variant != "native":
        assert any(e.is_resume for g in generations for e in g.events), "a request lost tokens before its preemption"
    assert not tracker.requests and tracker.ledger.num_free_blocks == tracker.ledger.num_blocks
    pool = scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1  # every block back but the null block


def test_a_replay_counts_each_requests_preemptions(llm, tiny_model_dir):
    from vtoken.engine import Experiment
    from vtoken.engine.vllm.run import replay
    from vtoken.hardware import resolve_gpu
    from vtoken.model_spec import model_spec_from_hf_config
    from vtoken.trace import Request

    model = model_spec_from_hf_config(tiny_model_dir)
    experiment = Experiment(model, resolve_gpu("h100"), num_blocks=NUM_BLOCKS, block_size=32)
    requests = [Request(f"r{i}", 0.0, 40 + 8 * i, 48) for i in range(3)]
    result = replay(llm, experiment.run("native", 3), requests)
    per_request = [record.num_preemptions for record in result.requests]
    assert len(per_request) == 3 and all(isinstance(n, int) for n in per_request)
    assert sum(per_request) == result.preemptions > 0, "the pool should have forced a preemption"
