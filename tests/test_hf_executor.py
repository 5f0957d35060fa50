"""The hf executor on a tiny random model built offline: exactness against the transformers
reference with evictions and relocations, agreement between naive-evict and vtoken, real
attention statistics, prompts, quality metrics."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from vtoken.engine.experiment import EvictionConfig, Experiment, Run
from vtoken.engine.sim import SimProfile
from vtoken.engine.hf import NEVER, build_hf_runtime, prepare_requests, run_hf
from vtoken.engine.hf_oracle import agreement, lcs_length, max_reference_error, quality_vs_native, rouge_l_f1, until_eos
from vtoken.errors import ConfigError
from vtoken.hardware import resolve_gpu
from vtoken.kv.reclaim import ReclaimConfig
from vtoken.models import load_model
from vtoken.models.tiny import build_tiny_model
from vtoken.policies import POLICIES
from vtoken.policies.base import Budget
from vtoken.trace import Request

TOLERANCE = 1e-5  # fp32 log-probabilities; the tiny model measures about 1e-6


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return load_model(str(build_tiny_model(tmp_path_factory.mktemp("tiny") / "llama")))


def make_requests(num_requests: int = 4, num_output_tokens: int = 24) -> list[Request]:
    return [Request(str(i), 0.0, 20 + 7 * i, num_output_tokens) for i in range(num_requests)]


def make_config(model, variant: str = "vtoken", policy: str = "h2o", mode: str = "hole-fill", **overrides) -> Run:
    """Small blocks, an eviction every 6 tokens and eager reclamation: many relocations."""
    experiment = Experiment(
        model.spec, resolve_gpu("h100"), num_blocks=200, block_size=4,
        eviction=EvictionConfig(policy, Budget(keep_ratio=0.5, num_sink_tokens=2, num_recent_tokens=4), 6),
        reclaim=ReclaimConfig(mode=mode, theta_f=0.05, check_interval_steps=1),
    )
    return replace(experiment, **overrides).run(variant, 3)


@pytest.mark.parametrize("mode", ["hole-fill", "ordered"])
@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_every_variant_matches_the_reference_with_evictions(tiny, policy, mode):
    requests = make_requests()
    runs = {v: run_hf(make_config(tiny, v, policy, mode), requests, tiny) for v in ("native", "naive-evict", "vtoken")}
    assert runs["naive-evict"].result.tokens_evicted > 0
    assert runs["vtoken"].result.tokens_moved > 0  # the copy engine moved real model KV
    assert runs["vtoken"].result.blocks_reclaimed > 0
    assert all(r.result.num_completed == len(requests) for r in runs.values())
    for run in runs.values():
        assert max_reference_error(tiny, run.outputs) < TOLERANCE
    same = agreement(runs["naive-evict"].outputs, runs["vtoken"].outputs)
    assert same.num_identical == len(requests)
    assert same.max_abs_logprob_diff < TOLERANCE


def test_outputs_record_what_was_evicted_and_when(tiny):
    run = run_hf(make_config(tiny, "vtoken", "streaming_llm"), make_requests(3), tiny)
    for output, request in zip(run.outputs, make_requests(3)):
        assert output.token_ids.size == request.num_prompt_tokens + request.num_output_tokens
        assert output.logprobs.size == request.num_output_tokens
        assert np.all(output.logprobs <= 0)
        hidden = output.evicted_at[output.evicted_at != NEVER]
        assert hidden.size > 0
        # a token is hidden from a query after it, never from its own prompt prefill
        assert np.all(hidden >= output.num_prompt_tokens)
        assert np.all(hidden > np.flatnonzero(output.evicted_at != NEVER))
        assert np.all(output.evicted_at[:2] == NEVER)  # the sinks stay


def test_deferred_copies_keep_exactness(tiny):
    config = make_config(tiny, "vtoken", "h2o", "ordered")
    run = run_hf(config, make_requests(), tiny, copy_mode="deferred")
    sync = run_hf(config, make_requests(), tiny)
    assert run.result.tokens_moved > 0
    assert max_reference_error(tiny, run.outputs) < TOLERANCE
    assert agreement(run.outputs, sync.outputs).num_identical == len(make_requests())


def test_preempted_requests_are_exact_after_their_last_prefill(tiny):
    config = make_config(tiny, "naive-evict", "random", num_blocks=36)
    run = run_hf(config, make_requests(4, 40), tiny)
    assert run.result.preemptions > 0
    assert run.result.num_completed == 4
    assert any(o.num_exact_from > 0 for o in run.outputs)
    assert max_reference_error(tiny, run.outputs) < TOLERANCE


def test_shared_prefix_requests_read_the_same_prefix(tiny):
    requests = [Request(str(i), 0.0, 30, 16, prefix_id="p", num_prefix_tokens=16) for i in range(3)]
    prepared = prepare_requests(requests, tiny.tokenizer, seed=0)
    assert all(np.array_equal(ids[:16], prepared.prompt_ids[0][:16]) for ids in prepared.prompt_ids)
    assert not np.array_equal(prepared.prompt_ids[0][16:], prepared.prompt_ids[1][16:])
    run = run_hf(make_config(tiny, "vtoken", "h2o"), requests, tiny)
    assert run.result.num_completed == 3
    assert max_reference_error(tiny, run.outputs) < TOLERANCE


@pytest.mark.parametrize("arch", ["mistral", "qwen2"])
def test_mistral_and_qwen2_folders_match_the_reference(tmp_path, arch):
    model = load_model(str(build_tiny_model(tmp_path / arch, arch)))
    runs = [run_hf(make_config(model, v, "tova", "ordered"), make_requests(3), model) for v in ("naive-evict", "vtoken")]
    assert runs[1].result.tokens_moved > 0
    assert max(max_reference_error(model, r.outputs) for r in runs) < TOLERANCE
    assert agreement(runs[0].outputs, runs[1].outputs).num_identical == 3


def test_sliding_window_models_are_refused(tmp_path):
    folder = build_tiny_model(tmp_path / "mistral", "mistral")
    config_path = folder / "config.json"
    config_path.write_text(config_path.read_text().replace('"sliding_window": null', '"sliding_window": 8'))
    with pytest.raises(ConfigError, match="sliding-window"):
        load_model(str(folder))


def test_unknown_model_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="not 'smollm2-135m' and not a folder"):
        load_model(str(tmp_path / "nowhere"))


# ---- attention statistics ------------------------------------------------------------------


def step_until(runtime, num_generated: int):
    while not runtime.scheduler.running or runtime.scheduler.running[0].num_generated < num_generated:
        runtime.step()
    return runtime.scheduler.running[0]


def reference_attention(model, token_ids: np.ndarray) -> torch.Tensor:
    """[queries, keys] probabilities summed over layers and heads, from transformers' eager attention."""
    model.model.set_attn_implementation("eager")
    try:
        with torch.inference_mode():
            out = model.model(torch.as_tensor(token_ids)[None], output_attentions=True)
    finally:
        model.model.set_attn_implementation("sdpa")
    return torch.stack(out.attentions)[:, 0].sum(dim=(0, 1))


def test_attention_statistics_are_the_models_attention(tiny):
    window = 5
    config = make_config(tiny, "native", sim=SimProfile(importance_window=window))
    runtime = build_hf_runtime(config, [Request("a", 0.0, 20, 30), Request("b", 0.0, 13, 30)], tiny, collect_scores=True)
    state = step_until(runtime, 10)
    num_tokens = state.table.num_tokens
    ids = np.arange(num_tokens)
    attention_sum, attention_last, importance_count = runtime.executor.attention_stats(0, ids, num_tokens)
    fed = runtime.executor.outputs()[0].token_ids[:num_tokens]
    want = reference_attention(tiny, fed).numpy()
    num_heads_layers = tiny.spec.num_attention_heads * tiny.spec.num_layers
    np.testing.assert_allclose(attention_sum, want.sum(axis=0), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(attention_last, want[-1] / num_heads_layers, atol=1e-6)
    rows = want[-window:] / num_heads_layers
    num_keys_read = np.arange(num_tokens - window, num_tokens) + 1
    np.testing.assert_array_equal(importance_count, (rows >= 1.0 / num_keys_read[:, None]).sum(axis=0))


def test_scores_are_collected_only_when_the_policy_needs_them(tiny):
    requests = make_requests(2)
    assert build_hf_runtime(make_config(tiny, "vtoken", "h2o"), requests, tiny).executor.collect_scores
    assert not build_hf_runtime(make_config(tiny, "vtoken", "streaming_llm"), requests, tiny).executor.collect_scores
    assert not build_hf_runtime(make_config(tiny, "native", "h2o"), requests, tiny).executor.collect_scores
    with pytest.raises(ConfigError, match="collect_scores=False"):
        run_hf(make_config(tiny, "vtoken", "h2o"), requests, tiny, collect_scores=False)


# ---- prompts ---------------------------------------------------------------------------------


def test_prompt_text_is_tokenized_and_the_rest_is_random(tiny):
    requests = [Request("t", 0.0, 99, 4, prompt="the quick brown fox"), Request("r", 0.0, 12, 4)]
    prepared = prepare_requests(requests, tiny.tokenizer, seed=3)
    assert prepared.requests[0].num_prompt_tokens == len(tiny.tokenizer("the quick brown fox")["input_ids"])
    assert prepared.prompt_ids[0].tolist() == tiny.tokenizer("the quick brown fox")["input_ids"]
    assert prepared.requests[1].num_prompt_tokens == 12
    assert prepared.is_random == (False, True)
    assert not set(prepared.prompt_ids[1].tolist()) & set(tiny.tokenizer.all_special_ids)
    assert np.array_equal(prepared.prompt_ids[1], prepare_requests(requests, tiny.tokenizer, seed=3).prompt_ids[1])
    assert any("1 of 2 requests have no prompt text" in note for note in prepared.notes)


# ---- quality -------------------------------------------------------------------------------


def test_lcs_and_rouge_l_by_hand():
    assert lcs_length("abcbdab", "bdcaba") == 4
    assert lcs_length("", "abc") == 0
    assert rouge_l_f1("a b c d".split(), "a b c d".split()) == 1.0
    # LCS 'a c' = 2: P = 2/3, R = 2/4, F1 = 2PR/(P+R) = 4/7
    assert rouge_l_f1("a x c".split(), "a b c d".split()) == pytest.approx(4 / 7)
    assert rouge_l_f1([], []) == 1.0
    assert rouge_l_f1([], ["a"]) == 0.0


def test_until_eos_cuts_at_the_first_eos():
    assert until_eos(np.array([5, 6, 2, 7, 2]), frozenset({2})).tolist() == [5, 6]
    assert until_eos(np.array([5, 6]), frozenset({2})).tolist() == [5, 6]


def test_quality_of_native_against_itself_is_perfect(tiny):
    run = run_hf(make_config(tiny, "native"), make_requests(2), tiny)
    quality = quality_vs_native(run.outputs, run.outputs, tiny)
    assert quality.rouge_l_f1 == 1.0
    assert quality.length_ratio == 1.0
