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

import numpy as np

from vtoken.engine.batch import Batch, ReqState, TableFactory
from vtoken.engine.eviction import EvictionEvent, EvictionSchedule
from vtoken.engine.executor import ChunkLoad, CopyCostModel, Executor, StepLoad
from vtoken.engine.experiment import Run
from vtoken.engine.observer import NullObserver, RuntimeObserver
from vtoken.engine.scheduler import Scheduler, SchedulerLimits
from vtoken.errors import ConfigError
from vtoken.invariants import check_round
from vtoken.kv.block_pool import BlockPool
from vtoken.kv.copy_engine import CopyEngine
from vtoken.kv.moves import RelocationPlan, end_to_end
from vtoken.kv.reclaim import ReclaimConfig, Reclaimer
from vtoken.kv.token_table import TokenTable
from vtoken.metrics import MemorySample, ReclaimWork, Recorder, RunCounters, RunResult
from vtoken.policies import make_policy
from vtoken.trace import Request

PlannerFactory = Callable[[ReclaimConfig, BlockPool], Reclaimer]


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
        experiment, spec = run.experiment.with_scheduler_defaults(), run.spec
        scheduling = experiment.scheduler
        if scheduling.enable_chunked_prefill and not executor.runs_prompt_chunks:
            raise ConfigError(f"the {executor.name} executor computes whole prompts: run it with chunked prefill off")
        self.experiment = experiment
        self.spec = spec
        self.executor = executor
        self._prices_copies = isinstance(executor, CopyCostModel)  # a runtime-checkable Protocol: slow to ask per round
        self.num_output_tokens = sum(r.num_output_tokens for r in requests)  # the progress total
        self.pool = BlockPool(experiment.num_blocks, experiment.block_size)
        limits = SchedulerLimits(scheduling.max_num_batched_tokens, scheduling.max_num_seqs,
                                 scheduling.enable_chunked_prefill, scheduling.long_prefill_token_threshold)
        self.scheduler = Scheduler(self.pool, list(requests), spec.concurrency, limits, self,
                                   spec.admit_all_at_start, table_factory=table_factory)
        self.eviction = EvictionSchedule(experiment.eviction,
                                         make_policy(experiment.eviction.policy, seed=experiment.seed))
        self.reclaimer = planner_factory(experiment.reclaim, self.pool) if spec.reclaims else None
        self.copy_engine = copy_engine or CopyEngine(None, "sync")
        self.observer = observer or NullObserver()
        self._is_observed = not isinstance(self.observer, NullObserver)  # else no event needs its arguments built
        self.recorder = Recorder(experiment.model.kv_bytes_per_token)
        self._counts = RunCounters().as_dict()  # plain integers: an eviction counts at every due step
        self.now_s = 0.0
        self.num_iterations = 0
        self.num_decode_steps = 0
        self.num_generated_tokens = 0  # over every step, recomputation after a preemption included
        self._num_copied_tokens = 0
        self._busy_req_ids: frozenset[int] = frozenset()
        # request -> its table, and the table's layout version when its plan in flight passed check_plan
        self._in_flight: dict[int, tuple[TokenTable, int]] = {}
        self.reclaim_work = {"lazy": ReclaimWork(), "pressure": ReclaimWork(), "layout": ReclaimWork()}  # by trigger

    # ---- the spine ---------------------------------------------------------------------------

    def run(self, on_progress: Callable[[int], None] | None = None) -> RunResult:
        """Replay to the end. `on_progress(n)`: n more tokens generated, as steps complete; the
        calls sum to the requests' output tokens exactly (a preemption's recomputed tokens are not
        counted twice, a skipped request's are reported at the end)."""
        started = time.perf_counter()
        num_total = self.num_output_tokens
        num_reported = 0
        while self.has_work():
            self.step()
            num_now = min(self.num_generated_tokens, num_total)
            if on_progress is not None and num_now > num_reported:
                on_progress(num_now - num_reported)
                num_reported = num_now
        if on_progress is not None and num_reported < num_total:
            on_progress(num_total - num_reported)
        return self.finish(time.perf_counter() - started)

    def has_work(self) -> bool:
        """Whether a request is still to arrive, waiting or running: `step` until it is not."""
        return self.scheduler.has_work()

    def finish(self, host_time_s: float) -> RunResult:
        """After the last step: land the copies still in flight; the run's result, with
        `host_time_s` as its host time. `run` is `step` while `has_work`, then this; a caller
        that drives the steps itself (several runs interleaved) calls it once at the end."""
        self._complete(self.copy_engine.drain())
        return self._result(host_time_s)

    def step(self) -> None:
        batch = self.schedule()
        if batch is None:
            return
        duration_s = self.execute(batch)
        self.postprocess(batch, duration_s)

    @property
    def counters(self) -> RunCounters:
        """What the run has done to KV memory so far."""
        return RunCounters(**self._counts)

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
        num_reserved = 0
        if self.reclaimer is not None and sched.running:
            # the reclaimer's headroom (ordered destinations) is kept from admissions while
            # something runs that it could pack; with nothing running, there is nothing to pack
            self._pack_under_pressure()
            num_reserved = self.reclaimer.num_headroom_blocks
        batch = sched.schedule(num_reserved, self.now_s)
        return batch if batch.decode or batch.prefill else None

    # ---- what the scheduler tells the runtime (SchedulerHooks) ---------------------------------

    def on_synced(self, table: TokenTable, num_tokens_before: int) -> None:
        self.observer.on_synced(table, num_tokens_before)

    def on_preempt(self, state: ReqState) -> None:
        self._leave(state)
        if self.spec.evicts:
            self.eviction.on_preempt(state.eviction, state.table)
        self._counts["preemptions"] += 1

    def on_drop(self, state: ReqState) -> None:
        self._leave(state)
        self.executor.forget(state.req_idx)

    # ---- execute -----------------------------------------------------------------------------

    def execute(self, batch: Batch) -> float:
        """The forward: the executor runs (or costs) it after every in-flight copy it needs."""
        self.copy_engine.wait_before_forward()
        self._complete(self.copy_engine.poll_completed())
        self.observer.on_forward(batch, self.copy_engine.in_flight_plans)
        load = StepLoad(
            num_kv_slots_read=batch.num_kv_slots_read,
            num_live_kv_tokens=batch.num_live_kv_tokens,
            num_decoding_requests=len(batch.decode),
            prefill_chunks=tuple(ChunkLoad(c.num_context_slots, c.num_context_live_tokens, c.num_new_tokens)
                                 for c in batch.prefill),
            num_copied_tokens=self._num_copied_tokens,
        )
        self._num_copied_tokens = 0
        return self.executor.execute(batch, load)

    # ---- postprocess -------------------------------------------------------------------------

    def postprocess(self, batch: Batch, duration_s: float) -> None:
        """After the forward: every request whose tokens are all computed samples one; a prompt
        chunk that is not the last samples nothing (the policy may run after it, as an option)."""
        self.now_s += duration_s
        self.num_iterations += 1
        self.num_decode_steps += 1 if batch.decode else 0
        sampled = list(batch.decode) + [c.state for c in batch.prefill if c.is_last]
        self.num_generated_tokens += len(sampled)
        for state in sampled:
            state.num_generated += 1
            if state.first_token_s is None:
                state.first_token_s = self.now_s
        for chunk in batch.prefill:
            if not chunk.is_last and self.experiment.scheduler.evict_every_chunk and self.spec.evicts:
                self._evict_mid_prompt(chunk.state)
        evicts = self.spec.evicts
        for state in sampled:
            if state.num_remaining == 0:
                self._finish(state)
            elif evicts and state.num_generated >= state.eviction.due_at:  # EvictionSchedule.is_due, at every step
                self._evict(state)
        if self.reclaimer is not None and self.reclaimer.is_eligible(self.num_iterations):
            self._reclaim(step_s=duration_s)
        self.recorder.sample(self.now_s, len(self.scheduler.running), MemorySample.of_pool(self.pool))

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
        if event is not None:
            self._apply_eviction(state, event)

    def _evict_mid_prompt(self, state: ReqState) -> None:
        """`evict_every_chunk`: the policy on the prompt computed so far (a fresh prompt only: a
        recomputed one evicts what it had lost after its last chunk)."""
        if state.num_generated or state.eviction.resume_token_ids is not None:
            return
        if state.request.num_prefix_tokens >= self.experiment.block_size and not state.table.num_pinned_tokens:
            return  # its shared prefix is not pinned yet: the policy must not see it
        event = self.eviction.decide_mid_prompt(state.req_idx, state.table)
        if event is not None:
            self._apply_eviction(state, event)

    def _apply_eviction(self, state: ReqState, event: EvictionEvent) -> None:
        table = state.table
        emptied = table.evict_tokens(event.token_ids)
        self._counts["tokens_evicted"] += int(event.token_ids.size)
        self._counts["eviction_events"] += 1
        if state.req_idx in self._busy_req_ids:
            return  # blocks of a request with a copy in flight are released when it lands
        if emptied.size:
            table.release_blocks(emptied)
            self.pool.free(emptied)
        if self.reclaimer is not None:
            self._repack_if_worse_than_uncompacted(table)

    # ---- reclamation -------------------------------------------------------------------------

    def _pack_under_pressure(self) -> None:
        """Memory decides now: when the running requests' next step and the admission waiting
        for blocks do not fit with the reserve to spare, free the shortfall, and no more."""
        num_to_admit = self.scheduler.num_blocks_to_admit_next()
        if self.reclaimer.num_blocks_short(self.scheduler.max_num_blocks_to_grow() + num_to_admit) == 0:
            return  # not short even at the bound (the exact count walks every running request)
        num_short = self.reclaimer.num_blocks_short(self.scheduler.num_blocks_to_grow() + num_to_admit)
        if num_short > 0:
            self._reclaim(num_short)

    def _repack_if_worse_than_uncompacted(self, table: TokenTable) -> None:
        """An eviction can leave a request holding more blocks than its tokens would without
        any compaction: lazy hole-fill moved young tokens into the holes of old blocks, and
        FIFO eviction (StreamingLLM) then killed the old tokens around them, so those blocks
        stay held where naive-evict frees them whole. Pack that request now, freeing the
        excess, as far as its live tokens allow (the open tail itself is never packed). Block
        counts decide what attention reads, (blocks - 1) x S plus the open tail's written
        slots, because the open tail is written as far as the uncompacted layout's: a packed
        full tail leaves the new tail full (`TokenTable._keep_held`). Only an eviction that
        empties the open tail (a policy without a recent window) moves that cursor."""
        num_excess = table.num_blocks_over_uncompacted()
        if num_excess > 0 and table.req_id not in self._busy_req_ids:
            self._reclaim(num_excess, [table], "layout")

    def _reclaim(self, num_blocks_short: int | None = None, tables: list[TokenTable] | None = None,
                 trigger: str | None = None, step_s: float | None = None) -> None:
        """Plan and launch: lazily over every running request (None), or until `num_blocks_short`
        blocks are freed (under pressure; or over the one table given, for the `layout` trigger).
        `step_s`: the step a lazy round step runs after (the executor's duration of it), which a
        budget that follows the step (`StepShare`) is a share of."""
        tables = tables if tables is not None else [s.table for s in self.scheduler.running]
        busy = frozenset(p.req_id for p in self.copy_engine.in_flight_plans)
        by_id = {t.req_id: t for t in tables}
        if trigger == "layout":
            plans = self.reclaimer.plan_repack(tables[0], num_blocks_short)
        elif num_blocks_short is None:
            plans, trigger = self.reclaimer.plan(tables, busy, step_s), "lazy"
        else:
            plans, trigger = self.reclaimer.plan_to_free(tables, busy, num_blocks_short), "pressure"
        num_moved = sum(p.num_tokens_moved for p in plans)
        copy_s = self.executor.raw_copy_time_s(num_moved) if self._prices_copies else None
        self.reclaim_work[trigger] = self.reclaim_work[trigger].plus(
            len(plans), num_moved, sum(p.num_blocks_freed for p in plans), copy_s)
        check_round(plans, [by_id[p.req_id] for p in plans], self.pool, busy)  # I4, before any launch
        for plan in plans:
            table = by_id[plan.req_id]
            self.observer.on_plan(plan, table)
            if plan.dst_new_block_ids.size:  # an ordered plan's fresh destinations
                got = self.pool.allocate(plan.dst_new_block_ids.size)
                assert np.array_equal(got, plan.dst_new_block_ids), "allocation diverged from the planned destinations"
                table.adopt_blocks(got)
            self._in_flight[plan.req_id] = (table, table.layout_version)
            self.copy_engine.launch(plan)
            self._num_copied_tokens += plan.num_tokens_moved
        self._busy_req_ids = busy.union(plan.req_id for plan in plans)
        if self.copy_engine.mode == "sync":  # other modes complete after the next forward at the earliest
            self._complete(self.copy_engine.poll_completed())

    def _complete(self, plans: list[RelocationPlan]) -> None:
        """Copies landed: repoint the moved tokens and free every block left empty, the pool's
        side once for all the plans (a round's land together)."""
        if not plans:
            return
        self._busy_req_ids = self._busy_req_ids.difference(plan.req_id for plan in plans)
        landed, tables, versions = [], [], []
        for plan in plans:
            in_flight = self._in_flight.pop(plan.req_id, None)
            if in_flight is not None:  # else it finished or was preempted while the copy was in flight (`_leave`)
                landed.append(plan)
                tables.append(in_flight[0])
                versions.append(in_flight[1])
        if not landed:
            return
        lives_before = [table.live_token_ids() for table in tables] if self._is_observed else [None] * len(tables)
        moves, move_of, _, _ = end_to_end(landed)  # a round's plans, as they were planned: views
        TokenTable.apply_moves_each(tables, [plan.moves for plan in landed], versions, (moves, move_of))
        TokenTable.release_empty_blocks_each(tables)
        counts = self._counts
        for plan, table, live_before in zip(landed, tables, lives_before):
            counts["tokens_moved"] += plan.num_tokens_moved
            counts["blocks_reclaimed"] += plan.num_blocks_freed
            counts["relocation_events"] += 1
            self.observer.on_plan_completed(plan, table, live_before)

    def _leave(self, state: ReqState) -> None:
        """A request gives up its blocks: its copies in flight must not land anywhere."""
        if state.req_idx in self._busy_req_ids:
            self.copy_engine.cancel(state.req_idx)
            self._busy_req_ids = self._busy_req_ids - {state.req_idx}
            self._in_flight.pop(state.req_idx, None)

    # ---- result ------------------------------------------------------------------------------

    def _result(self, host_time_s: float) -> RunResult:
        spec = self.spec
        return RunResult.from_recording(
            self.recorder, self.counters, variant=spec.variant,
            policy=self.experiment.eviction.policy if spec.evicts else "none", num_requests=len(self.scheduler.requests),
            skipped=tuple(self.scheduler.skipped), num_iterations=self.num_iterations,
            num_decode_steps=self.num_decode_steps, host_time_s=host_time_s, reclaim_work=self.reclaim_work,
        )
