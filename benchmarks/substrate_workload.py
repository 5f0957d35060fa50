"""The workload bench_substrate.py times: R requests of an L-token context on one block pool,
one new token per request per step, and with eviction one victim per request per step and the
reclaimer on. Not a benchmark by itself: it builds the state and runs the steps; the bench
times them.

Cadences of the reclaimer (hole-fill, no KV data; its plans land in the step that launched
them, or with `landing="next-step"` at the next one, as asynchronous copies do):

    default      as shipped (ReclaimConfig defaults): every k = 4 steps, when F >= theta_F =
                 0.25, a round starts; it moves at most 2,048 tokens a step and goes on at the
                 next steps until every request it took is planned
    auto         the default with a budget that follows the step (`--reclaim-budget auto`,
                 StepShare): 10 moves a millisecond of the modelled step, plans of at most
                 B' = 1.25 x budget / S blocks, a request whose plan B' cut going on alone
    whole-round  the same gate, the whole round in the step it starts (max_moves_per_step=None,
                 `vtoken compare --reclaim-budget none`): one step does a whole cycle's work
    paced        the gate checked every step, a fixed budget: auto's after the modelled step
                 (`paced_moves_per_step`), plans of at most its B' source blocks
    every-step   plan every step regardless of F (a stress case: many one-block plans)
"""

from __future__ import annotations

import time
from typing import NamedTuple

import numpy as np

from vtoken import defaults
from vtoken.engine.executor import StepLoad
from vtoken.engine.sim import SimExecutor, SimProfile
from vtoken.engine.warmup import warm_compiled_loops
from vtoken.hardware import resolve_gpu
from vtoken.invariants import check_round
from vtoken.kv.block_pool import BlockPool
from vtoken.kv.copy_engine import CopyEngine
from vtoken.kv.live_counts import compiled_loops
from vtoken.kv.moves import RelocationPlan, end_to_end
from vtoken.kv.planning import plan_hole_fill_round
from vtoken.kv.reclaim import ReclaimConfig, Reclaimer, StepShare, src_blocks_for_moves
from vtoken.kv.token_table import TokenTable
from vtoken.model_spec import resolve_model

BLOCK_SIZE = 16
NUM_SINK_TOKENS = 4
NUM_RECENT_TOKENS = 256
CADENCES = ("default", "auto", "whole-round", "paced", "every-step")
LANDINGS = ("same-step", "next-step")  # when launched plans land: synchronous copies, or asynchronous (a GPU's)
# who reads every table's slot list after a step: nothing (the sim's and the vLLM executor's
# engines: attention reads the block table, Runtime and vllm/ never call `slots()`), or the hf
# executor's attention, which reads `slots()` of every request at every step (engine/hf.py)
# and so keeps each list up to date, which every eviction then records (`remove_later`)
READERS = ("none", "slots")
ROUND_CADENCES = ("default", "auto", "whole-round", "paced")  # a round starts at a check and ends when it is done
NO_BLOCKS = np.zeros(0, dtype=np.int64)
# what a diagnostic warms between the steps outside a round (EvictingRun.warm_round_code): the
# round's code run through the substrate's verbs, Python and compiled, or its compiled calls alone
WARMINGS = ("verbs", "compiled")
# the compiled calls of a round step (kv/compiled.py): planning, the I4 check, landing, release
ROUND_LOOPS = ("hole_fill_round", "round_passes", "land_moves", "release_empty_blocks")


def modelled_step_us(num_requests: int, context_tokens: int) -> float:
    """The sim's duration of one decode step of `num_requests` requests with `context_tokens`
    each (every slot live), for the default model and GPU, in microseconds."""
    executor = SimExecutor(resolve_model(defaults.MODEL), resolve_gpu(defaults.GPU), SimProfile(), defaults.SEED)
    num_slots = num_requests * context_tokens
    load = StepLoad(num_kv_slots_read=num_slots, num_live_kv_tokens=num_slots, num_decoding_requests=num_requests,
                    prefill_chunks=(), num_copied_tokens=0)
    return 1e6 * executor.iteration_time_s(load)


def paced_moves_per_step(step_us: float) -> int:
    """The paced cadence's budget: `--reclaim-budget auto`'s (StepShare) after the modelled step."""
    return StepShare().num_moves(step_us / 1e6, BLOCK_SIZE)


def reclaim_config(cadence: str, step_us: float, mode: str = "hole-fill") -> ReclaimConfig:
    if cadence == "paced":
        return budgeted_config(paced_moves_per_step(step_us), mode)
    if cadence == "whole-round":
        return ReclaimConfig(mode=mode, max_moves_per_step=None)
    if cadence == "auto":
        return ReclaimConfig(mode=mode, max_moves_per_step=StepShare())
    return ReclaimConfig(mode=mode)


def budgeted_config(num_moves: int, mode: str = "hole-fill") -> ReclaimConfig:
    """The paced cadence's reclaimer at a fixed budget of `num_moves` tokens a step: the gate
    checked every step, and B the B' that StepShare gives that budget (`src_blocks_for_moves`,
    here not capped by the shipped B), so that a request gives a round one plan."""
    return ReclaimConfig(mode=mode, check_interval_steps=1, max_moves_per_step=num_moves,
                         max_src_blocks=src_blocks_for_moves(num_moves, BLOCK_SIZE))


def num_pool_blocks(num_requests: int, context_tokens: int, num_steps: int) -> int:
    per_request = -(-(context_tokens + num_steps + 64) // BLOCK_SIZE) + 4
    return num_requests * per_request + 256


class NativeTable:
    """A plain block table with the token table's growth calls: slot = block_table[pos // S] * S
    + pos % S for each new token, appended to a slot array (numpy buffers grown by doubling)."""

    def __init__(self, pool: BlockPool) -> None:
        self.block_size = pool.block_size
        self.block_table = np.zeros(64, dtype=np.int64)
        self.num_blocks = 0
        self.slot_buffer = np.zeros(1024, dtype=np.int64)
        self.num_tokens = 0

    def num_new_blocks_needed(self, num_new_tokens: int) -> int:
        overflow = self.num_tokens + num_new_tokens - self.num_blocks * self.block_size
        return -(-overflow // self.block_size) if overflow > 0 else 0

    def sync_new_tokens(self, new_block_ids: np.ndarray, num_tokens: int) -> None:
        if len(new_block_ids):
            end = self.num_blocks + len(new_block_ids)
            if end > self.block_table.size:
                self.block_table = np.concatenate((self.block_table, np.zeros(max(end, self.block_table.size), np.int64)))
            self.block_table[self.num_blocks : end] = new_block_ids
            self.num_blocks = end
        start = self.num_tokens
        if num_tokens > self.slot_buffer.size:
            self.slot_buffer = np.concatenate((self.slot_buffer, np.zeros(max(num_tokens, self.slot_buffer.size), np.int64)))
        if num_tokens == start + 1:
            self.slot_buffer[start] = self.block_table[start // self.block_size] * self.block_size + start % self.block_size
        else:
            positions = np.arange(start, num_tokens)
            self.slot_buffer[start:num_tokens] = self.block_table[positions // self.block_size] * self.block_size + positions % self.block_size
        self.num_tokens = num_tokens

    def slots(self) -> np.ndarray:
        return self.slot_buffer[: self.num_tokens]


def grow_one(pool: BlockPool, table: TokenTable | NativeTable) -> None:
    """The runtime's growth step for one new token: allocate what overflows the tail, sync."""
    num_needed = table.num_new_blocks_needed(1)
    table.sync_new_tokens(pool.allocate(num_needed) if num_needed else NO_BLOCKS, table.num_tokens + 1)


def make_tables(pool: BlockPool, num_requests: int, context_tokens: int, kind: type = TokenTable) -> list:
    tables = []
    for req_id in range(num_requests):
        table = TokenTable(req_id, pool, capacity=context_tokens + 1024) if kind is TokenTable else NativeTable(pool)
        table.sync_new_tokens(pool.allocate(table.num_new_blocks_needed(context_tokens)), context_tokens)
        tables.append(table)
    return tables


def choose_victims(tables: list[TokenTable], rng: np.random.Generator, pattern: str) -> np.ndarray:
    """One live token per request from [sinks, length - recent): random, or the oldest."""
    victims = []
    for table in tables:
        low, high = max(NUM_SINK_TOKENS, table.num_pinned_tokens), table.num_tokens + 1 - NUM_RECENT_TOKENS
        live = table.live_mask
        if pattern == "oldest":
            token_id = low + int(np.argmax(live[low:high]))
        else:
            token_id = int(rng.integers(low, high))
            while not live[token_id]:
                token_id = int(rng.integers(low, high))
        victims.append(token_id)
    return np.array(victims, dtype=np.int64)


class CompiledRoundCalls:
    """The round's compiled calls (ROUND_LOOPS) as `warm_compiled_loops` makes them on its pool
    of its own, recorded once, then made again on fresh copies of their arrays at each call of
    this object: the round's compiled code warm, and none of the Python around it run (only the
    copies and the calls' dispatch)."""

    def __init__(self) -> None:
        loops = compiled_loops()
        self.functions = {name: getattr(loops, name) for name in ROUND_LOOPS}
        self.calls: dict[str, tuple] = {}

        def recording(name: str):
            def call(*args):
                self.calls.setdefault(name, tuple(a.copy() if isinstance(a, np.ndarray) else a for a in args))
                return self.functions[name](*args)
            return call

        try:
            for name in ROUND_LOOPS:
                setattr(loops, name, recording(name))
            warm_compiled_loops()
        finally:
            for name, function in self.functions.items():
                setattr(loops, name, function)
        if missing := [name for name in ROUND_LOOPS if name not in self.calls]:
            raise RuntimeError(f"warm_compiled_loops made no call of {', '.join(missing)}")

    def __call__(self) -> None:
        for name, args in self.calls.items():
            self.functions[name](*(a.copy() if isinstance(a, np.ndarray) else a for a in args))


class RoundStep(NamedTuple):
    """A step whose reclamation launched plans: how many, the tokens they moved, the seconds
    of each part of it (`EvictingRun.reclaim`), and the seconds of the step's evictions before
    it (0 for a reclaim called outside `step`). `is_first`: the first step of its round to
    launch plans; `replan_s`: at such a step with `EvictingRun.replan_first`, the seconds of
    planning the step's requests again right after its planning (0 otherwise)."""

    num_plans: int
    num_tokens_moved: int
    plan_s: float
    check_s: float
    launch_s: float
    land_s: float
    evict_s: float
    is_first: bool = False
    replan_s: float = 0.0

    @property
    def parts_s(self) -> tuple[float, float, float, float]:
        """The reclaim's parts: planning, the I4 check, launching and landing."""
        return self.plan_s, self.check_s, self.launch_s, self.land_s

    @property
    def reclaim_s(self) -> float:
        return sum(self.parts_s)


class EvictingRun:
    """R requests under one eviction per request per step, with the reclaimer on. `clock` is
    the timer of `step` (time.process_time or time.perf_counter)."""

    def __init__(self, num_requests: int, context_tokens: int, num_steps: int, config: ReclaimConfig,
                 pattern: str = "random", every_step: bool = False, seed: int = 0, clock=time.process_time,
                 landing: str = "same-step", reader: str = "none") -> None:
        if landing not in LANDINGS:
            raise ValueError(f"unknown landing '{landing}'; choose one of: {', '.join(LANDINGS)}")
        if reader not in READERS:
            raise ValueError(f"unknown reader '{reader}'; choose one of: {', '.join(READERS)}")
        self.pool = BlockPool(num_pool_blocks(num_requests, context_tokens, num_steps) + 64 * num_requests, BLOCK_SIZE)
        self.tables = make_tables(self.pool, num_requests, context_tokens)
        self.reclaimer = Reclaimer(config, self.pool)
        # the step a lazy round step follows, for a budget that follows it (StepShare): the
        # modelled one of this configuration, every step alike
        self.step_s = (modelled_step_us(num_requests, context_tokens) / 1e6
                       if isinstance(config.max_moves_per_step, StepShare) else None)
        self.engine = CopyEngine(None, "sync")
        self.by_id = {t.req_id: t for t in self.tables}
        self.rng = np.random.default_rng(seed)
        self.pattern = pattern
        self.every_step = every_step
        self.clock = clock
        self.step_idx = 0
        self.num_tokens_moved = 0
        self.num_blocks_freed_by_eviction = 0
        self.num_blocks_freed_by_plans = 0
        self.num_rounds = 0  # rounds that ended, having launched plans
        self.is_round_step = False  # the last step's reclaimer planned (a round started or went on)
        # per step that launched plans: its plans, tokens moved, and the seconds of planning, the
        # I4 check, launching (destinations adopted, copies launched and polled) and landing
        # (moves applied, emptied blocks released and freed); a caller that clears it counts
        # plans and moves from there on
        self.round_steps: list[RoundStep] = []
        self.launched_in_round = False  # the round in progress has launched plans
        # at a round's first launching step, plan its requests again right after its planning,
        # timed apart (`RoundStep.replan_s`): what the same planning costs once warm
        self.replan_first = False
        # next-step: the plans a step launches stay in flight in the copy engine and land at the
        # next step, before its evictions, as the runtime lands asynchronous copies (CUDA): it
        # polls them before the next forward (Runtime.execute)
        self.landing = landing
        self.reader = reader  # READERS: "slots" reads every table's slot list after each step (its seconds: `step`'s fourth)
        self.checked_at: dict[int, int] = {}  # a launched plan's table version at its check, by req_id
        # a diagnostic: after every step outside a round, untimed, the round's code run on a
        # small pool of its own, so that a round's first launching step meets it warm and only
        # its data cold: "verbs", through the substrate's verbs, Python and compiled
        # (engine/warmup.py); "compiled", the round's compiled calls alone (CompiledRoundCalls)
        self.warm_round_code: str | None = None
        self._warm_compiled: CompiledRoundCalls | None = None
        # a diagnostic: after every step, untimed, a write over this many bytes of a buffer of
        # its own, as the host's other work between two steps evicts its data caches
        self.sweep_bytes = 0
        self._sweep: np.ndarray | None = None

    def prefragment(self, num_dead_per_request: int | None = None) -> None:
        """Evict `num_dead_per_request` random tokens of every request (default: a different
        number below S each, so that requests do not all reach a reclaimable block at once)."""
        for table in self.tables:
            low, high = max(NUM_SINK_TOKENS, table.num_pinned_tokens), table.num_tokens + 1 - NUM_RECENT_TOKENS
            num_dead = int(self.rng.integers(0, BLOCK_SIZE)) if num_dead_per_request is None else num_dead_per_request
            if num_dead:
                candidates = low + np.flatnonzero(table.live_mask[low:high])
                emptied = table.evict_tokens(np.sort(self.rng.choice(candidates, num_dead, replace=False)))
                table.release_blocks(emptied)
                self.pool.free(emptied)

    def evict(self, victims: np.ndarray) -> None:
        """One victim per request in one call; the blocks it emptied go back in one free."""
        emptied = TokenTable.evict_one_each(self.tables, victims)
        hit = np.flatnonzero(emptied >= 0)
        if hit.size:
            for table_idx in hit.tolist():
                self.tables[table_idx].release_blocks(emptied[table_idx : table_idx + 1])
            self.pool.free(emptied[hit])
            self.num_blocks_freed_by_eviction += hit.size

    def reclaim(self, evict_s: float = 0.0, land_s: float = 0.0) -> None:
        """Plan, check, launch and land, as the runtime does (`Runtime._reclaim`): the step's
        plans checked with `check_round` (I4: one `plans_pass` call; `check_plan` plan by plan
        only when it finds something), launched, and, with same-step landing (synchronous
        copies), landed at once (`land`); with next-step landing they land at the next
        step. A step that launched plans is logged in `round_steps`, with the seconds of each
        part, `evict_s` (the step's evictions before it) and, next-step, `land_s` (the landing
        of the plans of the step before, at this step's start, copies polled) as its landing."""
        clock = self.clock
        started = clock()
        was_in_progress = self.reclaimer.is_round_in_progress
        plans = self.reclaimer.plan(self.tables, step_s=self.step_s)
        self.num_rounds += (was_in_progress or bool(plans)) and not self.reclaimer.is_round_in_progress
        if not was_in_progress:
            self.launched_in_round = False
        if not plans:
            return
        planned = clock()
        tables = [self.by_id[plan.req_id] for plan in plans]
        is_first, self.launched_in_round = not self.launched_in_round, True
        replan_s = self.time_replan(tables) if is_first and self.replan_first else 0.0
        check_started = clock()
        check_round(plans, tables, self.pool, frozenset())
        checked = clock()
        for plan, table in zip(plans, tables):
            if plan.dst_new_block_ids.size:  # an ordered plan's fresh destinations, as the runtime takes them
                table.adopt_blocks(self.pool.allocate(plan.dst_new_block_ids.size))
            self.checked_at[plan.req_id] = table.layout_version
            self.engine.launch(plan)
        if self.landing == "same-step":
            completed = self.engine.poll_completed()
            launched = clock()
            self.land(completed)
            land_s = clock() - launched
        else:
            launched = clock()
        self.round_steps.append(RoundStep(len(plans), sum(plan.num_tokens_moved for plan in plans), planned - started,
                                          checked - check_started, launched - checked, land_s, evict_s, is_first, replan_s))

    def land(self, completed: list[RelocationPlan]) -> None:
        """Land plans whose copies completed: their moves applied in one `apply_moves_each`
        call at the versions they were checked at (the moves end to end as they were planned,
        `end_to_end`), and every block they emptied released and freed in one call."""
        if not completed:
            return
        tables = [self.by_id[plan.req_id] for plan in completed]
        moves, move_of, _, _ = end_to_end(completed)
        TokenTable.apply_moves_each(tables, [plan.moves for plan in completed],
                                    [self.checked_at.pop(plan.req_id) for plan in completed], (moves, move_of))
        TokenTable.release_empty_blocks_each(tables)
        self.num_tokens_moved += sum(plan.num_tokens_moved for plan in completed)
        self.num_blocks_freed_by_plans += sum(plan.num_blocks_freed for plan in completed)

    def time_replan(self, tables: list[TokenTable]) -> float:
        """Seconds of planning `tables` again as a hole-fill round does (`plan_hole_fill_round`),
        the plans discarded; 0 for the ordered mode."""
        if self.reclaimer.config.mode != "hole-fill":
            return 0.0
        started = self.clock()
        plan_hole_fill_round(tables, self.reclaimer.step_budget(self.step_s)[1])
        return self.clock() - started

    def step(self, victims: np.ndarray) -> tuple[float, float, float, float]:
        """One decode step; returns seconds spent in growth, evict, reclaim and slots (the slots
        reader's; 0 without one). With
        next-step landing the plans in flight land first (in reclaim's seconds), as the runtime
        lands them before the forward; such a step counts as a round step."""
        pool, clock = self.pool, self.clock
        started = clock()
        for table in self.tables:
            grow_one(pool, table)
        pool.flush_deferred()  # the appends' live counts, as the runtime's per-step memory sample makes them
        grown = clock()
        has_landing = self.has_in_flight  # next-step only: a same-step step lands what it launches
        if has_landing:
            self.land(self.engine.poll_completed())
        landed = clock()
        self.evict(victims)
        evicted = clock()
        self.is_round_step = self.every_step or self.reclaimer.is_eligible(self.step_idx)
        if self.is_round_step:
            self.reclaim(evicted - landed, landed - grown)
        self.is_round_step |= has_landing
        reclaimed = clock()
        slots_s = 0.0
        if self.reader == "slots":
            for table in self.tables:
                table.slots()
            slots_s = clock() - reclaimed
        self.step_idx += 1
        parts = grown - started, evicted - landed, reclaimed - evicted + landed - grown, slots_s
        if self.warm_round_code and not self.reclaimer.is_round_in_progress and not self.has_in_flight:
            self._warm_round_code()
        if self.sweep_bytes:
            if self._sweep is None or self._sweep.size != self.sweep_bytes:
                self._sweep = np.zeros(self.sweep_bytes, dtype=np.uint8)
            self._sweep += 1
        return parts

    def _warm_round_code(self) -> None:
        if self.warm_round_code not in WARMINGS:
            raise ValueError(f"unknown warming '{self.warm_round_code}'; choose one of: {', '.join(WARMINGS)}")
        if self.warm_round_code == "verbs":
            warm_compiled_loops()
            return
        if self._warm_compiled is None:
            self._warm_compiled = CompiledRoundCalls()
        self._warm_compiled()

    @property
    def has_in_flight(self) -> bool:
        """Plans launched and not landed yet (next-step landing, between two steps)."""
        return bool(self.engine.in_flight_plans)

    def run(self, num_steps: int) -> np.ndarray:
        """Seconds per step of the four parts, [num_steps, 4]."""
        return np.array([self.step(choose_victims(self.tables, self.rng, self.pattern)) for _ in range(num_steps)])

    def advance_in_bulk(self, num_steps: int) -> None:
        """`num_steps` steps' growth and evictions at once, untimed and without the reclaimer:
        every request grows by `num_steps` tokens and loses as many random live tokens of its
        middle, in one call each (the caller keeps F below theta_F, where no round would run).
        With the slots reader the slot lists are rebuilt after, as a step leaves them."""
        pool = self.pool
        for table in self.tables:
            table.sync_new_tokens(pool.allocate(table.num_new_blocks_needed(num_steps)), table.num_tokens + num_steps)
            low, high = max(NUM_SINK_TOKENS, table.num_pinned_tokens), table.num_tokens + 1 - NUM_RECENT_TOKENS
            candidates = low + np.flatnonzero(table.live_mask[low:high])
            emptied = table.evict_tokens(np.sort(self.rng.choice(candidates, num_steps, replace=False)))
            table.release_blocks(emptied)
            pool.free(emptied)
            self.num_blocks_freed_by_eviction += emptied.size
            if self.reader == "slots":
                table.slots()
        self.step_idx += num_steps

    def run_until_a_round(self, max_steps: int) -> np.ndarray:
        """Steps until, and including, the step the next round that launched plans ends in."""
        num_rounds, parts = self.num_rounds, []
        while self.num_rounds == num_rounds:
            if len(parts) == max_steps:
                raise RuntimeError(f"no reclamation round in {max_steps} steps (F = {self.pool.waste_ratio():.3f})")
            parts.append(self.step(choose_victims(self.tables, self.rng, self.pattern)))
        return np.array(parts)
