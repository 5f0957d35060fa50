"""What a relocation plan of one request moves: its movable blocks, and the two planning modes
(DESIGN.md §3, stage 3; the reclaimer in reclaim.py decides which requests are planned and when).

hole-fill (default, fewest moves): live tokens of the request's *last* blocks move into the
holes of its earlier blocks; the emptied blocks are freed. No destination blocks are needed.
Valid because cached keys already carry their rotary position and attention does not depend on
the order of keys. `plan_hole_fill_each` plans many requests with one pass over all their
blocks; `plan_hole_fill_round` orders them and plans them in one call: a lazy round's way.

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

from vtoken.kv.block_pool import NO_BLOCKS, BlockPool
from vtoken.kv.live_counts import compiled_loops
from vtoken.kv.moves import Moves, PlanBatch, RelocationPlan
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
        """One compiled pass over every request's candidate blocks (compiled.movable_blocks),
        their ref counts and live counts read in the pool's arrays."""
        pool = tables[0].pool
        held, sizes = TokenTable.candidate_blocks_each(tables)
        movable = compiled_loops().movable_blocks(held, sizes, pool.ref_counts, pool.live_counts, pool.block_size)
        return cls(tables, *movable)


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


def plan_hole_fill_each(movables: Movables, max_src_blocks: int,
                        order: np.ndarray | None = None) -> list[RelocationPlan | None]:
    """The hole-fill plan of every request of `movables` (None where it has none), in one
    compiled pass over all their blocks (compiled.hole_fill_plans); the plans' arrays lie end
    to end in one `PlanBatch`, plan after plan in `order` (indices of the requests; default,
    their own order), so that a round that launches its first plans in that order checks and
    lands them with no concatenation (moves.end_to_end).

    Per request, over its movable blocks in order (positions i = 0..n-1): the last blocks are
    sources while the live tokens of the last 1, 2, ... of them fit in the holes before them, up
    to B = min(max_src_blocks, n - 1) sources. Position i can start the sources when the live
    tokens in [i, n) fit in the holes of [0, i); the sources are the longest run of such
    positions from the end. Their live tokens, in logical order, fill the first holes of the
    kept blocks, in block order and offsets ascending; the moves pair them in that order.
    """
    tables = movables.tables
    if order is None:
        order = np.arange(len(tables))
    *rows, _ = compiled_loops().hole_fill_plans(movables.block_ids, movables.live_counts, movables.starts, movables.ends,
                                                movables.num_reclaimable, order, tables[0].pool.token_at,
                                                tables[0].block_size, max_src_blocks, -1)
    plans: list[RelocationPlan | None] = [None] * len(tables)
    for k, plan in zip(rows[0][0].tolist(), _batch_of(tables, *rows)):
        plans[k] = plan
    return plans


def plan_hole_fill_round(tables: list[TokenTable], max_src_blocks: int,
                         max_moves: int | None = None) -> tuple[list[RelocationPlan], list[TokenTable]]:
    """The hole-fill plans of `tables` (requests with a reclaimable block by the bound), most
    reclaimable blocks first, ties by req_id: what `plan_hole_fill_each` gives over
    `Movables.of(tables)` in that order, with the requests that have none left out, in one
    compiled call that finds the movable blocks, orders the requests and plans them
    (compiled.hole_fill_round): a lazy round step's planning.

    With `max_moves`, a step's budget, only the first plans in that order while their moves add
    up to at most that (the first one whatever it moves), and, in the same order, the tables of
    the requests with a plan past them, left unplanned: the budget is applied to each request's
    move count before its plan is made, so a step makes only the plans it launches. Returns the
    plans and those tables (none without a budget)."""
    pool = tables[0].pool
    held, sizes = TokenTable.candidate_blocks_each(tables)
    req_ids = np.fromiter([table.req_id for table in tables], np.int64, len(tables))
    *rows, deferred = compiled_loops().hole_fill_round(held, sizes, req_ids, pool.ref_counts, pool.live_counts, pool.token_at,
                                                       pool.block_size, max_src_blocks, -1 if max_moves is None else max_moves)
    return _batch_of(tables, *rows), [tables[k] for k in deferred.tolist()]


def _batch_of(tables: list[TokenTable], plan_rows: np.ndarray, move_rows: np.ndarray,
              source_rows: np.ndarray) -> list[RelocationPlan]:
    """The plans of compiled.hole_fill_plans' rows, in their order, as views of one `PlanBatch`."""
    plan_requests, move_ends, source_ends = plan_rows.tolist()
    token_ids, src_blocks, src_offsets, dst_blocks, dst_offsets, move_of = (
        move_rows[0], move_rows[1], move_rows[2], move_rows[3], move_rows[4], move_rows[5])
    sources, source_of = source_rows[0], source_rows[1]
    all_moves = Moves(token_ids, src_blocks, src_offsets, dst_blocks, dst_offsets)
    batch = PlanBatch(all_moves, move_of, sources, source_of, move_ends, source_ends, [], [])
    plans = []
    first_move = first_src = 0
    for k, move_end, source_end in zip(plan_requests, move_ends, source_ends):
        table = tables[k]
        a, b = first_move, move_end
        if len(plan_requests) == 1:  # a paced round step's one plan: its arrays are the batch's
            moves, plan_sources = all_moves, sources
        else:
            moves = Moves(token_ids[a:b], src_blocks[a:b], src_offsets[a:b], dst_blocks[a:b], dst_offsets[a:b])
            plan_sources = sources[first_src:source_end]
        plans.append(RelocationPlan(table.req_id, "hole-fill", moves, plan_sources, NO_BLOCKS, table.layout_version, batch))
        batch.plan_moves.append(moves)
        batch.plan_sources.append(plan_sources)
        first_move, first_src = move_end, source_end
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
