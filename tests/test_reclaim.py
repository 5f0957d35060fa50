"""The reclaimer: configuration, eligibility and headroom, and both planning modes on hand-drawn
layouts (S = 4), plus a property check that every plan is safe, frees what it says and keeps
every live token."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vtoken.errors import ConfigError, InvariantError
from vtoken.invariants import check_plan, check_round, check_unique_mapping, plans_pass
from vtoken.kv.block_pool import BlockPool
from vtoken.kv.moves import RelocationPlan, end_to_end
from vtoken.kv.planning import movable_block_ids, num_reclaimable_blocks, plan_hole_fill, plan_ordered
from vtoken.kv.reclaim import (
    ROUND_PLANNING_SLACK, ReclaimConfig, Reclaimer, StepShare, most_reclaimable_first, within_budget,
)
from vtoken.kv.token_table import TokenTable

S = 4


def make_layout(*blocks: str, tail: str = "", pool: BlockPool | None = None, req_id: int = 0) -> TokenTable:
    """A request whose blocks look like the drawing: 'L' a live token, '.' an evicted one.

    `blocks` are closed blocks; `tail` is the open tail, written up to its length.
    make_layout("L.LL", "LL..", tail="LL") has tokens 0..9 in 3 blocks, 1, 6 and 7 evicted.
    """
    pool = pool or BlockPool(32, S)
    table = TokenTable(req_id, pool)
    pattern = "".join(blocks) + tail
    assert all(len(b) == S for b in blocks) and len(tail) < S
    table.sync_new_tokens(pool.allocate(table.num_new_blocks_needed(len(pattern))), len(pattern))
    dead = [i for i, mark in enumerate(pattern) if mark == "."]
    if dead:
        table.evict_tokens(np.array(dead))
    return table


def moves_of(plan: RelocationPlan) -> list[tuple[int, int, int, int, int]]:
    m = plan.moves
    return list(zip(m.token_ids.tolist(), m.src_block_ids.tolist(), m.src_offsets.tolist(),
                    m.dst_block_ids.tolist(), m.dst_offsets.tolist(), strict=True))


def launch(plan: RelocationPlan, table: TokenTable) -> None:
    """The runtime's launch, without KV data: check, allocate the planned destinations, adopt."""
    pool = table.pool
    check_plan(plan, table, pool, frozenset())
    got = pool.allocate(plan.dst_new_block_ids.size)
    assert got.tolist() == plan.dst_new_block_ids.tolist()
    table.adopt_blocks(got)


def complete(plan: RelocationPlan, table: TokenTable) -> None:
    table.apply_moves(plan.moves)
    table.release_blocks(plan.src_block_ids)
    table.pool.free(plan.src_block_ids)


def apply(plan: RelocationPlan, table: TokenTable) -> None:
    launch(plan, table)
    complete(plan, table)


def layout_of(table: TokenTable) -> list[str]:
    """The blocks of a table drawn back as strings, in held order."""
    drawn = {b: ["."] * S for b in table.held_block_ids}
    for token_id in table.live_token_ids().tolist():
        drawn[int(table.token_block_ids[token_id])][int(table.token_offsets[token_id])] = "L"
    return ["".join(drawn[b]) for b in table.held_block_ids.tolist()]


# ---- configuration -----------------------------------------------------------------------


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"mode": "compact"}, "unknown reclaim mode 'compact'; choose one of: hole-fill, ordered"),
    ({"theta_f": 0.0}, r"theta_F must be in \(0, 1\), got 0.0"),
    ({"theta_f": 1.0}, r"theta_F must be in \(0, 1\), got 1.0"),
    ({"theta_f": -0.1}, "theta_F must be in"),
    ({"theta_f": 1.5}, "theta_F must be in"),
    ({"low_watermark_frac": 0.0}, r"low watermark must be a fraction in \(0, 1\], got 0.0"),
    ({"low_watermark_frac": 1.01}, "low watermark must be a fraction"),
    ({"check_interval_steps": 0}, "reclaim check interval must be > 0 steps, got 0"),
    ({"max_src_blocks": 1}, "reclaim batch size B must be >= 2 blocks, got 1"),
    ({"headroom_blocks": -1}, "headroom must be >= 0 blocks, got -1"),
    ({"max_moves_per_step": 0}, "reclaim budget must be > 0 tokens moved per step, got 0"),
])
def test_bad_reclaim_config_raises(kwargs: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        ReclaimConfig(**kwargs)


def test_headroom_defaults_to_the_batch_size_for_ordered_and_zero_for_hole_fill() -> None:
    assert ReclaimConfig(mode="hole-fill", max_src_blocks=8).num_headroom_blocks == 0
    assert ReclaimConfig(mode="ordered", max_src_blocks=8).num_headroom_blocks == 8
    assert ReclaimConfig(mode="ordered", headroom_blocks=3).num_headroom_blocks == 3


# ---- eligibility and headroom ------------------------------------------------------------


def test_eligibility_needs_the_interval_the_watermark_and_theta_f() -> None:
    pool = BlockPool(16, S)
    reclaimer = Reclaimer(ReclaimConfig(theta_f=0.25, low_watermark_frac=0.5, check_interval_steps=4), pool)
    assert reclaimer.num_low_watermark_blocks == 8
    table = make_layout("LLLL", "LLLL", "LLLL", "LLLL", "LLLL", "LLLL", "LLLL", "LLLL", "LLLL", pool=pool)
    assert pool.num_free_blocks == 7 and pool.waste_ratio() == 0.0
    assert not reclaimer.is_eligible(0)  # F = 0 < theta_F
    table.evict_tokens(np.arange(0, 36, 4))  # one token per block: F = 9 / 36 = 0.25
    assert pool.waste_ratio() == pytest.approx(0.25)
    assert [reclaimer.is_eligible(step) for step in range(9)] == [True, False, False, False, True, False, False, False, True]
    pool.free(np.array(table.release_all()))
    assert not reclaimer.is_eligible(0)  # empty pool: F = 0 and every block free


def test_eligibility_is_off_while_enough_blocks_are_free() -> None:
    pool = BlockPool(16, S)
    reclaimer = Reclaimer(ReclaimConfig(theta_f=0.25, low_watermark_frac=0.5), pool)
    make_layout("L...", "L...", pool=pool)  # F = 0.75 but 14 of 16 blocks free
    assert pool.waste_ratio() == pytest.approx(0.75)
    assert not reclaimer.is_eligible(0)


@pytest.mark.parametrize(("mode", "headroom_blocks", "num_admissible"), [
    ("hole-fill", None, 10), ("ordered", None, 6), ("ordered", 3, 7), ("ordered", 12, 0),
])
def test_admission_leaves_the_headroom_free(mode: str, headroom_blocks: int | None, num_admissible: int) -> None:
    pool = BlockPool(16, S)
    pool.allocate(6)
    reclaimer = Reclaimer(ReclaimConfig(mode=mode, max_src_blocks=4, headroom_blocks=headroom_blocks), pool)
    assert reclaimer.num_admissible_blocks() == num_admissible


# ---- hole-fill ---------------------------------------------------------------------------


def test_hole_fill_moves_the_last_block_into_earlier_holes_as_drawn_in_the_module_docstring() -> None:
    table = make_layout("L.LL", "LL..", ".L.L", tail="LLL")  # blocks 0, 1, 2; tail 3
    plan = Reclaimer(ReclaimConfig(mode="hole-fill"), table.pool).plan([table])[0]
    assert (plan.req_id, plan.mode, plan.layout_version) == (0, "hole-fill", table.layout_version)
    assert moves_of(plan) == [(9, 2, 1, 0, 1), (11, 2, 3, 1, 2)]
    assert plan.src_block_ids.tolist() == [2]
    assert plan.dst_new_block_ids.tolist() == []
    assert (plan.num_tokens_moved, plan.num_blocks_freed) == (2, 1)
    apply(plan, table)
    assert layout_of(table) == ["LLLL", "LLL.", "LLL."]
    assert table.held_block_ids.tolist() == [0, 1, 3]
    assert table.pool.num_free_blocks == 32 - 3


def test_hole_fill_takes_as_many_trailing_blocks_as_the_holes_hold() -> None:
    table = make_layout("L...", "...L", "..LL", "LLLL", ".LLL", "...L", tail="L")  # blocks 0..5; tail 6
    plan = plan_hole_fill(table, max_src_blocks=64)
    assert plan.src_block_ids.tolist() == [3, 4, 5]
    assert moves_of(plan) == [
        (12, 3, 0, 0, 1), (13, 3, 1, 0, 2), (14, 3, 2, 0, 3), (15, 3, 3, 1, 0),
        (17, 4, 1, 1, 1), (18, 4, 2, 1, 2), (19, 4, 3, 2, 0), (23, 5, 3, 2, 1),
    ]
    apply(plan, table)
    assert layout_of(table) == ["LLLL", "LLLL", "LLLL", "L..."]


def test_hole_fill_respects_the_batch_size() -> None:
    table = make_layout("L...", "...L", "..LL", "LLLL", ".LLL", "...L", tail="L")
    plan = plan_hole_fill(table, max_src_blocks=2)
    assert plan.src_block_ids.tolist() == [4, 5]
    assert moves_of(plan) == [(17, 4, 1, 0, 1), (18, 4, 2, 0, 2), (19, 4, 3, 0, 3), (23, 5, 3, 1, 0)]


def test_hole_fill_frees_an_already_empty_trailing_block_without_moves() -> None:
    table = make_layout("LL..", "....", tail="L")  # block 1 emptied but not released
    plan = plan_hole_fill(table, max_src_blocks=64)
    assert (plan.src_block_ids.tolist(), plan.num_tokens_moved, plan.num_blocks_freed) == ([1], 0, 1)


# ---- ordered -----------------------------------------------------------------------------


def test_ordered_packs_the_emptiest_blocks_in_logical_order_into_fresh_blocks() -> None:
    table = make_layout("L...", "...L", "..LL", "LLLL", ".LLL", "...L", tail="L")  # blocks 0..6
    plan = Reclaimer(ReclaimConfig(mode="ordered"), table.pool).plan([table])[0]
    assert plan.src_block_ids.tolist() == [0, 1, 2, 4, 5]  # block 3 is full
    assert plan.dst_new_block_ids.tolist() == [7, 8]
    assert moves_of(plan) == [
        (0, 0, 0, 7, 0), (7, 1, 3, 7, 1), (10, 2, 2, 7, 2), (11, 2, 3, 7, 3),
        (17, 4, 1, 8, 0), (18, 4, 2, 8, 1), (19, 4, 3, 8, 2), (23, 5, 3, 8, 3),
    ]
    assert (plan.num_tokens_moved, plan.num_blocks_freed) == (8, 3)
    apply(plan, table)
    assert table.held_block_ids.tolist() == [3, 7, 8, 6]
    assert layout_of(table) == ["LLLL", "LLLL", "LLLL", "L..."]
    assert table.slots().tolist() == [28, 29, 30, 31, 12, 13, 14, 15, 32, 33, 34, 35, 24]


def test_ordered_takes_the_b_lowest_utilization_blocks() -> None:
    table = make_layout("LL..", "L...", "LLL.", "L...", tail="L")
    plan = plan_ordered(table, 2, table.pool, num_dst_used=0)
    assert plan.src_block_ids.tolist() == [1, 3]
    assert moves_of(plan) == [(4, 1, 0, 5, 0), (12, 3, 0, 5, 1)]


def test_ordered_plans_of_several_requests_take_consecutive_free_blocks_and_stop_when_short() -> None:
    pool = BlockPool(12, S)
    a = make_layout("L...", "L...", "L...", tail="L", pool=pool, req_id=0)  # blocks 0..3
    b = make_layout("L...", "L...", tail="L", pool=pool, req_id=1)  # blocks 4..6
    c = make_layout("L...", "L...", tail="L", pool=pool, req_id=2)  # blocks 7..9
    plans = Reclaimer(ReclaimConfig(mode="ordered"), pool).plan([c, b, a])
    assert [(p.req_id, p.dst_new_block_ids.tolist()) for p in plans] == [(0, [10]), (1, [11])]
    for plan, table in zip(plans, (a, b), strict=True):
        launch(plan, table)
    for plan, table in zip(plans, (a, b), strict=True):
        complete(plan, table)
    assert [a.held_block_ids.tolist(), b.held_block_ids.tolist()] == [[10, 3], [11, 6]]
    check_unique_mapping(pool, [a, b, c])


# ---- what is never planned ---------------------------------------------------------------


def test_nothing_to_gain_gives_no_plan() -> None:
    for mode in ("hole-fill", "ordered"):
        table = make_layout("LLL.", "LLL.", tail="LL")
        assert num_reclaimable_blocks(table) == 0
        assert Reclaimer(ReclaimConfig(mode=mode), table.pool).plan([table]) == []
    table = make_layout("LLL.", "LLL.", tail="LL")
    assert plan_hole_fill(table, 64) is None
    assert plan_ordered(table, 64, table.pool, 0) is None


def test_the_open_tail_is_never_planned_but_a_full_tail_is() -> None:
    table = make_layout("L...", tail="L")  # moving the tail token would free the tail
    assert movable_block_ids(table).tolist() == [0]
    assert num_reclaimable_blocks(table) == 0
    for mode in ("hole-fill", "ordered"):
        assert Reclaimer(ReclaimConfig(mode=mode), table.pool).plan([table]) == []
    full_tail = make_layout("L...", "L.LL")  # the last block is written to the end: closed
    assert movable_block_ids(full_tail).tolist() == [0, 1]
    assert moves_of(plan_hole_fill(full_tail, 64)) == [(4, 1, 0, 0, 1), (6, 1, 2, 0, 2), (7, 1, 3, 0, 3)]


def test_shared_and_pinned_prefix_blocks_are_never_planned() -> None:
    pool = BlockPool(32, S)
    owner = make_layout("LLLL", "LLLL", "L...", "L...", tail="L", pool=pool)  # blocks 0..4
    owner.pin_prefix(8)
    sharer = TokenTable(1, pool)
    pool.share(np.array([0, 1]))
    sharer.attach_shared_prefix(np.array([0, 1]), 8)
    sharer.sync_new_tokens(pool.allocate(sharer.num_new_blocks_needed(9)), 17)  # blocks 5, 6, 7
    sharer.evict_tokens(np.array([9, 10, 11, 13, 14, 15]))
    assert movable_block_ids(owner).tolist() == [2, 3]
    assert movable_block_ids(sharer).tolist() == [5, 6]
    for mode in ("hole-fill", "ordered"):
        plans = Reclaimer(ReclaimConfig(mode=mode), pool).plan([owner, sharer])
        assert sorted(p.req_id for p in plans) == [0, 1]
        for plan in plans:
            touched = set(plan.src_block_ids.tolist()) | set(plan.moves.dst_block_ids.tolist())
            assert touched.isdisjoint({0, 1})
            check_plan(plan, owner if plan.req_id == 0 else sharer, pool, frozenset())
    pool.share(np.array([3]))  # a block another request reuses is not movable either
    assert movable_block_ids(owner).tolist() == [2]


def test_busy_requests_are_skipped_and_the_most_reclaimable_comes_first() -> None:
    pool = BlockPool(32, S)
    a = make_layout("L...", "L...", tail="L", pool=pool, req_id=0)
    b = make_layout("L...", "L...", "L...", tail="L", pool=pool, req_id=1)
    c = make_layout("L...", "L...", tail="L", pool=pool, req_id=2)
    assert [num_reclaimable_blocks(t) for t in (a, b, c)] == [1, 2, 1]
    reclaimer = Reclaimer(ReclaimConfig(mode="hole-fill"), pool)
    assert [p.req_id for p in reclaimer.plan([a, b, c])] == [1, 0, 2]
    assert [p.req_id for p in reclaimer.plan([a, b, c], frozenset({1, 2}))] == [0]



def test_a_round_larger_than_a_step_goes_on_at_the_next_steps() -> None:
    """A step plans the round's next requests (the O(1) bound's order) while the moves they can
    make at most (bound x S) fit in two budgets, one request at least, and launches their plans
    while they move at most the budget, one plan at least; the rest come after."""
    pool = BlockPool(32, S)
    a = make_layout("L...", "L...", tail="L", pool=pool, req_id=0)  # bound 1: at most 4 moves
    b = make_layout("L...", "L...", "L...", tail="L", pool=pool, req_id=1)  # bound 2: at most 8
    c = make_layout("L...", "L...", tail="L", pool=pool, req_id=2)  # bound 1
    assert [t.max_reclaimable_blocks() for t in (a, b, c)] == [1, 2, 1]

    def steps(budget: int | None) -> list[list[tuple[int, int]]]:
        reclaimer = Reclaimer(ReclaimConfig(mode="hole-fill", max_moves_per_step=budget), pool)
        planned = [[(p.req_id, p.num_tokens_moved) for p in reclaimer.plan([a, b, c])]]
        while reclaimer.is_round_in_progress:
            assert reclaimer.is_eligible(1)  # every step while the round goes on (k = 4)
            planned.append([(p.req_id, p.num_tokens_moved) for p in reclaimer.plan([a, b, c])])
        return planned

    assert steps(None) == [[(1, 2), (0, 1), (2, 1)]]
    assert steps(8) == [[(1, 2), (0, 1), (2, 1)]]  # planned: 8 + 4 + 4 fit two budgets; moved: 4
    assert steps(4) == [[(1, 2)], [(0, 1), (2, 1)]]  # a would take the bounds to 12 > 8
    assert steps(2) == [[(1, 2)], [(0, 1)], [(2, 1)]]
    assert steps(1) == [[(1, 2)], [(0, 1)], [(2, 1)]]  # one plan a step at least: b's 2 pass the budget


def test_a_step_launches_plans_up_to_the_budget_and_the_next_step_starts_with_the_rest() -> None:
    pool = BlockPool(32, S)
    d = make_layout("LL..", "LL..", tail="L", pool=pool, req_id=3)  # bound 1 (at most 4 moves), 2 moves
    e = make_layout("L...", "LLL.", tail="L", pool=pool, req_id=4)  # bound 1, 3 moves
    f = make_layout("L...", "L...", tail="L", pool=pool, req_id=5)  # bound 1, 1 move
    reclaimer = Reclaimer(ReclaimConfig(mode="hole-fill", max_moves_per_step=4), pool)
    assert [(p.req_id, p.num_tokens_moved) for p in reclaimer.plan([d, e, f])] == [(3, 2)]  # planned d and e: 2 + 3 > 4
    assert [(p.req_id, p.num_tokens_moved) for p in reclaimer.plan([d, e, f])] == [(4, 3), (5, 1)]  # e first, then f: 3 + 1 fit
    assert not reclaimer.is_round_in_progress



def test_an_ordered_round_step_launches_its_plans_up_to_the_budget_and_puts_the_rest_back_first() -> None:
    """The ordered mode makes its plans and cuts them after (`within_budget`): the first plan
    whatever it moves, then while the moves fit; the requests of the plans it dropped come first
    at the next step."""
    pool = BlockPool(32, S)
    x, y, z = (make_layout("LL..", "L...", tail="L", pool=pool, req_id=req_id) for req_id in range(3))  # bound 1, 3 moves each
    reclaimer = Reclaimer(ReclaimConfig(mode="ordered", max_moves_per_step=4), pool)
    steps = [[(p.req_id, p.num_tokens_moved) for p in reclaimer.plan([x, y, z])]]
    while reclaimer.is_round_in_progress:
        steps.append([(p.req_id, p.num_tokens_moved) for p in reclaimer.plan([x, y, z])])
    # each step picks two (their bounds, 4 moves each at most, fill two budgets) and plans both:
    # 3 + 3 > 4, so the second waits and comes first at the next step
    assert steps == [[(0, 3)], [(1, 3)], [(2, 3)]]

def test_a_round_plans_each_request_as_it_is_when_its_turn_comes() -> None:
    """The requests a round reaches later are planned against their layout then: one that has
    nothing to give back any more, left, or has a copy in flight is passed over."""
    pool = BlockPool(64, S)
    a = make_layout("L...", "L...", tail="L", pool=pool, req_id=0)
    b = make_layout("L...", "L...", "L...", tail="L", pool=pool, req_id=1)
    c = make_layout("L...", "L...", tail="L", pool=pool, req_id=2)
    d = make_layout("L...", "L...", tail="L", pool=pool, req_id=3)
    e = make_layout("L...", "L...", "L...", "L...", tail="L", pool=pool, req_id=4)
    reclaimer = Reclaimer(ReclaimConfig(mode="hole-fill", max_moves_per_step=2), pool)
    assert [p.req_id for p in reclaimer.plan([a, b, c, d, e])] == [4]  # bound 3, then b 2, a, c, d 1
    emptied = a.evict_tokens(np.array([0]))  # a's first block is empty now: nothing to move
    a.release_blocks(emptied)
    pool.free(emptied)
    (plan,) = reclaimer.plan([a, b, c, d, e], frozenset({1}))  # b busy, a has no plan left
    assert plan.req_id == 2 and moves_of(plan) == moves_of(plan_hole_fill(c, 64))
    assert reclaimer.is_round_in_progress
    assert reclaimer.plan([a, b, c, e]) == []  # d left: the round ends without a plan
    assert not reclaimer.is_round_in_progress


def test_plan_mutates_nothing() -> None:
    table = make_layout("L...", "...L", "..LL", "LLLL", ".LLL", "...L", tail="L")
    pool = table.pool
    before = (table.token_block_ids.copy(), table.token_offsets.copy(), table.live_mask.copy(), list(table.held_block_ids),
              table.layout_version, pool.live_counts.copy(), pool.ref_counts.copy(), pool.num_free_blocks)
    for mode in ("hole-fill", "ordered"):
        assert Reclaimer(ReclaimConfig(mode=mode), pool).plan([table])
    after = (table.token_block_ids, table.token_offsets, table.live_mask, table.held_block_ids.tolist(),
             table.layout_version, pool.live_counts, pool.ref_counts, pool.num_free_blocks)
    for x, y in zip(before, after, strict=True):
        np.testing.assert_array_equal(x, y)


# ---- the two modes side by side ----------------------------------------------------------


@pytest.mark.parametrize(("blocks", "hole_fill_cost", "ordered_cost"), [
    # sparse blocks first, full ones last: hole-fill moves the full blocks, ordered the sparse
    (("L...", "L...", "L...", "L...", "LLLL", "LLLL"), (9, 3), (4, 3)),
    # full blocks first, sparse ones last: hole-fill moves only the sparse tail of the request
    (("LLLL", "LLLL", ".L..", "L...", "L...", "L..."), (3, 3), (4, 3)),
])
def test_tokens_moved_per_freed_block_of_the_two_modes(blocks, hole_fill_cost, ordered_cost) -> None:
    costs = {}
    for mode in ("hole-fill", "ordered"):
        table = make_layout(*blocks, tail="L")
        plan = Reclaimer(ReclaimConfig(mode=mode), table.pool).plan([table])[0]
        costs[mode] = (plan.num_tokens_moved, plan.num_blocks_freed)
        apply(plan, table)
        assert table.num_blocks == len(blocks) + 1 - plan.num_blocks_freed
    assert costs == {"hole-fill": hole_fill_cost, "ordered": ordered_cost}


# ---- every plan is safe ------------------------------------------------------------------


@st.composite
def layouts(draw):
    num_blocks = draw(st.integers(1, 10))
    blocks = [draw(st.text("L.", min_size=S, max_size=S)) for _ in range(num_blocks)]
    blocks = [b if "L" in b else "L" + b[1:] for b in blocks]  # emptied blocks would be released
    tail = draw(st.text("L", min_size=0, max_size=S - 1))
    return blocks, tail, draw(st.sampled_from(["hole-fill", "ordered"])), draw(st.integers(2, 6))


@settings(max_examples=300, deadline=None)
@given(layout=layouts())
def test_every_plan_is_safe_frees_what_it_says_and_keeps_every_live_token(layout) -> None:
    blocks, tail, mode, max_src_blocks = layout
    table = make_layout(*blocks, tail=tail)
    pool = table.pool
    live_before = table.live_token_ids().copy()
    num_reclaimable = num_reclaimable_blocks(table)
    plans = Reclaimer(ReclaimConfig(mode=mode, max_src_blocks=max_src_blocks), pool).plan([table])
    if num_reclaimable == 0:
        assert plans == []
    if mode == "hole-fill":  # one trailing block always fits once the holes add up to a block
        assert len(plans) == (num_reclaimable > 0)
    for plan in plans:
        assert 1 <= plan.num_blocks_freed <= num_reclaimable
        assert plan.src_block_ids.size <= max_src_blocks
        assert set(plan.src_block_ids.tolist()) <= set(movable_block_ids(table).tolist())
        num_blocks_before, num_free_before = table.num_blocks, pool.num_free_blocks
        apply(plan, table)
        assert table.num_blocks == num_blocks_before - plan.num_blocks_freed
        assert pool.num_free_blocks == num_free_before + plan.num_blocks_freed
    np.testing.assert_array_equal(table.live_token_ids(), live_before)
    check_unique_mapping(pool, [table])


@settings(max_examples=100, deadline=None)
@given(requests=st.lists(layouts(), min_size=1, max_size=6), busy=st.sets(st.integers(0, 5), max_size=2))
def test_requests_are_ranked_as_a_sort_of_their_exact_reclaimable_blocks(requests, busy) -> None:
    pool = BlockPool(128, S)
    tables = [make_layout(*blocks, tail=tail, pool=pool, req_id=req_id) for req_id, (blocks, tail, _, _) in enumerate(requests)]
    for table in tables[::2]:  # a dead token in the open tail: the O(1) bound is then above the exact count
        if table.tail_num_written and table.live_mask[-1]:
            table.evict_tokens(np.array([table.num_tokens - 1]))
    ranked = [(t.req_id, int(m.num_reclaimable[0])) for t, m in most_reclaimable_first(tables, frozenset(busy))]
    exact = sorted((-num_reclaimable_blocks(t), t.req_id) for t in tables if t.req_id not in busy and num_reclaimable_blocks(t) > 0)
    assert ranked == [(req_id, -negated) for negated, req_id in exact]


def reference_hole_fill(table: TokenTable, max_src_blocks: int) -> tuple[list[int], list[tuple[int, int, int, int, int]]] | None:
    """The hole-fill rule written out plainly, one request at a time: the last blocks go while
    their live tokens fit in the earlier blocks' holes, the tokens in logical order into the
    first holes, block by block, offsets ascending. Returns the sources (ascending) and the moves."""
    movable = movable_block_ids(table).tolist()
    live = [int(table.pool.live_counts[b]) for b in movable]
    n = len(movable)
    num_src = 0
    while num_src < min(max_src_blocks, n - 1) and sum(live[n - 1 - num_src :]) <= sum(S - c for c in live[: n - 1 - num_src]):
        num_src += 1
    if num_src == 0:
        return None
    sources, kept = movable[n - num_src :], movable[: n - num_src]
    tokens = [t for t in table.live_token_ids().tolist() if int(table.token_block_ids[t]) in sources]
    holes = [(b, o) for b in kept for o in range(S) if table.pool.token_at[b * S + o] < 0][: len(tokens)]
    moves = [(t, int(table.token_block_ids[t]), int(table.token_offsets[t]), b, o) for t, (b, o) in zip(tokens, holes, strict=True)]
    return sorted(sources), moves


@settings(max_examples=150, deadline=None)
@given(requests=st.lists(layouts(), min_size=1, max_size=8), busy=st.sets(st.integers(0, 7), max_size=2),
       max_src_blocks=st.integers(2, 6), budget=st.one_of(st.none(), st.integers(1, 12)), shared=st.booleans())
def test_a_hole_fill_round_plans_every_request_as_the_plain_rule_does_most_reclaimable_first(
        requests, busy, max_src_blocks, budget, shared) -> None:
    """A lazy round plans its requests with plan_hole_fill_each; the plans must be the rule's
    for each request alone, every request with something to give back planned once over the
    round's steps (the state does not change between them here), each step's plans ranked by
    exact reclaimable blocks, ties by req_id, and moving at most the budget unless there is
    one."""
    pool = BlockPool(256, S)
    tables = []
    for req_id, (blocks, tail, _, _) in enumerate(requests):
        owner = tables[0] if tables else None
        if shared and req_id == 1 and owner.num_blocks > 1 and owner.live_mask[:S].all():
            tables.append(make_sharer(owner, blocks, tail, req_id))  # shares request 0's first block
        else:
            tables.append(make_layout(*blocks, tail=tail, pool=pool, req_id=req_id))
    for table in tables[::3]:  # a dead token in the open tail
        if table.tail_num_written and table.live_mask[-1]:
            table.evict_tokens(np.array([table.num_tokens - 1]))
    config = ReclaimConfig(mode="hole-fill", max_src_blocks=max_src_blocks, max_moves_per_step=budget)
    reclaimer = Reclaimer(config, pool)
    steps = [reclaimer.plan(tables, frozenset(busy))]
    while reclaimer.is_round_in_progress:
        steps.append(reclaimer.plan(tables, frozenset(busy)))
    idle = [t for t in tables if t.req_id not in busy]
    reference = {t.req_id: (t.req_id, *plan) for t in idle
                 if t.max_reclaimable_blocks() > 0 and (plan := reference_hole_fill(t, max_src_blocks)) is not None}
    planned = [(p.req_id, p.src_block_ids.tolist(), moves_of(p)) for step in steps for p in step]
    assert sorted(planned) == sorted(reference.values())  # every request planned once, by the rule
    for plans in steps:
        assert [p.req_id for p in plans] == [t.req_id for _, _, t in sorted((-num_reclaimable_blocks(tables[p.req_id]), p.req_id, tables[p.req_id]) for p in plans)]
        if budget is None:
            assert len(steps) == 1
        elif len(plans) > 1:
            assert sum(p.num_tokens_moved for p in plans) <= budget
        for plan in plans:
            assert plan.layout_version == tables[plan.req_id].layout_version
            check_plan(plan, tables[plan.req_id], pool, frozenset())


def plan_every_chosen_then_cut(reclaimer: Reclaimer, tables: list[TokenTable], busy: frozenset[int]) -> list[RelocationPlan]:
    """A lazy round step as a budgeted hole-fill step made it before its planning call took the
    budget: every chosen request planned, then the plans cut (`within_budget`) and the requests
    of those past the cut put back first."""
    budget = reclaimer.config.max_moves_per_step
    if not reclaimer._round_req_ids:
        reclaimer._round_req_ids = reclaimer._round_order(tables, busy)
    chosen = reclaimer._next_of_round(tables, busy, ROUND_PLANNING_SLACK * budget, reclaimer.config.max_src_blocks)
    plans, waiting = within_budget(reclaimer._plans(chosen, busy, None)[0], budget)
    reclaimer._round_req_ids.extend(reversed(waiting))
    return plans


@settings(max_examples=150, deadline=None)
@given(requests=st.lists(layouts(), min_size=1, max_size=8), busy=st.sets(st.integers(0, 7), max_size=2),
       max_src_blocks=st.integers(2, 6), budget=st.integers(1, 12), seed=st.integers(0, 2**16))
def test_a_budgeted_hole_fill_step_launches_what_planning_every_chosen_request_and_cutting_launched(
        requests, busy, max_src_blocks, budget, seed) -> None:
    """The budget applied inside the planning call leaves every step of a round as it was when
    the step planned every request it chose and launched the first plans within the budget: the
    same plans, the same requests left for the next steps, over a round whose plans land and
    whose requests lose tokens between its steps (two copies of one state, one per way)."""
    config = ReclaimConfig(mode="hole-fill", max_src_blocks=max_src_blocks, max_moves_per_step=budget)
    runs = []
    for _ in range(2):
        pool = BlockPool(256, S)
        tables = [make_layout(*blocks, tail=tail, pool=pool, req_id=req_id) for req_id, (blocks, tail, _, _) in enumerate(requests)]
        runs.append((Reclaimer(config, pool), tables, np.random.default_rng(seed)))
    steps: list[list[list]] = [[], []]
    for way, (reclaimer, tables, rng) in enumerate(runs):
        plan = reclaimer.plan if way == 0 else lambda ts, b, r=reclaimer: plan_every_chosen_then_cut(r, ts, b)
        for _ in range(64):
            plans = plan(tables, frozenset(busy))
            steps[way].append([(p.req_id, p.src_block_ids.tolist(), moves_of(p)) for p in plans])
            for p in plans:
                apply(p, tables[p.req_id])
            for table in tables:  # a token of the middle dies now and then, as a policy evicts
                live = table.live_token_ids(0, max(table.num_tokens - S, 0))
                if live.size and rng.random() < 0.5:
                    emptied = table.evict_tokens(live[rng.integers(live.size)].reshape(1))
                    table.release_blocks(emptied)
                    table.pool.free(emptied)
            if not reclaimer.is_round_in_progress:
                break
        steps[way].append(list(reclaimer._round_req_ids))
    assert steps[0] == steps[1]


CORRUPTIONS = ("token", "src-offset", "dst-offset", "dst-block", "drop-move", "add-source", "version", "repeat-request")


@settings(max_examples=200, deadline=None)
@given(requests=st.lists(layouts(), min_size=2, max_size=6), mode=st.sampled_from(["hole-fill", "ordered"]),
       corruption=st.sampled_from(CORRUPTIONS), which=st.integers(0, 5), delta=st.integers(1, 9))
def test_the_round_check_passes_a_planned_round_and_fails_wherever_check_plan_would(requests, mode, corruption, which, delta) -> None:
    """plans_pass against check_plan of each plan in turn (each request busy once launched):
    a planned round passes both; a round with one plan corrupted never passes the round check
    where check_plan finds a violation."""
    pool = BlockPool(256, S)
    tables = [make_layout(*blocks, tail=tail, pool=pool, req_id=req_id) for req_id, (blocks, tail, _, _) in enumerate(requests)]
    plans = Reclaimer(ReclaimConfig(mode=mode), pool).plan(tables)
    by_id = {t.req_id: t for t in tables}
    assert plans_pass(plans, [by_id[p.req_id] for p in plans], pool, frozenset())
    check_round(plans, [by_id[p.req_id] for p in plans], pool, frozenset())
    if not plans:
        return
    k = which % len(plans)
    plans[k] = corrupt(plans[k], corruption, delta, pool, plans)
    try:
        busy = frozenset()
        for plan in plans:
            check_plan(plan, by_id[plan.req_id], pool, busy)
            busy |= {plan.req_id}
    except InvariantError as plan_by_plan:
        assert not plans_pass(plans, [by_id[p.req_id] for p in plans], pool, frozenset())
        with pytest.raises(InvariantError) as round_error:  # check_round raises check_plan's own error
            check_round(plans, [by_id[p.req_id] for p in plans], pool, frozenset())
        assert str(round_error.value) == str(plan_by_plan)
    else:
        check_round(plans, [by_id[p.req_id] for p in plans], pool, frozenset())  # passes where every plan does


@settings(max_examples=60, deadline=None)
@given(requests=st.lists(layouts(), min_size=1, max_size=6), data=st.data())
def test_a_rounds_plans_are_read_end_to_end_as_views_only_when_they_are_its_first_in_order(requests, data) -> None:
    """end_to_end gives every plan's moves and sources with the plan of each, as concatenating
    them does; views of the round's planning pass for its first plans in order (what a round
    launches), the plans' own arrays concatenated for any other choice, or for a plan copied
    with other moves."""
    pool = BlockPool(256, S)
    tables = [make_layout(*blocks, tail=tail, pool=pool, req_id=req_id) for req_id, (blocks, tail, _, _) in enumerate(requests)]
    plans = Reclaimer(ReclaimConfig(mode="hole-fill", max_moves_per_step=None), pool).plan(tables)
    if not plans:
        return
    batch = plans[0].batch
    assert all(plan.batch is batch for plan in plans)

    def concatenated(chosen):
        return ([np.concatenate([getattr(p.moves, name) for p in chosen]) for name in
                 ("token_ids", "src_block_ids", "src_offsets", "dst_block_ids", "dst_offsets")],
                np.concatenate([np.full(p.num_tokens_moved, k) for k, p in enumerate(chosen)]),
                np.concatenate([p.src_block_ids for p in chosen]),
                np.concatenate([np.full(p.src_block_ids.size, k) for k, p in enumerate(chosen)]))

    def read(chosen):
        moves, move_of, sources, source_of = end_to_end(chosen)
        want_moves, want_move_of, want_sources, want_source_of = concatenated(chosen)
        for got, want in zip((moves.token_ids, moves.src_block_ids, moves.src_offsets, moves.dst_block_ids,
                              moves.dst_offsets), want_moves, strict=True):
            assert got.tolist() == want.tolist()
        assert (move_of.tolist(), sources.tolist(), source_of.tolist()) == (
            want_move_of.tolist(), want_sources.tolist(), want_source_of.tolist())
        return starts_at(moves.token_ids, batch.moves.token_ids) and starts_at(sources, batch.sources)

    def starts_at(view, array):  # a view from the array's first entry on (empty or not)
        return view.__array_interface__["data"][0] == array.__array_interface__["data"][0]

    num_first = data.draw(st.integers(1, len(plans)))
    assert read(plans[:num_first])
    if len(plans) > 1:
        assert not read(plans[::-1])
        assert not read(plans[1:])
    if plans[0].num_tokens_moved > 1:
        assert not read([replace(plans[0], moves=plans[0].moves.select(np.arange(1, plans[0].num_tokens_moved)))] + plans[1:])
    assert not read([replace(plans[0], src_block_ids=plans[0].src_block_ids.copy())])


def corrupt(plan: RelocationPlan, corruption: str, delta: int, pool: BlockPool, plans: list[RelocationPlan]) -> RelocationPlan:
    m = plan.moves
    shifted = lambda a: np.concatenate(((a[:1] + delta) % max(int(a.max()) + 2, S), a[1:]))  # noqa: E731
    if corruption == "token":
        m = replace(m, token_ids=shifted(m.token_ids))
    elif corruption == "src-offset":
        m = replace(m, src_offsets=(m.src_offsets + np.eye(1, m.num_moves, 0, dtype=np.int64)[0] * delta) % S)
    elif corruption == "dst-offset":
        m = replace(m, dst_offsets=(m.dst_offsets + np.eye(1, m.num_moves, 0, dtype=np.int64)[0] * delta) % S)
    elif corruption == "dst-block":
        m = replace(m, dst_block_ids=np.concatenate(([delta % pool.num_blocks], m.dst_block_ids[1:])))
    elif corruption == "drop-move":
        m = m.select(np.arange(1, m.num_moves))
    elif corruption == "add-source":
        return replace(plan, src_block_ids=np.unique(np.append(plan.src_block_ids, delta % 24)))
    elif corruption == "version":
        return replace(plan, layout_version=plan.layout_version - delta)
    else:
        return replace(plan, req_id=plans[0].req_id) if plan is not plans[0] else replace(plan, req_id=plans[-1].req_id)
    return replace(plan, moves=m)


def make_sharer(owner: TokenTable, blocks: list[str], tail: str, req_id: int) -> TokenTable:
    """A request on the owner's pinned first block, then its own blocks as in `make_layout`."""
    pool, prefix = owner.pool, owner.held_block_ids[:1].copy()
    owner.pin_prefix(S)
    pool.share(prefix)
    table = TokenTable(req_id, pool)
    table.attach_shared_prefix(prefix, S)
    pattern = "".join(blocks) + tail
    table.sync_new_tokens(pool.allocate(table.num_new_blocks_needed(len(pattern))), S + len(pattern))
    dead = [S + i for i, mark in enumerate(pattern) if mark == "."]
    if dead:
        table.evict_tokens(np.array(dead))
    return table


# ---- under memory pressure ---------------------------------------------------------------


def test_shortfall_counts_the_needed_blocks_and_the_reserve() -> None:
    pool = BlockPool(32, S)
    pool.allocate(26)  # 6 free
    reclaimer = Reclaimer(ReclaimConfig(pressure_reserve_blocks=2), pool)
    assert [reclaimer.num_blocks_short(n) for n in (0, 4, 5, 9)] == [0, 0, 1, 5]
    assert Reclaimer(ReclaimConfig(), BlockPool(1000, S)).num_pressure_reserve_blocks == 10  # 1% of the pool
    assert Reclaimer(ReclaimConfig(), BlockPool(32, S)).num_pressure_reserve_blocks == 1


def test_plan_to_free_stops_at_the_shortfall() -> None:
    pool = BlockPool(32, S)
    a = make_layout("L...", "L...", "LL..", "LLLL", "LLLL", tail="L", pool=pool, req_id=0)
    b = make_layout("L...", "LL..", "LLLL", tail="L", pool=pool, req_id=1)
    reclaimer = Reclaimer(ReclaimConfig(mode="hole-fill"), pool)
    assert sum(p.num_blocks_freed for p in reclaimer.plan([a, b])) == 3  # a gives 2, b gives 1
    (plan,) = reclaimer.plan_to_free([a, b], frozenset(), 1)
    assert (plan.req_id, plan.src_block_ids.tolist(), plan.num_tokens_moved) == (0, [4], 4)
    plans = reclaimer.plan_to_free([a, b], frozenset(), 3)
    assert [(p.req_id, p.num_blocks_freed) for p in plans] == [(0, 2), (1, 1)]
    assert reclaimer.plan_to_free([a, b], frozenset({0}), 1)[0].req_id == 1


def test_bad_pressure_reserve_raises() -> None:
    with pytest.raises(ConfigError, match="pressure reserve must be >= 0 blocks, got -1"):
        ReclaimConfig(pressure_reserve_blocks=-1)


@settings(max_examples=200, deadline=None)
@given(st.sampled_from([S, 12, 16, 32]), st.data())
def test_uncompacted_blocks_are_the_logical_blocks_with_a_live_token_and_the_one_being_written(
        block_size: int, data: st.DataObject) -> None:
    # block sizes of 8, 16, 32 and 64 count each block's live bits as one packed word; others by rows
    live = data.draw(st.lists(st.booleans(), min_size=0, max_size=6 * block_size))
    pool = BlockPool(32, block_size)
    table = TokenTable(0, pool)
    table.sync_new_tokens(pool.allocate(table.num_new_blocks_needed(len(live))), len(live))
    dead = [i for i, is_live in enumerate(live) if not is_live]
    if dead:
        table.evict_tokens(np.array(dead))
    logical = {i // block_size for i, is_live in enumerate(live) if is_live} | ({(len(live) - 1) // block_size} if live else set())
    assert table.num_uncompacted_blocks() == len(logical)


@settings(max_examples=150, deadline=None)
@given(st.sampled_from([S, 16]), st.data())
def test_a_batch_eviction_lowers_the_uncompacted_floor_by_the_logical_blocks_it_empties(
        block_size: int, data: st.DataObject) -> None:
    """The layout trigger counts the uncompacted blocks only when its bound says it must: from
    an exact count, a batch eviction (in any order) lowers the bound of a table with a token off
    its uncompacted position by exactly the logical blocks before the one being written that it
    left without a live token, so the bound stays the count; a table whose tokens all sit where
    that layout puts them, which the trigger does not count, by the number of tokens."""
    num_tokens = data.draw(st.integers(1, 6 * block_size))
    pool = BlockPool(32, block_size)
    table = TokenTable(0, pool)
    table.sync_new_tokens(pool.allocate(table.num_new_blocks_needed(num_tokens)), num_tokens)
    first = data.draw(st.lists(st.integers(0, num_tokens - 1), unique=True, max_size=num_tokens))
    if first:
        table.evict_tokens(np.array(first))
    off_layout = data.draw(st.booleans())
    table._off_logical_layout = off_layout  # as a move, an adopted block or a cursor set back leaves it
    table._uncompacted_floor = num_counted = table.num_uncompacted_blocks()  # the count, as the trigger leaves it
    alive = table.live_token_ids().tolist()
    victims = data.draw(st.lists(st.sampled_from(alive), unique=True, min_size=2) if len(alive) > 1 else st.just([]))
    if victims:
        table.evict_tokens(np.array(victims))
    assert table._uncompacted_floor == (table.num_uncompacted_blocks() if off_layout else num_counted - len(victims))


def test_a_dropped_open_tail_leaves_tokens_off_their_uncompacted_positions() -> None:
    """No token is moved, but an eviction that empties the open tail hands the cursor back to
    the block before it: the next tokens open a fresh block at token 5, not at 8, so a block can
    keep a live token (8) where the uncompacted layout's block (4..7) died whole."""
    pool = BlockPool(8, S)
    table = TokenTable(0, pool)
    table.sync_new_tokens(pool.allocate(2), 5)  # [0 1 2 3] [4 . . .]
    emptied = table.evict_tokens(np.array([4]))  # the open tail empties and goes
    table.release_blocks(emptied)
    pool.free(emptied)
    for num_tokens in range(6, 17):  # [0 1 2 3] [5 6 7 8] [9 10 11 12] [13 14 15 .]
        table.sync_new_tokens(pool.allocate(table.num_new_blocks_needed(1)), num_tokens)
    table.evict_tokens(np.array([5, 6, 7]))  # logical block 4..7 is dead; [x x x 8] is not
    assert (table.num_blocks, table.num_uncompacted_blocks()) == (4, 3)
    assert table.num_blocks_over_uncompacted() == 1


def test_a_budget_that_follows_the_step_is_its_share_of_that_step() -> None:
    """StepShare: moves_per_ms tokens for every millisecond of the step before, two blocks'
    worth at least, in plans of at most 1.25x that many source slots (B' blocks, between 2 and
    the configured B); the configured budget and B otherwise; a StepShare without the step's
    duration is a caller's error."""
    pool = BlockPool(64, 16)
    reclaimer = Reclaimer(ReclaimConfig(max_moves_per_step=StepShare()), pool)
    assert reclaimer.step_budget(0.0336) == (336, 26)  # 64 x 8K's modelled step, at 10 a millisecond: 420 slots
    assert reclaimer.step_budget(0.2) == (2000, 64)  # 156 blocks, past B = 64
    assert reclaimer.step_budget(0.001) == (32, 2)  # 10 moves, below two blocks of 16
    assert Reclaimer(ReclaimConfig(max_moves_per_step=StepShare(2.5)), pool).step_budget(0.1) == (250, 19)
    assert Reclaimer(ReclaimConfig(max_moves_per_step=100, max_src_blocks=8), pool).step_budget(0.5) == (100, 8)
    assert Reclaimer(ReclaimConfig(max_moves_per_step=None), pool).step_budget(0.5) == (None, 64)
    with pytest.raises(ValueError, match="needs the step's duration"):
        reclaimer.plan([])
    with pytest.raises(ConfigError, match="tokens moved per millisecond of the step, got 0"):
        StepShare(0.0)


def test_a_round_under_a_budget_that_follows_the_step_plans_what_that_steps_fixed_budget_plans() -> None:
    """Step by step, as the step's duration changes, a StepShare round (B' = B = 2 here, so no
    plan is cut short) makes the plans of a round whose fixed budget is that step's number, the
    plans landing between steps, and leaves the same requests, in the same order."""
    rng = np.random.default_rng(11)
    layouts = [["".join("L" if rng.random() < 0.4 else "." for _ in range(S)) for _ in range(int(rng.integers(2, 9)))]
               for _ in range(24)]
    layouts = [[b if "L" in b else "L" + b[1:] for b in blocks] for blocks in layouts]
    share = StepShare(moves_per_ms=1.0)  # S = 4: two blocks' worth is 8 moves
    step_durations = [0.012, 0.002, 0.03, 0.009, 0.0, 0.02, 0.05, 0.015, 0.008, 0.1] * 3
    rounds = {}
    for name, budget in (("following", share), ("fixed", 1)):
        pool = BlockPool(400, S)
        tables = [make_layout(*blocks, tail="L", pool=pool, req_id=req_id) for req_id, blocks in enumerate(layouts)]
        reclaimer = Reclaimer(ReclaimConfig(mode="hole-fill", max_src_blocks=2, max_moves_per_step=budget), pool)
        steps = []
        for step_s in step_durations:
            if name == "fixed":
                reclaimer.config = replace(reclaimer.config, max_moves_per_step=share.num_moves(step_s, S))
            plans = reclaimer.plan(tables, step_s=step_s)
            steps.append(([moves_of(p) for p in plans], list(reclaimer._round_req_ids)))
            for plan in plans:
                complete(plan, tables[plan.req_id])
            if not reclaimer.is_round_in_progress:
                break
        rounds[name] = steps
    assert rounds["following"] == rounds["fixed"]
    assert len(rounds["fixed"]) > 4 and all(plans for plans, _ in rounds["fixed"])
    budgets = [share.num_moves(step_s, S) for step_s in step_durations[:len(rounds["fixed"])]]
    assert len(set(budgets)) > 3 and 8 in budgets  # the floor, and budgets that differ, were met


def test_a_plan_the_steps_b_cut_short_goes_on_at_the_next_step_within_the_rounds_b() -> None:
    """StepShare, B = 6: a budget of 8 moves gives B' = 2, so a plan takes 2 source blocks, and
    its request comes first at the next step, planned alone, until it has given 6."""
    pool = BlockPool(64, S)
    a = make_layout(*["L..."] * 12, tail="L", pool=pool, req_id=0)  # bound 9: at most 9 blocks freed
    b = make_layout(*["L..."] * 8, tail="L", pool=pool, req_id=1)  # bound 6
    tables = [a, b]
    reclaimer = Reclaimer(ReclaimConfig(mode="hole-fill", max_src_blocks=6, max_moves_per_step=StepShare(1.0)), pool)
    assert reclaimer.step_budget(0.008) == (8, 2)
    steps = []
    while True:
        plans = reclaimer.plan(tables, step_s=0.008)
        steps.append([(p.req_id, p.src_block_ids.size) for p in plans])
        for plan in plans:
            complete(plan, tables[plan.req_id])
        if not reclaimer.is_round_in_progress:
            break
    # the first step plans both (their bounds at B' = 2, 8 moves each, fill two budgets) and
    # launches both (2 moves each: a source here holds one live token); B' cuts both plans, so
    # both go on, a first, each planned alone until it gave 6 = B blocks (without going on: one
    # step, 2 each)
    assert steps == [[(0, 2), (1, 2)], [(0, 2)], [(0, 2)], [(1, 2)], [(1, 2)]]
    assert len(a.held_block_ids) == 13 - 6 and len(b.held_block_ids) == 9 - 6


@settings(max_examples=150, deadline=None)
@given(requests=st.lists(layouts(), min_size=1, max_size=6), max_src_blocks=st.integers(2, 8),
       mode=st.sampled_from(["hole-fill", "ordered"]), copy_steps=st.integers(1, 2), seed=st.integers(0, 2**16))
def test_a_round_that_follows_the_step_keeps_its_bounds_and_goes_on_with_the_requests_it_cut(
        requests, max_src_blocks, mode, copy_steps, seed) -> None:
    """StepShare rounds over steps of drawn durations, plans landing `copy_steps` steps after
    their launch (a request with a copy in flight is busy), tokens evicted between steps: every
    plan passes the I4 check when it is made; a plan takes at most the step's B' sources; a
    step moves at most max(budget, B' x S); a round takes at most B blocks from a request; and a
    request whose plan took all the step let it take, with less than B given, comes first in
    the round, and is planned alone once it is idle with something to give back."""
    rng = np.random.default_rng(seed)
    pool = BlockPool(256, S)
    tables = [make_layout(*blocks, tail=tail, pool=pool, req_id=req_id) for req_id, (blocks, tail, _, _) in enumerate(requests)]
    share = StepShare(moves_per_ms=0.5)  # S = 4: 8 moves (B' = 2) up to 16 ms, then 0.5 a ms more
    reclaimer = Reclaimer(ReclaimConfig(mode=mode, max_src_blocks=max_src_blocks, max_moves_per_step=share,
                                        headroom_blocks=0), pool)
    in_flight: list[tuple[int, RelocationPlan]] = []  # (the step it lands at, plan)
    taken: dict[int, int] = {}  # the round's source blocks per request
    going_on: set[int] = set()  # requests a cut plan left to go on
    for step_idx in range(40):
        for plan in [plan for due, plan in in_flight if due == step_idx]:
            complete(plan, tables[plan.req_id])
        in_flight = [(due, plan) for due, plan in in_flight if due > step_idx]
        busy = frozenset(plan.req_id for _, plan in in_flight)
        starts_round = not reclaimer.is_round_in_progress
        if starts_round:
            taken.clear()
            going_on.clear()
        step_s = float(rng.uniform(0.001, 0.06))
        budget, b_prime = reclaimer.step_budget(step_s)
        round_req_ids = reclaimer._round_req_ids
        top = round_req_ids[-1] if round_req_ids else None  # the round's next request
        goes_on_now = top in going_on and top not in busy and tables[top].max_reclaimable_blocks() > 0
        plans = reclaimer.plan(tables, busy, step_s)
        if goes_on_now:  # a request a cut plan left, idle: planned alone (or it had nothing to plan)
            assert [p.req_id for p in plans] in ([], [top])
        if top in going_on and top in busy:  # its copy still in flight: it waits in the round
            assert top in reclaimer._round_req_ids
        assert sum(p.num_tokens_moved for p in plans) <= max(budget, b_prime * S) or len(plans) == 1
        cut = []
        for plan in plans:
            cap = min(b_prime, max_src_blocks - taken[plan.req_id]) if plan.req_id in going_on else b_prime
            assert plan.src_block_ids.size <= cap
            check_plan(plan, tables[plan.req_id], pool, busy)
            launch(plan, tables[plan.req_id])
            in_flight.append((step_idx + copy_steps, plan))
            taken[plan.req_id] = taken.get(plan.req_id, 0) + plan.src_block_ids.size
            assert taken[plan.req_id] <= max_src_blocks
            going_on.discard(plan.req_id)
            if b_prime < max_src_blocks and plan.src_block_ids.size == cap and taken[plan.req_id] < max_src_blocks:
                going_on.add(plan.req_id)
                cut.append(plan.req_id)
        if cut:  # they come first at the next step, in the order they were planned
            assert reclaimer._round_req_ids[-len(cut):] == cut[::-1]
        in_flight_now = {plan.req_id for _, plan in in_flight}
        for table in tables:  # one token of some idle requests dies between two steps
            live = table.live_token_ids()
            if table.req_id not in in_flight_now and live.size > 2 and rng.random() < 0.5:
                emptied = table.evict_tokens(np.array([int(rng.choice(live[:-1]))]))
                table.release_blocks(emptied)
                pool.free(emptied)
