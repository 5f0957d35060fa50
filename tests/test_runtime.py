"""The runtime over the sim executor: variant properties and golden results."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from vtoken.engine import Experiment, Run, Runtime, SimExecutor, run_sim
from vtoken.engine.experiment import EvictionConfig
from vtoken.hardware import resolve_gpu
from vtoken.kv.reclaim import ReclaimConfig, Reclaimer, StepShare
from vtoken.model_spec import resolve_model
from vtoken.policies import POLICIES
from vtoken.policies.base import Budget
from vtoken.trace import Request, load_trace

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = Path(__file__).parent / "golden" / "azure_conv_sample.json"


def make_requests(num_requests: int, seed: int = 0) -> list[Request]:
    rng = np.random.default_rng(seed)
    return [Request(str(i), 0.0, int(rng.integers(40, 400)), int(rng.integers(20, 200))) for i in range(num_requests)]


def make_config(variant: str, concurrency: int | None = 4, **overrides) -> Run:
    base = Experiment(resolve_model("llama-3.1-8b"), resolve_gpu("h100"), num_blocks=4000)
    return replace(base, **overrides).run(variant, concurrency)


class RecordingPolicy:
    """Wraps a policy and records every decision (request, length, victims)."""

    def __init__(self, inner, log):
        self.inner, self.log = inner, log
        self.needs_attention, self.score_fields = inner.needs_attention, inner.score_fields

    def select_victims(self, view):
        victims = self.inner.select_victims(view)
        self.log.append((view.req_id, view.num_logical_tokens, tuple(victims.tolist())))
        return victims


def run_recorded(run: Run, requests):
    experiment = run.experiment
    runtime = Runtime(run, requests, SimExecutor(experiment.model, experiment.gpu, experiment.sim, experiment.seed))
    log: list = []
    runtime.eviction.policy = RecordingPolicy(runtime.eviction.policy, log)
    return runtime.run(), sorted(log)


def test_native_never_evicts():
    result = run_sim(make_config("native"), make_requests(20))
    assert result.tokens_evicted == 0
    assert result.tokens_moved == 0
    assert result.num_completed == 20


@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("mode", ["hole-fill", "ordered"])
def test_naive_and_vtoken_evict_exactly_the_same_tokens(policy, mode):
    requests = make_requests(16)
    eviction = EvictionConfig(policy, Budget(keep_ratio=0.4, num_sink_tokens=4, num_recent_tokens=16), 16)
    naive, naive_log = run_recorded(make_config("naive-evict", eviction=eviction), requests)
    vtoken, vtoken_log = run_recorded(make_config("vtoken", eviction=eviction, reclaim=ReclaimConfig(mode=mode)), requests)
    assert naive.preemptions == vtoken.preemptions == 0
    assert naive_log and naive_log == vtoken_log
    if policy != "streaming_llm":  # it evicts the oldest tokens: whole blocks die, nothing to pack
        assert vtoken.tokens_moved > 0


def test_hole_fill_never_holds_more_blocks_than_naive():
    requests = make_requests(24, seed=3)
    naive = run_sim(make_config("naive-evict"), requests)
    vtoken = run_sim(make_config("vtoken", reclaim=ReclaimConfig(mode="hole-fill", check_interval_steps=1)), requests)
    assert naive.num_iterations == vtoken.num_iterations
    assert np.all(vtoken.timeline.allocated_blocks <= naive.timeline.allocated_blocks)
    assert vtoken.timeline.allocated_blocks.sum() < naive.timeline.allocated_blocks.sum()


def test_ordered_holds_at_most_naive_plus_headroom():
    requests = make_requests(24, seed=4)
    reclaim = ReclaimConfig(mode="ordered", check_interval_steps=1)
    naive = run_sim(make_config("naive-evict"), requests)
    vtoken = run_sim(make_config("vtoken", reclaim=reclaim), requests)
    assert naive.num_iterations == vtoken.num_iterations
    assert np.all(vtoken.timeline.allocated_blocks <= naive.timeline.allocated_blocks + reclaim.num_headroom_blocks)


def test_tight_budget_preempts_and_vtoken_preempts_less():
    rng = np.random.default_rng(5)
    requests = [Request(str(i), 0.0, int(rng.integers(32, 64)), int(rng.integers(300, 600))) for i in range(40)]
    native = run_sim(make_config("native", num_blocks=200, concurrency=16), requests)
    vtoken = run_sim(make_config("vtoken", num_blocks=200, concurrency=16), requests)
    assert native.preemptions > 0
    assert vtoken.preemptions < native.preemptions
    assert native.num_completed == vtoken.num_completed == 40


def test_request_larger_than_budget_is_skipped_and_counted():
    requests = [Request("big", 0.0, 5000, 10), Request("ok", 0.0, 100, 10)]
    result = run_sim(make_config("native", num_blocks=64), requests)
    assert [rid for rid, _ in result.skipped] == ["big"]
    assert result.num_completed == 1


def test_shared_prefix_blocks_are_shared():
    requests = [Request(str(i), 0.0, 600, 50, prefix_id="p", num_prefix_tokens=512) for i in range(4)]
    alone = run_sim(make_config("native", concurrency=1), requests[:1])
    together = run_sim(make_config("native", concurrency=4), requests)
    # 4 requests of 38 blocks each would need 152 blocks; the 32 prefix blocks exist once
    assert together.peak_allocated_blocks == alone.peak_allocated_blocks + 3 * (alone.peak_allocated_blocks - 32)


def test_open_loop_respects_arrivals():
    requests = [Request("a", 0.0, 100, 20), Request("b", 50.0, 100, 20)]
    result = run_sim(make_config("vtoken", concurrency=None), requests)
    assert result.makespan_s > 50.0
    assert result.latency.p50_s < 5.0


def golden_figures() -> dict:
    trace = load_trace(ROOT / "sample_traces" / "azure_conv_sample.csv")
    out = {}
    for variant in ("native", "naive-evict", "vtoken"):
        result = run_sim(make_config(variant, num_blocks=2000, concurrency=16), trace.requests)
        out[variant] = {k: round(v, 6) for k, v in result.headline().items()}
    return out


def test_golden_results_for_the_azure_sample():
    """Changed only in a commit that says why: regenerate with `python tests/test_runtime.py`."""
    expected = json.loads(GOLDEN.read_text())
    assert golden_figures() == expected


if __name__ == "__main__":
    GOLDEN.write_text(json.dumps(golden_figures(), indent=2, sort_keys=True) + "\n")


def test_a_budget_that_follows_the_step_is_given_the_step_its_round_step_runs_after(monkeypatch):
    """--reclaim-budget auto: every lazy round step gets the executor's duration of the step it
    runs after (the sim's modelled one), and its plans move at most max(its budget, B' x S)."""
    reclaim = ReclaimConfig(max_moves_per_step=StepShare(moves_per_ms=2.0), theta_f=0.05, check_interval_steps=1)
    run = make_config("vtoken", concurrency=8, reclaim=reclaim)
    experiment = run.experiment
    executor = SimExecutor(experiment.model, experiment.gpu, experiment.sim, experiment.seed)
    durations: list[float] = []
    steps: list[tuple[int, float, int]] = []  # (steps executed before it, step_s, tokens its plans move)
    execute, plan = executor.execute, Reclaimer.plan

    def recording_execute(batch, load):
        durations.append(execute(batch, load))
        return durations[-1]

    def recording_plan(self, tables, busy_req_ids=frozenset(), step_s=None):
        plans = plan(self, tables, busy_req_ids, step_s)
        steps.append((len(durations), step_s, sum(p.num_tokens_moved for p in plans)))
        return plans

    executor.execute = recording_execute
    monkeypatch.setattr(Reclaimer, "plan", recording_plan)
    result = Runtime(run, make_requests(24), executor).run()
    launching = [s for s in steps if s[2]]
    assert result.tokens_moved > 0 and len(launching) > 5
    assert all(step_s == durations[num_executed - 1] for num_executed, step_s, _ in steps)
    share = reclaim.max_moves_per_step
    budgets = {share.num_moves(step_s, experiment.block_size) for _, step_s, _ in launching}
    assert len(budgets) > 1  # the steps' durations, and so their budgets, differed
    for _, step_s, moved in launching:  # max(budget, B' x S): B' = 1.25 x budget / S, B at most
        budget = share.num_moves(step_s, experiment.block_size)
        assert moved <= max(budget, share.num_src_blocks(budget, experiment.block_size, reclaim.max_src_blocks) * experiment.block_size)
