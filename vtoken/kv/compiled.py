"""The substrate's loops over blocks and tokens, compiled (numba, vtoken/jit.py): a
reclamation round step's, and an eviction's.

A round step plans, checks and lands the plans of a few requests at once: integer bookkeeping
over their blocks and moved tokens, no policy rule and no floating point. Written as numpy
calls over the round's arrays it is a few dozen calls, each a few microseconds whatever it
does, which set a floor under a round step however few tokens it moves (README, issue 17's
substrate table). Here each is one loop over the entries it reads, and a step's part is one
call: a lazy round's planning (`hole_fill_round`: the movable blocks, the order, the plans), a
round's landing (`land_moves`: the pool's live counts and histogram, `change_live_counts`, the
reverse map and the moved tokens' slots; then `release_empty_blocks`: the blocks it emptied,
released and freed).

The round's I4 check, `round_passes`, is in kv/compiled_check.py, and the evictions' loops
with the live-count change they share with the landing in kv/compiled_evict.py; both are
reached through this module. Imported by their callers when a process first evicts or
reclaims, or where an engine starts (engine/warmup.py). They take the arrays as the pool and
the tables keep them (int64 ids, int32 counts), so that one compiled version serves every call.
"""

from __future__ import annotations

import numpy as np

from vtoken.jit import njit
from vtoken.kv.compiled_check import ascending as _ascending
from vtoken.kv.compiled_check import first_outside as _first_outside
from vtoken.kv.compiled_check import round_passes  # noqa: F401 (its callers reach it here)
from vtoken.kv.compiled_check import sorted_ascending as _sorted_ascending
from vtoken.kv.compiled_evict import (  # noqa: F401 (the evictions' loops: their callers reach them here)
    DEAD_TOKEN, NOT_DISTINCT_TABLES, PINNED_TOKEN, REPEATED_TOKEN, UNKNOWN_TOKEN, change_live_counts, evict_one_each,
    evict_tokens,
)
from vtoken.kv.compiled_evict import are_distinct_tables as _are_distinct_tables


@njit
def hole_fill_plans(block_ids, live_counts, starts, ends, num_reclaimable, order, token_at, block_size, max_src_blocks,
                    max_moves):
    """The hole-fill plans of the requests whose movable blocks are block_ids[starts[k]:ends[k]]
    (planning.plan_hole_fill_each: the sources are the longest run of blocks from the end
    whose live tokens fit in the holes before them, at most min(max_src_blocks, n - 1); their
    live tokens, in logical order, fill the kept blocks' first holes in block order).

    Returns, plan after plan (the requests with a plan, in `order`, a permutation of the
    requests), three arrays of rows (one array returned where each row was one: a call's cost
    grows with the arrays it returns): [3, plans], the request of each plan and where its moves
    and its sources end (cumulative counts); [6, moves], the moves end to end (token ids,
    source block and offset, destination block and offset) and each one's plan's place (0 for
    the first plan); [2, sources], the sources, ascending within a plan, and each one's plan's
    place; and the requests a budget left unplanned, in `order`.

    `max_moves` >= 0, a lazy round step's budget (Reclaimer.plan): the plans in `order` while
    their moves add up to at most that, the first one whatever it moves; from the first that
    does not fit on, the requests with a plan are left unplanned and returned instead, for a
    later step to plan against its layout then. Each request's moves are counted from the live
    counts alone, before any row of the reverse map is read, so a plan the step would not launch
    costs no more than that count. < 0: every plan.
    """
    num_requests = starts.size
    num_src = np.zeros(num_requests, np.int64)
    num_moves = np.zeros(num_requests, np.int64)
    for k in range(num_requests):
        start, end = starts[k], ends[k]
        n = end - start
        if num_reclaimable[k] <= 0 or n < 2:
            continue
        max_src = min(max_src_blocks, n - 1)
        holes_before = 0  # in [0, i): starts as every block's, then gives back block i's
        for j in range(start, end):
            holes_before += block_size - live_counts[j]
        live_from = 0  # in [i, n)
        for i in range(n - 1, 0, -1):
            holes_before -= block_size - live_counts[start + i]
            live_from += live_counts[start + i]
            if live_from > holes_before or n - i > max_src:
                break
            num_src[k] = n - i
            num_moves[k] = live_from
    deferred = np.empty(num_requests, np.int64)
    num_deferred = 0
    if max_moves >= 0:
        num_planned, num_moved = 0, 0
        for k in order:
            if num_src[k] == 0:
                continue
            if num_deferred or (num_planned and num_moved + num_moves[k] > max_moves):
                deferred[num_deferred] = k
                num_deferred += 1
                num_src[k], num_moves[k] = 0, 0
            else:
                num_planned += 1
                num_moved += num_moves[k]
    total_moves, total_src = num_moves.sum(), num_src.sum()
    move_rows = np.empty((6, total_moves), np.int64)
    token_ids, src_blocks, src_offsets, dst_blocks, dst_offsets, move_of = (
        move_rows[0], move_rows[1], move_rows[2], move_rows[3], move_rows[4], move_rows[5])
    source_rows = np.empty((2, total_src), np.int64)
    sources, source_of = source_rows[0], source_rows[1]
    plan_rows = np.empty((3, np.count_nonzero(num_src)), np.int64)
    plan_requests, move_ends, source_ends = plan_rows[0], plan_rows[1], plan_rows[2]
    first_move, first_src, plan = 0, 0, 0
    for k in order:
        m, num = num_src[k], num_moves[k]
        if m == 0:
            continue
        move_of[first_move : first_move + num] = plan
        source_of[first_src : first_src + m] = plan
        plan_requests[plan], move_ends[plan], source_ends[plan] = k, first_move + num, first_src + m
        plan += 1
        end = ends[k]
        last = first_move
        for j in range(end - m, end):  # the sources' live tokens, by the reverse map's rows
            block_id = block_ids[j]
            sources[first_src + j - (end - m)] = block_id
            for offset in range(block_size):
                token_id = token_at[block_id * block_size + offset]
                if token_id >= 0:
                    if last == first_move + num:
                        raise ValueError("a source block holds more tokens than the pool counts live")
                    token_ids[last], src_blocks[last], src_offsets[last] = token_id, block_id, offset
                    last += 1
        stop = first_move + num
        if last != stop:
            raise ValueError("a source block holds fewer tokens than the pool counts live")
        # the sources are the request's last blocks, mostly filled by appends in logical order:
        # their tokens usually ascend already, and are sorted only when they do not
        if not _ascending(token_ids[first_move:stop]):
            order = np.argsort(token_ids[first_move:stop]) + first_move  # the ids are distinct
            token_ids[first_move:stop] = token_ids[order]
            src_blocks[first_move:stop] = src_blocks[order]
            src_offsets[first_move:stop] = src_offsets[order]
        sources[first_src : first_src + m] = _sorted_ascending(sources[first_src : first_src + m])
        last = first_move
        for j in range(starts[k], end - m):  # the kept blocks' holes, in block order
            if last == stop:
                break
            if live_counts[j] == block_size:  # a full block has no hole: its row of the reverse map is not read
                continue
            block_id = block_ids[j]
            for offset in range(block_size):
                if token_at[block_id * block_size + offset] < 0:
                    dst_blocks[last], dst_offsets[last] = block_id, offset
                    last += 1
                    if last == stop:
                        break
        if last != stop:
            raise ValueError("the kept blocks hold fewer holes than the pool counts")
        first_move, first_src = stop, first_src + m
    return plan_rows, move_rows, source_rows, deferred[:num_deferred]


@njit
def hole_fill_round(held, sizes, req_ids, ref_counts, live_counts, token_at, block_size, max_src_blocks, max_moves):
    """A lazy round's hole-fill plans in one call (Reclaimer's hole-fill round): the movable
    blocks of requests whose candidate blocks are held[...] end to end, sizes[k] of request k
    (movable_blocks), the requests ordered most reclaimable blocks first, ties by req_id, and
    their plans in that order within `max_moves` (hole_fill_plans, whose rows it returns)."""
    block_ids, counts, starts, ends, _, num_reclaimable = movable_blocks(held, sizes, ref_counts, live_counts, block_size)
    if _in_round_order(req_ids, num_reclaimable):  # as the reclaimer often hands them (a paced step: one)
        order = np.arange(req_ids.size)
    else:
        by_req_id = np.argsort(req_ids, kind="mergesort")
        order = by_req_id[np.argsort(-num_reclaimable[by_req_id], kind="mergesort")]  # stable: ties keep req_id order
    return hole_fill_plans(block_ids, counts, starts, ends, num_reclaimable, order, token_at, block_size, max_src_blocks,
                           max_moves)


@njit
def _in_round_order(req_ids, num_reclaimable):
    """Whether requests of distinct `req_ids` already come most reclaimable blocks first, ties
    by req_id."""
    for k in range(1, req_ids.size):
        more = num_reclaimable[k] > num_reclaimable[k - 1]
        if more or (num_reclaimable[k] == num_reclaimable[k - 1] and req_ids[k] < req_ids[k - 1]):
            return False
    return True


@njit
def movable_blocks(held, sizes, ref_counts, live_counts, block_size):
    """planning.Movables of several requests, whose candidate blocks (held, past the pinned
    prefix, the open tail left out) are held[...] end to end, sizes[k] of request k: the blocks
    no other request shares, in order, with their live counts; per request where its blocks
    start and end among them, its live tokens and the blocks a perfect packing of those would
    give back."""
    num_requests = sizes.size
    block_ids = np.empty(held.size, np.int64)
    counts = np.empty(held.size, np.int32)
    starts = np.empty(num_requests, np.int64)
    ends = np.empty(num_requests, np.int64)
    num_live = np.empty(num_requests, np.int64)
    num_reclaimable = np.empty(num_requests, np.int64)
    num_kept, position = 0, 0
    for k in range(num_requests):
        starts[k] = num_kept
        live = 0
        for i in range(position, position + sizes[k]):
            b = held[i]
            if ref_counts[b] == 1:
                block_ids[num_kept] = b
                counts[num_kept] = live_counts[b]
                live += live_counts[b]
                num_kept += 1
        position += sizes[k]
        ends[k], num_live[k] = num_kept, live
        num_reclaimable[k] = (num_kept - starts[k]) - (live + block_size - 1) // block_size
    return block_ids[:num_kept], counts[:num_kept], starts, ends, num_live, num_reclaimable


@njit
def release_empty_blocks(held, sizes, bases, live_counts, ref_counts):
    """The blocks without a live token among tables' held blocks, held[...] end to end, sizes[k]
    of table k (TokenTable.release_empty_blocks_each), released and freed: one reference less
    on each, as BlockPool.free drops it. Returns the others, in order (what the tables keep),
    those, table by table in order, how many of each table's they are, and, ascending, the ones
    left without a reference (for the pool's free list); then 0 and -1, or, having written
    nothing, a reason and the block it names: NOT_DISTINCT_TABLES when the tables are not
    distinct tables of the pool (compiled_evict.are_distinct_tables of their `bases` in its
    arena: another pool's blocks would be read against this pool's counts), 1 a block outside
    the pool, 2 a block without a reference, 3 a block named twice."""
    num_tables = sizes.size
    kept = np.empty(held.size, np.int64)
    released = np.empty(held.size, np.int64)
    num_released = np.zeros(num_tables, np.int64)
    no_blocks = np.empty(0, np.int64)
    if not _are_distinct_tables(bases):
        return kept[:0], released[:0], num_released, no_blocks, NOT_DISTINCT_TABLES, -1
    i = _first_outside(held, live_counts.size)
    if i >= 0:
        return kept[:0], released[:0], num_released, no_blocks, 1, held[i]
    num_kept, num_empty, position = 0, 0, 0
    for k in range(num_tables):
        for i in range(position, position + sizes[k]):
            b = held[i]
            if live_counts[b] == 0:
                released[num_empty] = b
                num_empty += 1
                num_released[k] += 1
            else:
                kept[num_kept] = b
                num_kept += 1
        position += sizes[k]
    released = released[:num_empty]
    if num_empty == 0:
        return kept[:num_kept], released, num_released, no_blocks, 0, -1
    ordered = _sorted_ascending(released)
    for i in range(num_empty):
        if ref_counts[ordered[i]] <= 0:
            return kept[:0], released[:0], num_released, no_blocks, 2, ordered[i]
        if i and ordered[i] == ordered[i - 1]:
            return kept[:0], released[:0], num_released, no_blocks, 3, ordered[i]
    freed = np.empty(num_empty, np.int64)
    num_freed = 0
    for i in range(num_empty):
        b = ordered[i]
        ref_counts[b] -= 1
        if ref_counts[b] == 0:
            freed[num_freed] = b
            num_freed += 1
    return kept[:num_kept], released, num_released, freed[:num_freed], 0, -1


@njit
def land_moves(token_ids, move_of, num_tables, bases, src_blocks, src_offsets, dst_blocks, dst_offsets, arena_live,
               arena_slot, token_at, block_size, live_counts, ref_counts, count_effects, delta, seen):
    """The writes of moves whose copies landed (TokenTable.apply_moves_each, the moves of
    `num_tables` tables end to end, `move_of` the table of each, whose per-token arrays start
    at bases[k] in the pool's arena): a live token leaves its source and joins its destination in the blocks'
    live counts (change_live_counts, every source then every destination, whose changes it
    returns) and in the reverse map (every source cleared first: a destination may be another
    move's source); every moved token's slot, live or evicted while its copy was in flight,
    becomes its destination. Returns (per table, whether it moved a live token; the changes;
    0; -1), or, writing nothing, NOT_DISTINCT_TABLES when the tables are not distinct tables of
    the pool (compiled_evict.are_distinct_tables of their bases), or change_live_counts' refusal and the
    block it names."""
    num_moves = token_ids.size
    blocks = np.empty(2 * num_moves, np.int64)
    deltas = np.empty(2 * num_moves, np.int64)
    has_live = np.zeros(num_tables, np.bool_)
    if not _are_distinct_tables(bases):
        return has_live, np.zeros(count_effects.shape[1], np.int64), NOT_DISTINCT_TABLES, -1
    at = np.empty(num_moves, np.int64)  # each moved token's entry in the arena
    for i in range(num_moves):
        at[i] = bases[move_of[i]] + token_ids[i]
    num_live = 0
    for i in range(num_moves):
        if arena_live[at[i]]:
            blocks[num_live], deltas[num_live] = src_blocks[i], -1
            num_live += 1
    num_entries = num_live
    for i in range(num_moves):
        if arena_live[at[i]]:
            blocks[num_entries], deltas[num_entries] = dst_blocks[i], 1
            num_entries += 1
            has_live[move_of[i]] = True
    _, changes, reason, block = change_live_counts(blocks[:num_entries], deltas[:num_entries], live_counts, ref_counts,
                                                   count_effects, delta, seen)
    if reason:
        return has_live, changes, reason, block
    for i in range(num_moves):
        if arena_live[at[i]]:
            token_at[src_blocks[i] * block_size + src_offsets[i]] = -1
    for i in range(num_moves):
        slot = dst_blocks[i] * block_size + dst_offsets[i]
        if arena_live[at[i]]:
            token_at[slot] = token_ids[i]
        arena_slot[at[i]] = slot
    return has_live, changes, 0, -1
