"""vToken with vLLM's prefix caching on: a cache hit and a miss give the same outputs.

The class of bug in tenstorrent/vllm#415 (KV corrupted only on cache hits) and
local-inference-lab/vllm#480 (phantom hits after eviction): a block vToken compacted must never
be matched as cached, and a block another request reads must never be rewritten. One
in-process engine (tiny Llama, fp32, block size 32, prefix caching on); each case takes a
fresh prompt of 136 tokens (4 full blocks and 8 tokens), runs the miss first, then the hit,
and holds both to the transformers reference with their own evictions.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.vllm_tier.conftest import VLLM_MISSING, VLLM_PROBE

pytest.importorskip(VLLM_PROBE, reason=VLLM_MISSING)

from vtoken.engine.vllm.engine import EngineSpec, generate, open_llm, scheduler_of  # noqa: E402
from vtoken.engine.vllm.prefix_cache import PrefixCache  # noqa: E402
from vtoken.engine.vllm.reference import reference_logprobs  # noqa: E402
from vtoken.engine.vllm.settings import settings_from_additional_config  # noqa: E402
from vtoken.errors import InvariantError  # noqa: E402

TOLERANCE = 1e-6
MAX_TOKENS = 48
PROMPT_LEN = 136
FULL_PROMPT_TOKENS = 128  # the 4 full blocks vLLM registers


def settings(protection: str, policy: str = "streaming_llm", variant: str = "vtoken"):
    return settings_from_additional_config({"vtoken": {
        "variant": variant, "policy": policy, "budget": 40, "num_recent_tokens": 16, "interval_tokens": 8,
        "theta_f": 0.01, "check_invariants": True, "prefix_protection": protection}})


def spec(tiny_model_dir: str) -> EngineSpec:
    return EngineSpec(tiny_model_dir, kv_cache_memory_bytes=8 << 20, max_model_len=1024, enable_prefix_caching=True)


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    with open_llm(spec(tiny_model_dir), settings("prompt"), record_events=True) as engine:
        yield engine


_prompt_seeds = iter(range(100, 10_000))


def fresh_prompt() -> list[int]:
    """A prompt no earlier case used: its first run cannot hit the cache."""
    return np.random.default_rng(next(_prompt_seeds)).integers(3, 500, PROMPT_LEN).tolist()


def assert_matches_reference(reference_model, generation) -> None:
    expected = reference_logprobs(reference_model, generation.prompt_ids, generation.token_ids, generation.events)
    error = np.abs(np.array(generation.logprobs) - expected).max()
    assert error < TOLERANCE, f"max |log p - reference| = {error:.2e} ({generation.num_cached_tokens} cached tokens)"


def assert_clean(llm) -> None:
    tracker = scheduler_of(llm).vtoken
    assert tracker.counters.invariant_violations == 0
    assert not tracker.requests and tracker.ledger.num_free_blocks == tracker.ledger.num_blocks


@pytest.mark.parametrize("variant, policy", [("vtoken", "streaming_llm"), ("vtoken", "h2o"),
                                             ("naive-evict", "streaming_llm")])
def test_prompt_protection_a_hit_after_a_miss_gives_the_same_outputs(llm, reference_model, variant, policy):
    scheduler_of(llm).reconfigure(settings("prompt", policy, variant))
    prompt = fresh_prompt()
    miss = generate(llm, [prompt], MAX_TOKENS)[0]
    hit = generate(llm, [prompt], MAX_TOKENS)[0]
    assert miss.num_cached_tokens == 0 and hit.num_cached_tokens == FULL_PROMPT_TOKENS
    assert miss.events and all(e.token_ids.min() >= FULL_PROMPT_TOKENS for e in miss.events)  # prompt blocks kept
    assert hit.token_ids == miss.token_ids
    assert [e.token_ids.tolist() for e in hit.events] == [e.token_ids.tolist() for e in miss.events]
    for generation in (miss, hit):
        assert_matches_reference(reference_model, generation)
    assert_clean(llm)


def test_shared_protection_a_compacted_prompt_is_never_a_hit(llm, reference_model):
    """Alone, the request evicts from its prompt: its blocks lose their hashes, so the same
    prompt afterwards misses (a hit would read compacted KV) and gives the same outputs."""
    scheduler_of(llm).reconfigure(settings("shared"))
    prompt = fresh_prompt()
    first = generate(llm, [prompt], MAX_TOKENS)[0]
    again = generate(llm, [prompt], MAX_TOKENS)[0]
    assert first.events[0].token_ids.min() < FULL_PROMPT_TOKENS  # the prompt itself lost tokens
    assert first.num_cached_tokens == 0 and again.num_cached_tokens == 0
    assert again.token_ids == first.token_ids
    for generation in (first, again):
        assert_matches_reference(reference_model, generation)
    assert scheduler_of(llm).vtoken_prefix_cache.num_hashes_dropped >= 4
    assert_clean(llm)


def test_shared_protection_concurrent_sharers_keep_the_shared_blocks_whole(llm, reference_model):
    """Submitted together, the second request hits the first one's blocks; both protect them
    (the policy evicts only private tokens) and give the same outputs, the reference's."""
    scheduler_of(llm).reconfigure(settings("shared"))
    prompt = fresh_prompt()
    miss, hit = generate(llm, [prompt, prompt], MAX_TOKENS)
    assert miss.num_cached_tokens == 0 and hit.num_cached_tokens == FULL_PROMPT_TOKENS
    for generation in (miss, hit):
        assert generation.events and all(e.token_ids.min() >= FULL_PROMPT_TOKENS for e in generation.events)
        assert_matches_reference(reference_model, generation)
    assert hit.token_ids == miss.token_ids
    assert_clean(llm)


def test_rewriting_a_cached_block_is_caught_before_the_forward(tiny_model_dir, monkeypatch):
    """Without dropping the hashes, the first compaction would write into a registered block:
    the step plan's check (every moved block private and unregistered) stops it."""
    monkeypatch.setattr(PrefixCache, "uncache", lambda self, vllm_block_ids: None)
    with open_llm(spec(tiny_model_dir), settings("shared")) as engine:
        with pytest.raises(InvariantError, match="registered in the prefix cache"):
            generate(engine, [fresh_prompt()], MAX_TOKENS)
        assert scheduler_of(engine).vtoken.counters.invariant_violations == 1
