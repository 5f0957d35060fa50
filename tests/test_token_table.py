"""TokenTable: placement across block boundaries, the slot cache, eviction, relocation
(apply_moves, eviction while a copy is in flight), releasing blocks and the tail cursor, shared prefixes.

Blocks hold S = 4 tokens so that every layout can be checked by hand."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vtoken.errors import VTokenError
from vtoken.kv.block_pool import BlockPool
from vtoken.kv.moves import Moves
from vtoken.kv.token_table import TokenTable

S = 4


def make_pool(num_blocks: int = 16) -> BlockPool:
    return BlockPool(num_blocks, S)


def grow(table: TokenTable, num_new_tokens: int) -> list[int]:
    """The runtime's growth step: allocate what overflows the tail, then sync."""
    block_ids = table.pool.allocate(table.num_new_blocks_needed(num_new_tokens))
    table.sync_new_tokens(block_ids, table.num_tokens + num_new_tokens)
    return block_ids.tolist()


def make_table(pool: BlockPool, num_tokens: int, req_id: int = 0) -> TokenTable:
    table = TokenTable(req_id, pool)
    grow(table, num_tokens)
    return table


def evict(table: TokenTable, token_ids: list[int]) -> list[int]:
    """The runtime's eviction step: evict, then release and free what came empty."""
    emptied = table.evict_tokens(np.array(token_ids, dtype=np.int64))
    table.release_blocks(emptied)
    table.pool.free(emptied)
    return emptied.tolist()


def make_moves(rows: list[tuple[int, int, int, int, int]]) -> Moves:
    """rows of (token_id, src_block, src_offset, dst_block, dst_offset)."""
    columns = np.array(rows, dtype=np.int64).reshape(-1, 5).T
    return Moves(*(column.copy() for column in columns))


def state(table: TokenTable) -> tuple:
    pool = table.pool
    return (
        table.token_block_ids.copy(), table.token_offsets.copy(), table.live_mask.copy(), table.slots().copy(),
        list(table.held_block_ids), table.tail_num_written, table.num_live_tokens, table.num_tokens,
        table.num_pinned_tokens, pool.ref_counts.copy(), pool.live_counts.copy(), pool.num_free_blocks,
        pool.num_live_tokens, pool.utilization_histogram(),
    )


def assert_unchanged(before: tuple, table: TokenTable) -> None:
    for a, b in zip(before, state(table), strict=True):
        np.testing.assert_array_equal(a, b)


def brute_force_slots(table: TokenTable) -> list[int]:
    return [int(table.token_block_ids[t]) * S + int(table.token_offsets[t]) for t in range(table.num_tokens) if table.live_mask[t]]


# ---- growth ------------------------------------------------------------------------------


def test_sync_places_tokens_across_block_boundaries() -> None:
    pool = make_pool()
    t0 = TokenTable(0, pool)
    assert grow(t0, 6) == [0, 1]
    assert t0.token_block_ids.tolist() == [0, 0, 0, 0, 1, 1]
    assert t0.token_offsets.tolist() == [0, 1, 2, 3, 0, 1]
    assert t0.slots().tolist() == [0, 1, 2, 3, 4, 5]
    assert t0.tail_num_written == 2
    t1 = make_table(pool, 3, req_id=1)
    assert t1.held_block_ids.tolist() == [2]
    assert t1.slots().tolist() == [8, 9, 10]
    assert grow(t0, 5) == [3]
    assert t0.token_block_ids.tolist() == [0, 0, 0, 0, 1, 1, 1, 1, 3, 3, 3]
    assert t0.token_offsets.tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2]
    assert t0.slots().tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 12, 13, 14]
    assert t0.held_block_ids.tolist() == [0, 1, 3]
    assert (t0.tail_num_written, t0.num_free_tail_slots()) == (3, 1)
    assert pool.live_counts[:4].tolist() == [4, 4, 3, 3]
    assert (t0.num_tokens, t0.num_live_tokens, pool.num_live_tokens) == (11, 11, 14)


def test_one_token_at_a_time_fills_the_tail_before_opening_a_block() -> None:
    pool = make_pool()
    table = TokenTable(0, pool)
    new_blocks = [grow(table, 1) for _ in range(9)]
    assert new_blocks == [[0], [], [], [], [1], [], [], [], [2]]
    assert table.slots().tolist() == list(range(9))
    assert table.live_token_ids().tolist() == list(range(9))


@pytest.mark.parametrize(("num_prompt_tokens", "num_new_tokens", "num_blocks"), [
    (0, 0, 0), (0, 1, 1), (0, 4, 1), (0, 5, 2), (0, 9, 3),
    (6, 0, 0), (6, 2, 0), (6, 3, 1), (6, 6, 1), (6, 7, 2),
    (8, 1, 1),  # a full tail has no room
])
def test_num_new_blocks_needed(num_prompt_tokens: int, num_new_tokens: int, num_blocks: int) -> None:
    table = make_table(make_pool(), num_prompt_tokens)
    assert table.num_new_blocks_needed(num_new_tokens) == num_blocks


def test_sync_with_the_wrong_number_of_blocks_or_a_shrinking_length_raises_and_changes_nothing() -> None:
    pool = make_pool()
    table = make_table(pool, 6)
    before = state(table)
    with pytest.raises(VTokenError, match="3 new tokens need 1 new blocks, got 0"):
        table.sync_new_tokens(np.zeros(0, dtype=np.int64), 9)
    with pytest.raises(VTokenError, match="1 new tokens need 0 new blocks, got 1"):
        table.sync_new_tokens(np.array([7]), 7)
    with pytest.raises(VTokenError, match="length went back from 6 to 5"):
        table.sync_new_tokens(np.zeros(0, dtype=np.int64), 5)
    with pytest.raises(VTokenError, match="block 9 is not a freshly allocated block"):
        table.sync_new_tokens(np.array([9]), 9)  # never allocated
    with pytest.raises(VTokenError, match="block 0 is not a freshly allocated block"):
        table.sync_new_tokens(np.array([0]), 9)  # its own first block
    assert_unchanged(before, table)


def test_a_block_that_is_not_fresh_is_refused_and_nothing_changes() -> None:
    pool = make_pool()
    table, other = make_table(pool, 8), make_table(pool, 2, req_id=1)  # blocks 0, 1 and 2
    before = state(table)
    for block_id in (5, 1):  # never allocated; its own (full) tail
        with pytest.raises(VTokenError, match=f"block {block_id} is not a freshly allocated block"):
            table.sync_new_tokens(np.array([block_id]), 9)  # a decode step: O(1) checks
    with pytest.raises(VTokenError, match="block 2 is not a freshly allocated block"):
        table.sync_new_tokens(np.array([2, 3]), 13)  # another request's: the general path sees its live tokens
    assert_unchanged(before, table)
    assert other.num_tokens == 2


def test_sync_of_no_new_tokens_changes_nothing() -> None:
    table = make_table(make_pool(), 6)
    version = table.layout_version
    before = state(table)
    table.sync_new_tokens(np.zeros(0, dtype=np.int64), 6)
    assert_unchanged(before, table)
    assert table.layout_version == version


def test_slot_cache_is_appended_on_growth_and_rebuilt_once_after_eviction(monkeypatch) -> None:
    table = make_table(make_pool(), 5)
    assert table.slots().tolist() == [0, 1, 2, 3, 4]
    rebuilds = []
    original = table._rebuild_slot_cache
    monkeypatch.setattr(table, "_rebuild_slot_cache", lambda: rebuilds.append(1) or original())
    grow(table, 4)
    assert table.slots().tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 8]
    assert rebuilds == []  # appended, not rebuilt
    table.evict_tokens(np.array([1, 6]))
    assert table.slots().tolist() == [0, 2, 3, 4, 5, 7, 8]
    assert table.slots().tolist() == [0, 2, 3, 4, 5, 7, 8]
    assert len(rebuilds) == 1
    grow(table, 2)
    assert table.slots().tolist() == [0, 2, 3, 4, 5, 7, 8, 9, 10]
    assert len(rebuilds) == 1


def test_slots_without_a_dead_token_is_the_token_slot_array_and_a_first_eviction_copies_it() -> None:
    table = make_table(make_pool(), 12)
    taken = table.slots()
    assert np.shares_memory(taken, table.token_slots)  # no second copy while every token is live
    table.evict_tokens(np.array([5]))
    assert not np.shares_memory(table.slots(), table.token_slots)
    assert table.slots().tolist() == [0, 1, 2, 3, 4, 6, 7, 8, 9, 10, 11]
    grow(table, 3)
    table.apply_moves(make_moves([(14, 3, 2, 1, 1)]))
    table.evict_tokens(np.array([0, 7]))
    assert table.slots().tolist() == [1, 2, 3, 4, 6, 8, 9, 10, 11, 12, 13, 5]  # token 14 moved to slot 5


def test_table_state_is_numpy_arrays_not_python_objects_per_token() -> None:
    pool = BlockPool(300, S)
    table = make_table(pool, 1000)
    table.evict_tokens(np.arange(10, 990, 3))
    for array, dtype in ((table.token_block_ids, np.int64), (table.token_offsets, np.int64), (table.live_mask, np.bool_), (table.slots(), np.int64)):
        assert isinstance(array, np.ndarray)
        assert array.dtype == dtype
    assert table.token_block_ids.size == 1000
    for name, value in vars(table).items():
        if isinstance(value, (list, tuple, dict, set, frozenset)):
            assert len(value) <= table.num_blocks, f"{name} grows with the number of tokens"


@st.composite
def growth_and_eviction_scripts(draw):
    """Steps of ("grow", n) and ("evict", seed, n, read_slots_between)."""
    steps = []
    for _ in range(draw(st.integers(1, 12))):
        if draw(st.booleans()):
            steps.append(("grow", draw(st.integers(1, 9))))
        else:
            steps.append(("evict", draw(st.integers(0, 2**16)), draw(st.integers(1, 5)), draw(st.booleans())))
    return steps


@settings(max_examples=150, deadline=None)
@given(script=growth_and_eviction_scripts())
def test_one_token_at_a_time_ends_where_the_batched_calls_end(script) -> None:
    """The decode-step shortcuts (one token grown, one token evicted) against the batched paths."""
    one_by_one, batched = make_table(make_pool(64), 0), make_table(make_pool(64), 0)
    for step in script:
        if step[0] == "grow":
            for _ in range(step[1]):
                grow(one_by_one, 1)
            grow(batched, step[1])
        else:
            _, seed, num_victims, read_slots_between = step
            candidates = batched.live_token_ids()
            if candidates.size == 0:
                continue
            victims = np.random.default_rng(seed).choice(candidates, min(num_victims, candidates.size), replace=False)
            emptied = []
            for victim in victims.tolist():
                emptied += one_by_one.evict_tokens(np.array([victim])).tolist()
                if read_slots_between:
                    one_by_one.slots()
            assert sorted(emptied) == evict(batched, victims.tolist())
            one_by_one.release_blocks(np.array(emptied, dtype=np.int64))
            one_by_one.pool.free(np.array(emptied, dtype=np.int64))
        for a, b in zip(state(one_by_one), state(batched), strict=True):
            np.testing.assert_array_equal(a, b)
        assert one_by_one.slots().tolist() == brute_force_slots(one_by_one)


# ---- eviction ----------------------------------------------------------------------------


def test_evict_returns_the_blocks_it_emptied_and_updates_the_pool() -> None:
    pool = make_pool()
    table = make_table(pool, 10)  # blocks 0, 1, 2; block 2 holds tokens 8, 9
    version = table.layout_version
    assert table.evict_tokens(np.array([5, 4, 7, 6])).tolist() == [1]
    assert table.layout_version == version + 1
    assert pool.live_counts[:3].tolist() == [4, 0, 2]
    assert table.evict_tokens(np.array([9])).tolist() == []
    assert table.evict_tokens(np.array([0, 8])).tolist() == [2]
    assert pool.live_counts[:3].tolist() == [3, 0, 0]
    assert table.live_token_ids().tolist() == [1, 2, 3]
    assert table.slots().tolist() == [1, 2, 3]
    assert (table.num_live_tokens, pool.num_live_tokens) == (3, 3)
    assert table.held_block_ids.tolist() == [0, 1, 2]  # evict does not release
    assert table.evict_tokens(np.zeros(0, dtype=np.int64)).tolist() == []


@pytest.mark.parametrize(("token_ids", "message"), [
    ([10], "cannot evict unknown token 10 .length 10."),
    ([-1], "cannot evict unknown token -1"),
    ([7, 6], "token 6 is already evicted"),
    ([4, 1], "token 1 is in the shared prefix"),
    ([5, 5], "repeated ids"),
    ([7, 5, 7], "repeated ids"),  # not ascending
    ([6, 10], "cannot evict unknown token 10"),  # unknown before dead
    ([1, 6], "token 6 is already evicted"),  # dead before pinned
    ([8, 2, 1, 5], "token 2 is in the shared prefix"),  # the first of them, in the order given
])
def test_evict_of_a_bad_id_raises_and_changes_nothing(token_ids: list[int], message: str) -> None:
    pool = make_pool()
    table = make_table(pool, 10)
    table.pin_prefix(4)
    table.evict_tokens(np.array([6]))
    before = state(table)
    version = table.layout_version
    with pytest.raises(VTokenError, match=message):
        table.evict_tokens(np.array(token_ids))
    assert_unchanged(before, table)
    assert table.layout_version == version



def test_evict_one_each_equals_one_evict_tokens_per_table() -> None:
    def tables_of(pool: BlockPool) -> list[TokenTable]:
        tables = [make_table(pool, n, req_id) for req_id, n in enumerate((10, 7, 13))]
        tables[1].evict_tokens(np.array([2]))  # a slot cache to shift
        grow(tables[2], 1)  # an append not yet counted, in the tail the eviction empties
        return tables
    batched_pool, single_pool = make_pool(), make_pool()
    batched, single = tables_of(batched_pool), tables_of(single_pool)
    victims = [9, 5, 13]  # the last token of a two-token tail, a middle one, the uncounted append
    for tables in (single, batched):
        tables[0].evict_tokens(np.array([8]))
    for table, token_id in zip(single, victims):
        table.evict_tokens(np.array([token_id]))
    emptied = TokenTable.evict_one_each(batched, np.array(victims))
    assert emptied.tolist() == [2, -1, -1]  # block 2 held tokens 8 and 9 of request 0
    for got, want in zip(batched, single):
        np.testing.assert_equal(state(got), state(want))
    assert batched_pool.token_at.tolist() == single_pool.token_at.tolist()


@pytest.mark.parametrize(("victims", "message"), [
    ([3, 10], "request 1: cannot evict unknown token 10"),
    ([3, -1], "request 1: cannot evict unknown token -1"),
    ([3, 6], "request 1: token 6 is already evicted"),
    ([3, 1], "request 1: token 1 is in the shared prefix"),
])
def test_evict_one_each_of_a_bad_id_raises_and_changes_no_table(victims: list[int], message: str) -> None:
    pool = make_pool()
    first, second = make_table(pool, 10, 0), make_table(pool, 10, 1)
    second.pin_prefix(4)
    second.evict_tokens(np.array([6]))
    before = [state(first), state(second)]
    with pytest.raises(VTokenError, match=message):
        TokenTable.evict_one_each([first, second], np.array(victims))
    assert_unchanged(before[0], first)
    assert_unchanged(before[1], second)


@settings(max_examples=80, deadline=None)
@given(lengths=st.lists(st.integers(2, 30), min_size=1, max_size=6), data=st.data())
def test_evict_one_each_is_evict_tokens_of_each_table_in_turn(lengths: list[int], data: st.DataObject) -> None:
    """On tables with holes already and appends not yet counted, one live victim each: the
    tables, the pool and the emptied blocks as one `evict_tokens` per table gives."""
    def tables_of(pool: BlockPool) -> list[TokenTable]:
        tables = [make_table(pool, n, req_id) for req_id, n in enumerate(lengths)]
        for table, dead in zip(tables, holes):
            if dead:
                table.evict_tokens(np.array(dead, dtype=np.int64))
            grow(table, 1)  # an append not yet counted
        return tables
    holes = [data.draw(st.lists(st.integers(0, n - 2), unique=True, max_size=n // 2)) for n in lengths]
    victims = [data.draw(st.sampled_from([t for t in range(n + 1) if t not in dead])) for n, dead in zip(lengths, holes)]
    batched_pool, single_pool = make_pool(64), make_pool(64)
    batched, single = tables_of(batched_pool), tables_of(single_pool)
    want = []
    for table, token_id in zip(single, victims):
        emptied = table.evict_tokens(np.array([token_id]))
        want.append(int(emptied[0]) if emptied.size else -1)
    assert TokenTable.evict_one_each(batched, np.array(victims)).tolist() == want
    for got, expected in zip(batched, single):
        np.testing.assert_equal(state(got), state(expected))
        assert got.layout_version == expected.layout_version
    assert batched_pool.token_at.tolist() == single_pool.token_at.tolist()


def test_evict_one_each_refused_by_the_pool_changes_nothing() -> None:
    """A block the pool holds free under a table (state a caller corrupted): the pool's refusal,
    raised before a live bit, a slot or a table's counter changes."""
    pool = make_pool()
    first, second = make_table(pool, 10, 0), make_table(pool, 10, 1)
    block_id = int(second.token_block_ids[5])
    pool.ref_counts[block_id] = 0
    before = [state(first), state(second)]
    with pytest.raises(VTokenError, match=f"live-count change on free blocks \\[{block_id}\\]"):
        TokenTable.evict_one_each([first, second], np.array([3, 5]))
    assert_unchanged(before[0], first)
    assert_unchanged(before[1], second)


def test_evict_one_each_takes_ids_of_any_layout_and_refuses_a_count_other_than_the_tables() -> None:
    """Ids as a strided view evict as a fresh array does (the compiled loop gets them
    contiguous); two ids a table for two tables (a [2, 2] array) is refused, changing nothing."""
    for_view, for_array = make_pool(), make_pool()
    viewed = [make_table(for_view, 10, req_id) for req_id in range(2)]
    fresh = [make_table(for_array, 10, req_id) for req_id in range(2)]
    ids = np.array([[4, 0], [7, 0]], dtype=np.int64)[:, 0]  # not contiguous
    assert TokenTable.evict_one_each(viewed, ids).tolist() == TokenTable.evict_one_each(fresh, np.array([4, 7])).tolist()
    for got, want in zip(viewed, fresh):
        np.testing.assert_equal(state(got), state(want))
    before = [state(table) for table in viewed]
    with pytest.raises(VTokenError, match="got 2 tables and 4 token ids"):
        TokenTable.evict_one_each(viewed, np.array([[5, 6], [5, 6]]))
    for table, table_before in zip(viewed, before):
        assert_unchanged(table_before, table)


@pytest.mark.parametrize("fault", ["a table given twice", "a table of another pool"])
def test_evict_one_each_refuses_tables_that_are_not_distinct_tables_of_one_pool(fault: str) -> None:
    """Refused before anything is written: the tables, their pools and their arenas as before
    (the check is the compiled loop's, by the tables' bases in the pool's arena)."""
    pool = make_pool()
    first = make_table(pool, 10)
    second = first if fault == "a table given twice" else make_table(make_pool(), 10)
    tables = [make_table(pool, 8, req_id=1), first, second]
    before = [state(table) for table in tables]
    arenas = [table.pool.token_arena.live.copy() for table in tables]
    with pytest.raises(VTokenError, match="distinct tables of one pool"):
        TokenTable.evict_one_each(tables, np.array([3, 4, 5]))
    for table, table_before, arena in zip(tables, before, arenas):
        assert_unchanged(table_before, table)
        np.testing.assert_array_equal(table.pool.token_arena.live, arena)



def test_counting_every_pending_append_at_once_counts_what_counting_each_counts() -> None:
    def pool_after(flush_each: bool) -> BlockPool:
        pool = BlockPool(64, S)
        tables = [make_table(pool, 5 + req_id, req_id) for req_id in range(10)]
        for req_id, table in enumerate(tables):
            for _ in range(req_id % 3 + 1):  # 1 to 3 appends pending, some of them opening a new tail
                grow(table, 1)
                if flush_each:
                    table.flush()
        return pool
    each, batched = pool_after(True), pool_after(False)
    # nothing counted yet, some blocks twice over (a table's appends since the last read): the
    # first read below counts them all in one batch
    assert len(batched.pending_slots) == sum(req_id % 3 + 1 for req_id in range(10))
    assert batched.live_counts.tolist() == each.live_counts.tolist()
    assert batched.token_at.tolist() == each.token_at.tolist()
    assert batched.utilization_histogram().tolist() == each.utilization_histogram().tolist()
    assert (batched.num_blocks_le_half, batched.num_live_tokens) == (each.num_blocks_le_half, each.num_live_tokens)
    assert not batched.pending_slots and not batched.pending_token_ids


def test_appends_pending_in_a_tail_the_table_has_left_are_counted_before_an_eviction_reads_it() -> None:
    pool = BlockPool(8, S)
    table = make_table(pool, S - 2)
    for _ in range(4):  # the last two offsets of the first block, then two of a new tail, all pending
        grow(table, 1)
    assert len(pool.pending_slots) == 4 and table.num_blocks == 2
    emptied = table.evict_tokens(np.arange(S))  # every token of the first block, two of them pending
    assert emptied.tolist() == [int(table.held_block_ids[0])]
    assert pool.live_counts[table.held_block_ids].tolist() == [0, 2] and not pool.pending_slots


# ---- relocation --------------------------------------------------------------------------


def holey_table() -> TokenTable:
    """12 tokens in three full blocks; tokens 1 and 2 evicted.

        block 0: [0 . . 3]  block 1: [4 5 6 7]  block 2 (full tail): [8 9 10 11]
    """
    pool = make_pool()
    table = make_table(pool, 12)
    table.evict_tokens(np.array([1, 2]))
    return table


def test_apply_moves_repoints_tokens_and_moves_live_counts() -> None:
    table = holey_table()
    version = table.layout_version
    table.apply_moves(make_moves([(8, 2, 0, 0, 1), (9, 2, 1, 0, 2)]))
    assert table.token_block_ids[8:10].tolist() == [0, 0]
    assert table.token_offsets[8:10].tolist() == [1, 2]
    assert table.pool.live_counts[:3].tolist() == [4, 4, 2]
    assert table.slots().tolist() == [0, 3, 4, 5, 6, 7, 1, 2, 10, 11]
    assert table.layout_version == version + 1
    assert table.pool.num_live_tokens == 10


def test_apply_moves_may_move_a_token_into_a_slot_another_moved_token_leaves() -> None:
    table = holey_table()
    table.apply_moves(make_moves([(8, 2, 0, 0, 1), (9, 2, 1, 2, 0)]))
    assert table.slots().tolist() == [0, 3, 4, 5, 6, 7, 1, 8, 10, 11]
    assert table.pool.live_counts[:3].tolist() == [3, 4, 3]


@pytest.mark.parametrize(("rows", "message"), [
    ([(8, 2, 1, 0, 1)], "move of token 8 names a source it does not occupy"),
    ([(8, 1, 0, 0, 1)], "move of token 8 names a source it does not occupy"),
    ([(8, 2, 0, 0, 0)], "move onto occupied slot 0 .block 0, offset 0."),
    ([(8, 2, 0, 1, 3)], "move onto occupied slot 7 .block 1, offset 3."),
    ([(8, 2, 0, 0, 1), (9, 2, 1, 0, 1)], "move onto occupied slot"),
    ([(8, 2, 0, 5, 0)], "move into block 5 it does not hold"),
    ([(12, 2, 0, 0, 1)], "unknown or repeated tokens"),
    ([(8, 2, 0, 0, 1), (8, 2, 0, 0, 2)], "unknown or repeated tokens"),
])
def test_apply_moves_rejects_a_bad_move_and_changes_nothing(rows, message: str) -> None:
    table = holey_table()
    table.pool.allocate(6)  # block 5 exists but is not the table's
    before = state(table)
    version = table.layout_version
    with pytest.raises(VTokenError, match=message):
        table.apply_moves(make_moves(rows))
    assert_unchanged(before, table)
    assert table.layout_version == version


def test_a_token_evicted_while_its_copy_is_in_flight_is_repointed_without_count_changes() -> None:
    table = holey_table()
    moves = make_moves([(8, 2, 0, 0, 1), (9, 2, 1, 0, 2)])
    table.evict_tokens(np.array([8]))
    table.apply_moves(moves)
    assert table.token_block_ids[8:10].tolist() == [0, 0]
    assert table.pool.live_counts[:3].tolist() == [3, 4, 2]
    assert table.slots().tolist() == [0, 3, 4, 5, 6, 7, 2, 10, 11]


def two_holey_tables() -> tuple[TokenTable, TokenTable]:
    """Two requests of one pool, each with a hole in its first block and live tokens to move.

        request 0: block 0: [0 . . 3]  block 1: [4 5 6 7]  block 2: [8 9 10 11]
        request 1: block 3: [0 1 . .]  block 4: [4 5 6 7]  block 5: [8 9 10 11]
    """
    pool = make_pool()
    first, second = make_table(pool, 12, req_id=0), make_table(pool, 12, req_id=1)
    first.evict_tokens(np.array([1, 2]))
    second.evict_tokens(np.array([2, 3]))
    return first, second


FIRST_MOVES = [(8, 2, 0, 0, 1), (9, 2, 1, 0, 2)]
SECOND_MOVES = [(10, 5, 2, 3, 2), (11, 5, 3, 3, 3)]


def test_apply_moves_each_equals_apply_moves_of_each_table_in_turn() -> None:
    each = two_holey_tables()
    each[0].apply_moves(make_moves(FIRST_MOVES))
    each[1].apply_moves(make_moves(SECOND_MOVES))
    together = two_holey_tables()
    TokenTable.apply_moves_each(together, [make_moves(FIRST_MOVES), make_moves(SECOND_MOVES)], [None, None])
    for one, other in zip(each, together):
        assert_unchanged(state(one), other)
        assert one.layout_version == other.layout_version
    np.testing.assert_array_equal(each[0].pool.token_at, together[0].pool.token_at)


@pytest.mark.parametrize("with_idle_table", [False, True])
def test_apply_moves_each_reads_the_moves_end_to_end_when_given(with_idle_table: bool, monkeypatch) -> None:
    """The caller's moves end to end (a round's, moves.end_to_end) are what the landing reads,
    and land as the tables' own do; with a table that moves nothing among them (left out of the
    landing, so the indices of the end-to-end moves no longer name the landing's tables) they
    are not read."""
    landed = []
    land_moves = BlockPool.land_moves

    def spy(pool, token_ids, *rest):
        landed.append(token_ids)
        return land_moves(pool, token_ids, *rest)

    monkeypatch.setattr(BlockPool, "land_moves", spy)
    each, together = two_holey_tables(), two_holey_tables()
    if with_idle_table:
        each, together = ((make_table(tables[0].pool, 4, req_id=2), *tables) for tables in (each, together))
    for table, rows in zip(each[-2:], (FIRST_MOVES, SECOND_MOVES)):
        table.apply_moves(make_moves(rows))
    moves = [make_moves([])] * with_idle_table + [make_moves(FIRST_MOVES), make_moves(SECOND_MOVES)]
    joined = make_moves(FIRST_MOVES + SECOND_MOVES), np.array([0, 0, 1, 1]) + with_idle_table
    TokenTable.apply_moves_each(together, moves, [None] * len(together), joined)
    assert (landed[-1] is joined[0].token_ids) is not with_idle_table
    for one, other in zip(each, together):
        assert_unchanged(state(one), other)
        assert one.layout_version == other.layout_version
    np.testing.assert_array_equal(each[0].pool.token_at, together[0].pool.token_at)


def test_apply_moves_each_rejects_a_bad_move_of_any_table_and_changes_neither() -> None:
    first, second = two_holey_tables()
    before = state(first), state(second)
    with pytest.raises(VTokenError, match="request 1: move onto occupied slot 12"):
        TokenTable.apply_moves_each([first, second], [make_moves(FIRST_MOVES), make_moves([(10, 5, 2, 3, 0)])], [None, None])
    assert_unchanged(before[0], first)
    assert_unchanged(before[1], second)


def test_apply_moves_each_skips_the_check_only_for_a_table_still_at_its_checked_version(monkeypatch) -> None:
    first, second = two_holey_tables()
    stale = make_moves([(8, 2, 1, 0, 1)])  # names a source token 8 does not occupy
    with pytest.raises(VTokenError, match="request 0: move of token 8 names a source"):
        TokenTable.apply_moves_each([first, second], [stale, make_moves(SECOND_MOVES)], [first.layout_version - 1, None])
    checked = []
    monkeypatch.setattr(TokenTable, "_check_moves", lambda table, moves: checked.append(table.req_id))
    TokenTable.apply_moves_each([first, second], [make_moves(FIRST_MOVES), make_moves(SECOND_MOVES)], [first.layout_version, None])
    assert checked == [1]  # the first was checked at its version: not again


@pytest.mark.parametrize(("evicted_in_flight", "first_live_counts"), [([8], [3, 4, 2]), ([8, 9], [2, 4, 2])])
def test_apply_moves_each_repoints_the_tokens_evicted_in_flight_of_one_table_as_apply_moves_does(
        evicted_in_flight: list[int], first_live_counts: list[int]) -> None:
    """The first request loses one or both of its moved tokens while the copies are in flight,
    the second none: every table's moved tokens are repointed, and only the live ones count."""
    each, together = two_holey_tables(), two_holey_tables()
    for first, _ in (each, together):
        first.evict_tokens(np.array(evicted_in_flight))
    each[0].apply_moves(make_moves(FIRST_MOVES), each[0].layout_version - 1)
    each[1].apply_moves(make_moves(SECOND_MOVES), each[1].layout_version)
    TokenTable.apply_moves_each(together, [make_moves(FIRST_MOVES), make_moves(SECOND_MOVES)],
                                [together[0].layout_version - 1, together[1].layout_version])
    for one, other in zip(each, together):
        assert_unchanged(state(one), other)
        assert one.layout_version == other.layout_version
    np.testing.assert_array_equal(each[0].pool.token_at, together[0].pool.token_at)
    assert together[0].token_block_ids[8:10].tolist() == [0, 0]
    assert together[0].pool.live_counts[:3].tolist() == first_live_counts  # only live tokens moved a count
    assert together[1].pool.live_counts[3:6].tolist() == [4, 4, 2]


@pytest.mark.parametrize("fault", ["a table given twice", "a table of another pool"])
def test_apply_moves_each_refuses_tables_that_are_not_distinct_tables_of_one_pool(fault: str) -> None:
    """Refused before anything is written: the tables, their pools and their arenas as before
    (the check is the compiled landing's, by the tables' bases in the pool's arena, as the
    batched eviction's)."""
    first, second = two_holey_tables()
    if fault == "a table given twice":
        tables, moves = [first, first], [make_moves(FIRST_MOVES[:1]), make_moves(FIRST_MOVES[1:])]
    else:
        second = two_holey_tables()[1]  # the same layout in a pool of its own
        tables, moves = [first, second], [make_moves(FIRST_MOVES), make_moves(SECOND_MOVES)]
    before, before_pools = [state(table) for table in tables], [pool_state(table.pool) for table in tables]
    arenas = [table.pool.token_arena.slot.copy() for table in tables]
    with pytest.raises(VTokenError, match="apply_moves_each needs distinct tables of one pool"):
        TokenTable.apply_moves_each(tables, moves, [table.layout_version for table in tables])
    for table, table_before, pool_before, arena in zip(tables, before, before_pools, arenas):
        assert_unchanged(table_before, table)
        for a, b in zip(pool_before, pool_state(table.pool), strict=True):
            np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(table.pool.token_arena.slot, arena)


def test_adopt_blocks_puts_relocation_destinations_before_the_tail() -> None:
    pool = make_pool()
    table = make_table(pool, 10)  # blocks 0, 1, 2 (tail, 2 written)
    table.adopt_blocks(pool.allocate(2))
    assert table.held_block_ids.tolist() == [0, 1, 3, 4, 2]
    assert grow(table, 2) == []
    assert table.slots().tolist()[-2:] == [10, 11]


# ---- relocation in flight (the runtime's protocol) ---------------------------------------
#
# While a request has a copy in flight, the blocks `evict_tokens` reports empty are not
# released: the copy may still fill them (destinations) or read them (sources). When the copy
# completes, the runtime applies the moves and releases every held block left empty.


def release_empty_blocks(table: TokenTable) -> list[int]:
    return table.release_empty_blocks().tolist()  # the pool frees them in the same pass


def four_tables_that_lost_blocks_in_flight(shared_block: bool = False) -> list[TokenTable]:
    """Two requests that lost blocks whole while copies were in flight, one that holds no block
    between them, and one that lost none; with `shared_block`, one of the emptied blocks (block
    3) has a second reference, as a block another holder still reads: released, but not freed."""
    first, second = two_holey_tables()
    third = make_table(first.pool, 5, req_id=2)
    first.evict_tokens(np.array([4, 5, 6, 7]))  # block 1
    second.evict_tokens(np.array([0, 1, 8, 9, 10, 11]))  # blocks 3 and 5, the tail
    if shared_block:
        first.pool.share(np.array([3]))
    return [first, TokenTable(3, first.pool), second, third]


def pool_state(pool: BlockPool, free_list_order: bool = True) -> tuple:
    """The pool's counts and maps, and its free blocks in the order it hands them out (or,
    without `free_list_order`, ascending)."""
    free = pool.peek_free(pool.num_free_blocks)
    return (pool.ref_counts.copy(), pool.live_counts.copy(), pool.token_at.copy(), free if free_list_order else np.sort(free),
            pool.utilization_histogram(), pool.num_blocks_le_half, pool.num_live_tokens)


def test_release_empty_blocks_each_is_release_empty_blocks_of_each_table_in_turn() -> None:
    """One call releases and frees what the four calls release and free, in table order (the
    free list holds the same blocks; the order it hands them out in follows the calls)."""
    each, together = four_tables_that_lost_blocks_in_flight(), four_tables_that_lost_blocks_in_flight()
    released_each = [table.release_empty_blocks().tolist() for table in each]
    assert released_each == [[1], [], [3, 5], []]
    assert TokenTable.release_empty_blocks_each(together).tolist() == [1, 3, 5]
    for one, other in zip(each, together):
        assert_unchanged(state(one), other)
        assert one.layout_version == other.layout_version
    for a, b in zip(pool_state(each[0].pool, free_list_order=False), pool_state(together[0].pool, free_list_order=False),
                    strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("shared_block", [False, True])
@pytest.mark.parametrize("table_order", ["as made", "reversed"])
def test_release_empty_blocks_each_is_release_blocks_of_the_empty_ones_then_free(shared_block: bool, table_order: str) -> None:
    """A landing's release and free in one pass: the tables and the pool (ref counts, the free
    list in the order it hands blocks out, the histogram) as after `release_blocks` of each
    table's blocks past its prefix without a live token and then `BlockPool.free` of them all;
    with the tables reversed, the blocks released (3, 5, then 1) do not ascend, and the free
    list still hands the lowest out first."""
    by_hand, by_call = four_tables_that_lost_blocks_in_flight(shared_block), four_tables_that_lost_blocks_in_flight(shared_block)
    if table_order == "reversed":
        by_hand, by_call = by_hand[::-1], by_call[::-1]
    pool = by_hand[0].pool
    empty = []
    for table in by_hand:
        held = table.held_block_ids[table.num_pinned_blocks :].copy()
        empty.append(held[pool.live_counts[held] == 0])
        table.release_blocks(empty[-1])
    pool.free(np.concatenate(empty))
    released = [1, 3, 5] if table_order == "as made" else [3, 5, 1]
    assert TokenTable.release_empty_blocks_each(by_call).tolist() == np.concatenate(empty).tolist() == released
    for one, other in zip(by_hand, by_call):
        assert_unchanged(state(one), other)
        assert one.layout_version == other.layout_version
    for a, b in zip(pool_state(pool), pool_state(by_call[0].pool), strict=True):
        np.testing.assert_array_equal(a, b)
    assert by_call[0].pool.ref_counts[3] == (1 if shared_block else 0)


@pytest.mark.parametrize("fault", ["double free", "a table given twice", "a table of another pool"])
def test_release_empty_blocks_each_refuses_changing_nothing(fault: str) -> None:
    """A block without a reference among those to free, a table given twice, or a table of
    another pool (whose blocks would be read against this pool's counts and freed in it):
    refused before a table or either pool changes."""
    tables = four_tables_that_lost_blocks_in_flight()
    pool = tables[0].pool
    if fault == "double free":
        pool.ref_counts[5] = 0  # as if freed already
        message = "double free of blocks \\[5\\]"
    elif fault == "a table given twice":
        tables = [tables[0], tables[0]]
        message = "release_empty_blocks_each needs distinct tables of one pool"
    else:
        tables = [tables[0], four_tables_that_lost_blocks_in_flight()[2]]  # the same layout in a pool of its own
        message = "release_empty_blocks_each needs distinct tables of one pool"
    before, before_pools = [state(table) for table in tables], [pool_state(table.pool) for table in tables]
    with pytest.raises(VTokenError, match=message):
        TokenTable.release_empty_blocks_each(tables)
    for table, table_before, pool_before in zip(tables, before, before_pools):
        assert_unchanged(table_before, table)
        for a, b in zip(pool_before, pool_state(table.pool), strict=True):
            np.testing.assert_array_equal(a, b)


@settings(max_examples=60, deadline=None)
@given(num_prefix_blocks=st.integers(0, 2), num_tokens=st.integers(1, 40), data=st.data())
def test_release_empty_blocks_is_release_blocks_of_every_empty_block_past_the_prefix(num_prefix_blocks: int, num_tokens: int,
                                                                                      data: st.DataObject) -> None:
    """Evictions without releasing (a request with a copy in flight), then one call: the same
    state as `release_blocks` of the held blocks past the shared prefix with no live token, the
    tail among them, and the pool's `free` of them, and those blocks returned in held order."""
    tables = []
    for _ in range(2):
        pool = make_pool(32)
        owner = make_table(pool, num_prefix_blocks * S, req_id=9)
        owner.pin_prefix(num_prefix_blocks * S)
        table = TokenTable(0, pool)
        prefix = owner.held_block_ids.copy()
        pool.share(prefix)
        table.attach_shared_prefix(prefix, prefix.size * S)
        grow(table, num_tokens)
        tables.append(table)
    unpinned = list(range(num_prefix_blocks * S, tables[0].num_tokens))
    victims = data.draw(st.lists(st.sampled_from(unpinned), unique=True) if unpinned else st.just([]))
    for table in tables:
        table.evict_tokens(np.array(sorted(victims), dtype=np.int64))
    by_hand, by_call = tables
    held = by_hand.held_block_ids[by_hand.num_pinned_blocks :].copy()
    expected = held[by_hand.pool.live_counts[held] == 0]
    by_hand.release_blocks(expected)
    by_hand.pool.free(expected)
    assert by_call.release_empty_blocks().tolist() == expected.tolist()
    assert_unchanged(state(by_hand), by_call)
    assert by_call.layout_version == by_hand.layout_version


def test_a_block_reported_empty_during_a_copy_is_refilled_by_it() -> None:
    table = holey_table()
    moves = make_moves([(8, 2, 0, 0, 1), (9, 2, 1, 0, 2)])  # launched: block 0 is a destination
    assert table.evict_tokens(np.array([0, 3])).tolist() == [0]
    table.apply_moves(moves)
    assert table.pool.live_counts[:3].tolist() == [2, 4, 2]
    with pytest.raises(VTokenError, match="still hold live tokens"):
        table.release_blocks(np.array([0]))


def test_completion_releases_the_blocks_evictions_emptied_in_flight() -> None:
    table = holey_table()
    moves = make_moves([(8, 2, 0, 0, 1), (9, 2, 1, 0, 2)])
    assert table.evict_tokens(np.array([0, 3, 8, 9])).tolist() == [0]
    table.apply_moves(moves)
    assert release_empty_blocks(table) == [0]
    assert table.held_block_ids.tolist() == [1, 2]
    assert table.slots().tolist() == [4, 5, 6, 7, 10, 11]


def test_a_tail_emptied_in_flight_is_released_at_completion_with_the_sources() -> None:
    pool = make_pool()
    table = make_table(pool, 14)  # blocks 0, 1, 2, 3 (tail: tokens 12, 13)
    evict(table, [1, 2, 10, 11])
    #   block 0: [0 . . 3]  block 1: [4 5 6 7]  block 2: [8 9 . .]  block 3: [12 13 . .]
    moves = make_moves([(8, 2, 0, 0, 1), (9, 2, 1, 0, 2)])
    assert table.evict_tokens(np.array([12, 13])).tolist() == [3]
    table.apply_moves(moves)
    assert release_empty_blocks(table) == [2, 3]
    assert (table.held_block_ids.tolist(), table.tail_num_written) == ([0, 1], S)
    assert grow(table, 1) == [2]
    assert table.slots().tolist() == [0, 3, 4, 5, 6, 7, 1, 2, 8]


# ---- releasing blocks and the tail cursor ------------------------------------------------


def test_releasing_the_tail_moves_the_cursor_after_the_last_live_token_of_the_new_tail() -> None:
    pool = make_pool()
    table = make_table(pool, 10)  # blocks 0, 1, 2 (tail: tokens 8, 9)
    assert evict(table, [6, 7]) == []
    assert evict(table, [8, 9]) == [2]
    assert table.held_block_ids.tolist() == [0, 1]
    assert table.tail_num_written == 2  # token 5 sits at offset 1 of block 1
    assert grow(table, 3) == [2]
    assert table.slots().tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 8]
    assert table.token_block_ids[10:13].tolist() == [1, 1, 2]


def test_a_full_tail_packed_away_leaves_the_new_tail_full() -> None:
    pool = make_pool()
    table = make_table(pool, 12)  # blocks 0, 1, 2, all full
    evict(table, [1, 2, 7, 8, 9])
    #   block 0: [0 . . 3]  block 1: [4 5 6 .]  block 2 (tail, full): [. . 10 11]
    table.apply_moves(make_moves([(10, 2, 2, 0, 1), (11, 2, 3, 0, 2)]))
    assert release_empty_blocks(table) == [2]
    assert (table.held_block_ids.tolist(), table.tail_num_written) == ([0, 1], S)  # not reopened at offset 3 of block 1
    assert grow(table, 1) == [2]  # a fresh block, as the uncompacted layout's next token opens
    assert table.token_block_ids[12] == 2 and table.token_offsets[12] == 0


def test_releasing_every_block_resets_the_cursor() -> None:
    pool = make_pool()
    table = make_table(pool, 3)
    assert evict(table, [0, 1, 2]) == [0]
    assert (table.held_block_ids.tolist(), table.tail_num_written, table.num_free_tail_slots()) == ([], 0, 0)
    assert grow(table, 1) == [0]
    assert table.slots().tolist() == [0]


def test_release_blocks_of_a_block_not_held_or_still_live_raises_and_changes_nothing() -> None:
    pool = make_pool()
    table = make_table(pool, 10)
    make_table(pool, 2, req_id=1)  # holds block 3
    before = state(table)
    with pytest.raises(VTokenError, match=r"releasing blocks it does not hold \[3\]"):
        table.release_blocks(np.array([0, 3]))
    with pytest.raises(VTokenError, match="still hold live tokens"):
        table.release_blocks(np.array([1]))
    assert_unchanged(before, table)


def test_release_all_returns_every_block_and_leaves_nothing_live() -> None:
    pool = make_pool()
    table = make_table(pool, 10)
    assert table.release_all() == [0, 1, 2]
    assert table.held_block_ids.tolist() == []
    assert table.num_live_tokens == 0
    assert table.slots().tolist() == []
    pool.free(np.array([0, 1, 2]))
    assert pool.num_free_blocks == 16


def test_the_reclaimable_bound_follows_release_all_and_the_tail_cursor() -> None:
    """The two verbs that recount the bound's free slots and that the substrate's state machine
    does not reach with a table it still checks."""
    table = make_table(make_pool(), 10)  # blocks 0, 1 full; block 2 open at 2
    evict(table, [1, 2, 5, 6])  # 4 live in blocks 0 and 1: one of them could go
    assert table.max_reclaimable_blocks() == 1
    table.release_all()
    assert table.max_reclaimable_blocks() == 0
    table = make_table(make_pool(), 11)  # blocks 0, 1 full; block 2 open at 3
    evict(table, [1, 2, 3, 9])  # block 0: token 0; the tail: tokens 8 and 10
    assert table.max_reclaimable_blocks() == 1  # the bound takes 3 tail tokens out, 2 are live
    table.apply_moves(make_moves([(10, 2, 2, 2, 1)]))
    table.set_tail_cursor(2)
    assert table.max_reclaimable_blocks() == 0  # 5 live in blocks 0 and 1: neither can go


# ---- shared prefixes ---------------------------------------------------------------------


def test_a_shared_prefix_maps_onto_the_owners_blocks_and_is_counted_once() -> None:
    pool = make_pool()
    owner = make_table(pool, 10)  # blocks 0, 1 full, 2 holds tokens 8, 9
    owner.pin_prefix(8)
    sharer = TokenTable(1, pool)
    pool.share(np.array([0, 1]))
    sharer.attach_shared_prefix(np.array([0, 1]), 8)
    assert grow(sharer, 3) == [3]
    assert sharer.token_block_ids.tolist() == [0, 0, 0, 0, 1, 1, 1, 1, 3, 3, 3]
    assert sharer.slots().tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 12, 13, 14]
    assert (sharer.num_pinned_tokens, sharer.num_pinned_blocks) == (8, 2)
    assert pool.ref_counts[:4].tolist() == [2, 2, 1, 1]
    assert pool.live_counts[:4].tolist() == [4, 4, 2, 3]
    assert pool.num_live_tokens == 13
    for table in (owner, sharer):
        with pytest.raises(VTokenError, match="token 7 is in the shared prefix"):
            table.evict_tokens(np.array([7]))
    pool.free(np.array(owner.release_all()))
    assert owner.num_pinned_tokens == 0
    assert pool.ref_counts[:4].tolist() == [1, 1, 0, 1]
    assert pool.live_counts[:4].tolist() == [4, 4, 0, 3]
    pool.free(np.array(sharer.release_all()))
    assert pool.num_free_blocks == 16 and pool.num_live_tokens == 0


def test_shared_prefix_and_pin_errors() -> None:
    pool = make_pool()
    owner = make_table(pool, 10)
    for bad_pin, message in ((6, "cannot pin 6 tokens"), (12, "cannot pin 12 tokens")):
        with pytest.raises(VTokenError, match=message):
            owner.pin_prefix(bad_pin)
    owner.evict_tokens(np.array([5]))
    with pytest.raises(VTokenError, match="cannot pin 8 tokens, token 5 is evicted"):
        owner.pin_prefix(8)
    assert owner.num_pinned_tokens == 0
    with pytest.raises(VTokenError, match="a shared prefix must come before any token"):
        owner.attach_shared_prefix(np.array([0]), 4)
    sharer = TokenTable(1, pool)
    with pytest.raises(VTokenError, match="got 7 tokens for 2 blocks of 4"):
        sharer.attach_shared_prefix(np.array([0, 1]), 7)
    assert (sharer.num_tokens, sharer.held_block_ids.tolist()) == (0, [])


def test_an_empty_shared_prefix_is_a_no_op() -> None:
    table = TokenTable(0, make_pool())
    table.attach_shared_prefix(np.zeros(0, dtype=np.int64), 0)
    assert (table.num_tokens, table.num_pinned_tokens, table.held_block_ids.tolist()) == (0, 0, [])
    assert grow(table, 2) == [0]


def test_evicting_from_a_tail_with_appends_not_yet_counted_does_not_call_it_empty() -> None:
    table = make_table(make_pool(), 5)  # block 0 full, token 4 at block 1 offset 0
    grow(table, 1)  # token 5: a decode step, counted by the pool lazily
    grow(table, 1)
    assert table.evict_tokens(np.array([4])).tolist() == []
    assert table.pool.live_counts[1] == 2 and table.pool.num_live_tokens == 6
    assert table.pool.token_at[[4, 5, 6]].tolist() == [-1, 5, 6]


def test_pool_reads_count_the_decode_appends_of_every_table() -> None:
    pool = make_pool()
    a, b = make_table(pool, 2), make_table(pool, 3, req_id=1)
    for _ in range(3):
        grow(a, 1)
        grow(b, 1)
    assert pool.live_counts[:4].tolist() == [4, 4, 2, 1]  # a: blocks 0, 3; b: blocks 1, 2
    assert (pool.num_live_tokens, pool.waste_ratio()) == (11, 1 - 11 / 16)
    assert pool.utilization_histogram().tolist() == [0, 0, 1, 0, 0, 1, 0, 0, 0, 2]


def test_set_tail_cursor_after_packing_and_its_refusals() -> None:
    table = make_table(make_pool(), 7)  # block 0 full, tokens 4..6 at block 1 offsets 0..2
    table.evict_tokens(np.array([5]))
    with pytest.raises(VTokenError, match="a live token sits at or past tail offset 2"):
        table.set_tail_cursor(2)  # token 6 is still at offset 2: nothing changes
    assert table.tail_num_written == 3
    table.apply_moves(make_moves([(6, 1, 2, 1, 1)]))  # pack token 6 into the hole at offset 1
    with pytest.raises(VTokenError, match="a live token sits at or past tail offset 1"):
        table.set_tail_cursor(1)
    table.set_tail_cursor(2)
    grow(table, 1)
    assert table.token_slots[7] == 1 * S + 2  # the next token lands right after the live ones
    with pytest.raises(VTokenError, match="cannot set the tail cursor to 5"):
        table.set_tail_cursor(5)


def test_slot_cache_drops_entries_near_either_end_and_grows_at_the_back() -> None:
    from vtoken.kv.slot_cache import SlotCache

    cache, live = SlotCache(), np.ones(10, dtype=bool)
    cache.reset(10)[:] = np.arange(100, 110)
    for token_id in (1, 8, 0, 9):  # front, back, front, back: the shorter side shifts
        cache.remove_later(token_id)
        live[token_id] = False
        cache.catch_up(live, 10)
    assert cache.slots().tolist() == [102, 103, 104, 105, 106, 107]
    cache.append(np.arange(200, 300))  # past the buffer's room: a new buffer, same entries
    cache.append_one(7)
    assert cache.slots().tolist() == [102, 103, 104, 105, 106, 107, *range(200, 300), 7]


@pytest.mark.parametrize("removed", [(3,), (7, 2), (2, 7), (0, 1, 9, 8), (4, 5, 6, 3), (9, 0, 5, 4)])
def test_slot_cache_drops_every_pending_removal_at_the_next_read(removed) -> None:
    """Removals recorded between reads, near either end and in any order, then appends:
    the read gives the live tokens' slots in logical order."""
    from vtoken.kv.slot_cache import SlotCache

    cache, live = SlotCache(), np.ones(12, dtype=bool)
    cache.reset(10)[:] = np.arange(100, 110)
    for token_id in removed:
        cache.remove_later(token_id)
        live[token_id] = False
    cache.append(np.array([110, 111]))  # tokens 10 and 11 arrive after the removals
    assert cache.has_pending and cache.is_valid
    cache.catch_up(live, 12)
    assert cache.slots().tolist() == (100 + np.flatnonzero(live)).tolist()
    assert not cache.has_pending


def test_slot_cache_past_its_pending_removals_is_dropped_for_a_rebuild() -> None:
    from vtoken.kv.slot_cache import MAX_PENDING_REMOVALS, SlotCache

    cache = SlotCache()
    cache.reset(20)[:] = np.arange(20)
    for token_id in range(MAX_PENDING_REMOVALS):
        cache.remove_later(token_id)
    assert cache.is_valid
    cache.remove_later(MAX_PENDING_REMOVALS)
    assert not cache.is_valid and not cache.has_pending


def test_an_eviction_leaves_the_slot_list_to_its_next_read() -> None:
    """Single evictions touch no slot list: none is built until a read, and one that was read
    keeps its entries until the next read drops them."""
    table = make_table(make_pool(), 40)
    table.evict_tokens(np.array([3]))
    assert not table._cache.is_valid  # nothing read it: nothing built
    assert table.slots().tolist() == brute_force_slots(table)
    for token_id in (30, 5, 17):
        table.evict_tokens(np.array([token_id]))
    assert table._cache.has_pending
    grow(table, 3)
    assert table.slots().tolist() == brute_force_slots(table)
    for token_id in range(6, 16):  # more than the cache keeps pending: rebuilt at the read
        table.evict_tokens(np.array([token_id]))
    assert not table._cache.is_valid
    assert table.slots().tolist() == brute_force_slots(table)


def test_readers_get_read_only_views():
    """Only the table's verbs change its mapping: a reader cannot write through a view."""
    pool = BlockPool(4, S)
    table = TokenTable(0, pool)
    table.sync_new_tokens(pool.allocate(2), 6)
    for view in (table.token_slots, table.live_mask, table.held_block_ids):
        with pytest.raises(ValueError, match="read-only"):
            view[0] = 1
    assert table.token_block_ids.tolist() == [0, 0, 0, 0, 1, 1] and table.token_offsets.tolist() == [0, 1, 2, 3, 0, 1]
