"""Invariants I1-I4 of the substrate (DESIGN.md §3) as pure checks.

Each function reads state and raises `InvariantError` with the numbers that disagree; none
mutates anything. They are independent of the planner's own gates: I4 re-derives what a plan
must satisfy from the table and the pool.

- I1 token conservation: relocation keeps the set of live ids and every live token's K/V.
- I2 unique mapping: one slot per live token, no slot claimed twice, pool counts and the pool's
  reverse map (slot -> token, which the reclaimer plans from) = the tables'.
- I3 pre-attention visibility: attention never reads a slot whose copy has not landed.
- I4 layout-aware planning: consistent snapshot, no overlap in flight, strict block decrease,
  no shared or pinned block touched.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from vtoken.errors import InvariantError
from vtoken.kv.arrays import is_distinct, isin
from vtoken.kv.block_pool import BlockPool
from vtoken.kv.live_counts import compiled_loops
from vtoken.kv.moves import RelocationPlan, end_to_end
from vtoken.kv.token_table import TokenTable


def check_conservation(req_id: int, live_ids_before: np.ndarray, live_ids_after: np.ndarray) -> None:
    """I1 (ids): a relocation neither loses nor adds live tokens."""
    if not np.array_equal(live_ids_before, live_ids_after):
        lost = np.setdiff1d(live_ids_before, live_ids_after)
        added = np.setdiff1d(live_ids_after, live_ids_before)
        raise InvariantError(
            "I1", f"request {req_id}: live tokens changed across relocation, lost {lost[:5].tolist()} added {added[:5].tolist()}",
            req_id=req_id, token_id=int((lost if lost.size else added)[0]),
        )


def check_contents(req_id: int, token_ids: np.ndarray, slots: np.ndarray, mismatched: np.ndarray, block_size: int) -> None:
    """I1 (data): `mismatched[i]` says token_ids[i] read back other K/V than it was written with."""
    if np.any(mismatched):
        i = int(np.flatnonzero(mismatched)[0])
        slot = int(slots[i])
        raise InvariantError(
            "I1", f"request {req_id}: token {int(token_ids[i])} reads wrong K/V at block {slot // block_size} "
            f"offset {slot % block_size} ({int(mismatched.sum())} tokens differ)",
            req_id=req_id, token_id=int(token_ids[i]), block_id=slot // block_size, offset=slot % block_size,
        )


def check_unique_mapping(pool: BlockPool, tables: Sequence[TokenTable]) -> None:
    """I2: every live token has one slot, no slot is claimed twice, counts agree with the pool."""
    block_size = pool.block_size
    expected_live = np.zeros(pool.num_blocks, dtype=np.int64)
    expected_refs = np.zeros(pool.num_blocks, dtype=np.int64)
    shared_block_ids: set[int] = set()
    claimed: list[np.ndarray] = []
    for table in tables:
        held = np.asarray(table.held_block_ids, dtype=np.int64)
        expected_refs[held] += 1
        live_ids = table.live_token_ids()
        own_ids = live_ids[live_ids >= table.num_pinned_tokens]
        blocks = table.token_block_ids[own_ids]
        outside = ~np.isin(blocks, held)
        if np.any(outside):
            token_id = int(own_ids[outside][0])
            raise InvariantError("I2", f"request {table.req_id}: token {token_id} maps to block {int(blocks[outside][0])} it does not hold",
                                 req_id=table.req_id, token_id=token_id)
        np.add.at(expected_live, blocks, 1)
        _check_pinned_prefix(table)
        shared_block_ids.update(table.held_block_ids[: table.num_pinned_blocks])
        claimed.append(np.stack((np.full(own_ids.size, table.req_id), own_ids, blocks * block_size + table.token_offsets[own_ids])))
    for block_id in shared_block_ids:
        expected_live[block_id] += block_size  # counted once; a stray token there shows as S + 1
    _check_no_slot_twice(claimed, block_size)
    _check_counts(pool, expected_live, expected_refs)
    _check_reverse_map(pool, claimed, len(shared_block_ids))


def _check_pinned_prefix(table: TokenTable) -> None:
    """Pinned tokens are live and fill the first pinned blocks in order."""
    num_pinned = table.num_pinned_tokens
    if num_pinned == 0:
        return
    held = np.asarray(table.held_block_ids[: table.num_pinned_blocks], dtype=np.int64)
    expected_blocks = np.repeat(held, table.block_size)
    expected_offsets = np.tile(np.arange(table.block_size), held.size)
    wrong = ~table.live_mask[:num_pinned] | (table.token_block_ids[:num_pinned] != expected_blocks) | (table.token_offsets[:num_pinned] != expected_offsets)
    if np.any(wrong):
        token_id = int(np.flatnonzero(wrong)[0])
        raise InvariantError("I2", f"request {table.req_id}: pinned prefix token {token_id} is not live at its place in the shared blocks",
                             req_id=table.req_id, token_id=token_id)


def _check_no_slot_twice(claimed: list[np.ndarray], block_size: int) -> None:
    if not claimed:
        return
    req_ids, token_ids, slots = np.concatenate(claimed, axis=1)
    order = np.argsort(slots, kind="stable")
    repeated = np.flatnonzero(np.diff(slots[order]) == 0)
    if repeated.size:
        a, b = order[repeated[0]], order[repeated[0] + 1]
        slot = int(slots[a])
        raise InvariantError(
            "I2", f"slot {slot} (block {slot // block_size}, offset {slot % block_size}) is claimed by "
            f"request {int(req_ids[a])} token {int(token_ids[a])} and request {int(req_ids[b])} token {int(token_ids[b])}",
            req_id=int(req_ids[b]), token_id=int(token_ids[b]), block_id=slot // block_size, offset=slot % block_size,
        )


def _check_counts(pool: BlockPool, expected_live: np.ndarray, expected_refs: np.ndarray) -> None:
    wrong = np.flatnonzero(expected_live != pool.live_counts)
    if wrong.size:
        b = int(wrong[0])
        raise InvariantError("I2", f"block {b}: pool counts {int(pool.live_counts[b])} live tokens, the tables map {int(expected_live[b])}",
                             block_id=b)
    wrong = np.flatnonzero(expected_refs != pool.ref_counts)
    if wrong.size:
        b = int(wrong[0])
        raise InvariantError("I2", f"block {b}: ref count {int(pool.ref_counts[b])}, held by {int(expected_refs[b])} requests", block_id=b)
    if pool.num_live_tokens != int(pool.live_counts.sum()):
        raise InvariantError("I2", f"pool total {pool.num_live_tokens} live tokens, blocks sum to {int(pool.live_counts.sum())}")


def _check_reverse_map(pool: BlockPool, claimed: list[np.ndarray], num_shared_blocks: int) -> None:
    """`pool.token_at` names each live token at its slot and nothing else (pinned prefix blocks
    are full: S entries each, written once by their owner)."""
    token_at = pool.token_at
    if claimed:
        req_ids, token_ids, slots = np.concatenate(claimed, axis=1)
        wrong = np.flatnonzero(token_at[slots] != token_ids)
        if wrong.size:
            i, slot = int(wrong[0]), int(slots[wrong[0]])
            raise InvariantError(
                "I2", f"request {int(req_ids[i])}: token {int(token_ids[i])} sits at slot {slot} but the pool's reverse map "
                f"names token {int(token_at[slot])} there", req_id=int(req_ids[i]), token_id=int(token_ids[i]),
                block_id=slot // pool.block_size, offset=slot % pool.block_size)
        num_live = slots.size
    else:
        num_live = 0
    num_entries = int(np.count_nonzero(token_at >= 0)) - num_shared_blocks * pool.block_size
    if num_entries != num_live:
        raise InvariantError("I2", f"the pool's reverse map holds {num_entries} entries outside shared prefixes for {num_live} live tokens")


def check_visibility(req_id: int, read_slots: np.ndarray, in_flight: Iterable[RelocationPlan], block_size: int) -> None:
    """I3: a read of a slot that an in-flight copy is still writing."""
    for plan in in_flight:
        pending = plan.moves.dst_slots(block_size)
        early = np.isin(read_slots, pending)
        if np.any(early):
            slot = int(read_slots[early][0])
            token_id = int(plan.moves.token_ids[np.flatnonzero(pending == slot)[0]])
            raise InvariantError(
                "I3", f"request {req_id} read slot {slot} (block {slot // block_size}, offset {slot % block_size}) "
                f"before the copy of request {plan.req_id} token {token_id} completed",
                req_id=req_id, token_id=token_id, block_id=slot // block_size, offset=slot % block_size,
            )


def check_plan(plan: RelocationPlan, table: TokenTable, pool: BlockPool, busy_req_ids: frozenset[int]) -> None:
    """I4: the plan is safe to launch on the current state. Runs before every launch, so its
    set tests are array lookups (`isin`), not Python loops."""
    def fail(message: str, **where: int) -> None:
        raise InvariantError("I4", f"request {plan.req_id} plan: {message}", req_id=plan.req_id, **where)

    if plan.req_id in busy_req_ids:
        fail("overlaps a plan of the same request still in flight")
    if plan.layout_version != table.layout_version:
        fail(f"planned on layout version {plan.layout_version}, the table is at {table.layout_version}")
    if plan.src_block_ids.size <= plan.dst_new_block_ids.size:
        fail(f"does not reduce the block count ({plan.src_block_ids.size} sources, {plan.dst_new_block_ids.size} new blocks)")
    held = np.asarray(table.held_block_ids, dtype=np.int64)
    touched = np.concatenate((plan.src_block_ids, plan.moves.dst_block_ids))  # repeats are harmless here
    shared = pool.ref_counts[touched] > 1
    if plan.dst_new_block_ids.size:
        shared &= ~isin(touched, plan.dst_new_block_ids)
    if table.num_pinned_blocks:
        shared |= isin(touched, held[: table.num_pinned_blocks])
    if shared.any():
        block_id = int(touched[shared].min())
        fail(f"touches shared prefix block {block_id}", block_id=block_id)
    is_held = isin(plan.src_block_ids, held)
    if not is_held.all():
        not_held = plan.src_block_ids[~is_held]
        fail(f"frees block {int(not_held[0])} the request does not hold", block_id=int(not_held[0]))
    if held.size and table.tail_num_written < table.block_size and held[-1] in plan.src_block_ids:
        fail(f"frees the open tail block {int(held[-1])}, where new tokens are appended", block_id=int(held[-1]))
    _check_plan_tokens(plan, table, pool, fail)
    _check_plan_destinations(plan, table, pool, held, fail)


def plans_pass(plans: Sequence[RelocationPlan], tables: Sequence[TokenTable], pool: BlockPool,
               busy_req_ids: frozenset[int]) -> bool:
    """Whether `check_plan` passes every plan of a round in turn, each launched before the next
    is checked (its request busy from then on): check_plan's conditions over the round's arrays
    at once, one compiled pass for the round (compiled.round_passes: the moved tokens' live bits
    and slots read in the pool's token arena) instead of a few dozen numpy calls per plan.
    `tables[i]` is the table of `plans[i]`.

    It only answers: on False the caller runs `check_plan` plan by plan, for the violation's
    own error. A False without a violation is possible only where two plans of the round name
    one block, which check_plan, seeing one plan at a time, does not look at.
    """
    if not plans:
        return True
    req_ids = [plan.req_id for plan in plans]
    if len(set(req_ids)) != len(req_ids) or not busy_req_ids.isdisjoint(req_ids):
        return False
    block_size, num_plans = pool.block_size, len(plans)
    for plan, table in zip(plans, tables, strict=True):
        if (plan.layout_version != table.layout_version or plan.src_block_ids.size <= plan.dst_new_block_ids.size
                or table.pool is not pool):
            return False
    held_blocks, held_ends, pinned, open_tails = TokenTable.held_blocks_each(tables)
    moves, move_of, sources, source_of = end_to_end(plans)  # views of the round's planning pass, as a round launches
    token_ids = moves.token_ids
    if any(plan.dst_new_block_ids.size for plan in plans):
        new_blocks, new_of = _concatenated([plan.dst_new_block_ids for plan in plans])
    else:  # hole-fill plans take no fresh block
        new_blocks = new_of = np.zeros(0, dtype=np.int64)
    # the moved tokens' live bits and slots are read in the pool's arena (token_arena.py), each
    # table's from its base there; the block labels are written in pool-sized arrays the pool keeps, only where they are read: a
    # fresh pool-sized array would pay the first touch of every page the round writes
    arena = pool.token_arena
    return compiled_loops().round_passes(
        num_plans, np.fromiter([table.num_tokens for table in tables], np.int64, num_plans), token_ids, move_of,
        moves.src_block_ids, moves.src_offsets, moves.dst_block_ids, moves.dst_offsets,
        arena.bases(tables), arena.live, arena.slot, sources, source_of,
        new_blocks, new_of, held_blocks, held_ends, pinned, open_tails, pool.ref_counts,
        pool.live_counts, pool.token_at, *(pool.scratch(name, np.int64) for name in ("plans_pass holder", "plans_pass source",
                                                                                      "plans_pass new", "plans_pass taken")),
        pool.scratch("plans_pass forbidden", bool), block_size)


def check_round(plans: Sequence[RelocationPlan], tables: Sequence[TokenTable], pool: BlockPool,
                busy_req_ids: frozenset[int]) -> None:
    """I4 for a round's plans, each as if launched before the next is checked (its request busy
    from then on): `plans_pass` for all of them at once, and `check_plan` plan by plan only when
    it finds something, so that a violation raises check_plan's error. `tables[i]` is the table
    of `plans[i]`. A plan's check reads only its own table and blocks and the requests busy
    before it, so checking the round before launching any plan raises what checking each plan
    just before its launch raised."""
    if plans_pass(plans, tables, pool, busy_req_ids):
        return
    for plan, table in zip(plans, tables, strict=True):
        check_plan(plan, table, pool, busy_req_ids)
        busy_req_ids = busy_req_ids | {plan.req_id}


def _concatenated(arrays: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """The arrays end to end, and the index of the array each entry came from."""
    return np.concatenate(arrays), np.repeat(np.arange(len(arrays)), [a.size for a in arrays])


def _check_plan_tokens(plan: RelocationPlan, table: TokenTable, pool: BlockPool, fail) -> None:
    """The plan moves every live token of its sources, each once, from where it sits: every
    moved token is live in the table, at its move's source slot, in a source block, and as many
    move as the pool counts live in the sources. O(moves), not O(tokens), by the pool's counts
    and reverse map, which agree with the tables' (I2, checked on their own)."""
    moves, block_size = plan.moves, table.block_size
    token_ids = moves.token_ids
    if token_ids.size and (token_ids.min() < 0 or token_ids.max() >= table.num_tokens or not is_distinct(token_ids)):
        fail("moves unknown or repeated tokens")
    is_live = table.live_mask[token_ids]
    if not is_live.all():
        token_id = int(token_ids[~is_live][0])
        fail(f"moves token {token_id}, which is not live", token_id=token_id)
    stale = table.token_slots[token_ids] != moves.src_slots(block_size)
    if stale.any():
        i = int(np.flatnonzero(stale)[0])
        token_id, block_id, offset = int(token_ids[i]), int(moves.src_block_ids[i]), int(moves.src_offsets[i])
        fail(f"moves token {token_id} from block {block_id} offset {offset}, which it does not occupy",
             token_id=token_id, block_id=block_id, offset=offset)
    inside = isin(moves.src_block_ids, plan.src_block_ids)
    if not inside.all():
        i = int(np.flatnonzero(~inside)[0])
        fail(f"moves token {int(token_ids[i])} out of block {int(moves.src_block_ids[i])}, which is not one of its sources",
             token_id=int(token_ids[i]), block_id=int(moves.src_block_ids[i]))
    num_src_live = int(pool.live_counts[plan.src_block_ids].sum())
    if num_src_live != token_ids.size:
        missing = np.setdiff1d(_live_ids_in(table, pool, plan.src_block_ids), token_ids)
        token_id = int(missing[0]) if missing.size else int(token_ids[0])
        fail(f"moves {moves.num_moves} tokens but its sources hold {num_src_live} live ones", token_id=token_id)


def _live_ids_in(table: TokenTable, pool: BlockPool, block_ids: np.ndarray) -> np.ndarray:
    """Live tokens of `table` stored in `block_ids`, ascending: one pass over the table."""
    is_listed = np.zeros(pool.num_blocks, dtype=bool)
    is_listed[block_ids] = True
    return np.flatnonzero(is_listed[table.token_block_ids] & table.live_mask)


def _check_plan_destinations(plan: RelocationPlan, table: TokenTable, pool: BlockPool, held: np.ndarray, fail) -> None:
    """The copy writes every destination before `apply_moves` can object: each must be a free
    slot of a block the request keeps, and no two moves may share one. A slot is free when the
    pool's reverse map holds no token there, or one that this plan moves away."""
    block_size = table.block_size
    dst_block_ids = plan.moves.dst_block_ids
    kept = np.concatenate((held, plan.dst_new_block_ids)) if plan.dst_new_block_ids.size else held
    outside = ~isin(dst_block_ids, kept) | isin(dst_block_ids, plan.src_block_ids)
    if outside.any():
        fail(f"moves into block {int(dst_block_ids[outside][0])}, which the request does not keep", block_id=int(dst_block_ids[outside][0]))
    dst_slots = plan.moves.dst_slots(block_size)
    occupant = pool.token_at[dst_slots]
    occupied = occupant >= 0
    if occupied.any():
        occupied[occupied] = ~isin(occupant[occupied], plan.moves.token_ids)
    if occupied.any() or not is_distinct(dst_slots):
        i = int(np.flatnonzero(occupied)[0]) if occupied.any() else 0
        slot = int(dst_slots[i])
        fail(f"moves token {int(plan.moves.token_ids[i])} onto slot {slot} (block {slot // block_size}, offset {slot % block_size}), "
             "which is not free", token_id=int(plan.moves.token_ids[i]), block_id=slot // block_size, offset=slot % block_size)
