"""The evictions' compiled loops (numba, vtoken/jit.py), reached through kv/compiled.py: a
table's batch eviction whole (`evict_tokens`: its checks, live bits and reverse-map entries),
which an eviction event pays on every policy run, and a decode step's evictions across the
batch, one token per request (`evict_one_each`); and the change of the pool's live counts and
histogram both make, which a round's landing makes too (`change_live_counts`).

They take the arrays as the pool and the tables keep them (int64 ids, int32 counts), so that
one compiled version serves every call.
"""

from __future__ import annotations

import numpy as np

from vtoken.jit import njit
from vtoken.kv.compiled_check import first_outside as _first_outside
from vtoken.kv.compiled_check import sorted_ascending as _sorted_ascending


@njit
def _reset(delta, seen, blocks):
    for b in blocks:
        delta[b] = 0
        seen[b] = False


@njit
def _first_seen(seen, blocks, distinct, num_distinct):
    for b in blocks:
        if not seen[b]:
            seen[b] = True
            distinct[num_distinct] = b
            num_distinct += 1
    return num_distinct


@njit
def change_live_counts(block_ids, deltas, live_counts, ref_counts, count_effects, delta, seen):
    """Add deltas[i] live tokens to block_ids[i], or deltas[0] to every one when `deltas` has
    one entry (ids may repeat: their deltas add up; an eviction gives -1 per token, landed moves -1 at their sources and +1 at their
    destinations): the blocks' live counts, written in place, and what the change adds to the
    pool's counts, the sum over the changed blocks of count_effects[new] - count_effects[old]
    (BlockPool: histogram bins, then blocks <= S/2, then live tokens).

    Returns (the blocks left without a live token, ascending; those changes; 0; -1), or, writing
    nothing, a reason and the first block it names: 1 an id outside the pool, 2 a free block
    (no reference), 3 a live count that would leave [0, S]. `delta` and `seen` are pool-sized
    scratch arrays, written here where they are read."""
    changes = np.zeros(count_effects.shape[1], np.int64)
    no_blocks = np.empty(0, np.int64)
    i = _first_outside(block_ids, live_counts.size)
    if i >= 0:
        return no_blocks, changes, 1, block_ids[i]
    _reset(delta, seen, block_ids)
    same = deltas.size == 1
    for i in range(block_ids.size):
        delta[block_ids[i]] += deltas[0] if same else deltas[i]
    distinct = np.empty(block_ids.size, np.int64)
    num_distinct = _first_seen(seen, block_ids, distinct, 0)
    block_size = count_effects.shape[0] - 1
    for i in range(num_distinct):
        b = distinct[i]
        if ref_counts[b] <= 0:
            return no_blocks, changes, 2, b
        if not 0 <= live_counts[b] + delta[b] <= block_size:
            return no_blocks, changes, 3, b
    emptied = np.empty(num_distinct, np.int64)
    num_emptied = 0
    for i in range(num_distinct):
        b = distinct[i]
        old = live_counts[b]
        new = old + delta[b]
        live_counts[b] = new
        for c in range(changes.size):
            changes[c] += count_effects[new, c] - count_effects[old, c]
        if new == 0:
            emptied[num_emptied] = b
            num_emptied += 1
    return _sorted_ascending(emptied[:num_emptied]), changes, 0, -1


# evict_tokens' refusals of the table's ids; the pool's (change_live_counts') follow, shifted by 4
UNKNOWN_TOKEN, DEAD_TOKEN, PINNED_TOKEN, REPEATED_TOKEN = 1, 2, 3, 4
# the refusal of tables that are not distinct tables of one pool (evict_one_each, land_moves):
# two at one base of the arena (a table given twice), or one of another pool (given the base -1)
NOT_DISTINCT_TABLES = -1


@njit
def are_distinct_tables(bases):
    """Whether tables whose tokens start at `bases` in a pool's arena (TokenArena.bases) are
    distinct tables of that pool: no base negative (another pool's table), no two equal."""
    if bases.size == 0:
        return True
    ordered = _sorted_ascending(bases)
    if ordered[0] < 0:
        return False
    for i in range(1, ordered.size):
        if ordered[i] == ordered[i - 1]:
            return False
    return True


@njit
def evict_tokens(token_ids, live, slot, token_at, num_pinned, num_tokens, block_size,
                 live_counts, ref_counts, count_effects, delta, seen, count_logical):
    """One table's batch eviction (TokenTable.evict_tokens): the ids' live bits cleared, their
    slots' reverse-map entries cleared, and one live token less in the block of each
    (change_live_counts, whose changes to the pool's counts it returns).

    `live` and `slot` are the table's per-token arrays, `token_at` the pool's reverse map.
    Checked before anything is written, in this order, the first id or block that fails named:
    an id outside [0, num_tokens) (UNKNOWN_TOKEN), one already dead (DEAD_TOKEN), one in the
    pinned prefix (PINNED_TOKEN), an id given twice (REPEATED_TOKEN), then the pool's refusals
    (change_live_counts' reason + 4). Returns (the blocks left without a live token, ascending;
    the changes; 0 or the reason; -1 or the id or block named; with `count_logical`, the
    logical blocks, S ids each, before the one being written, that the ids leave without a live
    token: what the table's uncompacted layout gives back, table_layout.py; without it, the
    number of ids, a bound of that)."""
    changes = np.zeros(count_effects.shape[1], np.int64)
    no_blocks = np.empty(0, np.int64)
    ascending = True
    for i in range(token_ids.size):
        t = token_ids[i]
        if t < 0 or t >= num_tokens:
            return no_blocks, changes, UNKNOWN_TOKEN, t, 0
        if i and t <= token_ids[i - 1]:
            ascending = False
    for i in range(token_ids.size):
        if not live[token_ids[i]]:
            return no_blocks, changes, DEAD_TOKEN, token_ids[i], 0
    for i in range(token_ids.size):
        if token_ids[i] < num_pinned:
            return no_blocks, changes, PINNED_TOKEN, token_ids[i], 0
    ordered = token_ids
    if not ascending:  # distinct ids ascend once sorted without two equal neighbours
        ordered = np.sort(token_ids)
        for i in range(1, ordered.size):
            if ordered[i] == ordered[i - 1]:
                return no_blocks, changes, REPEATED_TOKEN, ordered[i], 0
    block_ids = np.empty(token_ids.size, np.int64)
    for i in range(token_ids.size):
        block_ids[i] = slot[token_ids[i]] // block_size
    emptied, changes, reason, block = change_live_counts(block_ids, np.full(1, -1, np.int64), live_counts, ref_counts,
                                                         count_effects, delta, seen)
    if reason:
        return emptied, changes, REPEATED_TOKEN + reason, block, 0
    for i in range(token_ids.size):
        t = token_ids[i]
        token_at[slot[t]] = -1
        live[t] = False
    if not count_logical:
        return emptied, changes, 0, -1, token_ids.size
    # each logical block an id fell in, once (the ids ascend in `ordered`), that is now all dead
    num_before_writing = (num_tokens - 1) // block_size
    num_logical_emptied, last = 0, -1
    for i in range(ordered.size):
        logical = ordered[i] // block_size
        if logical == last or logical >= num_before_writing:
            continue
        last = logical
        num_logical_emptied += 1
        for t in range(logical * block_size, (logical + 1) * block_size):
            if live[t]:
                num_logical_emptied -= 1
                break
    return emptied, changes, 0, -1, num_logical_emptied


@njit
def evict_one_each(token_ids, num_tokens, num_pinned, bases, arena_live, arena_slot, token_at, block_size, live_counts,
                   ref_counts, count_effects, delta, seen):
    """A decode step's evictions across the batch, one token per table (TokenTable.evict_one_each):
    token_ids[i] of table i, whose per-token arrays start at bases[i] in the pool's arena, has
    its live bit cleared and its slot's reverse-map entry cleared, and its block one live token
    less (change_live_counts, whose changes to the pool's counts it returns).

    Returns (per table, the block its eviction emptied or -1; the changes; 0; -1), or, having
    written nothing: NOT_DISTINCT_TABLES when two tables share a base or one's is negative (of
    another pool); the first table whose id is outside [num_pinned[i], num_tokens[i]) or not
    live, as (.., .., UNKNOWN_TOKEN, i) (the table names the reason); or the pool's refusal
    (change_live_counts' reason + REPEATED_TOKEN) and the block it names."""
    num_tables = token_ids.size
    emptied = np.full(num_tables, -1, np.int64)
    changes = np.zeros(count_effects.shape[1], np.int64)
    block_ids = np.empty(num_tables, np.int64)
    if not are_distinct_tables(bases):
        return emptied, changes, NOT_DISTINCT_TABLES, -1
    for i in range(num_tables):
        t = token_ids[i]
        if not (num_pinned[i] <= t < num_tokens[i]) or not arena_live[bases[i] + t]:
            return emptied, changes, UNKNOWN_TOKEN, i
        block_ids[i] = arena_slot[bases[i] + t] // block_size
    _, changes, reason, block = change_live_counts(block_ids, np.full(1, -1, np.int64), live_counts, ref_counts,
                                                   count_effects, delta, seen)
    if reason:
        return emptied, changes, REPEATED_TOKEN + reason, block
    for i in range(num_tables):
        at = bases[i] + token_ids[i]
        arena_live[at] = False
        token_at[arena_slot[at]] = -1
        if live_counts[block_ids[i]] == 0:
            emptied[i] = block_ids[i]
    return emptied, changes, 0, -1
