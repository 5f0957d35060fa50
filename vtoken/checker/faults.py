"""Faults the checker must catch (`--inject-fault`). A fault is a set of faulty parts that the
run is built with: a copy engine wrapping the real one, a reclaimer subclass, a token table
subclass (the runtime takes `copy_engine`, `planner_factory` and `table_factory`); nothing is
replaced on a live object, and the production classes carry no fault flags. Which invariant
catches each one:

    drop-copy     a move is applied to the table but its data is not copied           I1
    stale-slot    the slot cache keeps the pre-move slots; attention reads the freed
                  sources (the mapping and the data are right, so I1 holds)            I3
    double-map    after a relocation one moved token is repointed onto another's slot I2
    early-read    the table is repointed at launch, before the copy completed          I3
    shared-block  a plan also names a shared prefix block as a source                  I4

The same faults go inside vLLM (`check-invariants --executor vllm`), where the scheduler's
tracker repoints a request's table when it compacts it and the model runner copies the K/V at
the start of the next step, before that step's forward. There the parts are the runner's
copier and lengths (`VTokenRunnerMixin.vtoken_use`, engine/vllm/worker.py) and the
tracker's token tables (`VTokenScheduler.reconfigure(settings, table_factory=...)`):

    drop-copy     the runner's copy skips the first move of every step                 I1
    stale-slot    the runner's read lengths keep the pre-relocation evicted count, so
                  attention reads past the live tokens, over the slots they left       I3
    double-map    the tracker's tables, the same subclass as in the sim                I2
    early-read    the runner copies after the forward that reads the moved tokens      I3
    shared-block  refused (`vllm_refusal`): vLLM runs vToken with prefix caching off,
                  so no block is ever shared
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import replace
from functools import partial

import numpy as np

from vtoken.checker.copies import CopyEngineWrapper
from vtoken.checker.names import FAULT_DETECTED_BY, FAULT_KINDS  # noqa: F401  (re-exported)
from vtoken.errors import ConfigError
from vtoken.kv.block_pool import BlockPool
from vtoken.kv.copy_engine import CopyEngine
from vtoken.kv.moves import Moves, RelocationPlan
from vtoken.kv.reclaim import ReclaimConfig, Reclaimer
from vtoken.kv.token_table import TokenTable

PlannerFactory = Callable[[ReclaimConfig, BlockPool], Reclaimer]  # as vtoken.engine.runtime's
TableFactory = Callable[[int, BlockPool, int], TokenTable]  # (req_id, pool, capacity), as vtoken.engine.scheduler's


class Fault:
    """No fault: the real copy engine, planner and tables. Subclasses return faulty ones."""

    kind: str | None = None
    vllm_refusal: str | None = None  # why the fault cannot be injected inside vLLM, if it cannot

    def __init__(self) -> None:
        self.num_injected = 0

    # ---- sim and hf: the runtime's parts ---------------------------------------------------------

    def copy_engine(self, engine: CopyEngine) -> CopyEngine:
        """The copy engine the run uses, given the real one."""
        return engine

    def planner_factory(self) -> PlannerFactory:
        return Reclaimer

    def table_factory(self) -> TableFactory:
        return TokenTable

    # ---- vLLM: the model runner's and the scheduler's parts ------------------------------------

    def vllm_copier(self) -> object | None:
        """A `StepCopier` for the model runner (engine/vllm/worker.py), or None: the runner's own."""
        return None

    def vllm_lengths(self) -> object | None:
        """A `PhysicalLengths` for the model runner, or None: the runner's own."""
        return None

    def vllm_table_factory(self) -> TableFactory:
        """The token table of every tracker the scheduler makes."""
        return TokenTable


# ---- drop-copy ---------------------------------------------------------------------------------


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
    return replace(plan, moves=plan.moves.select(kept))


class _CopyAllButFirst:
    """vLLM: the runner copies every move of a step but the first (a `StepCopier`)."""

    def __init__(self, fault: Fault) -> None:
        self._fault = fault

    def copy_slots(self, src_slots, dst_slots, copy: Callable) -> int:
        if src_slots.numel() == 0:
            return copy(src_slots, dst_slots)
        self._fault.num_injected += 1
        return copy(src_slots[1:], dst_slots[1:])

    def before_forward(self, plan, copy_step: Callable) -> None:
        copy_step(plan)

    def after_forward(self, copy_step: Callable) -> None:
        pass


class DropCopy(Fault):
    """The first move of every plan is applied to the table but its K/V is never copied."""

    kind = "drop-copy"

    def copy_engine(self, engine: CopyEngine) -> CopyEngine:
        return _SubstitutingCopyEngine(engine, self._drop_first_move)

    def _drop_first_move(self, plan: RelocationPlan) -> tuple[RelocationPlan, RelocationPlan]:
        if plan.moves.num_moves == 0:
            return plan, plan
        self.num_injected += 1
        return _with_moves(plan, np.arange(1, plan.moves.num_moves)), plan

    def vllm_copier(self) -> _CopyAllButFirst:
        return _CopyAllButFirst(self)


# ---- early-read --------------------------------------------------------------------------------


class _CopyAfterTheForward:
    """vLLM: in vLLM the tables are repointed when a compaction is planned and the copy runs at
    the start of the next step. This copier runs it after that step's forward has read the
    tokens (a `StepCopier`)."""

    def __init__(self, fault: Fault) -> None:
        self._fault = fault
        self._deferred: list = []  # StepPlans whose copy waits for the forward

    def copy_slots(self, src_slots, dst_slots, copy: Callable) -> int:
        return copy(src_slots, dst_slots)

    def before_forward(self, plan, copy_step: Callable) -> None:
        if plan.num_moves:
            self._fault.num_injected += 1
            self._deferred.append(plan)

    def after_forward(self, copy_step: Callable) -> None:
        while self._deferred:
            copy_step(self._deferred.pop(0))


class EarlyRead(Fault):
    """The table is repointed when the copy is launched instead of when it completed."""

    kind = "early-read"

    def __init__(self) -> None:
        super().__init__()
        self._tables: dict[int, TokenTable] = {}  # req_id -> its table (the latest: preemption makes a new one)

    def table_factory(self) -> TableFactory:
        return self._make_table

    def _make_table(self, req_id: int, pool: BlockPool, capacity: int = 64) -> TokenTable:
        table = TokenTable(req_id, pool, capacity)
        self._tables[req_id] = table
        return table

    def copy_engine(self, engine: CopyEngine) -> CopyEngine:
        return _SubstitutingCopyEngine(engine, self._repoint_at_launch)

    def _repoint_at_launch(self, plan: RelocationPlan) -> tuple[RelocationPlan, RelocationPlan]:
        self._tables[plan.req_id].apply_moves(plan.moves)
        self.num_injected += 1
        return plan, _with_moves(plan, np.zeros(0, dtype=np.int64))  # nothing left to apply

    def vllm_copier(self) -> _CopyAfterTheForward:
        return _CopyAfterTheForward(self)


# ---- stale-slot --------------------------------------------------------------------------------


class _StaleSlotTable(TokenTable):
    """`slots()` keeps naming the sources of the table's last relocation, which are freed and
    reused; the mapping (`token_slots`) and the data are right."""

    def __init__(self, req_id: int, pool: BlockPool, capacity: int = 64, *, fault: Fault) -> None:
        super().__init__(req_id, pool, capacity)
        self._fault = fault
        self._old_slot_of: dict[int, int] = {}  # token id -> its slot before the last relocation

    def _repointed(self, moves: Moves, has_live: bool) -> None:
        super()._repointed(moves, has_live)  # the last step of apply_moves
        if moves.num_moves:  # a moved token's slot before the move was its source (check_plan)
            self._old_slot_of = dict(zip(moves.token_ids.tolist(), moves.src_slots(self.block_size).tolist()))
            self._fault.num_injected += 1

    def slots(self) -> np.ndarray:
        live_ids = self.live_token_ids()
        moved = np.fromiter(self._old_slot_of, dtype=np.int64, count=len(self._old_slot_of))
        moved = moved[np.isin(moved, live_ids)]
        if moved.size == 0:
            return super().slots()
        read_slots = super().slots().copy()
        read_slots[np.searchsorted(live_ids, moved)] = [self._old_slot_of[t] for t in moved.tolist()]
        return read_slots


class _ReadLengthsWithoutRefresh:
    """vLLM's attention reads positions 0..seq_len-1 of a request's block list, and the runner
    shortens seq_len by the evicted count. Here that count is not refreshed after a relocation:
    the read keeps the extent from before it, over the slots the moved tokens left (the new
    tokens' write slots stay right). A `PhysicalLengths`."""

    def __init__(self, fault: Fault) -> None:
        self._fault = fault
        self._last_seen: dict[str, int] = {}  # req id -> evicted count it was last read with
        self._before_relocation: dict[str, int] = {}  # req id -> evicted count before its last relocation

    def write_offsets(self, num_evicted: dict[str, int]) -> dict[str, int]:
        return num_evicted

    def read_offsets(self, num_evicted: dict[str, int]) -> dict[str, int]:
        stale = {}
        for req_id, num in num_evicted.items():
            previous = self._last_seen.get(req_id, 0)
            if num > previous:
                self._before_relocation[req_id] = previous
                self._fault.num_injected += 1
            elif num < previous:  # rebuilt after a preemption, or a new request with the same id
                self._before_relocation.pop(req_id, None)
            self._last_seen[req_id] = num
            stale[req_id] = self._before_relocation.get(req_id, num)
        return stale


class StaleSlot(Fault):
    """The slot cache is not refreshed after a move: `slots()` keeps naming the sources of the
    table's last relocation, which are freed and reused. The mapping and the data are right."""

    kind = "stale-slot"

    def table_factory(self) -> TableFactory:
        return partial(_StaleSlotTable, fault=self)

    def vllm_lengths(self) -> _ReadLengthsWithoutRefresh:
        return _ReadLengthsWithoutRefresh(self)


# ---- double-map --------------------------------------------------------------------------------


class _DoubleMapTable(TokenTable):
    """After `apply_moves`, the last moved live token is pointed at the first one's slot."""

    def __init__(self, req_id: int, pool: BlockPool, capacity: int = 64, *, fault: Fault) -> None:
        super().__init__(req_id, pool, capacity)
        self._fault = fault

    def _repointed(self, moves: Moves, has_live: bool) -> None:
        super()._repointed(moves, has_live)  # the last step of apply_moves
        live = moves.token_ids[self.live_mask[moves.token_ids]]
        if live.size >= 2:
            first, last = int(live[0]), int(live[-1])
            self._slot[last] = self._slot[first]  # the table's own mapping, behind the pool's back
            self._fault.num_injected += 1


class DoubleMap(Fault):
    """After `apply_moves`, the last moved live token is pointed at the first one's slot."""

    kind = "double-map"

    def table_factory(self) -> TableFactory:
        return partial(_DoubleMapTable, fault=self)

    vllm_table_factory = table_factory  # the tracker compacts through the table's apply_moves too


# ---- shared-block ------------------------------------------------------------------------------


class _SharedBlockReclaimer(Reclaimer):
    """A reclaimer whose plans also free a shared prefix block: the request's own pinned prefix
    block if it holds one, else a block another request shares (reference count above one)."""

    def __init__(self, config: ReclaimConfig, pool: BlockPool, *, fault: Fault) -> None:
        super().__init__(config, pool)
        self._fault = fault

    def _plans(self, tables: Iterable[TokenTable], busy_req_ids: frozenset[int], num_blocks_wanted: int | None,
               max_moves: int | None = None, max_src_blocks: int | None = None) -> tuple[list[RelocationPlan], list[int]]:
        # every planning entry point (lazy rounds, packing under pressure, the layout re-pack) plans here
        tables = list(tables)
        by_id = {t.req_id: t for t in tables}
        plans, waiting_req_ids = super()._plans(tables, busy_req_ids, num_blocks_wanted, max_moves, max_src_blocks)
        return [self._with_shared_block(plan, by_id[plan.req_id]) for plan in plans], waiting_req_ids

    def _with_shared_block(self, plan: RelocationPlan, table: TokenTable) -> RelocationPlan:
        if table.num_pinned_blocks:
            block_id = table.held_block_ids[table.num_pinned_blocks - 1]
        else:
            shared = np.flatnonzero(table.pool.ref_counts > 1)  # held by several requests: a shared prefix's
            if not shared.size:
                return plan
            block_id = int(shared[0])
        self._fault.num_injected += 1
        return replace(plan, src_block_ids=np.sort(np.append(plan.src_block_ids, block_id)))


class SharedBlock(Fault):
    """Plans also free a shared prefix block (see `_SharedBlockReclaimer`). The runtime's own
    `check_plan` gate raises before launch; the run records that I4 violation and stops."""

    kind = "shared-block"
    vllm_refusal = ("vToken runs vLLM with prefix caching off (engine/vllm/support.py), so no KV block is ever "
                    "shared between requests and a compaction has no shared block to name")

    def planner_factory(self) -> PlannerFactory:
        return partial(_SharedBlockReclaimer, fault=self)


FAULTS: dict[str, type[Fault]] = {f.kind: f for f in (DropCopy, StaleSlot, DoubleMap, EarlyRead, SharedBlock)}


def make_fault(kind: str | None) -> Fault:
    if kind is None:
        return Fault()
    if kind not in FAULTS:
        raise ConfigError(f"unknown fault '{kind}'; choose one of: {', '.join(FAULTS)}")
    return FAULTS[kind]()
