"""The step loop that serves every variant and executor.

    def step(self):
        batch = self.schedule()                       # arrivals, admission, growth, preemption
        duration_s = self.execute(batch)              # the executor runs (or costs) the forward
        self.postprocess(batch, duration_s)           # tokens, finishes, eviction, reclamation

Eviction decisions are identical across variants and executors: when a request's policy runs
and what it sees come from `engine/eviction.py`, which the vLLM scheduler asks too. Only what
happens to memory afterwards differs:

    native       no eviction
    naive-evict  dead tokens are skipped; a block is freed only when all its tokens are dead
    vtoken       the same, plus the reclaimer packs live tokens so that whole blocks come free
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from vtoken.engine.experiment import Run
from vtoken.engine.eviction import EvictionSchedule
from vtoken.engine.executor import Executor, StepCostModel, StepLoad, kv_extent, prefill_kv_pairs
from vtoken.engine.observer import NullObserver, RuntimeObserver
from vtoken.engine.scheduler import Batch, ReqState, Scheduler, TableFactory
from vtoken.invariants import check_plan
from vtoken.kv.block_pool import BlockPool
from vtoken.kv.copy_engine import CopyEngine
from vtoken.kv.reclaim import ReclaimConfig, Reclaimer, RelocationPlan
from vtoken.kv.token_table import TokenTable
from vtoken.metrics import MemorySample, Recorder, RunCounters, RunResult
from vtoken.policies import make_policy
from vtoken.trace import Request

PlannerFactory = Callable[[ReclaimConfig, BlockPool], Reclaimer]


@dataclass(frozen=True)
class ReclaimWork:
    """What one reclamation trigger (lazy or pressure) planned over a run."""

    num_rounds: int = 0  # times the trigger fired
    num_plans: int = 0
    num_tokens_moved: int = 0
    num_blocks_freed: int = 0

    def plus(self, plans: Sequence[RelocationPlan]) -> ReclaimWork:
        return ReclaimWork(self.num_rounds + 1, self.num_plans + len(plans),
                           self.num_tokens_moved + sum(p.num_tokens_moved for p in plans),
                           self.num_blocks_freed + sum(p.num_blocks_freed for p in plans))


class Runtime:
    """One replay of `requests` through `run.spec.variant` on `executor`.

    The parts a run is built from can be passed in, for the checker and its faults: the copy
    engine (default: synchronous, no KV tensor), an observer of every event, the factory of the
    reclaimer (vtoken variant only) and the factory of every token table.
    """

    def __init__(
        self,
        run: Run,
        requests: Sequence[Request],
        executor: Executor,
        *,
        copy_engine: CopyEngine | None = None,
        observer: RuntimeObserver | None = None,
        planner_factory: PlannerFactory = Reclaimer,
        table_factory: TableFactory = TokenTable,
    ) -> None:
        if executor.max_fused_steps > 1 and not isinstance(executor, StepCostModel):
            raise TypeError(f"executor {executor.name!r} fuses decode steps but cannot predict their duration")
        experiment, spec = run.experiment, run.spec
        self.experiment = experiment
        self.spec = spec
        self.executor = executor
        self.num_output_tokens = sum(r.num_output_tokens for r in requests)  # the progress total
        self.pool = BlockPool(experiment.num_blocks, experiment.block_size)
        self.scheduler = Scheduler(self.pool, list(requests), spec.concurrency, experiment.scheduler.max_num_seqs,
                                   spec.admit_all_at_start, table_factory=table_factory)
        self.eviction = EvictionSchedule(experiment.eviction,
                                         make_policy(experiment.eviction.policy, seed=experiment.seed))
        self.reclaimer = planner_factory(experiment.reclaim, self.pool) if spec.reclaims else None
        self.copy_engine = copy_engine or CopyEngine(None, "sync")
        self.observer = observer or NullObserver()
        self._is_observed = not isinstance(self.observer, NullObserver)  # else no event needs its arguments built
        self.recorder = Recorder(experiment.model.kv_bytes_per_token)
        self.counters = RunCounters()
        self.now_s = 0.0
        self.num_iterations = 0
        self.num_decode_steps = 0
        self.num_generated_tokens = 0  # over every step, recomputation after a preemption included
        self._num_copied_tokens = 0
        self._busy_req_ids: frozenset[int] = frozenset()
        self.reclaim_work = {"lazy": ReclaimWork(), "pressure": ReclaimWork()}  # by trigger

    # ---- the spine ---------------------------------------------------------------------------

    def run(self, on_progress: Callable[[int], None] | None = None) -> RunResult:
        """Replay to the end. `on_progress(n)`: n more tokens generated, as steps complete; the
        calls sum to the requests' output tokens exactly (a preemption's recomputed tokens are not
        counted twice, a skipped request's are reported at the end)."""
        started = time.perf_counter()
        num_total = self.num_output_tokens
        num_reported = 0
        while self.scheduler.has_work():
            self.step()
            num_now = min(self.num_generated_tokens, num_total)
            if on_progress is not None and num_now > num_reported:
                on_progress(num_now - num_reported)
                num_reported = num_now
        for plan in self.copy_engine.drain():
            self._complete(plan)
        if on_progress is not None and num_reported < num_total:
            on_progress(num_total - num_reported)
        return self._result(time.perf_counter() - started)

    def step(self) -> None:
        batch = self.schedule()
        if batch is None:
            return
        duration_s = self.execute(batch)
        self.postprocess(batch, duration_s)

    def recorder_completed(self) -> int:
        return len(self.recorder.latencies_s)

    # ---- schedule ----------------------------------------------------------------------------

    def schedule(self) -> Batch | None:
        sched = self.scheduler
        if not sched.running and not sched.waiting:
            self.now_s = max(self.now_s, sched.next_arrival_s())
        before = len(sched.waiting)
        sched.collect_arrivals(self.now_s)
        for state in list(sched.waiting)[before:]:
            self.recorder.record_arrival(state.arrival_s)
        decode = list(sched.running)
        num_steps = self._num_fusable_steps(decode) if decode else 1
        admissible = self.pool.num_free_blocks
        if self.reclaimer is not None and decode:
            self._pack_under_pressure(decode, num_steps)
            admissible = self.reclaimer.num_admissible_blocks()
        prefill = sched.admit(admissible, self.now_s)
        for state in prefill:
            self.observer.on_synced(state.table, 0)
        num_steps = self._make_room(decode, 1 if prefill else num_steps)
        decode = [s for s in decode if s.table is not None]
        prefill = [s for s in prefill if s.table is not None]
        if not decode and not prefill:
            return None
        batch = Batch(tuple(prefill), tuple(decode), num_steps, *_kv_read_counts(decode))
        for state in decode:
            self._grow(state, num_steps)
        return batch

    def _num_fusable_steps(self, decode: list[ReqState]) -> int:
        """Decode steps to advance at once: until the first finish, at most `max_fused_steps`
        and one eviction interval, and not past the next open-loop arrival."""
        limit = min(self.experiment.scheduler.max_fused_steps, self.executor.max_fused_steps,
                    self.experiment.eviction.interval_tokens)
        num_steps = min([limit] + [s.num_remaining for s in decode])
        next_arrival_s = self.scheduler.next_arrival_s()
        while num_steps > 1 and next_arrival_s is not None and self.now_s + self._decode_time_s(decode, num_steps) > next_arrival_s:
            num_steps //= 2
        return max(1, num_steps)

    def _decode_time_s(self, decode: list[ReqState], num_steps: int) -> float:
        num_slots, num_live = _kv_read_counts(decode)
        load = StepLoad(num_steps, num_slots, num_live, len(decode), num_prefill_tokens=0, num_copied_tokens=0)
        return self.executor.iteration_time_s(load)  # a StepCostModel: checked in __init__

    def _make_room(self, decode: list[ReqState], num_steps: int) -> int:
        """Shrink the fused steps, then preempt, until the batch's growth fits in the pool."""
        sched = self.scheduler
        while True:
            growing = [s for s in decode if s.table is not None]
            num_needed = sched.num_blocks_to_grow(growing, num_steps)
            if num_needed <= self.pool.num_free_blocks:
                return num_steps
            if num_steps > 1:
                num_steps = 1
                continue
            if len(sched.running) == 1:
                state = sched.running[0]
                self._leave(state)
                sched.drop(state, f"does not fit in {self.pool.num_blocks} blocks even alone", self.now_s)
                self.executor.forget(state.req_idx)
                return num_steps
            victim = sched.running[-1]
            self._leave(victim)
            if self.spec.evicts:
                self.eviction.on_preempt(victim.eviction, victim.table)
            sched.preempt_last()
            self.counters = self.counters.plus(preemptions=1)

    # ---- execute -----------------------------------------------------------------------------

    def execute(self, batch: Batch) -> float:
        """The forward: the executor runs (or costs) it after every in-flight copy it needs."""
        self.copy_engine.wait_before_forward()
        for plan in self.copy_engine.poll_completed():
            self._complete(plan)
        self.observer.on_forward(batch, self.copy_engine.in_flight_plans)
        load = StepLoad(
            num_decode_steps=batch.num_decode_steps,
            num_kv_slots_read=batch.num_kv_slots_read,
            num_live_kv_tokens=batch.num_live_kv_tokens,
            num_decoding_requests=len(batch.decode),
            num_prefill_tokens=sum(s.table.num_tokens for s in batch.prefill),
            num_copied_tokens=self._num_copied_tokens,
            num_prefill_requests=len(batch.prefill),
            num_prefill_kv_pairs=sum(prefill_kv_pairs(0, s.table.num_tokens) for s in batch.prefill),
        )
        self._num_copied_tokens = 0
        return self.executor.execute(batch, load)

    # ---- postprocess -------------------------------------------------------------------------

    def postprocess(self, batch: Batch, duration_s: float) -> None:
        self.now_s += duration_s
        self.num_iterations += 1
        self.num_decode_steps += batch.num_decode_steps
        self.num_generated_tokens += len(batch.decode) * batch.num_decode_steps + len(batch.prefill)
        for state in batch.decode:
            state.num_generated += batch.num_decode_steps
        for state in batch.prefill:
            state.num_generated += 1
            if state.first_token_s is None:
                state.first_token_s = self.now_s
        for state in batch.prefill + batch.decode:
            if state.num_remaining == 0:
                self._finish(state)
            elif self.spec.evicts and self.eviction.is_due(state.eviction, state.num_generated):
                self._evict(state)
        if self.reclaimer is not None and self.reclaimer.is_eligible(self.num_iterations):
            self._reclaim()
        self.recorder.sample(self.now_s, len(self.scheduler.running), MemorySample.of_pool(self.pool))

    def _grow(self, state: ReqState, num_steps: int) -> None:
        """Place the KV of the next `num_steps` tokens (written by the coming forward)."""
        table = state.table
        num_tokens_before = table.num_tokens
        block_ids = self.pool.allocate(table.num_new_blocks_needed(num_steps))
        table.sync_new_tokens(block_ids, table.num_tokens + num_steps)
        self.observer.on_synced(table, num_tokens_before)

    def _finish(self, state: ReqState) -> None:
        self.recorder.record_finish(state.request, state.arrival_s, state.first_token_s, self.now_s,
                                    num_preemptions=state.num_preemptions)
        self._leave(state)
        self.scheduler.finish(state, self.now_s)
        self.executor.forget(state.req_idx)

    # ---- eviction ----------------------------------------------------------------------------

    def _evict(self, state: ReqState) -> None:
        """Ask the schedule what the request loses now, then mark those tokens dead."""
        scores = None
        policy = self.eviction.policy
        if policy.needs_attention:
            scores = lambda token_ids, num_tokens: self.executor.attention_stats(  # noqa: E731
                state.req_idx, token_ids, num_tokens, policy.score_fields)
        event = self.eviction.decide(state.eviction, state.req_idx, state.table, state.num_generated, scores)
        if event is None:
            return
        table = state.table
        emptied = table.evict_tokens(event.token_ids)
        self.counters = self.counters.plus(tokens_evicted=int(event.token_ids.size), eviction_events=1)
        if state.req_idx in self._busy_req_ids:
            return  # blocks of a request with a copy in flight are released when it lands
        table.release_blocks(emptied)
        self.pool.free(emptied)

    # ---- reclamation -------------------------------------------------------------------------

    def _pack_under_pressure(self, decode: list[ReqState], num_steps: int) -> None:
        """Memory decides now: when the decodes' next `num_steps` of growth and the admission
        waiting for blocks do not fit with the reserve to spare, free the shortfall, and no more."""
        num_needed = self.scheduler.num_blocks_to_grow(decode, num_steps) + self.scheduler.num_blocks_to_admit_next()
        num_short = self.reclaimer.num_blocks_short(num_needed)
        if num_short > 0:
            self._reclaim(num_short)

    def _reclaim(self, num_blocks_short: int | None = None) -> None:
        """Plan and launch: lazily over everything (None), or under pressure until
        `num_blocks_short` blocks are freed."""
        tables = [s.table for s in self.scheduler.running]
        busy = frozenset(p.req_id for p in self.copy_engine.in_flight_plans)
        by_id = {t.req_id: t for t in tables}
        if num_blocks_short is None:
            plans, trigger = self.reclaimer.plan(tables, busy), "lazy"
        else:
            plans, trigger = self.reclaimer.plan_to_free(tables, busy, num_blocks_short), "pressure"
        self.reclaim_work[trigger] = self.reclaim_work[trigger].plus(plans)
        for plan in plans:
            table = by_id[plan.req_id]
            check_plan(plan, table, self.pool, busy)
            self.observer.on_plan(plan, table)
            got = self.pool.allocate(plan.dst_new_block_ids.size)
            assert np.array_equal(got, plan.dst_new_block_ids), "allocation diverged from the planned destinations"
            table.adopt_blocks(got)
            self.copy_engine.launch(plan)
            self._num_copied_tokens += plan.num_tokens_moved
            busy = busy | {plan.req_id}
        self._busy_req_ids = busy
        if self.copy_engine.mode == "sync":  # other modes complete after the next forward at the earliest
            for plan in self.copy_engine.poll_completed():
                self._complete(plan)

    def _complete(self, plan: RelocationPlan) -> None:
        """The copy landed: repoint the moved tokens and free every block left empty."""
        self._busy_req_ids = self._busy_req_ids - {plan.req_id}
        state = next((s for s in self.scheduler.running if s.req_idx == plan.req_id), None)
        if state is None:  # finished or preempted while the copy was in flight
            return
        table = state.table
        live_before = table.live_token_ids() if self._is_observed else None
        table.apply_moves(plan.moves)
        held = table.held_block_ids[table.num_pinned_blocks :]
        emptied = held[self.pool.live_counts[held] == 0]
        table.release_blocks(emptied)
        self.pool.free(emptied)
        self.counters = self.counters.plus(tokens_moved=plan.num_tokens_moved, blocks_reclaimed=plan.num_blocks_freed,
                                           relocation_events=1)
        self.observer.on_plan_completed(plan, table, live_before)

    def _leave(self, state: ReqState) -> None:
        """A request gives up its blocks: its copies in flight must not land anywhere."""
        if state.req_idx in self._busy_req_ids:
            self.copy_engine.cancel(state.req_idx)
            self._busy_req_ids = self._busy_req_ids - {state.req_idx}

    # ---- result ------------------------------------------------------------------------------

    def _result(self, host_time_s: float) -> RunResult:
        spec = self.spec
        return RunResult.from_recording(
            self.recorder, self.counters, variant=spec.variant,
            policy=self.experiment.eviction.policy if spec.evicts else "none", num_requests=len(self.scheduler.requests),
            skipped=tuple(self.scheduler.skipped), num_iterations=self.num_iterations,
            num_decode_steps=self.num_decode_steps, host_time_s=host_time_s,
        )


def _kv_read_counts(decode: Sequence[ReqState]) -> tuple[int, int]:
    """(KV slots attention reads, live KV tokens) of the decodes, before this iteration's growth.

    The first is what paged attention reads: each request's KV extent, its dead tokens in held
    blocks included (`executor.kv_extent`); native's equals its token count, naive-evict's its
    held blocks', and only compaction makes vtoken's smaller.
    """
    tables = [s.table for s in decode]
    return sum(kv_extent(t) for t in tables), sum(t.num_live_tokens for t in tables)
