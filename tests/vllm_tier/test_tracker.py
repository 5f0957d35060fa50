"""The vLLM integration's state, without vLLM: compaction plans, the tracker, settings, metrics.

These run in the plain test environment; the tests that need vLLM skip there.
"""

from __future__ import annotations

import numpy as np
import pytest

from vtoken.kv.compaction import live_positions, naive_num_blocks, plan_compaction
from vtoken.engine.vllm.metrics import EngineMetrics
from vtoken.engine.vllm.settings import VllmSettings, settings_from_additional_config
from vtoken.engine.vllm.tracker import VTokenTracker
from vtoken.errors import ConfigError
from vtoken.kv.block_pool import BlockPool
from vtoken.kv.token_table import TokenTable

S = 4


def make_table(num_tokens: int, evicted: list[int]) -> TokenTable:
    pool = BlockPool(8, S)
    table = TokenTable(0, pool)
    table.sync_new_tokens(pool.allocate(-(-num_tokens // S)), num_tokens)
    table.evict_tokens(np.array(evicted))
    return table


# ---- compaction ---------------------------------------------------------------------------------

def test_hole_fill_moves_last_tokens_into_first_holes():
    #  blocks  [0 . 2 3][. 5 . .][8 9 10 11]  ->  live 0 2 3 5 8 9 10 11 packed into 0..7
    table = make_table(12, [1, 4, 6, 7])
    moves = plan_compaction(table, "hole-fill")
    assert moves.token_ids.tolist() == [8, 9, 10, 11]
    assert list(zip(moves.dst_block_ids.tolist(), moves.dst_offsets.tolist())) == [(1, 3), (1, 2), (1, 0), (0, 1)]
    assert moves.src_block_ids.tolist() == [2, 2, 2, 2]


def test_ordered_keeps_logical_order():
    table = make_table(12, [1, 4, 6, 7])
    moves = plan_compaction(table, "ordered")
    assert moves.token_ids.tolist() == [2, 3, 5, 8, 9, 10, 11]
    table.apply_moves(moves)
    live_ids, positions = live_positions(table)
    assert positions.tolist() == list(range(8))
    assert live_ids.tolist() == [0, 2, 3, 5, 8, 9, 10, 11]


@pytest.mark.parametrize("mode", ["hole-fill", "ordered"])
def test_compaction_packs_live_tokens_densely(mode):
    rng = np.random.default_rng(1)
    for _ in range(20):
        num_tokens = int(rng.integers(5, 30))
        evicted = rng.choice(num_tokens, size=int(rng.integers(0, num_tokens)), replace=False)
        table = make_table(num_tokens, sorted(evicted.tolist()))
        table.apply_moves(plan_compaction(table, mode))
        _, positions = live_positions(table)
        assert sorted(positions.tolist()) == list(range(table.num_live_tokens))


def test_hole_fill_never_moves_more_than_ordered():
    table = make_table(12, [1, 4, 6, 7])
    assert plan_compaction(table, "hole-fill").num_moves <= plan_compaction(table, "ordered").num_moves


def test_naive_blocks_are_those_with_a_live_token_plus_the_tail():
    assert naive_num_blocks(make_table(12, [1, 4, 6, 7])) == 3
    assert naive_num_blocks(make_table(12, [4, 5, 6, 7])) == 2
    assert naive_num_blocks(make_table(10, [8, 9])) == 3  # the open tail stays


# ---- tracker --------------------------------------------------------------------------------------

def settings(variant: str = "vtoken", **extra) -> VllmSettings:
    raw = {"variant": variant, "policy": "streaming_llm", "budget": 6, "num_sink_tokens": 1,
           "num_recent_tokens": 2, "interval_tokens": 2, "theta_f": 0.01, **extra}
    return settings_from_additional_config({"vtoken": raw})


def tracker_after_prefill(variant: str = "vtoken") -> VTokenTracker:
    tracker = VTokenTracker(settings(variant), num_blocks=16, block_size=S)
    tracker.req_idx("a")
    tracker.sync("a", 10, [7, 3, 9])  # 10 prompt tokens in vLLM blocks 7, 3, 9
    tracker.after_step("a", num_output_tokens=1, num_kv_tokens=10)  # right after prefill
    return tracker


def test_eviction_compacts_and_sends_moves_in_vllm_slots():
    tracker = tracker_after_prefill()
    # keep 6 of 10: sink 0, recent 8 9, and 5 6 7; tokens 1..4 go.
    assert tracker.requests["a"].table.live_token_ids().tolist() == [0, 5, 6, 7, 8, 9]
    plan = tracker.take_step_plan(["a"])
    # hole-fill: 9 -> position 1, 8 -> 2, 7 -> 3, 6 -> 4; position p is vLLM block [7, 3, 9][p // 4]
    assert plan.src_slots.tolist() == [3 * 4 + 2, 3 * 4 + 3, 9 * 4 + 0, 9 * 4 + 1]  # tokens 6, 7, 8, 9
    assert plan.dst_slots.tolist() == [3 * 4 + 0, 7 * 4 + 3, 7 * 4 + 2, 7 * 4 + 1]
    assert plan.num_evicted_tokens == {"a": 4}
    assert tracker.manager_offset("a") == 4


def test_blocks_go_back_only_after_the_copy_landed():
    tracker = tracker_after_prefill()
    tracker.take_step_plan(["a"])  # the moves are now in flight
    assert tracker.num_blocks_to_keep("a", 3, reclaim_now=True) == 3
    tracker.complete_moves()
    assert tracker.num_blocks_to_keep("a", 3, reclaim_now=True) == 2
    assert tracker.num_blocks_to_keep("a", 3, reclaim_now=False) == 3  # theta_F gate not passed
    tracker.blocks_released("a", 2, 1)
    assert tracker.take_step_plan(["a"]).block_table_lengths == {"a": 2}


def test_new_tokens_go_right_after_the_packed_live_tokens():
    tracker = tracker_after_prefill()
    tracker.sync("a", 1, None)
    table = tracker.requests["a"].table
    assert tracker.vllm_id_of[table.token_block_ids[10]] == 3 and table.token_offsets[10] == 2  # position 6


def test_a_check_run_plan_names_the_slots_each_request_reads_and_writes():
    tracker = VTokenTracker(settings(check_invariants=True), num_blocks=16, block_size=S)
    tracker.req_idx("a")
    tracker.sync("a", 10, [7, 3, 9])
    prefill = tracker.take_step_plan(["a"])
    assert prefill.new_slots["a"].tolist() == [28, 29, 30, 31, 12, 13, 14, 15, 36, 37]  # positions 0..9 in blocks 7, 3, 9
    assert prefill.live_slots["a"].tolist() == [12, 13, 14, 15, 28, 29, 30, 31, 36, 37]
    tracker.after_step("a", num_output_tokens=1, num_kv_tokens=10)  # keeps 0, 5..9, packed into positions 0..5
    assert tracker.num_checks == {"I1": 1, "I2": 1, "I3": 1}
    tracker.sync("a", 1, None)
    decode = tracker.take_step_plan(["a"])
    assert decode.new_slots["a"].tolist() == [3 * 4 + 2]  # token 10 at position 6
    assert decode.live_slots["a"].tolist() == [12, 13, 14, 28, 29, 30, 31]  # positions 0..6
    assert tracker_after_prefill().take_step_plan(["a"]).live_slots == {}  # not a check run


def test_naive_evict_keeps_every_block_with_a_live_token():
    tracker = tracker_after_prefill("naive-evict")
    tracker.take_step_plan(["a"])
    tracker.complete_moves()
    assert tracker.manager_offset("a") == 0
    assert tracker.num_blocks_to_keep("a", 3, reclaim_now=True) == 3


def test_preemption_rebuilds_the_table_and_evicts_the_same_tokens_again():
    tracker = tracker_after_prefill()
    tracker.record_events = True
    tracker.drop("a", is_finished=False)
    assert tracker.ledger.num_free_blocks == 16 and tracker.manager_offset("a") == 0
    tracker.sync("a", 11, [2, 5, 6])  # the recompute: all 11 tokens
    tracker.after_step("a", num_output_tokens=2, num_kv_tokens=11)
    assert tracker.requests["a"].table.live_token_ids().tolist() == [0, 5, 6, 7, 8, 9, 10]
    event = tracker.events_of(0)[-1]
    assert event.is_resume and event.token_ids.tolist() == [1, 2, 3, 4]


def test_finish_frees_every_ledger_block():
    tracker = tracker_after_prefill()
    tracker.drop("a", is_finished=True)
    assert tracker.requests == {} and tracker.ledger.num_free_blocks == 16


def test_native_never_evicts():
    tracker = tracker_after_prefill("native")
    assert tracker.requests["a"].table.num_live_tokens == 10
    assert tracker.take_step_plan(["a"]).num_moves == 0


def test_stats_waste_ratio_over_vllm_blocks():
    stats = tracker_after_prefill().stats(num_allocated_blocks=3)
    assert stats.num_live_tokens == 6
    assert stats.waste_ratio == pytest.approx(1 - 6 / 12)
    # packed: one full block and one half full; vLLM's third block holds nothing (u = 0)
    assert stats.utilization_histogram == (1, 0, 0, 0, 0, 1, 0, 0, 0, 1)


# ---- settings and metrics -------------------------------------------------------------------------

def test_settings_round_trip():
    s = settings("naive-evict", reclaim_mode="ordered", seed=3)
    assert settings_from_additional_config({"vtoken": s.to_dict()}) == s


@pytest.mark.parametrize("raw, message", [
    ({"variant": "fast"}, "unknown variant 'fast'"),
    ({"policy": "lru"}, "unknown policy 'lru'"),
    ({"budget": "150%"}, "budget must be"),
    ({"reclaim_mode": "defrag"}, "unknown reclaim mode"),
    ({"interval_tokens": "8"}, "interval_tokens must be an integer"),
    ({"colour": 1}, "unknown keys ['colour']"),
])
def test_bad_settings_name_the_key(raw, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(")):
        settings_from_additional_config({"vtoken": raw})


def test_metrics_exposition_has_vtoken_names(monkeypatch):
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    metrics = EngineMetrics(settings(), "tiny")
    metrics.observe(tracker_after_prefill().stats(num_allocated_blocks=3))
    text = metrics.render()
    assert 'vtoken_waste_ratio{model_name="tiny"} 0.5' in text
    assert 'vtoken_tokens_evicted_total{model_name="tiny"} 4.0' in text
    assert 'vtoken_block_utilization_blocks{bin="5",model_name="tiny"} 1.0' in text
    assert 'vtoken_block_utilization_blocks{bin="1",model_name="tiny"} 0.0' in text
    assert 'vtoken_info{' in text and 'variant="vtoken"' in text


def test_time_weighted_waste(monkeypatch):
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    metrics = EngineMetrics(settings(), "tiny")
    stats = tracker_after_prefill().stats(num_allocated_blocks=3)  # F = 0.5
    metrics.observe(stats, now_s=10.0)
    metrics.observe(stats, now_s=12.0)  # 2 s at 6 live tokens out of 12 slots
    text = metrics.render()
    assert 'vtoken_live_token_seconds_total{model_name="tiny"} 12.0' in text
    assert 'vtoken_allocated_token_seconds_total{model_name="tiny"} 24.0' in text
    assert 'vtoken_waste_ratio_mean{model_name="tiny"} 0.5' in text


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_cuda_layout_copy_moves_token_rows(layout):
    import torch

    from vtoken.engine.vllm.kv_layout import cuda_slot_copy

    blocks, block_size, heads, dim = 4, 8, 2, 4
    shape = (2, blocks, block_size, heads, dim) if layout == "NHD" else (2, blocks, heads, block_size, dim)
    kv = torch.arange(float(np.prod(shape))).view(shape)
    token = (lambda t, b, o: t[:, b, o]) if layout == "NHD" else (lambda t, b, o: t[:, b, :, o])
    expected = token(kv, 0, 3).clone()
    num_bytes = cuda_slot_copy([kv], torch.tensor([3]), torch.tensor([2 * block_size + 5]), block_size)
    assert torch.equal(token(kv, 2, 5), expected)
    assert num_bytes == 2 * heads * dim * 4


def test_a_request_finishing_on_its_recompute_records_the_resume():
    tracker = tracker_after_prefill()
    tracker.record_events = True
    tracker.drop("a", is_finished=False)
    tracker.sync("a", 11, [2, 5, 6])  # the recompute samples the last token; the request ends
    tracker.drop("a", is_finished=True)
    event = tracker.events_of(0)[-1]
    assert event.is_resume and event.num_tokens == 11 and event.token_ids.tolist() == [1, 2, 3, 4]
