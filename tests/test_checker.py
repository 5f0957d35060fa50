"""The invariant checker as a library: clean runs pass on every sample trace, every fault is
caught by the invariant it breaks, fuzzing is deterministic, and the copy-engine harness keeps
every plan in flight across one forward."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from vtoken import defaults
from vtoken.checker import (
    FAULT_DETECTED_BY, FAULT_KINDS, CheckOptions, TraceLimits, build_scenarios, bundled_sample_traces, check_invariants,
    report_to_json, scale_requests,
)
from vtoken.checker import sim as sim_checker
from vtoken.checker.contents import kv_content
from vtoken.checker.copies import ReportAfterForwardCopyEngine, make_copy_engine
from vtoken.checker.faults import FAULTS
from vtoken.checker.observer import check_plan_independently
from vtoken.checker.scenarios import fuzz_scenario
from vtoken.engine.experiment import EvictionConfig, Experiment
from vtoken.errors import ConfigError, InvariantError
from vtoken.hardware import resolve_gpu
from vtoken.kv.block_pool import BlockPool
from vtoken.kv.copy_engine import CopyEngine
from vtoken.kv.kv_cache import KVShape, PagedKVCache
from vtoken.kv.reclaim import ReclaimConfig, Reclaimer, StepShare
from vtoken.kv.token_table import TokenTable
from vtoken.model_spec import resolve_model
from vtoken.policies.base import Budget
from vtoken.trace import Request, Trace, load_trace

SMALL = TraceLimits(max_requests=10, max_prompt_tokens=1024, max_output_tokens=96)
ONE = CheckOptions(policies=("h2o",), reclaim_modes=("hole-fill",), limits=SMALL, device="cpu")


def make_base(**overrides) -> Experiment:
    """What `vtoken check-invariants` runs by default: 50% budget, reclaim checked every step at F >= 0.05."""
    base = Experiment(resolve_model("llama-3.1-8b"), resolve_gpu("h100"), num_blocks=100_000,
                      eviction=EvictionConfig("h2o", Budget(keep_ratio=0.5), 32),
                      reclaim=ReclaimConfig(theta_f=0.05, check_interval_steps=1))
    return replace(base, **overrides)


def without_timings(payload: dict) -> dict:
    payload = {k: v for k, v in payload.items() if k not in ("elapsed_s", "relocation_events_per_s")}
    payload["runs"] = [{k: v for k, v in run.items() if k != "elapsed_s"} for run in payload["runs"]]
    return payload


# ---- materialized K/V -------------------------------------------------------------------------


def test_kv_content_is_distinct_per_token_and_exact_in_float32() -> None:
    kv = kv_content(3, np.array([0, 1, 7]))
    assert kv.shape == (2, 2, 3, 2, 8) and kv.dtype == np.float32
    assert kv[:, :, :, 0, 0].tolist() == [[[4.0] * 3] * 2] * 2  # owner + 1, in K and V of every layer
    assert kv[0, 1, :, 0, 1].tolist() == [1.0, 2.0, 8.0]  # token + 1
    assert np.all(kv < 2**23) and np.array_equal(kv, kv_content(3, np.array([0, 1, 7])))
    assert not np.array_equal(kv_content(4, np.array([7]))[:, :, 0], kv[:, :, 2])


# ---- clean runs ---------------------------------------------------------------------------------


@pytest.mark.parametrize("path", bundled_sample_traces(), ids=lambda p: p.name)
def test_every_sample_trace_passes_in_both_reclaim_modes(path) -> None:
    options = replace(ONE, reclaim_modes=("hole-fill", "ordered"))
    report = check_invariants([load_trace(path)], make_base(), options)
    assert report.passed, [t.first_violation for t in report.tallies.values()]
    assert report.relocation_events > 0
    tallies = report.tallies
    assert tallies["I1"].checked == report.relocation_events
    assert tallies["I2"].checked >= report.relocation_events
    assert tallies["I3"].checked > 0 and tallies["I4"].checked >= report.relocation_events
    assert all(run.stopped is None and run.num_completed == run.num_requests for run in report.runs)


def test_traces_are_cut_down_and_the_cut_is_noted() -> None:
    requests = [Request("a", 0.0, 5000, 300, prefix_id="p", num_prefix_tokens=4500), Request("b", 1.0, 100, 10),
                Request("c", 2.0, 100, 10)]
    kept, note = scale_requests(requests, TraceLimits(max_requests=2, max_prompt_tokens=4096, max_output_tokens=256))
    assert [(r.num_prompt_tokens, r.num_output_tokens, r.num_prefix_tokens) for r in kept] == [(4096, 256, 4095), (100, 10, 0)]
    assert note == "first 2 of 3 requests; prompts capped at 4096 tokens (1 requests); outputs capped at 256 tokens (1 requests)"
    assert scale_requests(requests[1:], TraceLimits()) == (tuple(requests[1:]), "")


def test_report_groups_by_policy_and_mode_and_counts_every_event() -> None:
    trace = load_trace(bundled_sample_traces()[0])
    options = replace(ONE, policies=("h2o", "random"), reclaim_modes=("hole-fill", "ordered"))
    report = check_invariants([trace], make_base(), options)
    groups = report.by_policy_mode()
    assert [(g.policy, g.reclaim_mode) for g in groups] == [("h2o", "hole-fill"), ("h2o", "ordered"), ("random", "hole-fill"),
                                                          ("random", "ordered")]
    assert sum(g.relocation_events for g in groups) == report.relocation_events
    assert report.relocation_events_per_s == report.relocation_events / report.elapsed_s


# ---- faults ---------------------------------------------------------------------------------------


def test_the_fault_names_the_cli_shows_are_the_fault_classes() -> None:
    assert tuple(FAULTS) == FAULT_KINDS
    assert list(FAULT_DETECTED_BY) == list(FAULT_KINDS)


@pytest.mark.parametrize("fault", FAULT_KINDS)
def test_each_fault_is_caught_by_the_invariant_it_breaks_and_only_that(fault) -> None:
    trace = load_trace(next(p for p in bundled_sample_traces() if p.name == "shared_prefix.jsonl"))
    report = check_invariants([trace], make_base(), replace(ONE, fault=fault))
    expected = FAULT_DETECTED_BY[fault]
    violated = {name for name, t in report.tallies.items() if t.violations}
    assert violated == {expected}
    assert sum(run.faults_injected for run in report.runs) > 0
    first = report.tallies[expected].first_violation
    assert first.invariant == expected and first.request_id is not None and first.block_id is not None
    if fault != "shared-block":  # a plan-level violation names a block, not one token
        assert first.token_id is not None and first.offset is not None


def test_a_stale_slot_reads_the_freed_source_while_the_mapping_and_data_are_right() -> None:
    trace = load_trace(bundled_sample_traces()[0])
    report = check_invariants([trace], make_base(), replace(ONE, fault="stale-slot"))
    first = report.tallies["I3"].first_violation
    assert "reads a slot the token left" in first.message
    assert report.tallies["I1"].checked == report.relocation_events > 0 and report.tallies["I1"].violations == 0


def test_one_dropped_copy_is_reported_once_not_again_at_every_read() -> None:
    trace = load_trace(bundled_sample_traces()[0])
    report = check_invariants([trace], make_base(), replace(ONE, fault="drop-copy"))
    assert 0 < report.tallies["I1"].violations <= sum(run.faults_injected for run in report.runs)
    assert report.tallies["I3"].violations == 0


def owner_and_sharer_with_holes() -> tuple[BlockPool, TokenTable, TokenTable]:
    """Two requests sharing the owner's 8-token pinned prefix (blocks of 4); the owner has holes
    past it, so a plan over it has a block to free."""
    pool = BlockPool(16, 4)
    owner, sharer = TokenTable(0, pool), TokenTable(1, pool)
    owner.sync_new_tokens(pool.allocate(4), 16)
    owner.pin_prefix(8)
    pool.share(np.array(owner.held_block_ids[:2]))
    sharer.attach_shared_prefix(np.array(owner.held_block_ids[:2]), 8)
    owner.evict_tokens(np.array([9, 10, 13, 14]))
    return pool, owner, sharer


@pytest.mark.parametrize("budget", [2048, None])
@pytest.mark.parametrize("mode", ["hole-fill", "ordered"])
def test_the_shared_block_fault_plans_in_every_lazy_round(budget, mode) -> None:
    # without a budget a lazy round once planned hole-fill outside _plans, where the fault adds its block
    pool, owner, sharer = owner_and_sharer_with_holes()
    fault = FAULTS["shared-block"]()
    reclaimer = fault.planner_factory()(ReclaimConfig(mode=mode, max_moves_per_step=budget), pool)
    (plan,) = reclaimer.plan([owner, sharer])
    assert fault.num_injected == 1 and owner.held_block_ids[1] in plan.src_block_ids


def test_independent_i4_rejects_a_plan_over_a_shared_prefix_block() -> None:
    pool, owner, sharer = owner_and_sharer_with_holes()
    (plan,) = Reclaimer(ReclaimConfig(mode="hole-fill"), pool).plan([owner, sharer])
    check_plan_independently(plan, owner, pool, [])
    bad = replace(plan, src_block_ids=np.sort(np.append(plan.src_block_ids, owner.held_block_ids[0])))
    with pytest.raises(InvariantError, match="touches shared prefix block 0") as caught:
        check_plan_independently(bad, owner, pool, [])
    assert caught.value.invariant == "I4" and caught.value.where["block_id"] == 0
    with pytest.raises(InvariantError, match="overlaps a plan of the same request still in flight"):
        check_plan_independently(plan, owner, pool, [plan])
    moved_away = replace(plan, moves=replace(plan.moves, src_offsets=plan.moves.src_offsets + 1))
    with pytest.raises(InvariantError, match="which it does not occupy"):
        check_plan_independently(moved_away, owner, pool, [])


# ---- fuzz -------------------------------------------------------------------------------------------


def test_fuzz_with_a_fixed_seed_passes_and_repeats_exactly() -> None:
    options = replace(ONE, policies=("h2o", "scissorhands", "random"), reclaim_modes=("hole-fill", "ordered"),
                      num_fuzz_scenarios=12)
    first = check_invariants([], make_base(seed=7), options)
    again = check_invariants([], make_base(seed=7), options)
    assert first.passed, [t.first_violation for t in first.tallies.values()]
    assert [run.scenario for run in first.runs] == [f"fuzz-{i:03d}" for i in range(12)]
    assert without_timings(report_to_json(first)) == without_timings(report_to_json(again))
    assert len({run.block_size for run in first.runs}) > 1 and first.relocation_events > 0
    other = check_invariants([], make_base(seed=8), options)
    assert without_timings(report_to_json(other)) != without_timings(report_to_json(first))


def test_fuzz_draws_the_reclaimers_budget_and_a_step_share_only_on_the_sim() -> None:
    """Fuzz scenarios draw the lazy round's budget too (as shipped, small fixed ones, none, one
    that follows the step), from a stream of their own, so that the other draws do not depend on
    it. A budget that follows the step follows a measured one on the hf executor, which would
    make a fuzz run depend on the host's timing: drawn on the sim only, and the hf executor's
    scenarios, drawn from fewer kinds of budget, are otherwise the sim's."""
    options = replace(ONE, num_fuzz_scenarios=60)
    base = make_base(seed=7)
    budgets = [fuzz_scenario(i, base, options).run.experiment.reclaim.max_moves_per_step for i in range(60)]
    assert {type(b) for b in budgets} == {int, type(None), StepShare}
    assert defaults.RECLAIM_MOVES_PER_STEP in budgets and any(isinstance(b, int) and b <= 128 for b in budgets)
    hf_budgets = [fuzz_scenario(i, base, replace(options, executor="hf")).run.experiment.reclaim.max_moves_per_step
                  for i in range(60)]
    assert not any(isinstance(b, StepShare) for b in hf_budgets)
    for i in range(10):  # the budget's draw leaves every other draw as it was
        scenario, on_hf = fuzz_scenario(i, base, options), fuzz_scenario(i, base, replace(options, executor="hf"))
        shipped = replace(scenario.run.experiment.reclaim, max_moves_per_step=defaults.RECLAIM_MOVES_PER_STEP)
        assert replace(on_hf.run.experiment.reclaim, max_moves_per_step=defaults.RECLAIM_MOVES_PER_STEP) == shipped
        assert on_hf.requests == scenario.requests


# ---- the copy-engine harness ---------------------------------------------------------------------


def make_plan():
    """block 0: [0 . . 3]  block 1: [4 5 6 7]  block 2: [8 9 . .]  block 3 (tail): [12 13 . .];
    the hole-fill plan moves tokens 8, 9 into slots 1, 2."""
    shape = KVShape(num_layers=2, num_blocks=8, block_size=4, num_kv_heads=2, head_dim=8)
    kv_cache = PagedKVCache(shape)
    pool = BlockPool(8, 4)
    table = TokenTable(0, pool)
    table.sync_new_tokens(pool.allocate(4), 14)
    kv_cache.write(torch.as_tensor(table.slots()), torch.from_numpy(kv_content(0, np.arange(14))))
    table.evict_tokens(np.array([1, 2, 10, 11]))
    (plan,) = Reclaimer(ReclaimConfig(mode="hole-fill"), pool).plan([table])
    return kv_cache, plan


def test_a_deferred_copy_lands_only_after_the_next_forward() -> None:
    """The runtime polls once per step, before the forward (and right after a launch only in
    sync mode): a deferred copy is still in flight at the first poll, so the next forward runs
    with it in flight, and lands at the second."""
    kv_cache, plan = make_plan()
    engine = make_copy_engine(kv_cache)
    assert engine.mode == "deferred"
    engine.launch(plan)
    engine.wait_before_forward()
    assert engine.poll_completed() == []  # before the next forward: still in flight
    assert engine.in_flight_plans == [plan]
    assert not np.array_equal(kv_cache.read(torch.tensor([1, 2])).numpy(), kv_content(0, np.array([8, 9])))
    assert engine.poll_completed() == [plan]  # before the forward after it
    assert np.array_equal(kv_cache.read(torch.tensor([1, 2])).numpy(), kv_content(0, np.array([8, 9])))


def test_async_harness_reports_a_landed_copy_only_after_a_forward_ran() -> None:
    kv_cache, plan = make_plan()
    engine = ReportAfterForwardCopyEngine(CopyEngine(kv_cache, "sync"))  # lands at once, like a fast side stream
    engine.launch(plan)
    assert engine.poll_completed() == []
    engine.wait_before_forward()
    assert engine.poll_completed() == [] and engine.in_flight_plans == [plan]
    engine.wait_before_forward()
    assert engine.poll_completed() == [plan] and engine.in_flight_plans == []
    engine.launch(plan)
    engine.cancel(req_id=0)
    assert engine.in_flight_plans == [] and engine.drain() == []


def test_the_async_harness_catches_early_reads_too() -> None:
    trace = load_trace(bundled_sample_traces()[0])
    (scenario,), _ = build_scenarios([trace], make_base(), ONE)

    def check(fault):
        return sim_checker.check_scenario(scenario, fault, copy_engine_for=lambda kv: ReportAfterForwardCopyEngine(
            CopyEngine(kv, "sync")))

    clean = check(None)
    assert clean.passed and clean.relocation_events > 0
    faulty = check("early-read")
    assert {name for name, t in faulty.tallies.items() if t.violations} == {"I3"}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_async_copies_pass_clean_and_catch_early_reads() -> None:
    trace = load_trace(bundled_sample_traces()[0])
    options = replace(ONE, device="cuda", reclaim_modes=("hole-fill", "ordered"))
    clean = check_invariants([trace], make_base(), options)
    assert clean.copy_mode == "async" and clean.passed and clean.relocation_events > 0
    for fault in ("early-read", "drop-copy"):
        faulty = check_invariants([trace], make_base(), replace(options, fault=fault))
        assert {name for name, t in faulty.tallies.items() if t.violations} == {FAULT_DETECTED_BY[fault]}


# ---- options ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, message", [
    ({"executor": "tpu"}, "unknown executor 'tpu'; check-invariants runs on: sim, hf, vllm"),
    ({"policies": ("lru",)}, "unknown policy 'lru'"),
    ({"reclaim_modes": ("magic",)}, "unknown reclaim mode 'magic'"),
    ({"fault": "bit-flip"}, "unknown fault 'bit-flip'; choose one of: drop-copy, stale-slot, double-map, early-read, shared-block"),
    ({"num_fuzz_scenarios": -1}, "--fuzz must be >= 0"),
    ({"num_blocks": 0}, "--num-blocks must be > 0"),
])
def test_bad_options_raise_config_errors(kwargs, message) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        CheckOptions(**kwargs)


def test_a_request_too_big_for_the_budget_is_skipped_not_a_violation() -> None:
    trace = Trace((Request("big", 0.0, 1000, 200), Request("small", 0.0, 100, 50)), "inline", "jsonl")
    report = check_invariants([trace], make_base(), replace(ONE, num_blocks=60, limits=TraceLimits()))
    assert report.passed and report.runs[0].num_completed == 1  # a 1,000-token prompt needs 63 blocks
