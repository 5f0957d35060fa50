"""Invariants I1-I4: every check passes on a clean state and raises InvariantError, naming the
invariant and the numbers, on a state or plan built to violate it (S = 4)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from vtoken.errors import InvariantError, VTokenError
from vtoken.invariants import (
    check_conservation,
    check_contents,
    check_plan,
    check_round,
    check_unique_mapping,
    check_visibility,
    plans_pass,
)
from vtoken.kv.block_pool import BlockPool
from vtoken.kv.copy_engine import CopyEngine
from vtoken.kv.kv_cache import KVShape, PagedKVCache
from vtoken.kv.moves import Moves
from vtoken.kv.moves import RelocationPlan
from vtoken.kv.reclaim import ReclaimConfig, Reclaimer
from vtoken.kv.token_table import TokenTable

S = 4


def make_table(pool: BlockPool, num_tokens: int, req_id: int = 0, evicted: tuple[int, ...] = ()) -> TokenTable:
    table = TokenTable(req_id, pool)
    table.sync_new_tokens(pool.allocate(table.num_new_blocks_needed(num_tokens)), num_tokens)
    if evicted:
        table.evict_tokens(np.array(evicted))
    return table


def holey_setup() -> tuple[BlockPool, TokenTable, RelocationPlan]:
    """block 0: [0 . . 3]  block 1: [4 5 6 7]  block 2: [8 9 . .]  block 3 (tail): [12 13 . .]
    hole-fill plan: 8 -> (0, 1), 9 -> (0, 2), block 2 freed."""
    pool = BlockPool(16, S)
    table = make_table(pool, 14, evicted=(1, 2, 10, 11))
    (plan,) = Reclaimer(ReclaimConfig(mode="hole-fill"), pool).plan([table])
    assert plan.moves.dst_slots(S).tolist() == [1, 2]
    return pool, table, plan


def moves(rows: list[tuple[int, int, int, int, int]]) -> Moves:
    columns = np.array(rows, dtype=np.int64).reshape(-1, 5).T
    return Moves(*(c.copy() for c in columns))


def raises(invariant: str, match: str):
    return pytest.raises(InvariantError, match=f"{invariant} violated: .*{match}")


# ---- I1 token conservation ---------------------------------------------------------------


def test_conservation_passes_when_the_live_ids_are_unchanged() -> None:
    check_conservation(0, np.array([0, 3, 8]), np.array([0, 3, 8]))


@pytest.mark.parametrize(("after", "match"), [
    ([0, 8], r"lost \[3\] added \[\]"),
    ([0, 3, 8, 9], r"lost \[\] added \[9\]"),
])
def test_conservation_raises_for_a_lost_or_added_token(after: list[int], match: str) -> None:
    with raises("I1", match) as raised:
        check_conservation(7, np.array([0, 3, 8]), np.array(after))
    assert raised.value.invariant == "I1"
    assert raised.value.where["req_id"] == 7
    assert isinstance(raised.value, VTokenError)


def test_contents_pass_when_nothing_mismatches() -> None:
    check_contents(0, np.array([0, 3]), np.array([0, 3]), np.array([False, False]), S)


def test_a_relocation_whose_data_never_moved_fails_the_content_check() -> None:
    pool, table, plan = holey_setup()
    shape = KVShape(num_layers=1, num_blocks=16, block_size=S, num_kv_heads=1, head_dim=2)
    kv_cache = PagedKVCache(shape, dtype=torch.float64)

    def expected(token_ids: np.ndarray) -> torch.Tensor:
        return torch.as_tensor(token_ids, dtype=torch.float64).view(1, 1, -1, 1, 1).expand(1, 2, -1, 1, 2)

    all_ids = np.arange(14)
    kv_cache.write(torch.as_tensor(table.token_block_ids * S + table.token_offsets), expected(all_ids))
    table.apply_moves(plan.moves)  # repointed, but no copy ran: I1 must catch it
    token_ids, slots = table.live_token_ids(), table.slots()
    mismatched = (kv_cache.read(torch.as_tensor(slots)) != expected(token_ids)).flatten(3).any(-1).any(0).any(0).numpy()
    assert mismatched.tolist() == [False, False, False, False, False, False, True, True, False, False]
    with raises("I1", r"token 8 reads wrong K/V at block 0 offset 1 \(2 tokens differ\)") as raised:
        check_contents(0, token_ids, slots, mismatched, S)
    assert raised.value.where == {"req_id": 0, "token_id": 8, "block_id": 0, "offset": 1}


# ---- I2 unique mapping -------------------------------------------------------------------


def shared_setup() -> tuple[BlockPool, TokenTable, TokenTable]:
    """owner: blocks 0, 1 (pinned), 2; sharer: blocks 0, 1 (shared), 3."""
    pool = BlockPool(16, S)
    owner = make_table(pool, 10, evicted=(9,))
    owner.pin_prefix(8)
    sharer = TokenTable(1, pool)
    pool.share(np.array([0, 1]))
    sharer.attach_shared_prefix(np.array([0, 1]), 8)
    sharer.sync_new_tokens(pool.allocate(1), 11)
    return pool, owner, sharer


def test_unique_mapping_passes_on_a_clean_state_with_a_shared_prefix() -> None:
    pool, owner, sharer = shared_setup()
    check_unique_mapping(pool, [owner, sharer])
    pool.free(np.array(owner.release_all()))
    check_unique_mapping(pool, [owner, sharer])


def test_a_slot_claimed_twice_raises() -> None:
    pool, owner, sharer = shared_setup()
    sharer._slot[10] = 3 * S + 1  # token 10 onto token 9's slot (block 3, offset 1)
    with raises("I2", r"slot 13 \(block 3, offset 1\) is claimed by request 1 token 9 and request 1 token 10") as raised:
        check_unique_mapping(pool, [owner, sharer])
    assert raised.value.where == {"req_id": 1, "token_id": 10, "block_id": 3, "offset": 1}


def test_a_slot_claimed_by_two_requests_raises() -> None:
    pool = BlockPool(16, S)
    a = make_table(pool, 6)  # blocks 0, 1
    b = make_table(pool, 2, req_id=1)  # block 2
    pool.share(np.array([1]))
    b.adopt_blocks(np.array([1]))  # b also holds block 1 (not as a pinned prefix)
    b._slot[0] = 1 * S + 0  # and maps its token 0 onto a's token 4
    with raises("I2", "is claimed by request 0 token 4 and request 1 token 0"):
        check_unique_mapping(pool, [a, b])


def test_a_token_mapped_outside_its_blocks_raises() -> None:
    pool = BlockPool(16, S)
    a = make_table(pool, 6)
    make_table(pool, 2, req_id=1)  # block 2
    a._slot[5] = 2 * S + int(a.token_offsets[5])  # block 1 -> block 2
    with raises("I2", "request 0: token 5 maps to block 2 it does not hold"):
        check_unique_mapping(pool, [a])


def test_pool_live_counts_that_disagree_with_the_tables_raise() -> None:
    pool, owner, sharer = shared_setup()
    pool.adjust_live(np.array([2]), np.array([-1]))  # behind the table's back
    with raises("I2", "block 2: pool counts 0 live tokens, the tables map 1") as raised:
        check_unique_mapping(pool, [owner, sharer])
    assert raised.value.where == {"block_id": 2}


def test_a_reference_no_table_holds_raises() -> None:
    pool, owner, sharer = shared_setup()
    pool.share(np.array([3]))
    with raises("I2", "block 3: ref count 2, held by 1 requests"):
        check_unique_mapping(pool, [owner, sharer])


def test_a_token_mapped_into_a_shared_prefix_block_raises() -> None:
    pool, owner, sharer = shared_setup()
    sharer._slot[10] = 1 * S + 0  # onto the shared prefix
    pool.adjust_live(np.array([3]), np.array([-1]))
    with raises("I2", "block 1: pool counts 4 live tokens, the tables map 5"):
        check_unique_mapping(pool, [owner, sharer])


def test_a_pinned_token_out_of_place_raises() -> None:
    pool, owner, sharer = shared_setup()
    sharer._slot[[5, 6]] = sharer.token_slots[[6, 5]]
    with raises("I2", "request 1: pinned prefix token 5 is not live at its place"):
        check_unique_mapping(pool, [owner, sharer])


# ---- I3 pre-attention visibility ---------------------------------------------------------


def test_reads_of_slots_no_copy_is_writing_pass() -> None:
    pool, table, plan = holey_setup()
    check_visibility(0, table.slots(), [plan], S)
    check_visibility(0, np.array([1, 2]), [], S)


def test_a_read_of_an_in_flight_destination_raises() -> None:
    pool, table, plan = holey_setup()
    engine = CopyEngine(None, "deferred")
    engine.launch(plan)
    table.apply_moves(plan.moves)  # applied before the copy completed
    with raises("I3", r"request 0 read slot 1 \(block 0, offset 1\) before the copy of request 0 token 8 completed") as raised:
        check_visibility(0, table.slots(), engine.in_flight_plans, S)
    assert raised.value.where == {"req_id": 0, "token_id": 8, "block_id": 0, "offset": 1}


# ---- I4 layout-aware planning ------------------------------------------------------------


def test_a_fresh_plan_passes_for_both_modes() -> None:
    for mode in ("hole-fill", "ordered"):
        pool = BlockPool(16, S)
        table = make_table(pool, 14, evicted=(1, 2, 10, 11))
        plans = Reclaimer(ReclaimConfig(mode=mode), pool).plan([table])
        for plan in plans:
            check_plan(plan, table, pool, frozenset({5}))
        assert plans and plans_pass(plans, [table] * len(plans), pool, frozenset({5}))


def test_a_plan_of_a_busy_request_raises() -> None:
    pool, table, plan = holey_setup()
    with raises("I4", "request 0 plan: overlaps a plan of the same request still in flight"):
        check_plan(plan, table, pool, frozenset({0}))
    assert not plans_pass([plan], [table], pool, frozenset({0}))  # the round check finds it too


def test_a_plan_from_a_stale_layout_raises() -> None:
    pool, table, plan = holey_setup()
    table.evict_tokens(np.array([4]))
    with raises("I4", f"planned on layout version {plan.layout_version}, the table is at {plan.layout_version + 1}"):
        check_plan(plan, table, pool, frozenset())
    assert not plans_pass([plan], [table], pool, frozenset())  # the round check finds it too


def test_a_plan_that_does_not_reduce_the_block_count_raises() -> None:
    pool, table, plan = holey_setup()
    ordered = replace(plan, mode="ordered", dst_new_block_ids=pool.peek_free(1),
                      moves=moves([(8, 2, 0, 4, 0), (9, 2, 1, 4, 1)]))
    with raises("I4", r"does not reduce the block count \(1 sources, 1 new blocks\)"):
        check_plan(ordered, table, pool, frozenset())
    assert not plans_pass([ordered], [table], pool, frozenset())  # the round check finds it too


def test_a_plan_touching_a_pinned_or_shared_block_raises() -> None:
    pool = BlockPool(16, S)
    table = make_table(pool, 14, evicted=(5, 6, 10, 11))  # block 0 full, then [4 . . 7] [8 9 . .]
    table.pin_prefix(4)
    into_pinned = RelocationPlan(0, "hole-fill", moves([(8, 2, 0, 0, 1)]), np.array([2]), np.zeros(0, np.int64), table.layout_version)
    with raises("I4", "touches shared prefix block 0") as raised:
        check_plan(into_pinned, table, pool, frozenset())
    assert not plans_pass([into_pinned], [table], pool, frozenset())  # the round check finds it too
    assert raised.value.where == {"req_id": 0, "block_id": 0}
    pool.share(np.array([1]))
    into_shared = RelocationPlan(0, "hole-fill", moves([(8, 2, 0, 1, 1), (9, 2, 1, 1, 2)]), np.array([2]),
                                 np.zeros(0, np.int64), table.layout_version)
    with raises("I4", "touches shared prefix block 1"):
        check_plan(into_shared, table, pool, frozenset())
    assert not plans_pass([into_shared], [table], pool, frozenset())  # the round check finds it too


def test_two_plans_of_one_request_in_a_round_do_not_pass() -> None:
    """Each plan is valid alone; check_plan of the second sees the first in flight."""
    pool = BlockPool(16, S)
    table = make_table(pool, 20, evicted=(1, 2, 5, 6, 8, 9, 10, 13, 14, 15))  # [0 . . 3] [4 . . 7] [. . . 11] [12 . . .] [16-19]
    first = RelocationPlan(0, "hole-fill", moves([(11, 2, 3, 0, 1)]), np.array([2]), np.zeros(0, np.int64), table.layout_version)
    second = RelocationPlan(0, "hole-fill", moves([(12, 3, 0, 1, 1)]), np.array([3]), np.zeros(0, np.int64), table.layout_version)
    for plan in (first, second):
        check_plan(plan, table, pool, frozenset())
    assert not plans_pass([first, second], [table, table], pool, frozenset())
    with raises("I4", "overlaps a plan of the same request still in flight"):
        check_plan(second, table, pool, frozenset({0}))


def test_a_plan_that_leaves_a_live_token_behind_raises() -> None:
    pool, table, plan = holey_setup()
    partial = replace(plan, moves=moves([(8, 2, 0, 0, 1)]))
    with raises("I4", "moves 1 tokens but its sources hold 2 live ones"):
        check_plan(partial, table, pool, frozenset())
    assert not plans_pass([partial], [table], pool, frozenset())  # the round check finds it too


@pytest.mark.parametrize(("rows", "src_block_ids", "match"), [
    ([(8, 2, 0, 0, 0), (9, 2, 1, 0, 2)], [2], r"moves token 8 onto slot 0 \(block 0, offset 0\), which is not free"),
    ([(8, 2, 0, 0, 1), (9, 2, 1, 0, 1)], [2], "onto slot 1 .block 0, offset 1., which is not free"),
    ([(8, 2, 0, 5, 0), (9, 2, 1, 5, 1)], [2], "moves into block 5, which the request does not keep"),
    ([(8, 2, 0, 2, 2), (9, 2, 1, 2, 3)], [2], "moves into block 2, which the request does not keep"),
    ([(8, 2, 0, 0, 1), (9, 2, 1, 0, 2)], [2, 5], "frees block 5 the request does not hold"),
    ([(8, 2, 0, 0, 1), (9, 2, 1, 0, 2), (12, 3, 0, 1, 3)], [2, 3], "frees the open tail block 3"),
])
def test_a_plan_whose_copy_would_overwrite_or_free_the_wrong_slots_raises(rows, src_block_ids, match: str) -> None:
    pool, table, plan = holey_setup()
    pool.allocate(2)  # blocks 4, 5 belong to nobody here
    bad = replace(plan, moves=moves(rows), src_block_ids=np.array(src_block_ids))
    with raises("I4", match):
        check_plan(bad, table, pool, frozenset())
    assert not plans_pass([bad], [table], pool, frozenset())  # the round check finds it too


@pytest.mark.parametrize(("rows", "match"), [
    ([(8, 2, 0, 0, 1), (10, 2, 2, 0, 2)], "moves token 10, which is not live"),
    ([(8, 2, 1, 0, 1), (9, 2, 0, 0, 2)], "moves token 8 from block 2 offset 1, which it does not occupy"),
    ([(8, 2, 0, 0, 1), (8, 2, 0, 0, 2)], "moves unknown or repeated tokens"),
    ([(8, 2, 0, 0, 1), (9, 2, 1, 0, 2), (14, 3, 2, 1, 1)], "moves unknown or repeated tokens"),
    ([(8, 2, 0, 0, 1), (9, 2, 1, 0, 2), (4, 1, 0, 3, 2)], "moves token 4 out of block 1, which is not one of its sources"),
    ([(8, 2, 0, 0, 1), (4, 1, 0, 0, 2)], "moves token 4 out of block 1, which is not one of its sources"),  # 9 left behind
])
def test_a_plan_that_moves_tokens_other_than_its_sources_live_ones_raises(rows, match: str) -> None:
    pool, table, plan = holey_setup()  # block 2: [8 9 . .], 10 and 11 evicted; 14 tokens
    bad = replace(plan, moves=moves(rows))
    with raises("I4", match):
        check_plan(bad, table, pool, frozenset())
    assert not plans_pass([bad], [table], pool, frozenset())  # the round check finds it too


@pytest.mark.parametrize(("rows", "src_block_ids"), [
    ([(8, 2, 0, 16, 1), (9, 2, 1, 0, 2)], [2]),  # a destination past the pool's 16 blocks
    ([(8, 2, 0, 0, 1), (9, 2, 1, 0, 2)], [99]),  # a source past it
    ([(8, 2, 0, 0, 1), (9, 2, 1, 0, 2 + S)], [2]),  # an offset past the block
])
def test_a_plan_naming_a_block_or_offset_outside_the_pool_does_not_pass_the_round_check(rows, src_block_ids) -> None:
    """The compiled round check reads the pool's arrays at the plans' blocks without numpy's
    bounds checks: an index outside them fails the check before any read, and check_round then
    raises (check_plan's error)."""
    pool, table, plan = holey_setup()
    bad = replace(plan, moves=moves(rows), src_block_ids=np.array(src_block_ids))
    assert not plans_pass([bad], [table], pool, frozenset())
    with pytest.raises((InvariantError, IndexError)):
        check_round([bad], [table], pool, frozenset())


def test_landing_moves_into_a_block_outside_the_pool_raises_and_changes_nothing() -> None:
    pool, table, plan = holey_setup()
    counts, token_at, slots = pool.live_counts.copy(), pool.token_at.copy(), table.slots().copy()
    bad = moves([(8, 2, 0, 16, 1), (9, 2, 1, 0, 2)])
    with pytest.raises(VTokenError, match=r"out of range \[0, 16\): \[16\]"):
        TokenTable.apply_moves_each([table], [bad], [table.layout_version])  # checked at its version: not checked again
    assert np.array_equal(pool.live_counts, counts) and np.array_equal(pool.token_at, token_at)
    assert np.array_equal(table.slots(), slots)


def test_moves_checked_at_the_tables_version_are_not_checked_again_and_any_change_brings_the_check_back(monkeypatch) -> None:
    pool, table, plan = holey_setup()
    check_plan(plan, table, pool, frozenset())
    checked_at = table.layout_version
    table.evict_tokens(np.array([12]))  # the layout moved on since the check
    stale = replace(plan.moves, src_offsets=plan.moves.src_offsets + 1)
    with pytest.raises(VTokenError, match="names a source it does not occupy"):
        table.apply_moves(stale, checked_at)
    pool, table, plan = holey_setup()
    check_plan(plan, table, pool, frozenset())

    def second_check(self, moves) -> None:
        raise AssertionError("checked twice")

    monkeypatch.setattr(TokenTable, "_check_moves", second_check)
    table.apply_moves(plan.moves, table.layout_version)
    assert table.token_slots[[8, 9]].tolist() == [1, 2]
    check_unique_mapping(pool, [table])


def test_a_reverse_map_entry_that_disagrees_with_the_table_raises() -> None:
    pool, owner, sharer = shared_setup()
    slot = int(sharer.token_slots[10])
    pool.token_at[slot] = 9  # the reclaimer would plan token 9 out of token 10's slot
    with raises("I2", f"request 1: token 10 sits at slot {slot} but the pool's reverse map names token 9 there"):
        check_unique_mapping(pool, [owner, sharer])


def test_a_stale_reverse_map_entry_raises() -> None:
    pool, owner, sharer = shared_setup()
    slot = int(sharer.token_slots[10])
    sharer.evict_tokens(np.array([10]))
    pool.token_at[slot] = 10  # eviction forgot to clear it
    with raises("I2", "the pool's reverse map holds"):
        check_unique_mapping(pool, [owner, sharer])
