"""BlockPool: free-list order, ref counts with sharing, live counts, and the incremental metrics
(F, utilization histogram, fraction of blocks at most half full) against a brute-force recount."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vtoken.errors import ConfigError, VTokenError
from vtoken.kv.block_pool import NUM_HISTOGRAM_BINS, BlockPool


def make_pool(num_blocks: int = 8, block_size: int = 4) -> BlockPool:
    return BlockPool(num_blocks, block_size)


def snapshot(pool: BlockPool) -> tuple:
    return (
        pool.ref_counts.copy(),
        pool.live_counts.copy(),
        pool.peek_free(pool.num_free_blocks).tolist(),
        pool.num_live_tokens,
        pool.utilization_histogram().tolist(),
        pool.num_blocks_le_half,
    )


def assert_same(before: tuple, after: tuple) -> None:
    for a, b in zip(before, after, strict=True):
        np.testing.assert_array_equal(a, b)


def brute_force_metrics(pool: BlockPool) -> tuple[float, list[int], float]:
    """F, histogram and frac <= half recomputed from scratch from ref_counts / live_counts."""
    allocated = pool.ref_counts > 0
    live = pool.live_counts[allocated].astype(np.int64)
    if live.size == 0:
        return 0.0, [0] * NUM_HISTOGRAM_BINS, 0.0
    waste = 1.0 - live.sum() / (live.size * pool.block_size)
    utilization = live / pool.block_size
    bins = np.minimum(np.floor(utilization * NUM_HISTOGRAM_BINS + 1e-9).astype(int), NUM_HISTOGRAM_BINS - 1)
    histogram = np.bincount(bins, minlength=NUM_HISTOGRAM_BINS).tolist()
    frac_le_half = float(np.mean(utilization <= 0.5))
    return float(waste), histogram, frac_le_half


def assert_metrics_match(pool: BlockPool) -> None:
    waste, histogram, frac_le_half = brute_force_metrics(pool)
    assert pool.waste_ratio() == pytest.approx(waste)
    assert pool.utilization_histogram().tolist() == histogram
    assert pool.frac_blocks_le_half() == pytest.approx(frac_le_half)
    assert pool.num_live_tokens == int(pool.live_counts.sum())
    assert pool.num_allocated_blocks == int(np.count_nonzero(pool.ref_counts))


# ---- construction ------------------------------------------------------------------------


@pytest.mark.parametrize(("num_blocks", "block_size", "message"), [
    (0, 16, "num_blocks must be > 0, got 0"),
    (-3, 16, "num_blocks must be > 0, got -3"),
    (8, 0, "block_size must be > 0, got 0"),
    (8, -1, "block_size must be > 0, got -1"),
])
def test_bad_construction_raises_config_error(num_blocks: int, block_size: int, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        BlockPool(num_blocks, block_size)


def test_fresh_pool_is_all_free_with_zero_metrics() -> None:
    pool = make_pool()
    assert pool.num_free_blocks == 8
    assert pool.num_allocated_blocks == 0
    assert pool.waste_ratio() == 0.0
    assert pool.frac_blocks_le_half() == 0.0
    assert pool.utilization_histogram().tolist() == [0] * 10


# ---- allocation order --------------------------------------------------------------------


def test_a_scratch_array_is_pool_sized_and_handed_out_again_by_name() -> None:
    pool = BlockPool(24, 4)
    labels = pool.scratch("labels", np.int64)
    labels[:] = 7
    assert labels.shape == (24,) and labels.dtype == np.int64
    assert pool.scratch("labels", np.int64) is labels and (labels == 7).all()  # what the last caller left
    flags = pool.scratch("flags", bool)
    assert flags is not labels and flags.dtype == bool
    assert BlockPool(24, 4).scratch("labels", np.int64) is not labels  # one set per pool


def test_fresh_pool_allocates_in_id_order() -> None:
    pool = make_pool()
    assert pool.allocate(3).tolist() == [0, 1, 2]
    assert pool.allocate(2).tolist() == [3, 4]
    assert pool.allocate(0).tolist() == []
    assert pool.num_free_blocks == 3
    assert pool.ref_counts.tolist() == [1, 1, 1, 1, 1, 0, 0, 0]


def test_peek_free_names_exactly_what_allocate_returns() -> None:
    pool = make_pool()
    pool.allocate(4)
    pool.free(np.array([3, 1]))
    peeked = pool.peek_free(3)
    assert peeked.tolist() == [1, 3, 4]
    assert pool.num_free_blocks == 6  # peek takes nothing
    assert pool.allocate(3).tolist() == peeked.tolist()
    assert pool.peek_free(0).tolist() == []


def test_freed_batch_comes_back_lowest_id_first_before_older_free_blocks() -> None:
    pool = make_pool()
    pool.allocate(6)
    pool.free(np.array([4, 0, 2]))
    assert pool.allocate(4).tolist() == [0, 2, 4, 6]


def test_allocate_and_peek_beyond_free_raise_and_change_nothing() -> None:
    pool = make_pool(num_blocks=4)
    pool.allocate(3)
    before = snapshot(pool)
    with pytest.raises(VTokenError, match="cannot peek 2 blocks, 1 free"):
        pool.allocate(2)
    with pytest.raises(VTokenError, match="cannot peek 5 blocks"):
        pool.peek_free(5)
    assert_same(before, snapshot(pool))
    assert pool.can_allocate(1)
    assert not pool.can_allocate(2)


def test_negative_allocation_raises_and_changes_nothing() -> None:
    pool = make_pool()
    pool.allocate(2)
    before = snapshot(pool)
    with pytest.raises(VTokenError, match="-1"):
        pool.allocate(-1)
    with pytest.raises(VTokenError, match="-2"):
        pool.peek_free(-2)
    assert_same(before, snapshot(pool))


# ---- ref counts, sharing, free -----------------------------------------------------------


def test_share_adds_a_reference_and_free_drops_one() -> None:
    pool = make_pool()
    block_ids = pool.allocate(3)  # 0, 1, 2
    pool.share(np.array([0, 1]))
    assert pool.ref_counts[:3].tolist() == [2, 2, 1]
    assert pool.is_shared(np.array([0, 1, 2])).tolist() == [True, True, False]
    pool.free(block_ids)
    assert pool.ref_counts[:3].tolist() == [1, 1, 0]
    assert pool.num_free_blocks == 6
    assert pool.peek_free(1).tolist() == [2]
    pool.free(np.array([0, 1]))
    assert pool.num_free_blocks == 8
    assert pool.ref_counts.tolist() == [0] * 8


def test_share_of_a_free_block_raises_and_changes_nothing() -> None:
    pool = make_pool()
    pool.allocate(2)
    before = snapshot(pool)
    with pytest.raises(VTokenError, match=r"cannot share free blocks \[5\]"):
        pool.share(np.array([1, 5]))
    assert_same(before, snapshot(pool))


def test_share_of_repeated_ids_raises_and_changes_nothing() -> None:
    pool = make_pool()
    pool.allocate(2)
    before = snapshot(pool)
    with pytest.raises(VTokenError, match="share.. got repeated block ids"):
        pool.share(np.array([1, 1]))
    assert_same(before, snapshot(pool))


def test_double_free_raises_and_changes_nothing() -> None:
    pool = make_pool()
    pool.allocate(3)
    pool.free(np.array([1]))
    before = snapshot(pool)
    with pytest.raises(VTokenError, match=r"double free of blocks \[1\]"):
        pool.free(np.array([0, 1]))
    assert_same(before, snapshot(pool))
    assert pool.ref_counts[0] == 1  # block 0 was not freed by the failed call


def test_free_of_repeated_ids_raises_and_changes_nothing() -> None:
    pool = make_pool()
    pool.allocate(3)
    before = snapshot(pool)
    with pytest.raises(VTokenError, match="repeated block ids"):
        pool.free(np.array([2, 2]))
    assert_same(before, snapshot(pool))


@pytest.mark.parametrize("bad_ids", [[-1], [8], [0, 99]])
def test_out_of_range_ids_raise_vtoken_error_and_change_nothing(bad_ids: list[int]) -> None:
    pool = make_pool()
    pool.allocate(8)
    before = snapshot(pool)
    for verb in (pool.free, pool.share):
        with pytest.raises(VTokenError, match="out of range"):
            verb(np.array(bad_ids))
    with pytest.raises(VTokenError, match="out of range"):
        pool.adjust_live(np.array(bad_ids), np.ones(len(bad_ids), dtype=np.int64))
    assert_same(before, snapshot(pool))


def test_free_of_empty_array_is_a_no_op() -> None:
    pool = make_pool()
    pool.allocate(1)
    before = snapshot(pool)
    pool.free(np.zeros(0, dtype=np.int64))
    assert_same(before, snapshot(pool))


def test_freeing_a_block_forgets_its_live_tokens() -> None:
    pool = make_pool()
    pool.allocate(2)
    pool.adjust_live(np.array([0, 1]), np.array([3, 4]))
    pool.free(np.array([0]))
    assert pool.live_counts[:2].tolist() == [0, 4]
    assert pool.num_live_tokens == 4
    assert_metrics_match(pool)


def test_free_of_a_shared_block_keeps_its_live_tokens() -> None:
    pool = make_pool()
    pool.allocate(1)
    pool.adjust_live(np.array([0]), np.array([4]))
    pool.share(np.array([0]))
    pool.free(np.array([0]))
    assert pool.live_counts[0] == 4
    assert pool.num_live_tokens == 4


# ---- live counts -------------------------------------------------------------------------


def test_adjust_live_bounds_raise_and_change_nothing() -> None:
    pool = make_pool(block_size=4)
    pool.allocate(2)
    pool.adjust_live(np.array([0, 1]), np.array([4, 1]))
    before = snapshot(pool)
    with pytest.raises(VTokenError, match=r"live count of blocks \[0\] would leave \[0, 4\]"):
        pool.adjust_live(np.array([0, 1]), np.array([1, 1]))
    with pytest.raises(VTokenError, match=r"live count of blocks \[1\] would leave \[0, 4\]"):
        pool.adjust_live(np.array([1]), np.array([-2]))
    with pytest.raises(VTokenError, match=r"live-count change on free blocks \[5\]"):
        pool.adjust_live(np.array([5]), np.array([1]))
    assert_same(before, snapshot(pool))
    pool.adjust_live(np.array([0, 1]), np.array([-4, 3]))  # both ends of [0, S] are allowed
    assert pool.live_counts[:2].tolist() == [0, 4]


def test_add_live_is_adjust_live_for_one_block() -> None:
    scalar, vector = make_pool(), make_pool()
    for pool in (scalar, vector):
        pool.allocate(3)
    for block_id, delta in ((0, 4), (1, 2), (0, -1), (2, 1), (1, -2)):
        scalar.add_live(block_id, delta)
        vector.adjust_live(np.array([block_id]), np.array([delta]))
        assert_same(snapshot(scalar), snapshot(vector))
    before = snapshot(scalar)
    for block_id, delta, message in ((0, 2, r"live count of blocks \[0\] would leave \[0, 4\]"),
                                     (1, -1, r"live count of blocks \[1\] would leave"),
                                     (5, 1, r"live-count change on free blocks \[5\]"),
                                     (-1, 1, "out of range")):
        with pytest.raises(VTokenError, match=message):
            scalar.add_live(block_id, delta)
    assert_same(before, snapshot(scalar))


@settings(max_examples=60, deadline=None)
@given(num_lost=st.lists(st.integers(0, 4), min_size=40, max_size=40), seed=st.integers(0, 2**16))
def test_one_token_less_in_each_block_named_is_remove_live_token_of_each_and_names_the_emptied_blocks(num_lost: list[int],
                                                                                                      seed: int) -> None:
    """`adjust_live` with one delta for every block named (-1: a token lost, as the
    substrate's batch evictions count them): block b loses num_lost[b] of its live tokens, in
    any order (the compiled loop of kv/compiled.py against the scalar verb)."""
    batch, each = BlockPool(40, 4), BlockPool(40, 4)
    block_ids = np.random.default_rng(seed).permutation(np.repeat(np.arange(40), num_lost))
    live = np.random.default_rng(seed + 1).integers(np.array(num_lost), 5)  # at least what each block loses
    for pool in (batch, each):
        pool.allocate(40)
        pool.adjust_live(np.arange(40), live)
    emptied = batch.adjust_live(block_ids, np.array([-1], dtype=np.int64))
    for block_id in block_ids.tolist():
        each.remove_live_token(block_id)
    assert_same(snapshot(each), snapshot(batch))
    assert emptied.tolist() == np.flatnonzero((each.live_counts == 0) & (np.array(num_lost) > 0)).tolist()  # emptied now



@pytest.mark.parametrize("block_ids, message", [
    ([3, 40], r"out of range \[0, 40\): \[40\]"),
    ([3, -1], r"out of range \[0, 40\): \[-1\]"),
    ([3, 5, 5, 5], r"live count of blocks \[5\] would leave \[0, 4\]"),  # block 5 holds 2
])
def test_one_token_less_refuses_what_no_table_holds_and_changes_nothing(block_ids, message) -> None:
    pool = BlockPool(40, 4)
    pool.allocate(40)
    pool.adjust_live(np.arange(40), np.full(40, 2))
    before = snapshot(pool)
    with pytest.raises(VTokenError, match=message):
        pool.adjust_live(np.array(block_ids, dtype=np.int64), np.array([-1], dtype=np.int64))
    assert_same(before, snapshot(pool))

# ---- metrics -----------------------------------------------------------------------------


def test_metrics_after_a_scripted_sequence_match_hand_computation_and_brute_force() -> None:
    pool = BlockPool(num_blocks=10, block_size=10)
    pool.allocate(5)  # 0..4
    pool.adjust_live(np.array([0, 1, 2, 3, 4]), np.array([10, 5, 1, 9, 0]))
    pool.share(np.array([0]))
    pool.free(np.array([0]))  # still referenced once
    pool.free(np.array([2]))  # gone with its 1 live token
    pool.adjust_live(np.array([3, 4]), np.array([-3, 6]))
    # allocated: 0 (10 live), 1 (5), 3 (6), 4 (6) -> 27 live in 4 blocks of 10
    assert pool.num_allocated_blocks == 4
    assert pool.waste_ratio() == pytest.approx(1 - 27 / 40)
    assert pool.utilization_histogram().tolist() == [0, 0, 0, 0, 0, 1, 2, 0, 0, 1]
    assert pool.frac_blocks_le_half() == pytest.approx(1 / 4)
    assert_metrics_match(pool)


def test_histogram_puts_a_full_block_in_the_last_bin_and_an_empty_one_in_the_first() -> None:
    pool = BlockPool(num_blocks=4, block_size=16)
    pool.allocate(3)
    pool.adjust_live(np.array([0, 1]), np.array([16, 8]))
    assert pool.utilization_histogram().tolist() == [1, 0, 0, 0, 0, 1, 0, 0, 0, 1]
    assert pool.frac_blocks_le_half() == pytest.approx(2 / 3)  # the empty block and the half one
    assert pool.waste_ratio() == pytest.approx(1 - 24 / 48)


@st.composite
def pool_scripts(draw):
    block_size = draw(st.sampled_from([1, 3, 4, 16]))
    num_blocks = draw(st.integers(1, 12))
    ops = draw(st.lists(st.tuples(st.sampled_from(["allocate", "free", "share", "live"]), st.integers(0, 2**16)), max_size=40))
    return num_blocks, block_size, ops


@settings(max_examples=200, deadline=None)
@given(script=pool_scripts())
def test_incremental_metrics_equal_brute_force_after_any_sequence(script) -> None:
    num_blocks, block_size, ops = script
    pool = BlockPool(num_blocks, block_size)
    rng = np.random.default_rng(0)
    for op, seed in ops:
        rng = np.random.default_rng(seed)
        allocated = np.flatnonzero(pool.ref_counts > 0)
        if op == "allocate":
            pool.allocate(int(rng.integers(0, pool.num_free_blocks + 1)))
        elif op == "free" and allocated.size:
            pool.free(rng.choice(allocated, size=int(rng.integers(1, allocated.size + 1)), replace=False))
        elif op == "share" and allocated.size:
            pool.share(rng.choice(allocated, size=1))
        elif op == "live" and allocated.size:
            block_ids = rng.choice(allocated, size=int(rng.integers(1, allocated.size + 1)), replace=False)
            current = pool.live_counts[block_ids]
            targets = rng.integers(0, block_size + 1, size=block_ids.size)
            pool.adjust_live(block_ids, targets - current)
        assert_metrics_match(pool)
        assert pool.num_free_blocks + pool.num_allocated_blocks == num_blocks


@pytest.mark.parametrize("num_fitting", [0, 2])  # the scalar path (one pending append) and the array path
def test_a_refused_flush_of_pending_appends_changes_nothing(num_fitting: int) -> None:
    block_size = 4
    pool = BlockPool(4, block_size)
    block_id = int(pool.allocate(1)[0])
    for offset in range(num_fitting):
        pool.pending_slots.append(block_id * block_size + offset)
        pool.pending_token_ids.append(offset)
        pool.num_live_tokens += 1
    pool.pending_slots.append(3 * block_size)  # block 3 is free: no table appends there
    pool.pending_token_ids.append(9)
    with pytest.raises(VTokenError, match="do not fit block 3"):
        pool.flush_deferred()
    assert (pool._token_at == -1).all() and not pool._live_counts.any()
    assert len(pool.pending_slots) == len(pool.pending_token_ids) == num_fitting + 1
