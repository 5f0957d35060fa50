"""The round's I4 check compiled (numba, vtoken/jit.py): `round_passes`, the loops of
invariants.plans_pass over a round's arrays, and the small passes it is made of (order,
distinctness, bounds). kv/compiled.py holds the round step's other loops and reaches this one
for its callers (`live_counts.compiled_loops().round_passes`).

The check reads the pool's arrays at the plans' blocks and slots without numpy's bounds checks,
so every index is tested against the pool first; it writes only the pool's scratch arrays it
is handed, each where it reads them.
"""

from __future__ import annotations

import numpy as np

from vtoken.jit import njit


@njit
def ascending(values):
    """Each value above the one before it."""
    for i in range(1, values.size):
        if values[i] <= values[i - 1]:
            return False
    return True


@njit
def sorted_ascending(values):
    """`values` in ascending order: themselves, not a copy, when each is above the one before (a
    sort's code, which a round's first step meets cold, then does not run), else a sorted copy."""
    return values if ascending(values) else np.sort(values)


@njit
def _is_distinct(values):
    """No value repeats (one pass when they ascend, as the plans' usually do; else a sort)."""
    if ascending(values):
        return True
    ordered = np.sort(values)
    for j in range(1, ordered.size):
        if ordered[j] == ordered[j - 1]:
            return False
    return True


@njit
def _are_distinct_slots(blocks, offsets, block_size, taken):
    """No (block, offset) pair repeats: one bit per offset in a word per block (`taken`, a
    pool-sized scratch array, cleared here where it is read), where sorting the slots costs
    some n log n; by a sort when a block has more offsets than a word has bits."""
    if block_size > 64:
        return _is_distinct(blocks * block_size + offsets)
    for b in blocks:
        taken[b] = 0
    for i in range(blocks.size):
        bit = np.int64(1) << offsets[i]
        if taken[blocks[i]] & bit:
            return False
        taken[blocks[i]] |= bit
    return True


@njit
def first_outside(values, end):
    for i in range(values.size):
        if not 0 <= values[i] < end:
            return i
    return -1


@njit
def _within(values, end):
    return first_outside(values, end) < 0


@njit
def _unlabel(holder, source, new, blocks):
    for b in blocks:
        holder[b] = -1
        source[b] = -1
        new[b] = -1


@njit
def round_passes(num_plans, num_tokens, token_ids, move_of, src_blocks, src_offsets, dst_blocks, dst_offsets,
                 bases, arena_live, arena_slot, sources, source_of, new_blocks, new_of, held_blocks, held_ends,
                 pinned_blocks, open_tails, ref_counts, live_counts, token_at, holder, source, new, taken, forbidden,
                 block_size):
    """invariants.plans_pass's checks over a round's arrays (the plans' moves end to end,
    `move_of` the plan of each; their sources and fresh blocks likewise; the tables' held
    blocks end to end, plan k's table's ending at held_ends[k]), one loop each. A moved token's
    live bit and slot are read in the pool's arena, its table's starting at bases[k].
    `holder`, `source`, `new`, `taken` and `forbidden` are the pool's scratch arrays, written
    here where they are read. True when every check passes."""
    num_moves, num_blocks = token_ids.size, ref_counts.size
    # an index out of the pool would read past its arrays: such a plan does not pass
    if not (_within(sources, num_blocks) and _within(dst_blocks, num_blocks) and _within(src_blocks, num_blocks)
            and _within(new_blocks, num_blocks) and _within(held_blocks, num_blocks)
            and _within(pinned_blocks, num_blocks) and _within(open_tails, num_blocks)):
        return False
    for i in range(num_moves):
        if not (0 <= src_offsets[i] < block_size and 0 <= dst_offsets[i] < block_size):
            return False
    max_tokens = 0
    for k in range(num_plans):
        max_tokens = max(max_tokens, num_tokens[k])
    move_keys = np.empty(num_moves, np.int64)
    for i in range(num_moves):
        token_id, plan = token_ids[i], move_of[i]
        if token_id < 0 or token_id >= num_tokens[plan]:
            return False
        move_keys[i] = plan * (max_tokens + 1) + token_id
        at = bases[plan] + token_id
        if not arena_live[at] or arena_slot[at] != src_blocks[i] * block_size + src_offsets[i]:
            return False
    keys_ascend = ascending(move_keys)  # the usual round: plan after plan, each its tokens ascending
    if not (keys_ascend or _is_distinct(move_keys)):
        return False
    # one label per block: the plan whose table holds it, whose sources or fresh blocks it is in
    _unlabel(holder, source, new, sources)
    _unlabel(holder, source, new, dst_blocks)
    _unlabel(holder, source, new, src_blocks)
    start = 0
    for k in range(held_ends.size):
        for i in range(start, held_ends[k]):
            holder[held_blocks[i]] = k
        start = held_ends[k]
    for i in range(sources.size):
        source[sources[i]] = source_of[i]
    for i in range(new_blocks.size):
        new[new_blocks[i]] = new_of[i]
    for b in sources:
        forbidden[b] = False
    for b in dst_blocks:
        forbidden[b] = False
    for b in pinned_blocks:
        forbidden[b] = True
    for i in range(sources.size):  # a shared block only as the plan's own fresh block; no pinned block
        b = sources[i]
        if (ref_counts[b] > 1 and new[b] != source_of[i]) or forbidden[b]:
            return False
    for i in range(num_moves):
        b = dst_blocks[i]
        if (ref_counts[b] > 1 and new[b] != move_of[i]) or forbidden[b]:
            return False
    for b in open_tails:
        forbidden[b] = True
    num_src_live = np.zeros(num_plans, np.int64)
    for i in range(sources.size):  # a source is the plan's table's, not an open tail
        b = sources[i]
        if holder[b] != source_of[i] or forbidden[b]:
            return False
        num_src_live[source_of[i]] += live_counts[b]
    num_plan_moves = np.zeros(num_plans, np.int64)
    for i in range(num_moves):  # a move leaves one of its plan's sources ...
        if source[src_blocks[i]] != move_of[i]:
            return False
        num_plan_moves[move_of[i]] += 1
    for k in range(num_plans):  # ... and every live token of the sources moves
        if num_src_live[k] != num_plan_moves[k]:
            return False
    ordered_keys = move_keys if keys_ascend else np.sort(move_keys)
    for i in range(num_moves):  # into a block of its plan's table or fresh blocks, not a source of it
        b, plan = dst_blocks[i], move_of[i]
        if (holder[b] != plan and new[b] != plan) or source[b] == plan:
            return False
        occupant = token_at[b * block_size + dst_offsets[i]]
        if occupant >= 0:  # a slot still occupied only by a token the same plan moves away
            key = plan * (max_tokens + 1) + occupant
            j = np.searchsorted(ordered_keys, key)
            if j == ordered_keys.size or ordered_keys[j] != key:
                return False
    return _are_distinct_slots(dst_blocks, dst_offsets, block_size, taken)  # no two moves into one slot
