"""What a relocation plan of one request moves: its movable blocks, and the two planning modes
(DESIGN.md §3, stage 3; the reclaimer in reclaim.py decides which requests are planned and when).

hole-fill (default, fewest moves): live tokens of the request's *last* blocks move into the
holes of its earlier blocks; the emptied blocks are freed. No destination blocks are needed.
Valid because cached keys already carry their rotary position and attention does not depend on
the order of keys. `plan_hole_fill_each` plans many requests with one pass over all their
blocks: a lazy round's way.

    before:  [L . L L][L L . .][. L . L][L L L . tail]
    after:   [L L L L][L L L .][. . . .][L L L . tail]   the third block freed, 2 moves

ordered (the paper's): the live tokens of up to B lowest-utilization blocks are copied in
logical order into ceil(T/S) fresh blocks taken from the headroom, out of place.

Both only touch blocks the request alone owns (never a shared or pinned prefix block) and never
the open tail block, where new tokens are being appended. Nothing here mutates anything.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from vtoken.kv.arrays import by_group
from vtoken.kv.block_pool import NO_BLOCKS, BlockPool
from vtoken.kv.moves import Moves, RelocationPlan
from vtoken.kv.token_table import TokenTable


@dataclass(frozen=True)
class Movables:
    """The movable blocks of several requests (`movable_block_ids`), concatenated in the
    requests' order, with their live counts: request k's are [starts[k], ends[k])."""

    tables: list[TokenTable]
    block_ids: np.ndarray
    live_counts: np.ndarray
    starts: np.ndarray
    ends: np.ndarray
    num_live: np.ndarray  # [requests] live tokens in their movable blocks
    num_reclaimable: np.ndarray  # [requests] blocks a perfect packing of those would give back

    @classmethod
    def of(cls, tables: list[TokenTable]) -> Movables:
        """One numpy pass over every request's held blocks (a slice per request, then the pool's
        ref counts and live counts read once for all of them)."""
        pool, block_size = tables[0].pool, tables[0].block_size
        held = []
        for table in tables:
            table_held = table.held_block_ids
            end = table_held.size - (table_held.size > table.num_pinned_blocks and table.tail_num_written < block_size)
            held.append(table_held[table.num_pinned_blocks : end])
        block_ids = np.concatenate(held)
        request_of = np.repeat(np.arange(len(held)), [h.size for h in held])
        unshared = pool.ref_counts[block_ids] == 1
        block_ids = block_ids[unshared]
        sizes = np.bincount(request_of[unshared], minlength=len(held))
        ends = np.cumsum(sizes)
        starts = ends - sizes
        live_counts = pool.live_counts[block_ids]
        live_before = np.concatenate(([0], np.cumsum(live_counts)))
        num_live = live_before[ends] - live_before[starts]
        return cls(tables, block_ids, live_counts, starts, ends, num_live, (ends - starts) - -(-num_live // block_size))


def num_reclaimable_blocks(table: TokenTable) -> int:
    """Blocks a perfect packing of the request's relocatable live tokens would give back."""
    return int(Movables.of([table]).num_reclaimable[0])


def movable_block_ids(table: TokenTable) -> np.ndarray:
    """Blocks a plan may touch: held, not a pinned prefix, not the open tail, not shared."""
    held = table.held_block_ids[table.num_pinned_blocks :]
    if held.size and table.tail_num_written < table.block_size:
        held = held[:-1]
    return held[table.pool.ref_counts[held] == 1]


def plan_hole_fill(table: TokenTable, max_src_blocks: int, movable: Movables | None = None) -> RelocationPlan | None:
    """The hole-fill plan of one request (`plan_hole_fill_each` of it alone); `movable`: its
    `Movables`, when the caller has read them."""
    return plan_hole_fill_each(movable or Movables.of([table]), max_src_blocks)[0]


def plan_hole_fill_each(movables: Movables, max_src_blocks: int) -> list[RelocationPlan | None]:
    """The hole-fill plan of every request of `movables` (None where it has none), with a fixed
    number of numpy calls over all their blocks, not a few dozen per request.

    Per request, over its movable blocks in order (positions i = 0..n-1): the last blocks are
    sources while the live tokens of the last 1, 2, ... of them fit in the holes before them, up
    to B = min(max_src_blocks, n - 1) sources. Position i can start the sources when the live
    tokens in [i, n) fit in the holes of [0, i); the sources are the longest run of such
    positions from the end. Their live tokens, in logical order, fill the first holes of the
    kept blocks, in block order and offsets ascending; the moves pair them in that order.
    """
    block_size, pool = movables.tables[0].block_size, movables.tables[0].pool
    starts, ends = movables.starts, movables.ends
    sizes = ends - starts
    planned = (movables.num_reclaimable > 0) & (sizes >= 2)
    plans: list[RelocationPlan | None] = [None] * len(movables.tables)
    if not planned.any():
        return plans
    request_of = np.repeat(np.arange(sizes.size), sizes)  # the request of each movable block
    position = np.arange(request_of.size) - starts[request_of]
    live = movables.live_counts.astype(np.int64)
    live_before = np.cumsum(live) - live  # live tokens before each block, over all requests
    holes_before = np.cumsum(block_size - live) - (block_size - live)
    live_before_in = live_before - live_before[starts][request_of]  # ... within its request
    holes_before_in = holes_before - holes_before[starts][request_of]
    live_from = movables.num_live[request_of] - live_before_in  # live tokens in [i, n)
    num_from_end = sizes[request_of] - position  # sources if the run starts here (n - i)
    max_src = np.minimum(max_src_blocks, sizes - 1)
    stops = (live_from > holes_before_in) | (num_from_end > max_src[request_of])
    # the run from the end stops at the last position that cannot start it (position 0 always
    # stops it: it would leave no block to fill)
    last_stop = np.full(sizes.size, -1, dtype=np.int64)
    np.maximum.at(last_stop, request_of[stops], position[stops])
    num_src = np.where(planned, sizes - 1 - last_stop, 0)
    planned &= num_src > 0
    if not planned.any():
        return plans
    is_src = position >= (sizes - num_src)[request_of]
    is_src &= planned[request_of]
    num_moves = np.where(planned, live_from[np.minimum(ends - num_src, request_of.size - 1)], 0)
    # the sources' live tokens, in logical order per request: the reverse map's rows of the
    # source blocks, read in one gather; a flat index into them is (row, offset)
    token_at = pool.token_at.reshape(-1, block_size)
    src_blocks, src_request = movables.block_ids[is_src], request_of[is_src]
    src_rows = token_at[src_blocks]
    live_at = np.flatnonzero(src_rows >= 0)
    token_ids, src_row = src_rows.ravel()[live_at], live_at // block_size
    order = np.argsort(by_group(src_request[src_row], token_ids))
    token_ids, src_block_of, src_offset_of = token_ids[order], src_blocks[src_row[order]], (live_at % block_size)[order]
    # the holes: only kept blocks of a planned request whose free slots before them fall short
    # of its moves, and that have a free slot
    need = num_moves[request_of]
    is_dst = ~is_src & planned[request_of] & (holes_before_in < need) & (live < block_size)
    dst_blocks, dst_request = movables.block_ids[is_dst], request_of[is_dst]
    hole_at = np.flatnonzero(token_at[dst_blocks] < 0)
    dst_row = hole_at // block_size
    hole_request = dst_request[dst_row]  # ascends: a request's holes are a run
    num_holes = np.bincount(hole_request, minlength=sizes.size)
    rank = np.arange(hole_request.size) - (np.cumsum(num_holes) - num_holes)[hole_request]
    used = rank < num_moves[hole_request]
    dst_block_of, dst_offset_of = dst_blocks[dst_row[used]], hole_at[used] % block_size
    src_blocks_sorted = src_blocks[np.argsort(by_group(src_request, src_blocks))]
    move_ends = np.cumsum(num_moves)
    src_ends = np.cumsum(num_src)
    move_ends, num_moves, src_ends, num_src = move_ends.tolist(), num_moves.tolist(), src_ends.tolist(), num_src.tolist()
    for k in np.flatnonzero(planned).tolist():
        table = movables.tables[k]
        a, b = move_ends[k] - num_moves[k], move_ends[k]
        moves = Moves(token_ids[a:b], src_block_of[a:b], src_offset_of[a:b], dst_block_of[a:b], dst_offset_of[a:b])
        sources = src_blocks_sorted[src_ends[k] - num_src[k] : src_ends[k]]
        plans[k] = RelocationPlan(table.req_id, "hole-fill", moves, sources, NO_BLOCKS, table.layout_version)
    return plans


def plan_ordered(table: TokenTable, max_src_blocks: int, pool: BlockPool, num_dst_used: int,
                 movable: Movables | None = None) -> RelocationPlan | None:
    """The ordered plan of one request; `movable`: its `Movables`, when the caller has read them."""
    movable = movable or Movables.of([table])
    block_ids, live_counts = movable.block_ids, movable.live_counts
    order = np.argsort(live_counts, kind="stable")
    src_block_ids = block_ids[order[:max_src_blocks]]
    src_block_ids = src_block_ids[pool.live_counts[src_block_ids] < table.block_size]
    num_live = int(pool.live_counts[src_block_ids].sum())
    num_dst = -(-num_live // table.block_size)
    if num_dst >= src_block_ids.size or num_dst_used + num_dst > pool.num_free_blocks:
        return None
    dst_new_block_ids = pool.peek_free(num_dst_used + num_dst)[num_dst_used:]
    token_ids, block_of_token, offset_of_token = _live_tokens_in(table, src_block_ids)
    positions = np.arange(num_live)
    moves = Moves(token_ids, block_of_token, offset_of_token, dst_new_block_ids[positions // table.block_size], positions % table.block_size)
    return RelocationPlan(table.req_id, "ordered", moves, np.sort(src_block_ids), dst_new_block_ids, table.layout_version)


def _live_tokens_in(table: TokenTable, block_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Live tokens of `table` stored in `block_ids`, in logical order, with their slots."""
    token_ids = table.live_ids_in(block_ids)
    slots = table.token_slots[token_ids]
    return token_ids, slots // table.block_size, slots % table.block_size
