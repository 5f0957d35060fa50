"""Load the compiled loops before a server's first step needs them.

The substrate's loops and a policy's selection are compiled with numba (vtoken/jit.py) and
imported when a process first evicts or reclaims. Loading them from numba's cache takes over
half a second, compiling them (the first run in an environment) some 18-20 s (the README's vLLM
section gives the command): a server that loads them at its first eviction stalls that step,
and every request in its batch with it. An engine calls `warm_compiled_loops()` where it starts
instead (the vLLM scheduler's tracker does).

It runs a small eviction and reclamation on a pool of its own through the substrate's verbs,
the call sites a replay or a server uses, so that each loop is typed by the arrays the
substrate really passes; then the selection over each dtype a policy ranks by (float scores,
Scissorhands' int32 counts, StreamingLLM's int64 token ids). tests/test_warmup.py replays
workloads after it and fails if any loop compiles again.
"""

from __future__ import annotations

import importlib

import numpy as np

from vtoken.invariants import check_round
from vtoken.kv.block_pool import BlockPool
from vtoken.kv.compaction import plan_compaction
from vtoken.kv.reclaim import ReclaimConfig, Reclaimer
from vtoken.kv.token_table import TokenTable
from vtoken.policies.base import lowest_positions

BLOCK_SIZE = 4
# every module of compiled loops (vtoken/jit.py); each imports numba
COMPILED_MODULES = ("vtoken.kv.compiled", "vtoken.kv.compiled_check", "vtoken.kv.compiled_evict",
                    "vtoken.policies.selection", "vtoken.engine.sim_compiled")
SCORE_DTYPES = (np.float64, np.int32, np.int64)  # attention_sum and attention_last; importance_count; token ids (StreamingLLM)


def warm_compiled_loops() -> None:
    """Compile or load every compiled loop for the types the runtime passes it."""
    from vtoken.policies.selection import lowest_unprotected_ids, unprotected_slice  # numba: at the call, not with this module

    pool = BlockPool(16, BLOCK_SIZE)
    tables = [TokenTable(req_id, pool) for req_id in range(2)]
    for table in tables:
        table.sync_new_tokens(pool.allocate(table.num_new_blocks_needed(12)), 12)
        table.evict_tokens(np.array([1, 2, 5, 6], dtype=np.int64))  # the table's and the pool's counts
    reclaimer = Reclaimer(ReclaimConfig(max_moves_per_step=None), pool)
    assert reclaimer.plan_to_free(tables, frozenset(), 1), "the warm-up's layout gave the reclaimer nothing to plan"  # under pressure
    plans = reclaimer.plan(tables)  # a lazy round's planning
    planned = [tables[plan.req_id] for plan in plans]
    check_round(plans, planned, pool, frozenset())  # I4
    TokenTable.apply_moves_each(planned, [plan.moves for plan in plans], [table.layout_version for table in planned])  # a round's landing
    TokenTable.release_empty_blocks_each(planned)
    tables[0].apply_moves(plan_compaction(tables[0], "hole-fill"))  # a vLLM tracker's compaction
    TokenTable.evict_one_each(tables, np.array([8, 8], dtype=np.int64))  # one token per request, many requests in one call
    pool.adjust_live(pool.allocate(1), np.array([0], dtype=np.int64))  # a caller's own live-count change
    token_ids = np.arange(64, dtype=np.int64)  # a view's ids, as TokenTable.live_token_ids gives them
    for dtype in SCORE_DTYPES:
        scores = np.arange(64, 0, -1).astype(dtype)
        for k in (1, 8):  # the heap and the partition
            n = min(k * 32, scores.size)
            lowest_positions(scores[:n], k)
            lowest_unprotected_ids(token_ids[:n], scores[:n], 0, n, n - k)  # a policy's run (`evict_lowest`), k victims
    unprotected_slice(token_ids, 0, 64, 60)  # the rule alone (`num_victims`)


def warm_sim_loops() -> None:
    """Compile or load the sim executor's scores (engine/sim_compiled.py) for the types the sim
    passes them (float64 values, int64 token ids): what a replay on the sim would otherwise load
    at its first scores."""
    from vtoken.engine import sim_compiled  # numba: at the call, not with this module

    sim_compiled.pareto_plus_one(np.ones(2), 1.5, np.empty(2))
    sim_compiled.weighted_by_age(np.ones(2), np.ones(2), 2, np.zeros(1, dtype=np.int64))


def compiled_signatures(module_names: tuple[str, ...] = COMPILED_MODULES) -> dict[str, int]:
    """How many typed versions each compiled loop bound to a public name in these modules holds
    now (the entry points their callers reach from Python; a loop that only other loops call
    holds none of its own), under the loop's own name, module.qualname, so that a loop another
    module re-exports counts once. Imports the modules, and numba with them."""
    counts = {}
    for module_name in module_names:
        for name, value in vars(importlib.import_module(module_name)).items():
            if not name.startswith("_") and hasattr(value, "signatures") and hasattr(value, "py_func"):  # a numba dispatcher
                counts[f"{value.py_func.__module__}.{value.py_func.__qualname__}"] = len(value.signatures)
    return counts
