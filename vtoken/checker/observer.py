"""The observer that sees every event of a checked run and checks I1-I4 (DESIGN.md §3) on it:

    on_synced          sim: write the new tokens' K/V, a pure function of (owner, token id)
    on_plan            I4  re-derived from the table, the pool and the copy engine's in-flight list
                       hf: snapshot the request's K/V before the launch
    on_forward         I3  every slot attention reads: not an in-flight copy destination, the
                           token's mapped slot, and (sim) holding the token's K/V
    on_plan_completed  I2  one slot per live token over all tables, counts agree with the pool
                       I1  the same live ids, and every live token's mapped slot holds its K/V
                           (sim: the book's; hf: the snapshot's)

What differs between the executors is one object, `contents`: `KVContents` (contents.py) for the
sim's synthetic K/V, `ModelKVSnapshots` (snapshots.py) for a real model's.

Violations are recorded, not raised. A run goes on after an I1 or I3 violation (after an I1
content loss the checker restores the lost K/V, so one lost copy is reported once and not again
at every later read), and stops after an I2 or I4 violation: the mapping or the plan is wrong,
and what followed would only report consequences or crash.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import numpy as np
import torch

from vtoken.checker.contents import KVContents
from vtoken.checker.faults import Fault
from vtoken.checker.report import INVARIANTS, RunCheck, Tally, Violation
from vtoken.checker.scenarios import Scenario
from vtoken.checker.snapshots import ModelKVSnapshots
from vtoken.engine.batch import Batch
from vtoken.engine.runtime import Runtime
from vtoken.errors import InvariantError, VTokenError
from vtoken.invariants import check_conservation, check_contents, check_plan, check_unique_mapping, check_visibility
from vtoken.kv.block_pool import BlockPool
from vtoken.kv.copy_engine import CopyEngine
from vtoken.kv.moves import RelocationPlan
from vtoken.kv.token_table import TokenTable
from vtoken.trace import num_output_tokens

I2_EVERY_NUM_FORWARDS = 8  # periodic full I2 scan, besides the one after every relocation


class _RunStopped(Exception):
    """Raised by the observer to end a run that a violation left meaningless to continue."""


class CheckingObserver:
    """Receives the runtime's events and checks I1-I4 on each; records violations."""

    def __init__(self, scenario: Scenario, fault: Fault) -> None:
        self.scenario = scenario
        self.fault = fault
        self.block_size = scenario.run.experiment.block_size
        self.runtime: Runtime | None = None
        self.contents: KVContents | ModelKVSnapshots | None = None
        self.copy_engine: CopyEngine | None = None
        self.num_relocations = 0
        self.num_tokens_moved = 0
        self._num_checked = dict.fromkeys(INVARIANTS, 0)
        self._num_violations = dict.fromkeys(INVARIANTS, 0)
        self._first: dict[str, Violation] = {}
        self._num_tokens_launched: dict[int, int] = {}  # req_idx -> tokens of its plan in flight
        self._num_forwards = 0

    def bind(self, runtime: Runtime, contents: KVContents | ModelKVSnapshots) -> None:
        """Watch `runtime` (its copy engine as it launches plans) with `contents` over its KV."""
        self.runtime = runtime
        self.copy_engine = runtime.copy_engine
        self.contents = contents

    def run(self, on_progress: Callable[[int], None]) -> str | None:
        """Run the bound runtime to the end; returns why it stopped early, or None."""
        try:
            self.runtime.run(on_progress)
        except _RunStopped as stop:
            return str(stop)
        except InvariantError as exc:  # the runtime's own gate (check_plan before launch)
            self._num_checked[exc.invariant] += 1
            self._record(exc.invariant, exc, note="raised by the runtime's own check")
            return f"the runtime raised {exc.invariant} and stopped"
        except VTokenError as exc:
            if not any(self._num_violations.values()):
                raise
            return f"the runtime failed after a violation: {exc}"
        return None

    def tallies(self) -> dict[str, Tally]:
        return {name: Tally(self._num_checked[name], self._num_violations[name], self._first.get(name))
                for name in INVARIANTS}

    # ---- events --------------------------------------------------------------------------

    def on_synced(self, table: TokenTable, num_tokens_before: int) -> None:
        token_ids = np.arange(num_tokens_before, table.num_tokens)
        slots = table.token_block_ids[token_ids] * self.block_size + table.token_offsets[token_ids]
        self.contents.place(table, token_ids, slots)

    def on_forward(self, batch: Batch, in_flight_plans: list[RelocationPlan]) -> None:
        self._num_forwards += 1
        if self._num_forwards % I2_EVERY_NUM_FORWARDS == 0:
            self._check_mapping()
        for state in batch.states:
            self._check("I3", lambda t=state.table: self._check_reads(t, in_flight_plans))

    def on_plan(self, plan: RelocationPlan, table: TokenTable) -> None:
        self._num_tokens_launched[plan.req_id] = plan.num_tokens_moved
        in_flight = self.copy_engine.in_flight_plans
        if not self._check("I4", lambda: check_plan_independently(plan, table, self.runtime.pool, in_flight)):
            raise _RunStopped("stopped after an I4 violation: the runtime was about to launch the plan")
        self.contents.snapshot(plan, table)

    def on_plan_completed(self, plan: RelocationPlan, table: TokenTable, live_ids_before: np.ndarray) -> None:
        self.num_relocations += 1
        self.num_tokens_moved += self._num_tokens_launched.pop(plan.req_id, plan.num_tokens_moved)
        self._check_mapping()
        self._check("I1", lambda: self._check_conservation(table, live_ids_before))

    # ---- checks --------------------------------------------------------------------------

    def _check_mapping(self) -> None:
        """I2 over every table and the pool; a corrupt mapping ends the run."""
        tables = [s.table for s in self.runtime.scheduler.running]
        if not self._check("I2", lambda: check_unique_mapping(self.runtime.pool, tables)):
            raise _RunStopped("stopped after an I2 violation: the token mapping is corrupt")

    def _check_conservation(self, table: TokenTable, live_ids_before: np.ndarray) -> None:
        """I1: same live ids; each live token's mapped slot holds its own K/V. A loss is
        repaired after it is reported, so that later reads do not report it again."""
        live_ids = table.live_token_ids()
        check_conservation(table.req_id, live_ids_before, live_ids)
        slots = table.token_block_ids[live_ids] * self.block_size + table.token_offsets[live_ids]
        check_contents(table.req_id, live_ids, slots, self.contents.lost(table, live_ids, slots), self.block_size)

    def _check_reads(self, table: TokenTable, in_flight_plans: list[RelocationPlan]) -> None:
        """I3: every slot attention reads (the table's slot cache) is no pending copy
        destination, is the token's mapped slot, and holds the token's K/V (where known)."""
        read_slots = table.slots()
        check_visibility(table.req_id, read_slots, in_flight_plans, self.block_size)
        live_ids = table.live_token_ids()
        mapped = table.token_block_ids[live_ids] * self.block_size + table.token_offsets[live_ids]
        if read_slots.shape != mapped.shape or not np.array_equal(read_slots, mapped):
            self._raise_stale_read(table, live_ids, read_slots, mapped)
        mismatched = self.contents.misread(table, live_ids, read_slots)
        if mismatched is not None and np.any(mismatched):
            i = int(np.flatnonzero(mismatched)[0])
            self._raise_read(table, int(live_ids[i]), int(read_slots[i]),
                             f"reads K/V that is not its own ({int(mismatched.sum())} tokens differ)")

    def _raise_stale_read(self, table: TokenTable, live_ids: np.ndarray, read_slots: np.ndarray,
                          mapped: np.ndarray) -> None:
        if read_slots.size != mapped.size:
            raise InvariantError("I3", f"request {table.req_id} reads {read_slots.size} slots for {mapped.size} live tokens",
                                 req_id=table.req_id)
        i = int(np.flatnonzero(read_slots != mapped)[0])
        slot = int(mapped[i])
        S = self.block_size
        self._raise_read(table, int(live_ids[i]), int(read_slots[i]),
                         f"reads a slot the token left: it lives at block {slot // S} offset {slot % S}")

    def _raise_read(self, table: TokenTable, token_id: int, slot: int, what: str) -> None:
        S = self.block_size
        raise InvariantError("I3", f"request {table.req_id} token {token_id} at block {slot // S} offset {slot % S} {what}",
                             req_id=table.req_id, token_id=token_id, block_id=slot // S, offset=slot % S)

    def _check(self, invariant: str, check: Callable[[], None]) -> bool:
        self._num_checked[invariant] += 1
        try:
            check()
        except InvariantError as exc:
            self._record(invariant, exc)
            return False
        return True

    def _record(self, invariant: str, exc: InvariantError, note: str = "") -> None:
        self._num_violations[invariant] += 1
        if invariant in self._first:
            return
        where = exc.where
        req_idx, token_id = where.get("req_id"), where.get("token_id")
        block_id, offset = where.get("block_id"), where.get("offset")
        table = self._table_of(req_idx)
        if block_id is None and table is not None and token_id is not None and token_id < table.num_tokens:
            block_id, offset = int(table.token_block_ids[token_id]), int(table.token_offsets[token_id])
        experiment = self.scenario.run.experiment
        requests = self.scenario.requests
        self._first[invariant] = Violation(
            invariant, f"{exc} ({note})" if note else str(exc), self.scenario.name, experiment.eviction.policy,
            experiment.reclaim.mode, requests[req_idx].request_id if req_idx is not None else None,
            req_idx, token_id, block_id, offset,
        )

    def _table_of(self, req_idx: int | None) -> TokenTable | None:
        if req_idx is None or self.runtime is None:
            return None
        return next((s.table for s in self.runtime.scheduler.running if s.req_idx == req_idx), None)


def run_checked(observer: CheckingObserver, on_progress: Callable[[int], None] | None = None) -> RunCheck:
    """Run the runtime bound to `observer` to the end; what was checked and what failed.
    `on_progress(n)`: n more tokens generated (Runtime.run: they sum to the output tokens)."""
    started = time.perf_counter()
    runtime, scenario, experiment = observer.runtime, observer.scenario, observer.scenario.run.experiment
    num_done = [0]

    def count_done(n: int) -> None:
        num_done[0] += n
        if on_progress is not None:
            on_progress(n)

    stopped = observer.run(count_done)
    num_total = num_output_tokens(scenario.requests)
    if on_progress is not None and num_done[0] < num_total:  # a failed check stops the run early
        on_progress(num_total - num_done[0])
    return RunCheck(
        scenario=scenario.name, policy=experiment.eviction.policy, reclaim_mode=experiment.reclaim.mode,
        block_size=experiment.block_size, num_blocks=experiment.num_blocks, num_requests=len(scenario.requests),
        num_completed=runtime.recorder_completed(), relocation_events=observer.num_relocations,
        tokens_moved=observer.num_tokens_moved, preemptions=runtime.counters.preemptions,
        faults_injected=observer.fault.num_injected, stopped=stopped, tallies=observer.tallies(),
        elapsed_s=time.perf_counter() - started,
    )


@contextmanager
def torch_threads(num_threads: int) -> Iterator[None]:
    """Run torch ops on `num_threads` threads, restored after. The sim's KV tensors are tiny:
    scattering a 2,000-token prefill through the intra-op thread pool took 23 ms on two cores,
    on one 0.2 ms."""
    before = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def check_plan_independently(plan: RelocationPlan, table: TokenTable, pool: BlockPool,
                             in_flight_plans: Sequence[RelocationPlan]) -> None:
    """I4 re-derived from the state: `check_plan` (which also checks that every move starts at
    its token's current slot) against the copy engine's own in-flight list, not the runtime's
    busy set; then every fresh destination block is still free."""
    check_plan(plan, table, pool, frozenset(p.req_id for p in in_flight_plans))
    taken = plan.dst_new_block_ids[pool.ref_counts[plan.dst_new_block_ids] != 0]
    if taken.size:
        raise InvariantError("I4", f"request {plan.req_id} plan: destination block {int(taken[0])} is not free",
                             req_id=plan.req_id, block_id=int(taken[0]))
