"""The substrate's small array helpers (kv/arrays.py) against numpy's general functions, on
both sides of their size switches."""

from __future__ import annotations

import collections

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from vtoken.kv.arrays import block_slots, count_by_block, is_distinct, isin, positions_in

# both of the helpers' paths: a dict up to 64 entries, a sort beyond
block_lists = st.lists(st.integers(0, 300), max_size=200)


@settings(max_examples=200, deadline=None)
@given(block_ids=block_lists)
def test_count_by_block_counts_each_block(block_ids) -> None:
    expected = collections.Counter(block_ids)
    blocks, counts = count_by_block(np.array(block_ids, dtype=np.int64))
    assert blocks.tolist() == sorted(expected)
    assert counts.tolist() == [expected[b] for b in sorted(expected)]


@settings(max_examples=200, deadline=None)
@given(values=block_lists)
def test_is_distinct_is_whether_no_value_repeats(values) -> None:
    assert is_distinct(np.array(values, dtype=np.int64)) == (len(set(values)) == len(values))


@settings(max_examples=200, deadline=None)
@given(values=block_lists, members=block_lists)
def test_isin_and_positions_in_agree_with_numpy(values, members) -> None:
    values, members = np.array(values, dtype=np.int64), np.array(members, dtype=np.int64)
    assert isin(values, members).tolist() == np.isin(values, members).tolist()
    distinct = np.unique(members)[::-1]  # a table's held blocks: distinct, in any order
    expected = [int(np.flatnonzero(distinct == v)[0]) if v in distinct else -1 for v in values.tolist()]
    assert positions_in(distinct, values).tolist() == expected


def test_block_slots_lists_every_slot_of_each_block_in_order() -> None:
    assert block_slots(np.array([3, 0]), 4).tolist() == [12, 13, 14, 15, 0, 1, 2, 3]
