"""The scheduler schedules as vLLM V1 does (vllm/v1/core/sched/scheduler.py, `Scheduler.schedule`).

Hand-checked cases first, then property tests over random workloads, token budgets, chunk caps
and block budgets tight enough to preempt: no step exceeds the token budget or max_num_seqs, a
request's prompt is fully computed before its first output token, preemption takes the most
recently admitted running request; and a differential check: with a budget no prompt reaches,
chunked prefill changes nothing and every prefill is whole.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vtoken.compare import variant_to_json
from vtoken.engine import Experiment, Run, Runtime, SimExecutor
from vtoken.engine.batch_limits import documented_batch_defaults, vllm_batch_defaults
from vtoken.engine.experiment import EvictionConfig, SchedulerConfig
from vtoken.errors import ConfigError
from vtoken.hardware import GPUS, resolve_gpu
from vtoken.model_spec import resolve_model
from vtoken.policies.base import Budget
from vtoken.trace import Request

S = 16


class RecordingSim(SimExecutor):
    """The sim executor, keeping what each step scheduled and the running set then."""

    def __init__(self, experiment: Experiment) -> None:
        super().__init__(experiment.model, experiment.gpu, experiment.sim, experiment.seed)
        self.runtime: Runtime | None = None
        self.steps: list[dict] = []

    def execute(self, batch, load):
        self.steps.append({
            "decode": [s.req_idx for s in batch.decode],
            "chunks": [(c.state.req_idx, c.num_context_tokens, c.num_new_tokens, c.is_last) for c in batch.prefill],
            "num_tokens": batch.num_scheduled_tokens,
            "num_running": len(self.runtime.scheduler.running),
        })
        return super().execute(batch, load)


class WatchedRuntime(Runtime):
    """Checks every preemption's victim against the running set as it was then, and that the
    O(1) bound pressure packing gates on never undercounts the next step's growth."""

    def schedule(self):
        assert self.scheduler.max_num_blocks_to_grow() >= self.scheduler.num_blocks_to_grow()
        return super().schedule()

    def on_preempt(self, state):
        running = self.scheduler.running
        assert state.admitted_seq == max(s.admitted_seq for s in running)
        assert state is running[-1]
        self.victims.append(state.req_idx)
        super().on_preempt(state)


SCHEDULER_FIELDS = {"max_num_batched_tokens", "max_num_seqs", "enable_chunked_prefill", "long_prefill_token_threshold",
                    "evict_every_chunk"}


def make_config(variant: str = "native", concurrency: int | None = 4, **overrides) -> Run:
    """A run; `overrides` are Experiment fields or SchedulerConfig fields."""
    scheduler = SchedulerConfig(**{"max_num_batched_tokens": 8192, "max_num_seqs": 256,
                                   **{k: v for k, v in overrides.items() if k in SCHEDULER_FIELDS}})
    eviction = EvictionConfig("h2o", Budget(keep_ratio=0.5, num_sink_tokens=4, num_recent_tokens=16), 16)
    base = Experiment(resolve_model("llama-3.1-8b"), resolve_gpu("h100"), num_blocks=20_000, block_size=S,
                      eviction=eviction, scheduler=scheduler)
    return replace(base, **{k: v for k, v in overrides.items() if k not in SCHEDULER_FIELDS}).run(variant, concurrency)


def with_scheduler(run: Run, **fields) -> Run:
    return Run(replace(run.experiment, scheduler=replace(run.experiment.scheduler, **fields)), run.spec)


def replay(run: Run, requests: list[Request]) -> tuple[WatchedRuntime, RecordingSim]:
    executor = RecordingSim(run.experiment)
    runtime = WatchedRuntime(run, requests, executor)
    executor.runtime = runtime
    runtime.victims = []
    runtime.result = runtime.run()
    return runtime, executor


# ---- by hand ----------------------------------------------------------------------------------


def test_decodes_first_then_a_long_prompt_in_chunks_of_what_the_budget_leaves():
    """Budget 100: two 40-token prompts, then a 250-token one arrives into two decodes."""
    requests = [Request("a", 0.0, 40, 5), Request("b", 0.0, 40, 5), Request("c", 0.0, 250, 2)]
    _, sim = replay(make_config(max_num_batched_tokens=100, concurrency=3), requests)
    assert sim.steps[0]["chunks"] == [(0, 0, 40, True), (1, 0, 40, True), (2, 0, 20, False)]
    assert sim.steps[1]["decode"] == [0, 1] and sim.steps[1]["chunks"] == [(2, 20, 98, False)]
    assert sim.steps[2]["decode"] == [0, 1] and sim.steps[2]["chunks"] == [(2, 118, 98, False)]
    assert sim.steps[3]["decode"] == [0, 1] and sim.steps[3]["chunks"] == [(2, 216, 34, True)]
    assert sim.steps[4]["decode"] == [0, 1, 2]


def test_long_prefill_token_threshold_caps_a_chunk_unless_the_request_is_alone():
    _, sim = replay(make_config(long_prefill_token_threshold=64, concurrency=1), [Request("a", 0.0, 200, 2)])
    assert sim.steps[0]["chunks"] == [(0, 0, 200, True)]
    _, sim = replay(make_config(long_prefill_token_threshold=64, concurrency=2),
                    [Request("a", 0.0, 200, 2), Request("b", 0.0, 10, 4)])
    assert sim.steps[0]["chunks"] == [(0, 0, 64, False), (1, 0, 10, True)]


def test_without_chunked_prefill_a_prompt_waits_for_a_step_that_holds_it_whole():
    requests = [Request("a", 0.0, 60, 3), Request("b", 0.0, 60, 3)]
    _, sim = replay(make_config(max_num_batched_tokens=100, enable_chunked_prefill=False, concurrency=2), requests)
    assert sim.steps[0]["chunks"] == [(0, 0, 60, True)]
    assert sim.steps[1] | {"num_running": None} == {"decode": [0], "chunks": [(1, 0, 60, True)], "num_tokens": 61,
                                                    "num_running": None}


def test_a_prompt_longer_than_the_budget_without_chunking_is_skipped_with_the_reason():
    runtime, _ = replay(make_config(max_num_batched_tokens=100, enable_chunked_prefill=False, concurrency=1),
                        [Request("long", 0.0, 150, 2), Request("short", 0.0, 20, 2)])
    assert runtime.result.skipped == (
        ("long", "needs 150 tokens in one step with chunked prefill off, max_num_batched_tokens is 100"),)
    assert runtime.result.num_completed == 1


def test_max_num_seqs_holds_back_admissions():
    requests = [Request(str(i), 0.0, 20, 4) for i in range(5)]
    _, sim = replay(make_config(max_num_seqs=2, concurrency=5), requests)
    assert max(step["num_running"] for step in sim.steps) == 2
    assert sim.steps[0]["chunks"] == [(0, 0, 20, True), (1, 0, 20, True)]


def test_preemption_takes_the_most_recently_admitted_and_it_resumes_first():
    """Three requests of 40 + 80 tokens in 16 blocks of 16 (256 slots): they are admitted (their
    prompts fit), then decode growth preempts the last admitted, which is recomputed later."""
    requests = [Request(str(i), 0.0, 40, 80) for i in range(3)]
    runtime, _ = replay(make_config(num_blocks=16, concurrency=3), requests)
    assert runtime.victims[0] == 2
    assert runtime.result.preemptions == len(runtime.victims) > 0
    assert runtime.result.num_completed == 3


def test_vllm_defaults_by_gpu_memory_as_vllm_0_32_documents_them():
    by_gpu = {name: (d.max_num_batched_tokens, d.max_num_seqs)
              for name, d in ((n, documented_batch_defaults(g)) for n, g in GPUS.items())}
    assert by_gpu == {"h100-80gb": (8192, 1024), "h200": (8192, 1024), "a100-80gb": (2048, 256), "l40s": (2048, 256)}
    assert vllm_batch_defaults(GPUS["h100-80gb"]).source.startswith("vLLM 0.32 vllm/engine/arg_utils.py")


def test_an_experiment_without_limits_takes_vllm_defaults_and_given_ones_win():
    experiment = Experiment(resolve_model("llama-3.1-8b"), resolve_gpu("l40s"), num_blocks=100)
    resolved = experiment.with_scheduler_defaults().scheduler
    assert (resolved.max_num_batched_tokens, resolved.max_num_seqs) == (2048, 256)
    given = replace(experiment, scheduler=SchedulerConfig(max_num_seqs=7)).with_scheduler_defaults().scheduler
    assert (given.max_num_batched_tokens, given.max_num_seqs) == (2048, 7)


def test_every_chunk_eviction_is_refused_for_policies_that_rank_by_attention():
    with pytest.raises(ConfigError, match="h2o ranks tokens by the attention the whole prompt's queries paid"):
        make_config(evict_every_chunk=True)


def test_every_chunk_eviction_evicts_during_the_prompt():
    eviction = EvictionConfig("streaming_llm", Budget(keep_ratio=0.5, num_sink_tokens=4, num_recent_tokens=16), 16)
    config = make_config("naive-evict", eviction=eviction, max_num_batched_tokens=64, concurrency=1)
    after_last, _ = replay(config, [Request("a", 0.0, 300, 4)])
    every, _ = replay(with_scheduler(config, evict_every_chunk=True), [Request("a", 0.0, 300, 4)])
    assert every.result.peak_allocated_blocks < after_last.result.peak_allocated_blocks
    assert every.counters.eviction_events > after_last.counters.eviction_events


# ---- properties ---------------------------------------------------------------------------------

workloads = st.lists(
    st.tuples(st.integers(1, 400), st.integers(1, 120)).map(lambda lengths: Request("r", 0.0, *lengths)),
    min_size=1, max_size=8,
).map(lambda reqs: [replace(r, request_id=str(i)) for i, r in enumerate(reqs)])
limits = st.fixed_dictionaries({
    "max_num_batched_tokens": st.sampled_from([16, 48, 128, 512]),
    "max_num_seqs": st.integers(1, 6),
    "enable_chunked_prefill": st.booleans(),
    "long_prefill_token_threshold": st.sampled_from([0, 0, 8, 40]),
})


@settings(max_examples=40, deadline=None)
@given(requests=workloads, limits=limits, variant=st.sampled_from(["native", "naive-evict", "vtoken"]),
       num_blocks=st.integers(8, 80), concurrency=st.integers(1, 8))
def test_every_step_keeps_the_limits_prompts_complete_before_output_and_preemption_takes_the_last(
        requests, limits, variant, num_blocks, concurrency):
    config = make_config(variant, num_blocks=num_blocks, concurrency=concurrency, **limits)
    runtime, sim = replay(config, requests)  # WatchedRuntime asserts each victim is the last admitted
    computed: dict[int, int] = {}  # tokens computed since the request's last (re)admission
    for step in sim.steps:
        assert 0 < step["num_tokens"] <= limits["max_num_batched_tokens"]
        assert step["num_running"] <= limits["max_num_seqs"]
        for req_idx, num_context, num_new, is_last in step["chunks"]:
            if num_context == 0:
                computed[req_idx] = 0
            assert computed[req_idx] == num_context
            computed[req_idx] += num_new
            if not limits["enable_chunked_prefill"] and not limits["long_prefill_token_threshold"]:
                assert num_context == 0 and is_last  # (vLLM applies the threshold even then)
        for req_idx in step["decode"]:
            computed[req_idx] += 1
    for record in runtime.result.requests:  # the first token came after the whole prompt
        assert record.first_token_s is not None and record.first_token_s > record.arrival_s
    first_sample = {}
    for idx, step in enumerate(sim.steps):
        for req_idx, num_context, num_new, is_last in step["chunks"]:
            if is_last and req_idx not in first_sample:
                first_sample[req_idx] = idx
                assert num_context + num_new >= requests[req_idx].num_prompt_tokens
        for req_idx in step["decode"]:
            assert req_idx in first_sample  # no decode before its prompt's last chunk
    assert runtime.result.num_completed + len(runtime.result.skipped) == len(requests)


@settings(max_examples=20, deadline=None)
@given(requests=workloads, variant=st.sampled_from(["native", "naive-evict", "vtoken"]),
       concurrency=st.integers(1, 8))
def test_with_a_budget_no_prompt_reaches_chunking_changes_nothing_and_prefills_are_whole(
        requests, variant, concurrency):
    huge = make_config(variant, concurrency=concurrency, max_num_batched_tokens=1 << 20)
    chunked_run, chunked = replay(huge, requests)
    whole_run, whole = replay(with_scheduler(huge, enable_chunked_prefill=False), requests)
    assert chunked.steps == whole.steps
    assert variant_to_json(chunked_run.result) == variant_to_json(whole_run.result)
    assert chunked_run.result.requests == whole_run.result.requests
    for step in chunked.steps:
        assert all(num_context == 0 and is_last for _, num_context, _, is_last in step["chunks"])


def test_the_vllm_engine_is_given_the_experiment_s_scheduler_limits():
    from vtoken.engine.vllm.run import engine_spec_for

    experiment = Experiment(resolve_model("smollm2-135m"), resolve_gpu("h100-80gb"), 200, 32,
                            scheduler=SchedulerConfig(max_num_batched_tokens=96, max_num_seqs=16,
                                                      long_prefill_token_threshold=32))
    kwargs = engine_spec_for(experiment, 3, "model-dir").llm_kwargs()
    assert (kwargs["max_num_batched_tokens"], kwargs["long_prefill_token_threshold"], kwargs["enable_chunked_prefill"]) == \
        (96, 32, True)
    assert kwargs["max_num_seqs"] == 3  # closed loop: at most `concurrency` exist at once
    assert engine_spec_for(experiment, None, "model-dir").llm_kwargs()["max_num_seqs"] == 16  # open loop: the limit
    whole = replace(experiment, scheduler=SchedulerConfig(max_num_batched_tokens=96, max_num_seqs=16,
                                                          enable_chunked_prefill=False))
    with pytest.raises(ConfigError, match="with chunked prefill off, --max-num-batched-tokens \\(96\\)"):
        engine_spec_for(whole, 3, "model-dir")
