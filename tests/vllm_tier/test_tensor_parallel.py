"""vToken on two tensor-parallel CPU ranks (gloo): one scheduler-side token table, one copy plan
applied by every rank to its own shard of heads, and H2O's attention rows summed over the ranks
before the policy ranks tokens.

The tiny Llama has 4 query and 2 KV heads: each rank holds 2 and 1. Its logprobs are held to
the transformers reference with the evictions the run made, and the rows the scheduler ranks
on must sum to every head of every layer (one rank's rows would sum to half).
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from tests.vllm_tier.conftest import VLLM_MISSING, VLLM_PROBE, prompts

pytest.importorskip(VLLM_PROBE, reason=VLLM_MISSING)

from vtoken.engine.vllm.engine import EngineSpec, generate, open_llm, scheduler_of  # noqa: E402
from vtoken.engine.vllm.reference import reference_logprobs  # noqa: E402
from vtoken.engine.vllm.settings import settings_from_additional_config  # noqa: E402

TOLERANCE = 1e-5  # fp32; the all-reduce of the two ranks' partial outputs sums in another order
MAX_TOKENS = 32

pytestmark = pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="two tensor-parallel ranks need two cores")


def settings(policy: str):
    return settings_from_additional_config({"vtoken": {
        "variant": "vtoken", "policy": policy, "budget": 40, "num_recent_tokens": 16, "interval_tokens": 8,
        "theta_f": 0.01, "check_invariants": True}})


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    spec = EngineSpec(tiny_model_dir, kv_cache_memory_bytes=8 << 20, max_model_len=1024,
                      extra_llm_kwargs={"tensor_parallel_size": 2})
    with open_llm(spec, settings("h2o"), record_events=True) as engine:
        yield engine


@pytest.mark.timeout(900)
@pytest.mark.parametrize("policy", ["h2o", "streaming_llm"])
def test_two_ranks_follow_one_plan_and_match_the_reference(llm, reference_model, policy):
    scheduler = scheduler_of(llm)
    scheduler.reconfigure(settings(policy))
    tracker = scheduler.vtoken
    row_sums = []
    add_scores = tracker.add_scores
    tracker.add_scores = lambda req_id, rows: (row_sums.append(rows.sum(axis=1)), add_scores(req_id, rows))
    generations = generate(llm, prompts(), MAX_TOKENS)
    assert tracker.counters.invariant_violations == 0 and tracker.counters.tokens_moved > 0
    for g in generations:
        assert g.events, "the budget should have forced evictions"
        expected = reference_logprobs(reference_model, g.prompt_ids, g.token_ids, g.events)
        error = np.abs(np.array(g.logprobs) - expected).max()
        assert error < TOLERANCE, f"{policy}: max |log p - reference| = {error:.2e}"
    if policy == "h2o":
        rows = np.concatenate(row_sums)
        assert rows.size > 3 * MAX_TOKENS
        np.testing.assert_allclose(rows, tracker.num_heads_layers, rtol=1e-5)  # every head of both ranks
