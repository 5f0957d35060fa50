"""`vtoken check-invariants` as one library call: relocations on materialized KV, with I1-I4
(DESIGN.md §3) checked on every event, optionally with one fault injected.

Each scenario (a trace x policy x reclaim mode, or a fuzz draw) runs the real runtime with a
real copy engine over a small KV tensor, and an observer that sees every event:

    on_synced          write the new tokens' K/V: a pure function of (owner, token id)
    on_plan            I4  re-derived from the table, the pool and the copy engine's in-flight list
    on_forward         I3  every slot attention reads: not an in-flight copy destination, the
                           token's mapped slot, and holding the token's K/V
    on_plan_completed  I2  one slot per live token over all tables, counts agree with the pool
                       I1  the same live ids, and every live token's mapped slot holds its K/V

Every copy stays in flight across the next forward, so that the ordering the runtime must
respect really has a window: on CPU the copy engine runs `deferred` and its data lands only
after that forward (`OverlappingDeferredCopyEngine`); on CUDA it runs `async` on a side stream
and its completion is reported only after that forward (`ReportAfterForwardCopyEngine`).

Violations are recorded, not raised. A run goes on after an I1 or I3 violation (after an I1
content loss the checker restores the lost K/V, so one lost copy is reported once and not again
at every later read), and stops after an I2 or I4 violation: the mapping or the plan is wrong,
and what followed would only report consequences or crash.

Faults (`--inject-fault`) wrap the copy engine, the planner or a table's `apply_moves`; the
production classes carry no fault flags. Which invariant catches each one:

    drop-copy     a move is applied to the table but its data is not copied           I1
    stale-slot    the slot cache keeps the pre-move slots; attention reads the freed
                  sources (the mapping and the data are right, so I1 holds)            I3
    double-map    after a relocation one moved token is repointed onto another's slot I2
    early-read    the table is repointed at launch, before the copy completed          I3
    shared-block  a plan also names a shared prefix block as a source                  I4
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch

from vtoken.engine.config import EvictionConfig, RunConfig
from vtoken.engine.runtime import Runtime
from vtoken.engine.scheduler import Batch
from vtoken.engine.sim import SimExecutor
from vtoken.errors import ConfigError, InvariantError, VTokenError
from vtoken.invariants import check_conservation, check_contents, check_plan, check_unique_mapping, check_visibility
from vtoken.kv.block_pool import BlockPool
from vtoken.kv.copy_engine import CopyEngine
from vtoken.kv.kv_cache import KVShape, PagedKVCache
from vtoken.kv.reclaim import RECLAIM_MODES, ReclaimConfig, RelocationPlan
from vtoken.kv.token_table import Moves, TokenTable
from vtoken.policies import DEFAULT_AUDIT_POLICIES, POLICIES
from vtoken.policies.base import Budget
from vtoken.trace import Request, Trace

INVARIANTS = ("I1", "I2", "I3", "I4")
INVARIANT_NAMES = {
    "I1": "token conservation",
    "I2": "unique mapping",
    "I3": "pre-attention visibility",
    "I4": "layout-aware planning",
}
# What one check of each invariant is, for the report.
CHECK_UNITS = {
    "I1": "completed relocations",
    "I2": "scans of all tables and the pool",
    "I3": "attention reads (one request in one forward)",
    "I4": "plans before launch",
}
EXECUTORS = ("sim",)
FAULT_KINDS = ("drop-copy", "stale-slot", "double-map", "early-read", "shared-block")
FAULT_DETECTED_BY = {"drop-copy": "I1", "stale-slot": "I3", "double-map": "I2", "early-read": "I3", "shared-block": "I4"}

# The materialized KV: tiny per token (2 layers x K,V x 2 heads x 8 dims x fp32 = 256 bytes),
# so thousands of blocks cost a few MiB. The block budget and block size come from the config.
KV_NUM_LAYERS, KV_NUM_HEADS, KV_HEAD_DIM = 2, 2, 8
KV_DTYPE = torch.float32
I2_EVERY_NUM_FORWARDS = 8  # periodic full I2 scan, besides the one after every relocation


@dataclass(frozen=True)
class TraceLimits:
    """How far traces are cut down so that a full check stays fast (None: no limit)."""

    max_requests: int | None = 32
    max_prompt_tokens: int | None = 4096
    max_output_tokens: int | None = 256

    def __post_init__(self) -> None:
        for name in ("max_requests", "max_prompt_tokens", "max_output_tokens"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be > 0, got {value}")


@dataclass(frozen=True)
class CheckOptions:
    policies: tuple[str, ...] = DEFAULT_AUDIT_POLICIES
    reclaim_modes: tuple[str, ...] = RECLAIM_MODES
    executor: str = "sim"
    fault: str | None = None
    num_fuzz_scenarios: int = 0
    num_blocks: int | None = None  # None: chosen per trace so that the pool is under pressure
    block_size: int | None = None  # None: the base config's (fuzz: drawn per scenario)
    limits: TraceLimits = field(default_factory=TraceLimits)
    device: str | None = None  # None: cuda when available, else cpu

    def __post_init__(self) -> None:
        if self.executor not in EXECUTORS:
            raise ConfigError(f"unknown executor '{self.executor}'; check-invariants runs on: {', '.join(EXECUTORS)}")
        if not self.policies:
            raise ConfigError("no policy to check")
        for policy in self.policies:
            if policy not in POLICIES:
                raise ConfigError(f"unknown policy '{policy}'; choose one of: {', '.join(POLICIES)} or 'all'")
        if not self.reclaim_modes:
            raise ConfigError("no reclaim mode to check")
        for mode in self.reclaim_modes:
            if mode not in RECLAIM_MODES:
                raise ConfigError(f"unknown reclaim mode '{mode}'; choose one of: {', '.join(RECLAIM_MODES)} or 'both'")
        if self.fault is not None and self.fault not in FAULT_KINDS:
            raise ConfigError(f"unknown fault '{self.fault}'; choose one of: {', '.join(FAULT_KINDS)}")
        if self.num_fuzz_scenarios < 0:
            raise ConfigError(f"--fuzz must be >= 0 scenarios, got {self.num_fuzz_scenarios}")
        if self.num_blocks is not None and self.num_blocks <= 0:
            raise ConfigError(f"--num-blocks must be > 0, got {self.num_blocks}")
        if self.block_size is not None and self.block_size <= 0:
            raise ConfigError(f"--block-size must be > 0, got {self.block_size}")
        if self.device not in (None, "cpu", "cuda"):
            raise ConfigError(f"unknown device '{self.device}'; choose cpu or cuda")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ConfigError("device 'cuda' requested but torch sees no CUDA device")


@dataclass(frozen=True)
class Scenario:
    """One run to check: requests and the full config (policy, reclaim mode, budget, geometry)."""

    name: str
    requests: tuple[Request, ...]
    config: RunConfig


@dataclass(frozen=True)
class Violation:
    invariant: str
    message: str
    scenario: str
    policy: str
    reclaim_mode: str
    request_id: str | None = None
    req_idx: int | None = None
    token_id: int | None = None
    block_id: int | None = None
    offset: int | None = None


@dataclass(frozen=True)
class Tally:
    """Checks of one invariant: how many ran, how many failed, and the first failure."""

    checked: int = 0
    violations: int = 0
    first_violation: Violation | None = None

    def plus(self, other: Tally) -> Tally:
        return Tally(self.checked + other.checked, self.violations + other.violations,
                     self.first_violation or other.first_violation)


@dataclass(frozen=True)
class RunCheck:
    scenario: str
    policy: str
    reclaim_mode: str
    block_size: int
    num_blocks: int
    num_requests: int
    num_completed: int
    relocation_events: int
    tokens_moved: int
    preemptions: int
    faults_injected: int
    stopped: str | None  # why the run ended early, or None
    tallies: dict[str, Tally]
    elapsed_s: float

    @property
    def passed(self) -> bool:
        return all(t.violations == 0 for t in self.tallies.values())


class _Totals:
    """Totals over `self.runs`."""

    runs: tuple[RunCheck, ...]

    @property
    def tallies(self) -> dict[str, Tally]:
        total = {name: Tally() for name in INVARIANTS}
        for run in self.runs:
            total = {name: total[name].plus(run.tallies[name]) for name in INVARIANTS}
        return total

    @property
    def passed(self) -> bool:
        return all(run.passed for run in self.runs)

    @property
    def relocation_events(self) -> int:
        return sum(run.relocation_events for run in self.runs)

    @property
    def tokens_moved(self) -> int:
        return sum(run.tokens_moved for run in self.runs)


@dataclass(frozen=True)
class GroupTotal(_Totals):
    """The runs of one (policy, reclaim mode) over every scenario."""

    policy: str
    reclaim_mode: str
    runs: tuple[RunCheck, ...]


@dataclass(frozen=True)
class CheckReport(_Totals):
    runs: tuple[RunCheck, ...]
    base: RunConfig  # what every trace scenario starts from (fuzz draws replace most of it)
    options: CheckOptions
    device: str
    copy_mode: str
    notes: tuple[str, ...]  # how the traces were cut down
    elapsed_s: float

    @property
    def relocation_events_per_s(self) -> float:
        return self.relocation_events / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def by_policy_mode(self) -> list[GroupTotal]:
        """Totals per (policy, reclaim mode) over every scenario, in run order."""
        groups: dict[tuple[str, str], list[RunCheck]] = {}
        for run in self.runs:
            groups.setdefault((run.policy, run.reclaim_mode), []).append(run)
        return [GroupTotal(policy, mode, tuple(runs)) for (policy, mode), runs in groups.items()]


Progress = Callable[[str, int], None]  # (what is running, requests done)

SAMPLE_TRACES_DIR = Path(__file__).resolve().parent.parent / "sample_traces"
TRACE_SUFFIXES = (".jsonl", ".csv", ".json")


def bundled_sample_traces() -> list[Path]:
    """The sample traces that ship in the repository's sample_traces/, sorted by name."""
    paths = sorted(p for p in SAMPLE_TRACES_DIR.glob("*") if p.suffix in TRACE_SUFFIXES) if SAMPLE_TRACES_DIR.is_dir() else []
    if not paths:
        raise ConfigError(f"no bundled sample traces in {SAMPLE_TRACES_DIR}; give a TRACE or --fuzz N")
    return paths


# ---- the library call --------------------------------------------------------------------------


def check_invariants(traces: Sequence[Trace], base: RunConfig, options: CheckOptions,
                     progress: Progress | None = None) -> CheckReport:
    """Run every scenario of `traces` (x policies x reclaim modes) and `options.num_fuzz_scenarios`
    random ones with materialized KV, checking I1-I4 on every event. `base` gives the model, GPU,
    budget, eviction interval, concurrency and seed; `base.num_blocks` caps the block budget.
    """
    started = time.perf_counter()
    scenarios, notes = build_scenarios(traces, base, options)
    device = options.device or ("cuda" if torch.cuda.is_available() else "cpu")
    books: dict[int, KVBook] = {}  # id(requests) -> book; scenarios of one trace share their requests
    runs = []
    for scenario in scenarios:
        book = books.setdefault(id(scenario.requests), KVBook(scenario.requests))
        on_progress = (lambda n, s=scenario: progress(_describe(s), n)) if progress else None
        runs.append(check_scenario(scenario, options.fault, device, book, on_progress))
    elapsed_s = time.perf_counter() - started
    return CheckReport(tuple(runs), base, options, device, copy_mode_for(device), tuple(notes), elapsed_s)


def num_progress_units(traces: Sequence[Trace], base: RunConfig, options: CheckOptions) -> int:
    """Requests `check_invariants` replays in all (its progress unit)."""
    scenarios, _ = build_scenarios(traces, base, options)
    return sum(len(s.requests) for s in scenarios)


@contextmanager
def _single_torch_thread() -> Iterator[None]:
    """Run torch ops on one thread, restored after. The KV tensors here are tiny: scattering a
    2,000-token prefill through the intra-op thread pool took 23 ms on two cores, on one 0.2 ms."""
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(num_threads)


def _describe(scenario: Scenario) -> str:
    return f"{scenario.name} {scenario.config.eviction.policy}/{scenario.config.reclaim.mode}"


def copy_mode_for(device: str) -> str:
    """`async` on a CUDA stream; on CPU `deferred`, so that copies land one step after launch."""
    return "async" if device == "cuda" else "deferred"


def make_copy_engine(kv_cache: PagedKVCache) -> CopyEngine:
    """The copy engine of a checked run: every plan stays in flight across the next forward."""
    engine = CopyEngine(kv_cache, copy_mode_for(kv_cache.device.type))
    if engine.mode == "deferred":
        return OverlappingDeferredCopyEngine(engine)
    return ReportAfterForwardCopyEngine(engine)


def check_scenario(scenario: Scenario, fault: str | None = None, device: str = "cpu", book: KVBook | None = None,
                   on_progress: Callable[[int], None] | None = None) -> RunCheck:
    """Run one scenario under the checker; returns what was checked and what failed."""
    started = time.perf_counter()
    config = scenario.config
    shape = KVShape(KV_NUM_LAYERS, config.num_blocks, config.block_size, KV_NUM_HEADS, KV_HEAD_DIM)
    kv_cache = PagedKVCache(shape, KV_DTYPE, device)
    injector = make_fault(fault)
    copy_engine = injector.wrap_copy_engine(make_copy_engine(kv_cache))
    contents = KVContents(book or KVBook(scenario.requests), kv_cache)
    observer = CheckingObserver(scenario, contents, copy_engine, injector)
    executor = SimExecutor(config.model, config.gpu, config.sim, config.seed)
    runtime = Runtime(config, scenario.requests, executor, copy_engine=copy_engine, observer=observer)
    injector.wrap_runtime(runtime)
    observer.bind(runtime)
    num_done = [0]

    def count_done(n: int) -> None:
        num_done[0] += n
        if on_progress is not None:
            on_progress(n)

    with _single_torch_thread():
        stopped = observer.run(count_done)
    if on_progress is not None and num_done[0] < len(scenario.requests):
        on_progress(len(scenario.requests) - num_done[0])
    return RunCheck(
        scenario=scenario.name, policy=config.eviction.policy, reclaim_mode=config.reclaim.mode,
        block_size=config.block_size, num_blocks=config.num_blocks, num_requests=len(scenario.requests),
        num_completed=runtime.recorder_completed(), relocation_events=observer.num_relocations,
        tokens_moved=observer.num_tokens_moved, preemptions=runtime.scheduler.num_preemptions,
        faults_injected=injector.num_injected, stopped=stopped, tallies=observer.tallies(),
        elapsed_s=time.perf_counter() - started,
    )


# ---- the observer ------------------------------------------------------------------------------


class _RunStopped(Exception):
    """Raised by the observer to end a run that a violation left meaningless to continue."""


class CheckingObserver:
    """Receives the runtime's events and checks I1-I4 on each; records violations."""

    def __init__(self, scenario: Scenario, contents: KVContents, copy_engine: CopyEngine, fault: Fault) -> None:
        self.scenario = scenario
        self.contents = contents
        self.copy_engine = copy_engine
        self.fault = fault
        self.block_size = scenario.config.block_size
        self.runtime: Runtime | None = None
        self.num_relocations = 0
        self.num_tokens_moved = 0
        self._num_checked = dict.fromkeys(INVARIANTS, 0)
        self._num_violations = dict.fromkeys(INVARIANTS, 0)
        self._first: dict[str, Violation] = {}
        self._num_tokens_launched: dict[int, int] = {}  # req_idx -> tokens of its plan in flight
        self._num_forwards = 0

    def bind(self, runtime: Runtime) -> None:
        self.runtime = runtime

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
        if num_tokens_before == 0:
            self.fault.adopt_table(table)
        token_ids = np.arange(num_tokens_before, table.num_tokens)
        slots = table.block_ids[token_ids] * self.block_size + table.offsets[token_ids]
        self.contents.write(table, token_ids, slots)

    def on_forward(self, batch: Batch, in_flight_plans: list[RelocationPlan]) -> None:
        self._num_forwards += 1
        if self._num_forwards % I2_EVERY_NUM_FORWARDS == 0:
            self._check_mapping()
        for state in batch.prefill + batch.decode:
            self._check("I3", lambda t=state.table: self._check_reads(t, in_flight_plans))

    def on_plan(self, plan: RelocationPlan, table: TokenTable) -> None:
        self._num_tokens_launched[plan.req_id] = plan.num_tokens_moved
        in_flight = self.copy_engine.in_flight_plans
        if not self._check("I4", lambda: check_plan_independently(plan, table, self.runtime.pool, in_flight)):
            raise _RunStopped("stopped after an I4 violation: the runtime was about to launch the plan")

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
        slots = table.block_ids[live_ids] * self.block_size + table.offsets[live_ids]
        mismatched = self.contents.mismatched(table, live_ids, slots)
        if np.any(mismatched):
            lost = live_ids[mismatched]
            self.contents.write(table, lost, slots[mismatched])
        check_contents(table.req_id, live_ids, slots, mismatched, self.block_size)

    def _check_reads(self, table: TokenTable, in_flight_plans: list[RelocationPlan]) -> None:
        """I3: every slot attention reads (the table's slot cache) is no pending copy
        destination, is the token's mapped slot, and holds the token's K/V."""
        read_slots = table.slots()
        check_visibility(table.req_id, read_slots, in_flight_plans, self.block_size)
        live_ids = table.live_token_ids()
        mapped = table.block_ids[live_ids] * self.block_size + table.offsets[live_ids]
        if read_slots.shape != mapped.shape or not np.array_equal(read_slots, mapped):
            self._raise_stale_read(table, live_ids, read_slots, mapped)
        mismatched = self.contents.mismatched(table, live_ids, read_slots)
        if np.any(mismatched):
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
            block_id, offset = int(table.block_ids[token_id]), int(table.offsets[token_id])
        config = self.scenario.config
        requests = self.scenario.requests
        self._first[invariant] = Violation(
            invariant, f"{exc} ({note})" if note else str(exc), self.scenario.name, config.eviction.policy,
            config.reclaim.mode, requests[req_idx].request_id if req_idx is not None else None,
            req_idx, token_id, block_id, offset,
        )

    def _table_of(self, req_idx: int | None) -> TokenTable | None:
        if req_idx is None or self.runtime is None:
            return None
        return next((s.table for s in self.runtime.scheduler.running if s.req_idx == req_idx), None)


def check_plan_independently(plan: RelocationPlan, table: TokenTable, pool: BlockPool,
                             in_flight_plans: Sequence[RelocationPlan]) -> None:
    """I4 re-derived from the state: `check_plan` against the copy engine's own in-flight list
    (not the runtime's busy set), then every move starts at its token's current slot and every
    fresh destination block is still free."""
    check_plan(plan, table, pool, frozenset(p.req_id for p in in_flight_plans))
    moves = plan.moves
    stale = (table.block_ids[moves.token_ids] != moves.src_block_ids) | (table.offsets[moves.token_ids] != moves.src_offsets)
    if np.any(stale):
        i = int(np.flatnonzero(stale)[0])
        token_id, block_id, offset = int(moves.token_ids[i]), int(moves.src_block_ids[i]), int(moves.src_offsets[i])
        raise InvariantError("I4", f"request {plan.req_id} plan: moves token {token_id} from block {block_id} offset {offset}, "
                             "which it does not occupy", req_id=plan.req_id, token_id=token_id, block_id=block_id, offset=offset)
    taken = plan.dst_new_block_ids[pool.ref_counts[plan.dst_new_block_ids] != 0]
    if taken.size:
        raise InvariantError("I4", f"request {plan.req_id} plan: destination block {int(taken[0])} is not free",
                             req_id=plan.req_id, block_id=int(taken[0]))


# ---- materialized K/V ----------------------------------------------------------------------------


def kv_content(owner: int, token_ids: np.ndarray) -> np.ndarray:
    """K/V of tokens `token_ids` of `owner`: [num_layers, 2, n, kv_heads, head_dim] float32.

    A pure function of (owner, token id). Element [l, k, :, 0, 0] is owner + 1 and [l, k, :, 0, 1]
    token + 1 in every layer for K and V, so no two tokens hold the same K or V; the rest is
    a hash. Values stay below 2**23, exact in float32.
    """
    token_ids = np.asarray(token_ids, dtype=np.int64)
    num_elems = KV_NUM_LAYERS * 2 * KV_NUM_HEADS * KV_HEAD_DIM
    key = (owner + 1) * 1_000_003 + token_ids + 1
    x = (key[:, None] * 2_654_435_761 + np.arange(num_elems, dtype=np.int64)[None, :] * 40_503) % 2_147_483_647
    x = (x * 48_271) % 2_147_483_647 & 0x7FFFFF
    x = x.reshape(-1, KV_NUM_LAYERS, 2, KV_NUM_HEADS, KV_HEAD_DIM)
    x[:, :, :, 0, 0] = owner + 1
    x[:, :, :, 0, 1] = token_ids[:, None, None] + 1
    return np.ascontiguousarray(x.transpose(1, 2, 0, 3, 4), dtype=np.float32)


class KVBook:
    """The K/V every token of a request list must hold, computed once per owner and shared by
    every scenario over the same requests.

    A token's owner is its request, except for tokens of a pinned (shared) prefix: those belong
    to the prefix, and every request that shares it reads the same physical K/V.
    """

    def __init__(self, requests: Sequence[Request]) -> None:
        prefix_ids = sorted({r.prefix_id for r in requests if r.prefix_id is not None})
        self._owner_of_prefix = {prefix_id: len(requests) + i for i, prefix_id in enumerate(prefix_ids)}
        self._requests = requests
        self._num_tokens_of = [r.num_prompt_tokens + r.num_output_tokens for r in requests] + [0] * len(prefix_ids)
        for r in requests:
            if r.prefix_id is not None:
                owner = self._owner_of_prefix[r.prefix_id]
                self._num_tokens_of[owner] = max(self._num_tokens_of[owner], r.num_prompt_tokens)
        self._contents: dict[int, np.ndarray] = {}  # owner -> [num_layers, 2, num_tokens, kv_heads, head_dim]

    def expected(self, table: TokenTable, token_ids: np.ndarray) -> np.ndarray:
        """[num_layers, 2, n, kv_heads, head_dim] for ascending `token_ids` of `table`."""
        num_prefix = int(np.searchsorted(token_ids, table.num_pinned_tokens))
        if num_prefix == 0:
            return self._of(table.req_id, token_ids)
        prefix = self._of(self._owner_of_prefix[self._requests[table.req_id].prefix_id], token_ids[:num_prefix])
        if num_prefix == token_ids.size:
            return prefix
        return np.concatenate((prefix, self._of(table.req_id, token_ids[num_prefix:])), axis=2)

    def _of(self, owner: int, token_ids: np.ndarray) -> np.ndarray:
        contents = self._contents.get(owner)
        num_needed = int(token_ids[-1]) + 1 if token_ids.size else 0
        if contents is None or contents.shape[2] < num_needed:
            contents = kv_content(owner, np.arange(max(num_needed, self._num_tokens_of[owner])))
            self._contents[owner] = contents
        return np.take(contents, token_ids, axis=2)


class KVContents:
    """Writes and checks of one run's KV cache against a `KVBook`.

    Comparisons run in numpy on the host: on CPU over a view of the cache tensor, on CUDA
    through `PagedKVCache.read` (ordered on the compute stream after the copies it waits for).
    """

    def __init__(self, book: KVBook, kv_cache: PagedKVCache) -> None:
        self.book = book
        self._kv_cache = kv_cache
        self._host_view = kv_cache.flat.numpy() if kv_cache.device.type == "cpu" else None

    def write(self, table: TokenTable, token_ids: np.ndarray, slots: np.ndarray) -> None:
        self._kv_cache.write(torch.from_numpy(slots), torch.from_numpy(self.book.expected(table, token_ids)))

    def read(self, slots: np.ndarray) -> np.ndarray:
        if self._host_view is not None:
            return np.take(self._host_view, slots, axis=2)
        return self._kv_cache.read(torch.from_numpy(slots)).cpu().numpy()

    def mismatched(self, table: TokenTable, token_ids: np.ndarray, slots: np.ndarray) -> np.ndarray:
        """Per token: does the KV cache at `slots[i]` differ from token_ids[i]'s K/V?"""
        got, want = self.read(slots), self.book.expected(table, token_ids)
        if np.array_equal(got, want):
            return np.zeros(token_ids.size, dtype=bool)
        return (got != want).any(axis=(0, 1, 3, 4))


# ---- fault injection -------------------------------------------------------------------------------


class Fault:
    """No fault: the real copy engine, planner and tables. Subclasses wrap one of them."""

    kind: str | None = None

    def __init__(self) -> None:
        self.num_injected = 0

    def wrap_copy_engine(self, engine: CopyEngine) -> CopyEngine:
        return engine

    def wrap_runtime(self, runtime: Runtime) -> None:
        """Replace parts of a freshly built runtime (its planner)."""

    def adopt_table(self, table: TokenTable) -> None:
        """See a token table as it is created (before any relocation touches it)."""


class _CopyEngineWrapper:
    """Delegates to a copy engine; subclasses change one part of its behaviour."""

    def __init__(self, inner: CopyEngine) -> None:
        self._inner = inner

    def __getattr__(self, name: str):
        return getattr(self._inner, name)

    @property
    def in_flight_plans(self) -> list[RelocationPlan]:
        return self._inner.in_flight_plans

    def launch(self, plan: RelocationPlan) -> None:
        self._inner.launch(plan)

    def wait_before_forward(self) -> None:
        self._inner.wait_before_forward()

    def poll_completed(self) -> list[RelocationPlan]:
        return self._inner.poll_completed()

    def cancel(self, req_id: int) -> None:
        self._inner.cancel(req_id)

    def drain(self) -> list[RelocationPlan]:
        return self._inner.drain()


class OverlappingDeferredCopyEngine(_CopyEngineWrapper):
    """`deferred` copies that stay in flight across the next forward, as a copy on a side stream
    overlaps the next forward on a GPU.

    The runtime polls right after it launches (so that `sync` plans complete in the same step).
    A deferred copy completes at its second poll, so with that poll counted the data would land
    at the start of the next step, before its forward: no forward would ever run with a copy in
    flight, and I3 would have nothing to check. The poll right after a launch is not passed on.
    """

    def __init__(self, inner: CopyEngine) -> None:
        super().__init__(inner)
        self._has_launched_since_poll = False

    def launch(self, plan: RelocationPlan) -> None:
        self._inner.launch(plan)
        self._has_launched_since_poll = True

    def poll_completed(self) -> list[RelocationPlan]:
        if self._has_launched_since_poll:
            self._has_launched_since_poll = False
            return []
        return self._inner.poll_completed()

    def drain(self) -> list[RelocationPlan]:
        self._has_launched_since_poll = False
        return self._inner.drain()


class ReportAfterForwardCopyEngine(_CopyEngineWrapper):
    """`async` copies (CUDA) whose completion is reported only once a forward ran while they
    were in flight. A small copy on the side stream may land before the host polls again; the
    runtime must behave the same when it has not, and this makes that case happen every time."""

    def __init__(self, inner: CopyEngine) -> None:
        super().__init__(inner)
        self._landed: list[RelocationPlan] = []  # completed by the inner engine, not reported yet
        self._num_forwards: dict[int, int] = {}  # id(plan) -> forwards begun since its launch

    @property
    def in_flight_plans(self) -> list[RelocationPlan]:
        return self._landed + self._inner.in_flight_plans

    def launch(self, plan: RelocationPlan) -> None:
        self._inner.launch(plan)
        self._num_forwards[id(plan)] = 0

    def wait_before_forward(self) -> None:
        self._inner.wait_before_forward()
        for key in self._num_forwards:
            self._num_forwards[key] += 1

    def poll_completed(self) -> list[RelocationPlan]:
        # the first forward begins right after the poll that follows its wait: 2 = one forward passed
        self._landed += self._inner.poll_completed()
        ready = [p for p in self._landed if self._num_forwards[id(p)] >= 2]
        self._landed = [p for p in self._landed if self._num_forwards[id(p)] < 2]
        for plan in ready:
            del self._num_forwards[id(plan)]
        return ready

    def cancel(self, req_id: int) -> None:
        for plan in self.in_flight_plans:
            if plan.req_id == req_id:
                del self._num_forwards[id(plan)]
        self._landed = [p for p in self._landed if p.req_id != req_id]
        self._inner.cancel(req_id)

    def drain(self) -> list[RelocationPlan]:
        plans = self._landed + self._inner.drain()
        self._landed = []
        self._num_forwards.clear()
        return plans


class _SubstitutingCopyEngine(_CopyEngineWrapper):
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
                table.block_ids[last], table.offsets[last] = table.block_ids[first], table.offsets[first]  # views
                self.num_injected += 1

        table.apply_moves = apply_moves_mapping_twice


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


# ---- scenarios -------------------------------------------------------------------------------------

# Share of the peak blocks of the `concurrency` largest requests that the default budget gives:
# below 1, so that the pool is under pressure (reclamation, preemption, block reuse).
PRESSURE = 0.6


def build_scenarios(traces: Sequence[Trace], base: RunConfig, options: CheckOptions) -> tuple[list[Scenario], list[str]]:
    """Scenarios of the traces (x policies x reclaim modes) and the fuzz draws; notes say what
    was cut down."""
    scenarios: list[Scenario] = []
    notes: list[str] = []
    block_size = options.block_size or base.block_size
    for trace in traces:
        name = trace.source.replace("\\", "/").rsplit("/", 1)[-1]
        requests, cut = scale_requests(trace.requests, options.limits)
        if cut:
            notes.append(f"{name}: {cut}")
        num_blocks = options.num_blocks or pressure_num_blocks(requests, block_size, base)
        for policy in options.policies:
            for mode in options.reclaim_modes:
                config = replace(base, variant="vtoken", block_size=block_size, num_blocks=num_blocks,
                                 eviction=replace(base.eviction, policy=policy), reclaim=replace(base.reclaim, mode=mode))
                scenarios.append(Scenario(name, requests, config))
    scenarios += [fuzz_scenario(i, base, options) for i in range(options.num_fuzz_scenarios)]
    return scenarios, notes


def scale_requests(requests: Sequence[Request], limits: TraceLimits) -> tuple[tuple[Request, ...], str]:
    """Cut a trace down to `limits`; returns the requests and a note of what was cut ('' if nothing)."""
    kept = list(requests[: limits.max_requests])
    cuts = []
    if len(kept) < len(requests):
        cuts.append(f"first {len(kept)} of {len(requests)} requests")
    max_prompt = limits.max_prompt_tokens or max(r.num_prompt_tokens for r in kept)
    max_output = limits.max_output_tokens or max(r.num_output_tokens for r in kept)
    num_long_prompts = sum(r.num_prompt_tokens > max_prompt for r in kept)
    num_long_outputs = sum(r.num_output_tokens > max_output for r in kept)
    if num_long_prompts:
        cuts.append(f"prompts capped at {max_prompt} tokens ({num_long_prompts} requests)")
    if num_long_outputs:
        cuts.append(f"outputs capped at {max_output} tokens ({num_long_outputs} requests)")
    return tuple(_capped(r, max_prompt, max_output) for r in kept), "; ".join(cuts)


def _capped(request: Request, max_prompt: int, max_output: int) -> Request:
    num_prompt = min(request.num_prompt_tokens, max_prompt)
    num_prefix = min(request.num_prefix_tokens, num_prompt - 1)
    prefix_id = request.prefix_id if num_prefix > 0 else None
    return replace(request, num_prompt_tokens=num_prompt, num_output_tokens=min(request.num_output_tokens, max_output),
                   prefix_id=prefix_id, num_prefix_tokens=num_prefix if prefix_id else 0)


def pressure_num_blocks(requests: Sequence[Request], block_size: int, base: RunConfig) -> int:
    """A budget under pressure: PRESSURE x the peak blocks of the `concurrency` largest requests,
    at least the largest request plus the ordered headroom, at most what the model leaves on
    the GPU (`base.num_blocks`)."""
    peaks = sorted((-(-(r.num_prompt_tokens + r.num_output_tokens) // block_size) for r in requests), reverse=True)
    num_resident = base.concurrency or len(peaks)
    num_blocks = max(int(np.ceil(PRESSURE * sum(peaks[:num_resident]))), peaks[0] + base.reclaim.max_src_blocks + 1)
    return min(num_blocks, base.num_blocks)


def fuzz_scenario(index: int, base: RunConfig, options: CheckOptions) -> Scenario:
    """Random scenario `index` of seed `base.seed`: requests (lengths, arrivals, shared
    prefixes), budget, policy, reclaim mode and its knobs, block size and block budget."""
    rng = np.random.default_rng([base.seed, index, 0xF0])
    block_size = options.block_size or int(rng.choice([4, 8, 16, 32]))
    requests = _fuzz_requests(rng, block_size)
    keep = Budget(keep_ratio=float(rng.uniform(0.15, 0.9)), num_sink_tokens=int(rng.integers(0, 9)),
                  num_recent_tokens=int(rng.integers(0, 65)))
    if rng.random() < 0.3:
        keep = replace(keep, keep_ratio=None, num_tokens=int(rng.integers(16, 512)))
    mode = str(rng.choice(options.reclaim_modes))
    reclaim = ReclaimConfig(mode=mode, theta_f=float(rng.uniform(0.05, 0.5)), check_interval_steps=int(rng.integers(1, 5)),
                            max_src_blocks=int(rng.integers(2, 33)))
    concurrency = None if rng.random() < 0.3 else int(rng.integers(1, 9))
    config = replace(
        base, variant="vtoken", block_size=block_size, concurrency=concurrency, seed=int(rng.integers(0, 2**31)),
        max_fused_steps=int(rng.integers(1, 17)),
        eviction=EvictionConfig(str(rng.choice(options.policies)), keep, int(rng.choice([1, 4, 8, 16, 32]))),
        reclaim=reclaim,
    )
    # From starved (long requests dropped, preemption) to roomy; the floor admits most requests.
    peaks = sorted(-(-(r.num_prompt_tokens + r.num_output_tokens) // block_size) for r in requests)
    num_resident_peak = sum(peaks[-(concurrency or len(peaks)):])
    num_floor = int(rng.uniform(0.5, 1.0) * peaks[-1]) + reclaim.num_headroom_blocks + 1
    num_blocks = options.num_blocks or max(int(rng.uniform(0.1, 1.0) * num_resident_peak), num_floor)
    return Scenario(f"fuzz-{index:03d}", requests, replace(config, num_blocks=num_blocks))


def _fuzz_requests(rng: np.random.Generator, block_size: int) -> tuple[Request, ...]:
    num_prefixes = int(rng.integers(0, 4))
    prefix_lengths = [int(rng.integers(1, 8)) * block_size + int(rng.integers(0, block_size)) for _ in range(num_prefixes)]
    requests, arrival_s = [], 0.0
    for i in range(int(rng.integers(2, 17))):
        num_question = int(np.exp(rng.uniform(np.log(4), np.log(1500))))
        prefix_idx = int(rng.integers(0, num_prefixes)) if num_prefixes and rng.random() < 0.7 else None
        num_prefix = prefix_lengths[prefix_idx] if prefix_idx is not None else 0
        arrival_s += float(rng.exponential(0.05))
        requests.append(Request(
            f"fuzz-{i}", arrival_s, num_prefix + num_question, int(rng.integers(1, 200)),
            prefix_id=f"p{prefix_idx}" if prefix_idx is not None else None, num_prefix_tokens=num_prefix,
        ))
    return tuple(requests)


# ---- JSON ------------------------------------------------------------------------------------------


def report_to_json(report: CheckReport) -> dict:
    """The `--json` object."""
    return {
        "passed": report.passed,
        "invariants": _tallies_json(report.tallies),
        "relocation_events": report.relocation_events,
        "tokens_moved": report.tokens_moved,
        "elapsed_s": report.elapsed_s,
        "relocation_events_per_s": report.relocation_events_per_s,
        "by_policy_mode": [
            {"policy": g.policy, "reclaim_mode": g.reclaim_mode, "num_runs": len(g.runs), "passed": g.passed,
             "relocation_events": g.relocation_events, "tokens_moved": g.tokens_moved, "invariants": _tallies_json(g.tallies)}
            for g in report.by_policy_mode()
        ],
        "runs": [_run_json(run) for run in report.runs],
        "fault": None if report.options.fault is None else {
            "kind": report.options.fault, "expected_invariant": FAULT_DETECTED_BY[report.options.fault],
            "num_injected": sum(r.faults_injected for r in report.runs),
        },
        "config": _config_json(report),
        "notes": list(report.notes),
    }


def _config_json(report: CheckReport) -> dict:
    base, options = report.base, report.options
    return {
        "executor": options.executor, "device": report.device, "copy_mode": report.copy_mode,
        "kv_shape": {"num_layers": KV_NUM_LAYERS, "num_kv_heads": KV_NUM_HEADS, "head_dim": KV_HEAD_DIM,
                     "dtype": str(KV_DTYPE).removeprefix("torch.")},
        "model": base.model.name, "gpu": base.gpu.name, "block_size": options.block_size or base.block_size,
        "num_blocks": options.num_blocks, "budget": base.eviction.budget.describe(),
        "eviction_interval_tokens": base.eviction.interval_tokens, "concurrency": base.concurrency,
        "theta_f": base.reclaim.theta_f, "reclaim_check_interval_steps": base.reclaim.check_interval_steps,
        "seed": base.seed, "policies": list(options.policies), "reclaim_modes": list(options.reclaim_modes),
        "num_fuzz_scenarios": options.num_fuzz_scenarios, "limits": vars(options.limits).copy(),
    }


def _tallies_json(tallies: dict[str, Tally]) -> dict:
    return {name: {"name": INVARIANT_NAMES[name], "checked": t.checked, "violations": t.violations,
                   "first_violation": None if t.first_violation is None else vars(t.first_violation).copy()}
            for name, t in tallies.items()}


def _run_json(run: RunCheck) -> dict:
    out = {k: v for k, v in vars(run).items() if k != "tallies"}
    out["passed"] = run.passed
    out["invariants"] = _tallies_json(run.tallies)
    return out
