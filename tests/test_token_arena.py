"""The pool's token arena: every table's per-token arrays as ranges of two pool-wide arrays,
moved when the arena runs out of room, the ranges of finished tables reclaimed then."""

from __future__ import annotations

import gc

import numpy as np

from vtoken.kv.block_pool import BlockPool
from vtoken.kv.token_arena import TokenArena
from vtoken.kv.token_table import TokenTable

S = 4


def grown(table: TokenTable, num_tokens: int) -> TokenTable:
    """`table` grown to `num_tokens` one decode step at a time, every third token evicted."""
    pool = table.pool
    for length in range(table.num_tokens + 1, num_tokens + 1):
        table.sync_new_tokens(pool.allocate(table.num_new_blocks_needed(1)), length)
        if length % 3 == 0:
            emptied = table.evict_tokens(np.array([length - 2]))
            table.release_blocks(emptied)
            pool.free(emptied)
    return table


def contents(table: TokenTable) -> tuple[list[int], list[int], list[int]]:
    return table.live_token_ids().tolist(), table.token_slots.tolist(), table.slots().tolist()


def uses_the_arena(table: TokenTable) -> bool:
    arena = table.pool.token_arena
    return np.shares_memory(table._slot, arena.slot) and np.shares_memory(table._live, arena.live)


def test_the_tables_of_a_pool_keep_their_tokens_in_its_arena() -> None:
    pool = BlockPool(64, S)
    first, second = grown(TokenTable(0, pool, capacity=8), 7), grown(TokenTable(1, pool, capacity=8), 5)
    assert uses_the_arena(first) and uses_the_arena(second)
    assert (first._base, second._base) == (0, 8)  # one range after the other
    assert pool.token_arena.live[first._base + np.array([0, 1, 2])].tolist() == [True, False, True]  # token 1 died


def test_bases_name_where_each_tables_tokens_start_and_no_place_for_another_pools() -> None:
    """What the compiled loops over many tables take: token t of table k at bases[k] + t; -1
    for a table of another pool, whose range is in its own arena; the bases follow a range the
    arena moved."""
    pool = BlockPool(64, S)
    pool.token_arena = TokenArena(20)
    first, second = grown(TokenTable(0, pool, capacity=8), 7), grown(TokenTable(1, pool, capacity=8), 5)
    stranger = grown(TokenTable(2, BlockPool(16, S), capacity=8), 3)
    assert pool.token_arena.bases([second, stranger, first]).tolist() == [8, -1, 0]
    grown(first, 12)  # outgrows its range: the arena moves every range
    bases = pool.token_arena.bases([first, second])
    assert bases.tolist() == [first._base, second._base] and bases.tolist() != [0, 8]
    for table, base in zip((first, second), bases.tolist()):
        assert pool.token_arena.live[base : base + table.num_tokens].tolist() == table.live_mask.tolist()


def test_running_out_of_room_moves_the_live_tables_and_drops_the_finished_ones() -> None:
    pool = BlockPool(256, S)
    pool.token_arena = TokenArena(56)
    tables = [grown(TokenTable(req_id, pool, capacity=8), 6) for req_id in range(6)]  # 48 of 56 entries
    for finished in tables[::2]:  # three finish
        pool.free(np.asarray(finished.release_all(), dtype=np.int64))
    del finished
    tables = tables[1::2]
    gc.collect()
    before = [contents(table) for table in tables]
    grown(tables[0], 12)  # outgrows its 8 entries: 16 more do not fit behind the 48 handed out
    arena = pool.token_arena
    assert arena.slot.size == 2 * (8 + 8 + 8 + 16)  # the three live ranges and the new one, doubled
    assert arena.end == 8 + 8 + 8 + 16  # the finished tables' ranges and the old one are gone
    assert all(uses_the_arena(table) for table in tables)
    assert [contents(table) for table in tables[1:]] == before[1:]
    assert contents(tables[0])[0] == [t for t in range(12) if t % 3 != 1]
    assert tables[0].token_slots[:6].tolist() == before[0][1]


def test_a_table_made_while_the_arena_is_full_gets_a_fresh_range() -> None:
    pool = BlockPool(64, S)
    pool.token_arena = TokenArena(16)
    old = grown(TokenTable(0, pool, capacity=16), 10)
    new = TokenTable(1, pool, capacity=8)
    assert uses_the_arena(old) and uses_the_arena(new)
    assert new.live_mask.size == 0 and new._live.all()  # past its length every bit is live
    assert contents(old)[0] == [0, 2, 3, 5, 6, 8, 9]
