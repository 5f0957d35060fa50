"""The sim charges what a real engine does: attention reads each request's KV extent, dead tokens
in held blocks included, so only compaction makes it cheaper.

Property tests over random workloads, eviction settings and token budgets (prompts chunked
across steps), on the same admitted requests and no preemption: per step, vToken's KV read is
never above Naive-Evict's, for every policy with a recent window (one token at least, so the
open tail always holds the token just written and is a block opened where Naive-Evict opens
its own; without one, a policy may evict that token, and an open tail that is an older,
further written block is never packed; README, serving fidelity), and Naive-Evict's equals Native's
while no block has been handed back (no block fully dead yet). And the reclaimer's packing under memory
pressure runs only when memory is short: an admission waits for blocks, or the free pool is
below the next step's growth plus the reserve.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vtoken.engine import Experiment, Run, Runtime, SimExecutor, SimProfile
from vtoken.engine.experiment import EvictionConfig, SchedulerConfig
from vtoken.engine.executor import ChunkLoad, StepLoad, kv_extent
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
    num_tokens: int  # of the decodes, before this step's tokens
    has_handed_back: bool  # some request of the step holds fewer blocks than its tokens fill


class RecordingSim(SimExecutor):
    """The sim executor, keeping the load of every step it costs."""

    def __init__(self, experiment: Experiment) -> None:
        super().__init__(experiment.model, experiment.gpu, experiment.sim, experiment.seed)
        self.steps: list[StepRecord] = []

    def execute(self, batch, load: StepLoad) -> float:
        num_tokens = sum(s.table.num_tokens - 1 for s in batch.decode)  # the tables already hold the new token
        handed_back = any(s.table.num_blocks < -(-s.table.num_tokens // S) for s in batch.states)
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
                    st.sampled_from([0.2, 0.4, 0.6]), st.sampled_from([1, 2, 8, 16, 32]))
step_budgets = st.sampled_from([64, 256, 8192])  # max_num_batched_tokens: long prompts chunked at 64 and 256


def shape(steps: list[StepRecord]) -> list[tuple]:
    """What each step computed: its decodes and its prompt chunks' sizes."""
    return [(s.load.num_decoding_requests, tuple(c.num_new_tokens for c in s.load.prefill_chunks)) for s in steps]


@pytest.mark.parametrize("policy", sorted(POLICIES))
@settings(max_examples=25, deadline=None)
@given(requests=workloads, budget=budgets, interval=st.sampled_from([8, 16, 32]), step_budget=step_budgets)
def test_vtoken_reads_at_most_naive_and_naive_reads_native_until_a_block_is_handed_back(policy, requests, budget,
                                                                                         interval, step_budget):
    eviction = EvictionConfig(policy, budget, interval)
    scheduler = SchedulerConfig(max_num_batched_tokens=step_budget)
    native, native_preempted = replay(make_config("native", eviction, scheduler=scheduler), requests)
    naive, naive_preempted = replay(make_config("naive-evict", eviction, scheduler=scheduler), requests)
    vtoken, vtoken_preempted = replay(make_config("vtoken", eviction, scheduler=scheduler), requests)
    assert native_preempted == naive_preempted == vtoken_preempted == 0
    assert shape(native) == shape(naive) == shape(vtoken)
    for native_step, naive_step, vtoken_step in zip(native, naive, vtoken, strict=True):
        assert native_step.load.num_kv_slots_read == native_step.num_tokens  # native holds every token
        assert vtoken_step.load.num_kv_slots_read <= naive_step.load.num_kv_slots_read
        assert vtoken_step.load.num_live_kv_tokens == naive_step.load.num_live_kv_tokens  # same decisions
        assert naive_step.load.num_live_kv_tokens <= naive_step.load.num_kv_slots_read
        for naive_chunk, vtoken_chunk in zip(naive_step.load.prefill_chunks, vtoken_step.load.prefill_chunks):
            assert vtoken_chunk.num_context_slots <= naive_chunk.num_context_slots
        if not naive_step.has_handed_back:
            assert naive_step.load.num_kv_slots_read == native_step.load.num_kv_slots_read


def test_fifo_eviction_no_longer_leaves_vtoken_reading_more_than_naive():
    """Lazy hole-fill under FIFO eviction moves young tokens into the holes of old blocks; when
    the old tokens die, those blocks stay held by the moved ones while naive-evict frees them
    whole. Before the layout trigger this request read 145 slots at its last step where
    naive-evict read 129; now the runtime re-packs it right after that eviction."""
    requests = [Request("0", 0.0, 33, 162)]
    eviction = EvictionConfig("streaming_llm", Budget(keep_ratio=0.6, num_sink_tokens=4, num_recent_tokens=8), 16)
    naive, _ = replay(make_config("naive-evict", eviction), requests)
    run = make_config("vtoken", eviction)
    executor = RecordingSim(run.experiment)
    runtime = Runtime(run, requests, executor)
    runtime.run()
    vtoken = executor.steps
    excess = [v.load.num_kv_slots_read - n.load.num_kv_slots_read for n, v in zip(naive, vtoken, strict=True)]
    assert max(excess) <= 0
    assert runtime.reclaim_work["layout"].num_rounds > 0  # the case still arises: the trigger handled it
    assert sum(v.load.num_kv_slots_read for v in vtoken) < sum(n.load.num_kv_slots_read for n in naive)


def test_a_further_written_tail_is_no_longer_read_past_naive():
    """Request 6 held as many blocks as naive-evict's at step 203, but its open tail was an
    older block, written 13 slots deep where naive-evict's fresh tail holds 4: it read 129
    slots there against naive-evict's 120. A packed full tail no longer reopens an older block,
    so its open tail is a fresh block, as naive-evict's is."""
    lengths = [(8, 123), (141, 123), (108, 299), (239, 163), (272, 200), (239, 166), (36, 81)]
    requests = [Request(str(i), 0.0, *pair) for i, pair in enumerate(lengths)]
    eviction = EvictionConfig("streaming_llm", Budget(keep_ratio=0.2, num_sink_tokens=4, num_recent_tokens=16), 8)
    scheduler = SchedulerConfig(max_num_batched_tokens=256)
    naive, _ = replay(make_config("naive-evict", eviction, scheduler=scheduler), requests)
    vtoken, _ = replay(make_config("vtoken", eviction, scheduler=scheduler), requests)
    assert (naive[203].load.num_kv_slots_read, naive[203].load.num_live_kv_tokens) == (120, 87)
    assert vtoken[203].load.num_kv_slots_read <= 120
    assert all(v.load.num_kv_slots_read <= n.load.num_kv_slots_read for n, v in zip(naive, vtoken, strict=True))


def test_a_packed_full_tail_keeps_the_open_tail_in_phase_with_naive():
    """Request 1 packed its full tail (4 live tokens) into its sink block at 32 tokens. When
    that block became the tail again with its cursor after the moved tokens, the request wrote
    from offset 8 there, out of phase with Naive-Evict's fresh blocks: at 55 tokens it held as
    many blocks but read 31 slots against 23, the excess in an open tail that no re-pack may
    move. Now a full tail that goes leaves the new tail full, and the next token opens a fresh
    block, as Naive-Evict's does."""
    requests = [Request("0", 0.0, 185, 4), Request("1", 0.0, 8, 49)]
    eviction = EvictionConfig("streaming_llm", Budget(keep_ratio=0.2, num_sink_tokens=4, num_recent_tokens=1), 8)
    scheduler = SchedulerConfig(max_num_batched_tokens=64)
    naive, _ = replay(make_config("naive-evict", eviction, scheduler=scheduler), requests)
    vtoken, _ = replay(make_config("vtoken", eviction, scheduler=scheduler), requests)
    assert (naive[51].num_tokens, naive[51].load.num_kv_slots_read) == (55, 23)  # the step of the case
    assert all(v.load.num_kv_slots_read <= n.load.num_kv_slots_read for n, v in zip(naive, vtoken, strict=True))
    assert sum(v.load.num_copied_tokens for v in vtoken) > 0  # it still compacts


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


def test_a_mixed_step_pays_the_weights_once_and_each_part_its_reads_and_flops():
    """Two decodes and a 512-token chunk over a 1,000-slot context in one forward: the weights
    once, the decodes' extents + their new slots, the chunk's context + its own keys, and the
    chunk's FLOPs (linear, and attention over its context and causally over itself)."""
    config = make_config("native", EvictionConfig()).experiment
    sim = SimExecutor(config.model, config.gpu, config.sim, 0)
    model, gpu = config.model, config.gpu
    rate = gpu.hbm_bytes_per_s * config.sim.hbm_efficiency
    per_slot_s = model.kv_bytes_per_token / rate
    decodes = StepLoad(3000, 3000, 2, (), 0)
    chunk = ChunkLoad(num_context_slots=1000, num_context_live_tokens=1000, num_new_tokens=512)
    mixed = replace(decodes, prefill_chunks=(chunk,))
    flops = 2 * model.num_params * 512 + 4 * model.num_layers * model.num_attention_heads * model.head_dim * (
        512 * 1000 + 512 * 513 // 2)
    assert sim.iteration_time_s(decodes) == pytest.approx(
        config.sim.overhead_s + model.weight_bytes / rate + 3002 * per_slot_s)
    assert sim.iteration_time_s(mixed) - sim.iteration_time_s(decodes) == pytest.approx(
        1512 * per_slot_s + flops / (gpu.bf16_flop_per_s * config.sim.mfu))
    farther = replace(decodes, prefill_chunks=(replace(chunk, num_context_slots=3000),))
    assert sim.iteration_time_s(farther) > sim.iteration_time_s(mixed)  # a chunk reads its context so far


def test_live_tokens_model_charges_only_live_tokens():
    config = make_config("native", EvictionConfig()).experiment
    extent = SimExecutor(config.model, config.gpu, config.sim, 0)
    gather = SimExecutor(config.model, config.gpu, SimProfile(attention_reads="live-tokens"), 0)
    chunk = ChunkLoad(num_context_slots=2048, num_context_live_tokens=512, num_new_tokens=64)
    load = StepLoad(num_kv_slots_read=4096, num_live_kv_tokens=1024, num_decoding_requests=4,
                    prefill_chunks=(chunk,), num_copied_tokens=0)
    as_live = replace(load, num_kv_slots_read=1024, prefill_chunks=(replace(chunk, num_context_slots=512),))
    assert extent.iteration_time_s(load) == extent.iteration_time_s(
        replace(load, num_live_kv_tokens=4096, prefill_chunks=(replace(chunk, num_context_live_tokens=2048),)))
    assert gather.iteration_time_s(load) == extent.iteration_time_s(as_live)


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
        sched = self.runtime.scheduler
        num_growth = sched.num_blocks_to_grow()  # the next step's
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


@settings(max_examples=40, deadline=None)
@given(lengths=st.lists(st.integers(1, 3000), min_size=1, max_size=8), forget_at=st.integers(0, 8))
def test_a_requests_importance_is_one_stream_however_it_grows(lengths: list[int], forget_at: int) -> None:
    """w_j is drawn as the request grows, continuing its generator: at every length it equals
    the first values of one draw of the whole stream (1 + Pareto(alpha), the sinks boosted),
    and a request forgotten and asked again starts the same stream over."""
    import numpy as np

    profile = SimProfile()
    executor = SimExecutor(resolve_model("llama-3.1-8b"), resolve_gpu("h100"), profile, seed=11)
    whole = np.random.default_rng([11, 3]).pareto(profile.pareto_alpha, 4000) + 1.0
    whole[: profile.num_sink_tokens] *= profile.sink_boost
    seen = []
    for step, num_tokens in enumerate(lengths):
        if step == forget_at:
            executor.forget(3)
        weights = executor.importance(3, num_tokens)
        assert np.array_equal(weights, whole[:num_tokens])
        seen.append(weights.copy())
    for weights, num_tokens in zip(seen, lengths):  # an earlier result is not changed by later draws
        assert np.array_equal(weights, whole[:num_tokens])


@settings(max_examples=40, deadline=None)
@given(order=st.lists(st.integers(0, 300), min_size=1, max_size=12), forget=st.lists(st.integers(0, 300), max_size=4))
def test_a_stream_seeded_ahead_is_the_stream_seeded_on_demand(order: list[int], forget: list[int]) -> None:
    """Generators are seeded with those of the next requests: whatever order requests first ask
    in, and whichever were forgotten before they asked, each gets its own stream from its
    start, and no more than twice GENERATORS_SEEDED_AHEAD wait unused."""
    import numpy as np

    from vtoken.engine.sim import GENERATORS_SEEDED_AHEAD

    profile = SimProfile()
    executor = SimExecutor(resolve_model("llama-3.1-8b"), resolve_gpu("h100"), profile, seed=5)
    for req_idx in forget:
        executor.forget(req_idx)
    for req_idx in order:
        weights = executor.importance(req_idx, 40)
        whole = np.random.default_rng([5, req_idx]).pareto(profile.pareto_alpha, 40) + 1.0
        whole[: profile.num_sink_tokens] *= profile.sink_boost
        assert np.array_equal(weights, whole)
        assert len(executor._seeded) <= 2 * GENERATORS_SEEDED_AHEAD
        executor.forget(req_idx)  # asked again later, it starts over
