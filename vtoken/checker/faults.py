"""Faults the checker must catch (`--inject-fault`). Each wraps the copy engine, the planner or
a table's `apply_moves`; the production classes carry no fault flags. Which invariant catches
each one:

    drop-copy     a move is applied to the table but its data is not copied           I1
    stale-slot    the slot cache keeps the pre-move slots; attention reads the freed
                  sources (the mapping and the data are right, so I1 holds)            I3
    double-map    after a relocation one moved token is repointed onto another's slot I2
    early-read    the table is repointed at launch, before the copy completed          I3
    shared-block  a plan also names a shared prefix block as a source                  I4

The same faults go inside vLLM (`check-invariants --executor vllm`), where the scheduler's
tracker repoints a request's table when it compacts it and the model runner copies the K/V at
the start of the next step, before that step's forward. `wrap_vllm_runner` replaces methods of
one model runner instance (engine/vllm/worker.py); `adopt_vllm_table` sees each token table the
tracker creates:

    drop-copy     the runner's copy skips the first move of every step                 I1
    stale-slot    the runner's read lengths keep the pre-relocation evicted count, so
                  attention reads past the live tokens, over the slots they left       I3
    double-map    the tracker's tables, wrapped as in the sim                           I2
    early-read    the runner copies after the forward that reads the moved tokens      I3
    shared-block  refused (`vllm_refusal`): vLLM runs vToken with prefix caching off,
                  so no block is ever shared
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import numpy as np

from vtoken.checker.copies import CopyEngineWrapper
from vtoken.checker_names import FAULT_DETECTED_BY, FAULT_KINDS  # noqa: F401  (re-exported)
from vtoken.engine.runtime import Runtime
from vtoken.errors import ConfigError
from vtoken.kv.copy_engine import CopyEngine
from vtoken.kv.reclaim import RelocationPlan
from vtoken.kv.token_table import Moves, TokenTable

class Fault:
    """No fault: the real copy engine, planner and tables. Subclasses wrap one of them."""

    kind: str | None = None
    vllm_refusal: str | None = None  # why the fault cannot be injected inside vLLM, if it cannot

    def __init__(self) -> None:
        self.num_injected = 0

    def wrap_copy_engine(self, engine: CopyEngine) -> CopyEngine:
        return engine

    def wrap_runtime(self, runtime: Runtime) -> None:
        """Replace parts of a freshly built runtime (its planner)."""

    def adopt_table(self, table: TokenTable) -> None:
        """See a token table as it is created (before any relocation touches it)."""

    def wrap_vllm_runner(self, runner) -> None:
        """Replace methods of vLLM's model runner (a `VTokenRunnerMixin`) on this instance."""

    def adopt_vllm_table(self, table: TokenTable) -> None:
        """See a token table of vLLM's scheduler as it is created (before any relocation)."""


class _SubstitutingCopyEngine(CopyEngineWrapper):
    """Launches a substitute of each plan (what is really copied) while the runtime sees the
    original in flight, and a third version of it when it completes."""

    def __init__(self, inner: CopyEngine,
                 substitute: Callable[[RelocationPlan], tuple[RelocationPlan, RelocationPlan]]) -> None:
        super().__init__(inner)
        self._substitute = substitute
        self._reported: dict[int, tuple[RelocationPlan, RelocationPlan]] = {}  # id(launched) -> (in flight, completed)

    def launch(self, plan: RelocationPlan) -> None:
        launched, completed = self._substitute(plan)
        self._reported[id(launched)] = (plan, completed)
        self._inner.launch(launched)

    @property
    def in_flight_plans(self) -> list[RelocationPlan]:
        return [self._reported[id(p)][0] for p in self._inner.in_flight_plans]

    def poll_completed(self) -> list[RelocationPlan]:
        return [self._reported.pop(id(p))[1] for p in self._inner.poll_completed()]

    def drain(self) -> list[RelocationPlan]:
        return [self._reported.pop(id(p))[1] for p in self._inner.drain()]

    def cancel(self, req_id: int) -> None:
        for plan in self._inner.in_flight_plans:
            if plan.req_id == req_id:
                self._reported.pop(id(plan))
        self._inner.cancel(req_id)


def _with_moves(plan: RelocationPlan, kept: np.ndarray) -> RelocationPlan:
    """`plan` with only the moves at indices `kept`."""
    m = plan.moves
    moves = Moves(m.token_ids[kept], m.src_block_ids[kept], m.src_offsets[kept], m.dst_block_ids[kept], m.dst_offsets[kept])
    return replace(plan, moves=moves)


class DropCopy(Fault):
    """The first move of every plan is applied to the table but its K/V is never copied."""

    kind = "drop-copy"

    def wrap_copy_engine(self, engine: CopyEngine) -> CopyEngine:
        return _SubstitutingCopyEngine(engine, self._drop_first_move)

    def _drop_first_move(self, plan: RelocationPlan) -> tuple[RelocationPlan, RelocationPlan]:
        if plan.moves.num_moves == 0:
            return plan, plan
        self.num_injected += 1
        return _with_moves(plan, np.arange(1, plan.moves.num_moves)), plan

    def wrap_vllm_runner(self, runner) -> None:
        copy_slots = runner._vtoken_copy_slots

        def copy_all_but_first(src_slots, dst_slots) -> int:
            if src_slots.numel() == 0:
                return copy_slots(src_slots, dst_slots)
            self.num_injected += 1
            return copy_slots(src_slots[1:], dst_slots[1:])

        runner._vtoken_copy_slots = copy_all_but_first


class EarlyRead(Fault):
    """The table is repointed when the copy is launched instead of when it completed."""

    kind = "early-read"

    def __init__(self) -> None:
        super().__init__()
        self._tables: dict[int, TokenTable] = {}

    def adopt_table(self, table: TokenTable) -> None:
        self._tables[table.req_id] = table

    def wrap_copy_engine(self, engine: CopyEngine) -> CopyEngine:
        return _SubstitutingCopyEngine(engine, self._repoint_at_launch)

    def _repoint_at_launch(self, plan: RelocationPlan) -> tuple[RelocationPlan, RelocationPlan]:
        self._tables[plan.req_id].apply_moves(plan.moves)
        self.num_injected += 1
        return plan, _with_moves(plan, np.zeros(0, dtype=np.int64))  # nothing left to apply

    def wrap_vllm_runner(self, runner) -> None:
        """In vLLM the tables are repointed when a compaction is planned; the copy runs at the
        start of the next step. Here it runs after that step's forward has read the tokens."""
        copy, execute_model = runner._vtoken_copy, runner.execute_model
        deferred = []

        def copy_after_the_forward(plan) -> None:
            if plan.num_moves:
                self.num_injected += 1
                deferred.append(plan)

        def execute_model_then_copy(*args, **kwargs):
            output = execute_model(*args, **kwargs)
            while deferred:
                copy(deferred.pop(0))
            return output

        runner._vtoken_copy, runner.execute_model = copy_after_the_forward, execute_model_then_copy


class StaleSlot(Fault):
    """The slot cache is not refreshed after a move: `slots()` keeps naming the sources of the
    table's last relocation, which are freed and reused. The mapping and the data are right."""

    kind = "stale-slot"

    def adopt_table(self, table: TokenTable) -> None:
        apply_moves, slots = table.apply_moves, table.slots
        old_slot_of: dict[int, int] = {}  # token id -> its slot before the last relocation

        def apply_moves_without_refresh(moves: Moves) -> None:
            apply_moves(moves)
            if moves.num_moves:
                old_slot_of.clear()
                old_slot_of.update(zip(moves.token_ids.tolist(), moves.src_slots(table.block_size).tolist()))
                self.num_injected += 1

        def stale_slots() -> np.ndarray:
            live_ids = table.live_token_ids()
            moved = np.fromiter(old_slot_of, dtype=np.int64, count=len(old_slot_of))
            moved = moved[np.isin(moved, live_ids)]
            if moved.size == 0:
                return slots()
            read_slots = slots().copy()
            read_slots[np.searchsorted(live_ids, moved)] = [old_slot_of[t] for t in moved.tolist()]
            return read_slots

        table.apply_moves, table.slots = apply_moves_without_refresh, stale_slots

    def wrap_vllm_runner(self, runner) -> None:
        """vLLM's attention reads positions 0..seq_len-1 of a request's block list, and the
        runner shortens seq_len by the evicted count. Here that count is not refreshed after a
        relocation: the read keeps the extent from before it, over the slots the moved tokens
        left (the new tokens' write slots stay right)."""
        read_lengths = runner._vtoken_read_lengths
        last_seen: dict[str, int] = {}  # req id -> evicted count it was last read with
        before_relocation: dict[str, int] = {}  # req id -> evicted count before its last relocation

        def read_lengths_without_refresh(num_evicted: dict[str, int]) -> None:
            stale = {}
            for req_id, num in num_evicted.items():
                previous = last_seen.get(req_id, 0)
                if num > previous:
                    before_relocation[req_id] = previous
                    self.num_injected += 1
                elif num < previous:  # rebuilt after a preemption, or a new request with the same id
                    before_relocation.pop(req_id, None)
                last_seen[req_id] = num
                stale[req_id] = before_relocation.get(req_id, num)
            read_lengths(stale)

        runner._vtoken_read_lengths = read_lengths_without_refresh


class DoubleMap(Fault):
    """After `apply_moves`, the last moved live token is pointed at the first one's slot."""

    kind = "double-map"

    def adopt_table(self, table: TokenTable) -> None:
        apply_moves = table.apply_moves

        def apply_moves_mapping_twice(moves: Moves) -> None:
            apply_moves(moves)
            live = moves.token_ids[table.live[moves.token_ids]]
            if live.size >= 2:
                first, last = int(live[0]), int(live[-1])
                table.token_slots[last] = table.token_slots[first]  # a view: the table's own mapping
                self.num_injected += 1

        table.apply_moves = apply_moves_mapping_twice

    adopt_vllm_table = adopt_table  # the tracker compacts through the table's apply_moves too


class _SharedBlockPlanner:
    """A reclaimer whose plans also free a shared prefix block: the request's own pinned prefix
    block if it holds one, else a block another request shares (reference count above one)."""

    def __init__(self, inner, fault: SharedBlock) -> None:
        self._inner = inner
        self._fault = fault

    def __getattr__(self, name: str):
        return getattr(self._inner, name)

    def plan(self, tables, busy_req_ids: frozenset[int] = frozenset()) -> list[RelocationPlan]:
        tables = list(tables)
        by_id = {t.req_id: t for t in tables}
        return [self._with_shared_block(plan, by_id[plan.req_id], tables) for plan in self._inner.plan(tables, busy_req_ids)]

    def _with_shared_block(self, plan: RelocationPlan, table: TokenTable, tables: list[TokenTable]) -> RelocationPlan:
        if table.num_pinned_blocks:
            block_id = table.block_ids_held[table.num_pinned_blocks - 1]
        else:
            shared = [b for t in tables for b in t.block_ids_held[: t.num_pinned_blocks] if table.pool.ref_counts[b] > 1]
            if not shared:
                return plan
            block_id = shared[0]
        self._fault.num_injected += 1
        return replace(plan, src_block_ids=np.sort(np.append(plan.src_block_ids, block_id)))


class SharedBlock(Fault):
    """Plans also free a shared prefix block (see `_SharedBlockPlanner`). The runtime's own
    `check_plan` gate raises before launch; the run records that I4 violation and stops."""

    kind = "shared-block"
    vllm_refusal = ("vToken runs vLLM with prefix caching off (engine/vllm/support.py), so no KV block is ever "
                    "shared between requests and a compaction has no shared block to name")

    def wrap_runtime(self, runtime: Runtime) -> None:
        if runtime.reclaimer is not None:
            runtime.reclaimer = _SharedBlockPlanner(runtime.reclaimer, self)


FAULTS: dict[str, type[Fault]] = {f.kind: f for f in (DropCopy, StaleSlot, DoubleMap, EarlyRead, SharedBlock)}


def make_fault(kind: str | None) -> Fault:
    if kind is None:
        return Fault()
    if kind not in FAULTS:
        raise ConfigError(f"unknown fault '{kind}'; choose one of: {', '.join(FAULTS)}")
    return FAULTS[kind]()
