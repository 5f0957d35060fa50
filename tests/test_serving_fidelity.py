"""The sim charges what a real engine does: attention reads each request's KV extent, dead tokens
in held blocks included, so only compaction makes it cheaper.

Property tests over random workloads and eviction settings, on the same admitted requests and
no preemption: per step, vToken's KV read is never above Naive-Evict's, and Naive-Evict's
equals Native's while no block has been handed back (no block fully dead yet). And the
reclaimer's packing under memory pressure runs only when memory is short: an admission waits
for blocks, or the free pool is below the next steps' growth plus the reserve.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vtoken.engine import Experiment, Run, Runtime, SimExecutor, SimProfile
from vtoken.engine.experiment import EvictionConfig
from vtoken.engine.executor import StepLoad, kv_extent
from vtoken.errors import ConfigError
from vtoken.hardware import resolve_gpu
from vtoken.kv.block_pool import BlockPool
from vtoken.kv.reclaim import ReclaimConfig, Reclaimer
from vtoken.kv.token_table import TokenTable
from vtoken.model_spec import resolve_model
from vtoken.policies import POLICIES
from vtoken.policies.base import Budget
from vtoken.trace import Request

S = 16


@dataclass(frozen=True)
class StepRecord:
    load: StepLoad
    num_tokens: int  # of the decodes, before this iteration's growth
    has_handed_back: bool  # some decode holds fewer blocks than its tokens fill


class RecordingSim(SimExecutor):
    """The sim executor, keeping the load of every iteration it costs."""

    def __init__(self, experiment: Experiment) -> None:
        super().__init__(experiment.model, experiment.gpu, experiment.sim, experiment.seed)
        self.steps: list[StepRecord] = []

    def execute(self, batch, load: StepLoad) -> float:
        k = batch.num_decode_steps  # the tables already hold this iteration's k new tokens
        num_tokens = sum(s.table.num_tokens - k for s in batch.decode)
        handed_back = any(s.table.num_blocks < -(-s.table.num_tokens // S) for s in batch.decode)
        self.steps.append(StepRecord(load, num_tokens, handed_back))
        return super().execute(batch, load)


def make_config(variant: str, eviction: EvictionConfig, concurrency: int | None = 6, **overrides) -> Run:
    base = Experiment(resolve_model("llama-3.1-8b"), resolve_gpu("h100"), num_blocks=20_000, block_size=S,
                      eviction=eviction)
    return replace(base, **overrides).run(variant, concurrency)


def replay(run: Run, requests: list[Request]) -> tuple[list[StepRecord], int]:
    executor = RecordingSim(run.experiment)
    result = Runtime(run, requests, executor).run()
    assert result.num_completed == len(requests)
    return executor.steps, result.preemptions


workloads = st.lists(
    st.tuples(st.integers(8, 300), st.integers(4, 300)).map(lambda lengths: Request("r", 0.0, *lengths)),
    min_size=1, max_size=10,
).map(lambda reqs: [replace(r, request_id=str(i)) for i, r in enumerate(reqs)])
budgets = st.builds(lambda ratio, recent: Budget(keep_ratio=ratio, num_sink_tokens=4, num_recent_tokens=recent),
                    st.sampled_from([0.2, 0.4, 0.6]), st.sampled_from([8, 16, 32]))
FIFO_POLICIES = ("streaming_llm",)  # evict the oldest tokens first: see the test after this one


@pytest.mark.parametrize("policy", [p for p in sorted(POLICIES) if p not in FIFO_POLICIES])
@settings(max_examples=25, deadline=None)
@given(requests=workloads, budget=budgets, interval=st.sampled_from([8, 16, 32]))
def test_vtoken_reads_at_most_naive_and_naive_reads_native_until_a_block_is_handed_back(policy, requests, budget,
                                                                                         interval):
    eviction = EvictionConfig(policy, budget, interval)
    native, native_preempted = replay(make_config("native", eviction), requests)
    naive, naive_preempted = replay(make_config("naive-evict", eviction), requests)
    vtoken, vtoken_preempted = replay(make_config("vtoken", eviction), requests)
    assert native_preempted == naive_preempted == vtoken_preempted == 0
    shape = [(s.load.num_decode_steps, s.load.num_decoding_requests) for s in native]
    assert shape == [(s.load.num_decode_steps, s.load.num_decoding_requests) for s in naive]
    assert shape == [(s.load.num_decode_steps, s.load.num_decoding_requests) for s in vtoken]
    for native_step, naive_step, vtoken_step in zip(native, naive, vtoken, strict=True):
        assert native_step.load.num_kv_slots_read == native_step.num_tokens  # native holds every token
        assert vtoken_step.load.num_kv_slots_read <= naive_step.load.num_kv_slots_read
        assert vtoken_step.load.num_live_kv_tokens == naive_step.load.num_live_kv_tokens  # same decisions
        assert naive_step.load.num_live_kv_tokens <= naive_step.load.num_kv_slots_read
        if not naive_step.has_handed_back:
            assert naive_step.load.num_kv_slots_read == native_step.load.num_kv_slots_read


def test_fifo_eviction_can_leave_vtoken_reading_more_than_naive():
    """A known limit of lazy hole-fill: under FIFO eviction it moves young tokens into the holes
    of old blocks; when the old tokens die those blocks stay held by the moved ones, while
    naive-evict frees them whole, and nothing re-packs them while F stays below theta_F."""
    requests = [Request("0", 0.0, 33, 162)]
    eviction = EvictionConfig("streaming_llm", Budget(keep_ratio=0.6, num_sink_tokens=4, num_recent_tokens=8), 16)
    naive, _ = replay(make_config("naive-evict", eviction), requests)
    vtoken, _ = replay(make_config("vtoken", eviction), requests)
    excess = [v.load.num_kv_slots_read - n.load.num_kv_slots_read for n, v in zip(naive, vtoken, strict=True)]
    assert max(excess) == S  # one block more, at the last step: 145 slots where naive-evict reads 129
    assert sum(v.load.num_kv_slots_read for v in vtoken) < sum(n.load.num_kv_slots_read for n in naive)


def test_compaction_shrinks_the_read_and_the_step_time():
    """A workload where H2O leaves holes everywhere: vToken's decode reads fewer slots than
    Naive-Evict's, so its steps are shorter; with the live-tokens model they are not."""
    requests = [Request(str(i), 0.0, 1200, 400) for i in range(4)]
    eviction = EvictionConfig("h2o", Budget(keep_ratio=0.3, num_sink_tokens=4, num_recent_tokens=32), 32)
    naive, _ = replay(make_config("naive-evict", eviction), requests)
    vtoken, _ = replay(make_config("vtoken", eviction), requests)
    assert sum(s.load.num_kv_slots_read for s in vtoken) < 0.6 * sum(s.load.num_kv_slots_read for s in naive)
    config = make_config("vtoken", eviction).experiment
    extent = SimExecutor(config.model, config.gpu, config.sim, 0)
    gather = SimExecutor(config.model, config.gpu, replace(config.sim, attention_reads="live-tokens"), 0)
    naive_s = sum(extent.iteration_time_s(s.load) for s in naive)
    vtoken_s = sum(extent.iteration_time_s(s.load) for s in vtoken)
    assert vtoken_s < naive_s
    assert sum(gather.iteration_time_s(s.load) for s in vtoken) <= sum(gather.iteration_time_s(s.load) for s in naive)


def test_fused_steps_charge_one_more_slot_per_request_and_step():
    config = make_config("native", EvictionConfig()).experiment
    sim = SimExecutor(config.model, config.gpu, config.sim, 0)
    one = StepLoad(1, 1000, 10, 2, 0, 0)
    four = StepLoad(4, 1000, 10, 2, 0, 0)
    per_slot_s = config.model.kv_bytes_per_token / (config.gpu.hbm_bytes_per_s * config.sim.hbm_efficiency)
    # 4 steps read 1000 + 1002 + 1004 + 1006 slots; each step also pays the weights and the overhead
    assert sim.iteration_time_s(four) - 4 * sim.iteration_time_s(one) == pytest.approx(12 * per_slot_s)


def test_live_tokens_model_charges_only_live_tokens():
    config = make_config("native", EvictionConfig()).experiment
    extent = SimExecutor(config.model, config.gpu, config.sim, 0)
    gather = SimExecutor(config.model, config.gpu, SimProfile(attention_reads="live-tokens"), 0)
    load = StepLoad(1, num_kv_slots_read=4096, num_live_kv_tokens=1024, num_decoding_requests=4,
                    num_prefill_tokens=0, num_copied_tokens=0)
    assert extent.iteration_time_s(load) == extent.iteration_time_s(replace(load, num_live_kv_tokens=4096))
    assert gather.iteration_time_s(load) == extent.iteration_time_s(replace(load, num_kv_slots_read=1024))


def test_unknown_attention_model_is_refused():
    with pytest.raises(ConfigError, match="attention_reads must be one of kv-extent, live-tokens, got 'mask'"):
        SimProfile(attention_reads="mask")


def test_kv_extent_counts_dead_slots_and_stops_at_the_cursor():
    pool = BlockPool(8, 4)
    table = TokenTable(0, pool)
    assert kv_extent(table) == 0
    table.sync_new_tokens(pool.allocate(4), 14)  # [L L L L][L L L L][L L L L][L L . .]
    table.evict_tokens([1, 4, 6, 7, 9, 10])  # [L . L L][. L . .][L . . L][L L . .]
    assert (kv_extent(table), table.num_live_tokens) == (14, 8)
    table.evict_tokens([12, 13])  # the tail: dead, still held and still read up to the cursor
    assert kv_extent(table) == 14


# ---- packing under memory pressure -----------------------------------------------------------


class WatchedReclaimer(Reclaimer):
    """A reclaimer that checks, at every pressure round, that memory was short."""

    runtime: Runtime

    def plan_to_free(self, tables, busy_req_ids, num_blocks):
        sched, experiment = self.runtime.scheduler, self.runtime.experiment
        num_growth = sched.num_blocks_to_grow(list(sched.running), experiment.scheduler.max_fused_steps)  # >= the round's steps
        admission_waits = sched.num_blocks_to_admit_next() > 0
        assert admission_waits or self.num_admissible_blocks() < num_growth + self.num_pressure_reserve_blocks
        plans = super().plan_to_free(tables, busy_req_ids, num_blocks)
        assert sum(p.num_blocks_freed for p in plans) <= num_blocks  # hole-fill: no further than asked
        self.runtime.num_checked_rounds += 1
        return plans


def watched_run(run: Run, requests: list[Request]) -> Runtime:
    experiment = run.experiment
    runtime = Runtime(run, requests, SimExecutor(experiment.model, experiment.gpu, experiment.sim, experiment.seed),
                      planner_factory=WatchedReclaimer)
    runtime.reclaimer.runtime = runtime
    runtime.num_checked_rounds = 0
    runtime.run()
    return runtime


@settings(max_examples=30, deadline=None)
@given(requests=workloads, budget=budgets, num_blocks=st.integers(30, 120), concurrency=st.integers(1, 8),
       theta_f=st.sampled_from([0.05, 0.25, 0.9]))
def test_pressure_packing_runs_only_when_memory_is_short(requests, budget, num_blocks, concurrency, theta_f):
    config = make_config("vtoken", EvictionConfig("h2o", budget, 16), num_blocks=num_blocks, concurrency=concurrency,
                         reclaim=ReclaimConfig(theta_f=theta_f))
    runtime = watched_run(config, requests)
    assert runtime.num_checked_rounds == runtime.reclaim_work["pressure"].num_rounds


def test_pressure_packing_avoids_the_preemptions_lazy_packing_leaves():
    """theta_F = 0.9: the lazy trigger never fires; pressure alone packs, as far as the pool needs."""
    requests = [Request(str(i), 0.0, 200, 600) for i in range(6)]
    eviction = EvictionConfig("h2o", Budget(keep_ratio=0.5, num_sink_tokens=4, num_recent_tokens=32), 32)
    tight = {"num_blocks": 190, "concurrency": 6, "reclaim": ReclaimConfig(theta_f=0.9)}
    naive, naive_preempted = replay(make_config("naive-evict", eviction, **tight), requests)
    runtime = watched_run(make_config("vtoken", eviction, **tight), requests)
    assert naive_preempted > 0
    assert runtime.counters.preemptions == 0
    assert runtime.reclaim_work["lazy"].num_plans == 0
    pressure = runtime.reclaim_work["pressure"]
    assert pressure.num_rounds == runtime.num_checked_rounds > 0
    assert pressure.num_blocks_freed == runtime.counters.blocks_reclaimed
    assert pressure.num_tokens_moved <= S * pressure.num_blocks_freed  # hole-fill: at most a block's worth each


# ---- the synthetic attention's scores ----------------------------------------------------------


@pytest.mark.parametrize("beta", [1.0, 1.7])
def test_the_sims_scores_are_the_documented_formulas(beta: float) -> None:
    """attention_sum = w * sum_{d<=age} r(d), attention_last = w * r(age), importance_count =
    queries of the window within max_age_j, from tables the executor keeps across requests and
    lengths; a policy's `fields` only leave the others out."""
    import numpy as np

    profile = SimProfile(recency_beta=beta)
    executor = SimExecutor(resolve_model("llama-3.1-8b"), resolve_gpu("h100"), profile, seed=5)
    tau = profile.recency_tau
    for req_idx, num_tokens in ((0, 40), (1, 3000), (0, 700), (2, 1)):  # tables grow, then are reused
        token_ids = np.flatnonzero(np.random.default_rng(num_tokens).random(num_tokens) < 0.6)
        attention_sum, attention_last, importance_count = executor.attention_stats(req_idx, token_ids, num_tokens)
        w = executor.importance(req_idx, num_tokens)[token_ids]
        age = (num_tokens - 1 - token_ids).astype(np.float64)
        recency = (1.0 + age / tau) ** -beta
        cumulative = (1.0 + np.log1p(age / tau) * tau if beta == 1.0
                      else 1.0 + tau * ((1.0 + age / tau) ** (1.0 - beta) - 1.0) / (1.0 - beta))
        np.testing.assert_allclose(attention_last, w * recency, rtol=1e-12)
        np.testing.assert_allclose(attention_sum, w * cumulative, rtol=1e-12)
        max_age = np.floor(tau * ((w / profile.importance_threshold) ** (1.0 / beta) - 1.0))
        first_query = max(0, num_tokens - profile.importance_window)
        expected_count = [sum(1 for q in range(first_query, num_tokens) if 0 <= q - j <= a) for j, a in zip(token_ids, max_age)]
        assert importance_count.tolist() == expected_count
        only_sum = executor.attention_stats(req_idx, token_ids, num_tokens, ("attention_sum",))
        assert only_sum[1] is None and only_sum[2] is None and np.array_equal(only_sum[0], attention_sum)
