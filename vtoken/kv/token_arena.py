"""Every token table's per-token arrays of one pool, as ranges of two pool-wide arrays.

A table's slot array and live bits (token_table.py) are views of its range here, so a call
over many tables' tokens reads and writes them all in one compiled loop, token t of a table at
its base + t, instead of one call per table (`TokenTable.evict_one_each`, a decode step's
evictions across the batch; a round's I4 check and landing):

    slot:  [ table 3: 0..cap3 )[ table 7: 0..cap7 )[ (table 5, finished) ][ table 9 ... ) free
    live:  the same ranges

A table takes a range when it is made and a larger one when it outgrows it (by doubling, as
before); a range is never handed out twice. Ranges of finished tables, and the old ranges of
tables that grew, are reclaimed when the arena runs out of room: the tables still alive are
copied to the front of fresh arrays, twice as large as what they and the new range need, and
their views repointed. A view a caller kept from before the move still reads the table's values
as they were then (views are valid until the table next changes, token_table.py).

Fresh entries are 0 (slot) and True (live): a table's live bits are True past its length, so
that appending a token need not write its bit.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from vtoken.kv.token_table import TokenTable


class TokenArena:
    def __init__(self, num_entries: int = 4096) -> None:
        self.slot = np.zeros(num_entries, dtype=np.int64)
        self.live = np.ones(num_entries, dtype=bool)
        self.end = 0  # entries from here on were never handed out
        self._tables: weakref.WeakSet[TokenTable] = weakref.WeakSet()  # the tables whose ranges are in use

    def take(self, table: TokenTable, num_entries: int) -> int:
        """A fresh range of `num_entries` for `table`; returns its first index. May move every
        other table's range (repointing its views) to make room; the caller then repoints its
        own views, after copying what its current ones hold."""
        if self.end + num_entries > self.slot.size:
            self._compact(num_entries)
        base = self.end
        self.end += num_entries
        self._tables.add(table)
        return base

    def bases(self, tables: Sequence[TokenTable]) -> np.ndarray:
        """Where each table's tokens start here (int64), -1 for a table whose range is in
        another arena (another pool's): what the compiled loops over many tables' tokens take,
        token t of table k at bases[k] + t."""
        return np.fromiter([table._base if table._arena is self else -1 for table in tables], np.int64, len(tables))

    def _compact(self, num_entries_needed: int) -> None:
        tables = list(self._tables)
        num_used = sum(table._capacity for table in tables)
        num_entries = 2 * (num_used + num_entries_needed)
        slot = np.zeros(num_entries, dtype=np.int64)
        live = np.ones(num_entries, dtype=bool)
        end = 0
        for table in tables:
            old, capacity = table._base, table._capacity
            slot[end : end + capacity] = self.slot[old : old + capacity]
            live[end : end + capacity] = self.live[old : old + capacity]
            table.use_range(end, slot, live)
            end += capacity
        self.slot, self.live, self.end = slot, live, end
