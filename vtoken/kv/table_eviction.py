"""Eviction verbs of the token table: mark tokens dead, metadata only (no KV moves).

A mixin of `TokenTable` (token_table.py owns the state these methods read and write). Eviction
clears live bits and removes the tokens from the pool's reverse map and live counts; the slot
list is its reader's (`slots()`): a single victim is recorded for the next read to drop, a batch
invalidates the list for the next read to rebuild. The blocks it empties are returned for the
caller to release and free.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from vtoken.errors import VTokenError
from vtoken.kv.block_pool import NO_BLOCKS
from vtoken.kv.live_counts import compiled_loops

if TYPE_CHECKING:
    from vtoken.kv.token_table import TokenTable



class EvictionVerbs:
    """`TokenTable`'s eviction verbs (state in token_table.py)."""

    def evict_tokens(self, token_ids: np.ndarray) -> np.ndarray:
        """Mark tokens dead (metadata only: no KV moves). Returns blocks of this request that
        are now empty, which the caller may release with `release_blocks`.

        Raises (changing nothing) for an unknown, dead, pinned or repeated id.
        """
        if type(token_ids) is np.ndarray and token_ids.size == 1 and token_ids.dtype.kind in "iu":  # the per-step case
            return self._evict_one(token_ids.item())
        token_ids = np.ascontiguousarray(token_ids, dtype=np.int64)  # the compiled loop's one layout
        if token_ids.size == 0:
            return NO_BLOCKS
        if token_ids.size == 1:
            return self._evict_one(int(token_ids.flat[0]))
        self.flush()  # the blocks' counts must be whole before they can tell whether they emptied
        # the layout trigger's bound (table_layout.py) falls by the logical blocks the eviction
        # empties, counted where the trigger reads it: a table with a token off its position
        emptied, reason, token_id, num_logical_emptied = self.pool.remove_evicted_tokens(
            token_ids, self._live, self._slot, self.num_pinned_tokens, self.num_tokens, self._off_logical_layout)
        if reason:
            self._refuse_eviction(reason, token_id)
        self._num_dead += token_ids.size
        self._num_holes += token_ids.size
        self._uncompacted_floor -= num_logical_emptied
        self._cache.is_valid = False
        self.layout_version += 1
        return emptied

    @staticmethod
    def evict_one_each(tables: Sequence[TokenTable], token_ids: np.ndarray) -> np.ndarray:
        """`evict_tokens` of `token_ids[i]` in `tables[i]`, one token per table (distinct tables
        of one pool, as a decode step's evictions across the batch): the tokens' live bits and
        slots are read and written in the pool's arena with one gather and one scatter for all
        of them (token_arena.py), the pool's live counts and reverse map once for all of them;
        per table, only its counters are bumped.

        Returns [len(tables)] int64: the block each eviction emptied, -1 where none (the caller
        releases it with that table's `release_blocks` and frees them all in one call). Raises,
        changing nothing, for an unknown, dead or pinned id or a table given twice.
        """
        ids = np.ascontiguousarray(token_ids, dtype=np.int64).ravel()  # the compiled loop's one layout
        if len(tables) != ids.size:
            raise VTokenError(f"evict_one_each got {len(tables)} tables and {ids.size} token ids")
        if not tables:
            return np.zeros(0, dtype=np.int64)
        pool = tables[0].pool
        num_tables = len(tables)
        lengths = np.fromiter([table.num_tokens for table in tables], np.int64, num_tables)
        num_pinned = np.fromiter([table.num_pinned_tokens for table in tables], np.int64, num_tables)
        # a table of another pool has no base in this pool's arena (-1): the compiled loop
        # refuses it, and a table given twice (two at one base)
        bases = pool.token_arena.bases(tables)
        tables[0].flush()  # the blocks' counts must be whole before they can tell whether they emptied
        emptied, refused = pool.remove_evicted_one_each(ids, lengths, num_pinned, bases)
        if refused >= 0:
            tables[refused].evictable_slot(int(ids[refused]))  # raises the table's error
            raise VTokenError(f"request {tables[refused].req_id}: token {int(ids[refused])} refused by the pool's arena but not by its table")
        for table, token_id in zip(tables, ids.tolist()):  # what stays per table: its counters and slot list
            table._count_dead(token_id)
        return emptied

    def _evict_one(self, token_id: int) -> np.ndarray:
        """`evict_tokens` of a single id, with scalars only (same checks, same result)."""
        slot = self.evictable_slot(token_id)
        self.flush()  # the block's count must be whole before it can tell whether it emptied
        self._live[token_id] = False
        self._count_dead(token_id)
        self._token_at[slot] = -1
        block_id = slot // self.block_size
        if self.pool.remove_live_token(block_id):
            return NO_BLOCKS
        return np.array([block_id], dtype=np.int64)

    def evictable_slot(self, token_id: int) -> int:
        """The slot of `token_id`; raises VTokenError unless it is a live token outside the
        pinned prefix. Changes nothing."""
        if not 0 <= token_id < self.num_tokens:
            raise VTokenError(f"request {self.req_id}: cannot evict unknown token {token_id} (length {self.num_tokens})")
        if not self._live.item(token_id):
            raise VTokenError(f"request {self.req_id}: token {token_id} is already evicted")
        if token_id < self.num_pinned_tokens:
            raise VTokenError(f"request {self.req_id}: token {token_id} is in the shared prefix and cannot be evicted")
        return self._slot.item(token_id)

    def _count_dead(self, token_id: int) -> None:
        """The table's counters and slot list once `token_id`, live until now, died (its live bit
        is the caller's: `_evict_one` clears it, `evict_one_each` every table's at once)."""
        if self._cache.is_valid:  # the slot list's reader drops the entry when it next reads
            self._cache.remove_later(token_id)
        self._num_dead += 1
        self._num_holes += 1
        self._uncompacted_floor -= 1
        self.layout_version += 1

    def _refuse_eviction(self, reason: int, token_id: int) -> None:
        """Raise the pool's refusal `reason` of `token_id` (`BlockPool.remove_evicted_tokens`)."""
        compiled_reasons = compiled_loops()
        if reason == compiled_reasons.UNKNOWN_TOKEN:
            raise VTokenError(f"request {self.req_id}: cannot evict unknown token {token_id} (length {self.num_tokens})")
        if reason == compiled_reasons.DEAD_TOKEN:
            raise VTokenError(f"request {self.req_id}: token {token_id} is already evicted")
        if reason == compiled_reasons.PINNED_TOKEN:
            raise VTokenError(f"request {self.req_id}: token {token_id} is in the shared prefix and cannot be evicted")
        raise VTokenError(f"request {self.req_id}: evict_tokens got repeated ids")
