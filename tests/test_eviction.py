"""The one eviction schedule and view builder (vtoken/engine/eviction.py), and that every
executor asks it: the sim runtime and the vLLM tracker make the same decisions on the same
request."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest

from vtoken.engine import Experiment, Runtime, SimExecutor
from vtoken.engine.experiment import EvictionConfig
from vtoken.engine.eviction import EvictionClock, EvictionSchedule, build_view
from vtoken.engine.vllm.settings import VllmSettings
from vtoken.engine.vllm.tracker import VTokenTracker
from vtoken.hardware import resolve_gpu
from vtoken.kv.block_pool import BlockPool
from vtoken.kv.reclaim import ReclaimConfig
from vtoken.kv.token_table import TokenTable
from vtoken.model_spec import resolve_model
from vtoken.policies import make_policy
from vtoken.policies.base import Budget
from vtoken.trace import Request

ROOT = Path(__file__).resolve().parent.parent
S = 4


class RecordingPolicy:
    """Wraps a policy and records every view it was asked about: (length, keep, ids offered, victims)."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.needs_attention, self.score_fields = inner.needs_attention, inner.score_fields
        self.log: list[tuple[int, int, tuple[int, ...], tuple[int, ...]]] = []

    def select_victims(self, view):
        victims = self.inner.select_victims(view)
        self.log.append((view.num_logical_tokens, view.num_keep_tokens, tuple(view.token_ids.tolist()),
                         tuple(victims.tolist())))
        return victims


def table_of(num_tokens: int, num_blocks: int = 16) -> TokenTable:
    pool = BlockPool(num_blocks, S)
    table = TokenTable(0, pool)
    table.sync_new_tokens(pool.allocate(-(-num_tokens // S)), num_tokens)
    return table


def schedule(policy: str = "streaming_llm", keep: int = 6, interval: int = 4) -> EvictionSchedule:
    config = EvictionConfig(policy, Budget(num_tokens=keep, num_sink_tokens=1, num_recent_tokens=2), interval)
    return EvictionSchedule(config, RecordingPolicy(make_policy(policy)))


def test_the_policy_runs_after_prefill_and_every_interval_tokens():
    sched, clock, table = schedule(), EvictionClock(), table_of(10)
    assert sched.decide(clock, 0, table, num_generated=1) is not None  # right after prefill
    assert clock.next_eviction_at == 4
    for num_generated in (2, 3):
        table.sync_new_tokens(np.zeros(0, dtype=np.int64) if table.num_free_tail_slots() else table.pool.allocate(1),
                              table.num_tokens + 1)
        assert sched.decide(clock, 0, table, num_generated) is None
    assert [length for length, *_ in sched.policy.log] == [10]


def test_a_clock_is_due_from_its_next_point_or_at_once_while_a_resume_is_pending():
    """`due_at` follows both fields whichever is set and in any order: is_due is the rule
    (a resume pending, or num_generated at the next point), which the runtime asks as one
    comparison of it at every step."""
    sched, clock = schedule(interval=4), EvictionClock(next_eviction_at=8)
    rule = lambda n: clock.resume_token_ids is not None or n >= clock.next_eviction_at  # noqa: E731
    for change in ("resume", "next 12", "clear", "next 4", "resume", "next 20", "clear"):
        if change == "resume":
            clock.resume_token_ids = np.array([2, 3])
        elif change == "clear":
            clock.resume_token_ids = None
        else:
            clock.next_eviction_at = int(change.split()[1])
        assert [sched.is_due(clock, n) for n in range(24)] == [rule(n) for n in range(24)]
    assert clock.due_at == 20 and EvictionClock().due_at == 1 and EvictionClock(5, np.array([1])).due_at == 0


def test_a_fused_overshoot_shows_the_request_as_it_was_at_its_eviction_point():
    sched, clock, table = schedule(interval=4), EvictionClock(next_eviction_at=4), table_of(16)
    event = sched.decide(clock, 0, table, num_generated=7)  # 3 steps past the point: ids 13..15 are hidden
    length, keep, offered, victims = sched.policy.log[-1]
    assert length == 13 and max(offered) == 12 and keep == 6
    assert event.num_tokens == 16  # the tokens go now, at the table's length
    assert clock.next_eviction_at == 8


def test_the_view_hides_the_pinned_prefix_and_takes_it_out_of_the_keep_count():
    table = table_of(12)
    table.pin_prefix(8)
    config = EvictionConfig("streaming_llm", Budget(num_tokens=10, num_sink_tokens=1, num_recent_tokens=2), 4)
    view = build_view(0, table, config, 12, None)
    assert view.token_ids.tolist() == [8, 9, 10, 11]
    assert view.num_keep_tokens == 2


def test_after_a_preemption_the_lost_tokens_go_again_without_asking_the_policy():
    sched, clock, table = schedule(), EvictionClock(), table_of(10)
    event = sched.decide(clock, 0, table, num_generated=1)
    table.evict_tokens(event.token_ids)
    sched.on_preempt(clock, table)
    recomputed = table_of(11)  # the recompute: every token again
    resumed = sched.decide(clock, 0, recomputed, num_generated=2)
    assert resumed.is_resume and resumed.token_ids.tolist() == sorted(event.token_ids.tolist())
    assert resumed.num_tokens == 11 and len(sched.policy.log) == 1
    assert sched.decide(clock, 0, recomputed, num_generated=3) is None  # the interval continues as before


def test_a_request_built_in_one_module_only():
    """RequestView is constructed in vtoken/engine/eviction.py and nowhere else in the library."""
    builders = []
    for path in sorted((ROOT / "vtoken").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == "RequestView":
                builders.append(path.relative_to(ROOT).as_posix())
    assert builders == ["vtoken/engine/eviction.py"]


# ---- the same decisions on the sim runtime and on the vLLM tracker ---------------------------------


def runtime_decisions(policy: str, budget: Budget, interval: int, request: Request) -> list:
    experiment = Experiment(resolve_model("llama-3.1-8b"), resolve_gpu("h100"), num_blocks=4000, block_size=S,
                            eviction=EvictionConfig(policy, budget, interval), reclaim=ReclaimConfig(theta_f=0.01))
    executor = SimExecutor(experiment.model, experiment.gpu, experiment.sim, experiment.seed)
    runtime = Runtime(experiment.run("vtoken", 1), [request], executor)
    runtime.eviction.policy = recorder = RecordingPolicy(runtime.eviction.policy)
    runtime.run()
    return recorder.log


def tracker_decisions(policy: str, budget: Budget, interval: int, request: Request) -> list:
    """Drive the tracker as vLLM's scheduler does: sync what the step computes, then after_step."""
    settings = VllmSettings("vtoken", EvictionConfig(policy, budget, interval), ReclaimConfig(check_interval_steps=1))
    tracker = VTokenTracker(settings, num_blocks=4000, block_size=S)
    tracker.eviction.policy = recorder = RecordingPolicy(tracker.eviction.policy)
    next_vllm_block = iter(range(4000))
    vllm_blocks: list[int] = []

    def step(num_new_tokens: int, num_output_tokens: int) -> None:
        if tracker.num_new_blocks_needed("r", num_new_tokens):
            vllm_blocks.extend(next(next_vllm_block) for _ in range(tracker.num_new_blocks_needed("r", num_new_tokens)))
        tracker.sync("r", num_new_tokens, vllm_blocks)
        tracker.take_step_plan(["r"])
        tracker.complete_moves()
        tracker.after_step("r", num_output_tokens, tracker.requests["r"].table.num_tokens)

    tracker.req_idx("r")
    step(request.num_prompt_tokens, 1)
    for num_output_tokens in range(2, request.num_output_tokens + 1):
        step(1, num_output_tokens)
    return recorder.log


@pytest.mark.parametrize("policy", ["streaming_llm", "random"])
@pytest.mark.parametrize("budget", [Budget(num_tokens=40, num_sink_tokens=4, num_recent_tokens=8),
                                    Budget(keep_ratio=0.5, num_sink_tokens=4, num_recent_tokens=8)])
def test_sim_and_vllm_make_the_same_decisions_on_the_same_request(policy, budget):
    request = Request("r", 0.0, 57, 70)
    sim = runtime_decisions(policy, budget, 16, request)
    vllm = tracker_decisions(policy, budget, 16, request)
    assert len(sim) == 1 + (70 - 1) // 16
    assert sim == vllm
