"""Host-side cost of the vToken substrate per decode step. A benchmark, not a test.

    python benchmarks/bench_substrate.py [--json PATH] [--repeats N] [--quick]

R concurrent requests with an L-token context, block size S = 16, one new token per request
per step. Three ways of keeping the slots attention reads:

    native   a plain block table: slot = block_table[pos // S] * S + pos % S for the new
             token, appended to a cached slot array (what a paged engine without eviction does)
    table    the token-table indirection: sync_new_tokens + slots(), no eviction
    evict    table + one eviction per request per step from the unprotected middle (a random
             live token outside the sinks and the recent window; one in, one out, as at a
             policy's steady state) + the reclaimer (hole-fill) planning, launching and
             completing every step (sync copy, no KV data), + slots() of every request

Times are host microseconds from time.perf_counter: each repetition runs `steps` steps after
a warmup and takes the mean per step; the table shows the median over repetitions. Victims are
chosen outside the timed region (that is the policy's cost, not the substrate's). check_plan
(the I4 check the runtime runs on every plan) is not included; its cost is reported apart.

A second table compares the two reclamation modes on the same eviction sequence: tokens the
reclaimer moved per block it freed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass

import numpy as np

from vtoken.invariants import check_plan
from vtoken.kv.block_pool import BlockPool
from vtoken.kv.copy_engine import CopyEngine
from vtoken.kv.reclaim import ReclaimConfig, Reclaimer
from vtoken.kv.token_table import TokenTable

BLOCK_SIZE = 16
NUM_SINK_TOKENS = 4
NUM_RECENT_TOKENS = 256
SCENARIOS = ((64, 8192, 400), (64, 32768, 200), (256, 8192, 100), (256, 32768, 60))  # (requests, context, steps)
TARGET_TABLE_RATIO = 1.05
TARGET_EVICT_US_PER_STEP = 200.0  # at 64 requests x 8K


@dataclass(frozen=True)
class Row:
    num_requests: int
    context_tokens: int
    method: str
    us_per_step: float
    us_per_request_step: float
    ratio_vs_native: float
    plan_us_per_step: float = 0.0  # plan + launch + complete, inside us_per_step
    slots_us_per_step: float = 0.0  # slots() of every request, inside us_per_step
    check_plan_us_per_plan: float = 0.0  # not inside us_per_step
    plans_per_step: float = 0.0


@dataclass(frozen=True)
class MovesRow:
    pattern: str
    mode: str
    num_tokens_moved: int
    num_blocks_freed: int  # by relocation plans
    tokens_per_freed_block: float
    num_blocks_freed_by_eviction: int  # emptied by the evictions themselves, no move needed


def num_pool_blocks(num_requests: int, context_tokens: int, num_steps: int) -> int:
    per_request = -(-(context_tokens + num_steps + 64) // BLOCK_SIZE) + 4
    return num_requests * per_request + 256


# ---- (a) native ----------------------------------------------------------------------------


class NativeRequest:
    """A block table and a cached slot array, both numpy buffers grown by doubling."""

    def __init__(self, pool: BlockPool, num_tokens: int) -> None:
        self.pool = pool
        num_blocks = -(-num_tokens // BLOCK_SIZE)
        self.block_table = np.zeros(2 * num_blocks + 16, dtype=np.int64)
        self.block_table[:num_blocks] = pool.allocate(num_blocks)
        self.num_blocks = num_blocks
        positions = np.arange(num_tokens)
        self.slot_buffer = np.zeros(2 * num_tokens + 16, dtype=np.int64)
        self.slot_buffer[:num_tokens] = self.block_table[positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE
        self.num_tokens = num_tokens

    def append_token(self) -> np.ndarray:
        pos = self.num_tokens
        if pos % BLOCK_SIZE == 0:
            if self.num_blocks == self.block_table.size:
                self.block_table = np.concatenate((self.block_table, np.zeros_like(self.block_table)))
            self.block_table[self.num_blocks] = self.pool.allocate(1)[0]
            self.num_blocks += 1
        if pos == self.slot_buffer.size:
            self.slot_buffer = np.concatenate((self.slot_buffer, np.zeros_like(self.slot_buffer)))
        self.slot_buffer[pos] = self.block_table[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE
        self.num_tokens = pos + 1
        return self.slot_buffer[: pos + 1]


def time_native(num_requests: int, context_tokens: int, num_steps: int, num_repeats: int) -> list[float]:
    per_repeat = []
    for _ in range(num_repeats):
        pool = BlockPool(num_pool_blocks(num_requests, context_tokens, 2 * num_steps), BLOCK_SIZE)
        requests = [NativeRequest(pool, context_tokens) for _ in range(num_requests)]
        step_s = []
        for step_idx in range(2 * num_steps):  # the first half warms up
            started = time.perf_counter()
            for request in requests:
                request.append_token()
            if step_idx >= num_steps:
                step_s.append(time.perf_counter() - started)
        per_repeat.append(1e6 * statistics.fmean(step_s))
    return per_repeat


# ---- (b) token table -----------------------------------------------------------------------


def make_tables(pool: BlockPool, num_requests: int, context_tokens: int) -> list[TokenTable]:
    tables = []
    for req_id in range(num_requests):
        table = TokenTable(req_id, pool, capacity=context_tokens + 1024)
        table.sync_new_tokens(pool.allocate(table.num_new_blocks_needed(context_tokens)), context_tokens)
        tables.append(table)
    return tables


def grow_one(pool: BlockPool, table: TokenTable) -> None:
    block_ids = pool.allocate(table.num_new_blocks_needed(1))
    table.sync_new_tokens(block_ids, table.num_tokens + 1)


def time_table(num_requests: int, context_tokens: int, num_steps: int, num_repeats: int) -> list[float]:
    per_repeat = []
    for _ in range(num_repeats):
        pool = BlockPool(num_pool_blocks(num_requests, context_tokens, 2 * num_steps), BLOCK_SIZE)
        tables = make_tables(pool, num_requests, context_tokens)
        step_s = []
        for step_idx in range(2 * num_steps):
            started = time.perf_counter()
            for table in tables:
                grow_one(pool, table)
                table.slots()
            if step_idx >= num_steps:
                step_s.append(time.perf_counter() - started)
        per_repeat.append(1e6 * statistics.fmean(step_s))
    return per_repeat


# ---- (c) eviction + reclamation ------------------------------------------------------------


def choose_victims(tables: list[TokenTable], rng: np.random.Generator, pattern: str) -> list[np.ndarray]:
    """One live token per request from [sinks, length - recent): random, or the oldest."""
    victims = []
    for table in tables:
        low, high = max(NUM_SINK_TOKENS, table.num_pinned_tokens), table.num_tokens + 1 - NUM_RECENT_TOKENS
        if pattern == "oldest":
            token_id = low + int(np.argmax(table.live[low:high]))
        else:
            token_id = int(rng.integers(low, high))
            while not table.live[token_id]:
                token_id = int(rng.integers(low, high))
        victims.append(np.array([token_id], dtype=np.int64))
    return victims


class EvictingRun:
    """R requests under one eviction per request per step, reclaiming every step."""

    def __init__(self, num_requests: int, context_tokens: int, num_steps: int, mode: str, pattern: str, seed: int = 0) -> None:
        self.pool = BlockPool(num_pool_blocks(num_requests, context_tokens, num_steps) + 64 * num_requests, BLOCK_SIZE)
        self.tables = make_tables(self.pool, num_requests, context_tokens)
        self.reclaimer = Reclaimer(ReclaimConfig(mode=mode), self.pool)
        self.engine = CopyEngine(None, "sync")
        self.by_id = {t.req_id: t for t in self.tables}
        self.rng = np.random.default_rng(seed)
        self.pattern = pattern
        self.num_tokens_moved = 0
        self.num_blocks_freed_by_eviction = 0
        self.num_blocks_freed_by_plans = 0
        self.num_plans = 0

    def prefragment(self) -> None:
        """A different number of holes per request, so that requests do not all reach a
        reclaimable block at the same step."""
        for table in self.tables:
            for _ in range(int(self.rng.integers(0, BLOCK_SIZE))):
                self.evict(table, choose_victims([table], self.rng, self.pattern)[0])

    def evict(self, table: TokenTable, victims: np.ndarray) -> None:
        emptied = table.evict_tokens(victims)
        if emptied.size:
            table.release_blocks(emptied)
            self.pool.free(emptied)
            self.num_blocks_freed_by_eviction += emptied.size

    def step(self, victims: list[np.ndarray]) -> tuple[float, float, float]:
        """One decode step; returns seconds spent in (grow + evict, reclaim, slots)."""
        pool = self.pool
        started = time.perf_counter()
        for table, victim in zip(self.tables, victims, strict=True):
            grow_one(pool, table)
            self.evict(table, victim)
        evicted = time.perf_counter()
        for plan in self.reclaimer.plan(self.tables):
            table = self.by_id[plan.req_id]
            table.adopt_blocks(pool.allocate(plan.dst_new_block_ids.size))
            self.engine.launch(plan)
        for plan in self.engine.poll_completed():
            table = self.by_id[plan.req_id]
            table.apply_moves(plan.moves)
            table.release_blocks(plan.src_block_ids)
            pool.free(plan.src_block_ids)
            self.num_tokens_moved += plan.num_tokens_moved
            self.num_blocks_freed_by_plans += plan.num_blocks_freed
            self.num_plans += 1
        reclaimed = time.perf_counter()
        for table in self.tables:
            table.slots()
        return evicted - started, reclaimed - evicted, time.perf_counter() - reclaimed

    def run(self, num_steps: int) -> tuple[float, float, float]:
        """Mean seconds per step of the three parts over `num_steps` steps."""
        parts = np.zeros(3)
        for _ in range(num_steps):
            parts += self.step(choose_victims(self.tables, self.rng, self.pattern))
        return tuple(parts / num_steps)


def time_check_plan_us(run: EvictingRun, num_plans: int = 20) -> float:
    """Mean cost of the I4 check on fresh plans of this run's requests."""
    timings = []
    for plan in run.reclaimer.plan(run.tables)[:num_plans]:
        started = time.perf_counter()
        check_plan(plan, run.by_id[plan.req_id], run.pool, frozenset())
        timings.append(time.perf_counter() - started)
    return 1e6 * statistics.fmean(timings) if timings else 0.0


def time_evict(num_requests: int, context_tokens: int, num_steps: int, num_repeats: int) -> tuple[list[tuple[float, float, float]], float, float]:
    per_repeat, check_us, plans_per_step = [], 0.0, 0.0
    for repeat_idx in range(num_repeats):
        run = EvictingRun(num_requests, context_tokens, 3 * num_steps, "hole-fill", "random", seed=repeat_idx)
        run.prefragment()
        run.run(max(num_steps, 2 * BLOCK_SIZE))  # warm up into the steady state
        num_plans_before = run.num_plans
        per_repeat.append(run.run(num_steps))
        plans_per_step = (run.num_plans - num_plans_before) / num_steps
        for table in run.tables[: num_requests // 2]:  # some holes, so that check_plan has plans
            for _ in range(BLOCK_SIZE):
                run.evict(table, choose_victims([table], run.rng, "random")[0])
        check_us = time_check_plan_us(run)
    return per_repeat, check_us, plans_per_step


def measure_scenario(num_requests: int, context_tokens: int, num_steps: int, num_repeats: int) -> list[Row]:
    native, table = [], []
    for _ in range(num_repeats):  # alternated, so that a slow spell of the machine hits both
        native += time_native(num_requests, context_tokens, num_steps, 1)
        table += time_table(num_requests, context_tokens, num_steps, 1)
    native_us, table_us = statistics.median(native), statistics.median(table)
    parts, check_us, plans_per_step = time_evict(num_requests, context_tokens, num_steps, num_repeats)
    totals = [1e6 * sum(p) for p in parts]
    median_idx = int(np.argsort(totals)[len(totals) // 2])
    evict_us = totals[median_idx]
    _, plan_s, slots_s = parts[median_idx]

    def row(method: str, us: float, **extra: float) -> Row:
        return Row(num_requests, context_tokens, method, us, us / num_requests, us / native_us, **extra)

    return [
        row("native", native_us),
        row("table", table_us),
        row("evict", evict_us, plan_us_per_step=1e6 * plan_s, slots_us_per_step=1e6 * slots_s,
            check_plan_us_per_plan=check_us, plans_per_step=plans_per_step),
    ]


# ---- tokens moved per freed block ----------------------------------------------------------


def measure_moves(num_requests: int, context_tokens: int, num_steps: int) -> list[MovesRow]:
    rows = []
    for pattern in ("random", "oldest"):
        for mode in ("hole-fill", "ordered"):
            run = EvictingRun(num_requests, context_tokens, num_steps, mode, pattern, seed=7)
            run.run(num_steps)
            freed = run.num_blocks_freed_by_plans
            rows.append(MovesRow(pattern, mode, run.num_tokens_moved, freed, run.num_tokens_moved / freed if freed else float("nan"),
                                 run.num_blocks_freed_by_eviction))
    return rows


# ---- output --------------------------------------------------------------------------------


def format_rows(rows: list[Row]) -> str:
    header = (f"{'requests':>8} {'context':>7} {'method':<7} {'us/step':>10} {'us/req/step':>11} {'x native':>8} "
              f"{'reclaim us':>10} {'slots us':>9} {'plans/step':>10} {'check_plan us':>13}")
    lines = [header, "-" * len(header)]
    for r in rows:
        extra = (f"{r.plan_us_per_step:>10.1f} {r.slots_us_per_step:>9.1f} {r.plans_per_step:>10.2f} {r.check_plan_us_per_plan:>13.1f}"
                 if r.method == "evict" else "")
        lines.append(f"{r.num_requests:>8} {r.context_tokens // 1024:>6}K {r.method:<7} {r.us_per_step:>10.1f} "
                     f"{r.us_per_request_step:>11.2f} {r.ratio_vs_native:>8.2f} {extra}".rstrip())
    return "\n".join(lines)


def format_moves(rows: list[MovesRow]) -> str:
    header = f"{'pattern':<8} {'mode':<10} {'tokens moved':>12} {'blocks freed':>12} {'moved/freed':>11} {'freed by eviction':>17}"
    lines = [header, "-" * len(header)]
    lines += [f"{r.pattern:<8} {r.mode:<10} {r.num_tokens_moved:>12} {r.num_blocks_freed:>12} {r.tokens_per_freed_block:>11.2f} "
              f"{r.num_blocks_freed_by_eviction:>17}" for r in rows]
    return "\n".join(lines)


def format_targets(rows: list[Row]) -> str:
    lines = []
    for r in rows:
        if r.method == "table":
            verdict = "met" if r.ratio_vs_native <= TARGET_TABLE_RATIO else "MISSED"
            lines.append(f"table <= {TARGET_TABLE_RATIO}x native at {r.num_requests} x {r.context_tokens // 1024}K: "
                         f"{r.ratio_vs_native:.2f}x ({verdict})")
        if r.method == "evict" and (r.num_requests, r.context_tokens) == (64, 8192):
            verdict = "met" if r.us_per_step <= TARGET_EVICT_US_PER_STEP else "MISSED"
            lines.append(f"evict <= {TARGET_EVICT_US_PER_STEP:.0f} us/step at 64 x 8K: {r.us_per_step:.1f} us ({verdict})")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--repeats", type=int, default=5, help="repetitions per measurement (median reported)")
    parser.add_argument("--quick", action="store_true", help="64 x 8K only, fewer steps")
    args = parser.parse_args()
    scenarios = ((64, 8192, 50),) if args.quick else SCENARIOS
    started = time.perf_counter()
    rows = []
    for num_requests, context_tokens, num_steps in scenarios:
        rows += measure_scenario(num_requests, context_tokens, num_steps, args.repeats)
    moves = measure_moves(64, 8192, 50 if args.quick else 200)
    print(format_rows(rows))
    print()
    print("tokens moved per freed block, 64 requests x 8K, same eviction sequence for both modes")
    print(format_moves(moves))
    print()
    print(format_targets(rows))
    print(f"\n{time.perf_counter() - started:.0f} s", flush=True)
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"block_size": BLOCK_SIZE, "num_sink_tokens": NUM_SINK_TOKENS, "num_recent_tokens": NUM_RECENT_TOKENS,
                       "repeats": args.repeats, "rows": [asdict(r) for r in rows], "moves": [asdict(m) for m in moves]}, out, indent=2)


if __name__ == "__main__":
    main()
