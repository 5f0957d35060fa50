"""The block pool's live-token counts: what the token tables tell it of tokens that became live
or dead, and the pending appends it counts at its next read.

A mixin of `BlockPool` (block_pool.py owns the state these methods read and write: the live
counts, ref counts and reverse map, the histogram and the <= 50% count, the pending appends).
Every change of a block's live count moves its histogram bin and the <= 50% count with it, by
one of three paths: one block in Python integers (`add_live`, `remove_live_token`, one pending
append), distinct blocks in numpy (`_set_live`: appends, counted at a flush or at once by
`count_appended`, and freed blocks), and any blocks, ids repeating, in one compiled loop
(`adjust_live`, `remove_evicted_tokens`, `remove_evicted_one_each`, `land_moves`: evictions and landed moves; numba, kv/compiled.py,
loaded at the first call by `compiled_loops`: a process that neither evicts nor reclaims never
imports numba, tests/test_compiled.py).
"""

from __future__ import annotations

import numpy as np

from vtoken.errors import VTokenError
from vtoken.kv.arrays import count_by_block
from vtoken.lazy import imported_at_first_call

NUM_HISTOGRAM_BINS = 10

compiled_loops = imported_at_first_call("vtoken.kv.compiled")  # numba is not imported with the pool


class LiveCounts:
    """`BlockPool`'s live-count verbs (state in block_pool.py)."""

    def adjust_live(self, block_ids: np.ndarray, deltas: np.ndarray) -> np.ndarray:
        """Add `deltas[i]` live tokens to `block_ids[i]`, or `deltas[0]` to each when `deltas`
        has one entry (int64 ids of allocated blocks; an id may repeat, its deltas add up), in
        one compiled loop over the blocks (`change_live_counts`, which the substrate's own
        evictions and landings run inside theirs). Checked first, so that a rejected call
        changes nothing. Returns the blocks it left without a live token, ascending."""
        emptied, changes, reason, block_id = compiled_loops().change_live_counts(
            np.asarray(block_ids, dtype=np.int64), np.asarray(deltas, dtype=np.int64), self._live_counts, self.ref_counts,
            self._count_effects, self.scratch("adjust_live delta", np.int64), self.scratch("adjust_live seen", bool))
        if reason:
            self._refuse_live_change(reason, block_id)
        self.num_live_tokens += self._add_to_counts(changes.tolist())
        return emptied

    def remove_evicted_tokens(self, token_ids: np.ndarray, live: np.ndarray, slot: np.ndarray, num_pinned: int,
                              num_tokens: int, count_logical: bool) -> tuple[np.ndarray, int, int, int]:
        """A token table's batch eviction of `token_ids` (int64), checked and written in one
        compiled loop (kv/compiled_evict.py, `evict_tokens`): the ids' live bits in `live` and their
        slots' reverse-map entries cleared, one live token less in the block of each. `live` and
        `slot` are the table's per-token arrays; its pending appends must be counted first
        (its `flush`). Returns (the blocks left without a live token, ascending; 0; -1; with
        `count_logical`, the logical blocks before the one being written left without a live
        token, else the number of ids), or, having
        changed nothing, the refusal of an id (compiled.UNKNOWN_TOKEN ... REPEATED_TOKEN) and the
        id, for the table to report; raises the pool's own refusals."""
        loops = compiled_loops()
        emptied, changes, reason, culprit, num_logical_emptied = loops.evict_tokens(
            token_ids, live, slot, self._token_at, num_pinned, num_tokens, self.block_size, self._live_counts,
            self.ref_counts, self._count_effects, self.scratch("adjust_live delta", np.int64),
            self.scratch("adjust_live seen", bool), count_logical)
        if reason > loops.REPEATED_TOKEN:
            self._refuse_live_change(reason - loops.REPEATED_TOKEN, culprit)
        if reason == 0:
            self.num_live_tokens += self._add_to_counts(changes.tolist())
        return emptied, reason, culprit, num_logical_emptied

    def remove_evicted_one_each(self, token_ids: np.ndarray, num_tokens: np.ndarray, num_pinned: np.ndarray,
                                bases: np.ndarray) -> tuple[np.ndarray, int]:
        """A decode step's evictions across the batch, one token per table of this pool
        (`TokenTable.evict_one_each`: token_ids[i] of the table whose arena entries start at
        bases[i], of num_tokens[i] tokens and num_pinned[i] pinned), checked and written in one
        compiled loop (kv/compiled_evict.py, `evict_one_each`): the ids' live bits in the arena and
        their reverse-map entries cleared, one live token less in the block of each. The
        tables' pending appends must be counted first. Returns (per table, the block its
        eviction emptied or -1; -1), or, having changed nothing, (-, the first table whose id
        is not a live token outside its pinned prefix), for the table to report; raises the
        pool's own refusals, and, having changed nothing, tables that are not distinct tables of
        this pool (two at one base, or one given the base -1)."""
        loops = compiled_loops()
        arena = self.token_arena
        emptied, changes, reason, culprit = loops.evict_one_each(
            token_ids, num_tokens, num_pinned, bases, arena.live, arena.slot, self._token_at, self.block_size,
            self._live_counts, self.ref_counts, self._count_effects, self.scratch("adjust_live delta", np.int64),
            self.scratch("adjust_live seen", bool))
        if reason == loops.NOT_DISTINCT_TABLES:
            raise VTokenError("evict_one_each needs distinct tables of one pool")
        if reason > loops.REPEATED_TOKEN:
            self._refuse_live_change(reason - loops.REPEATED_TOKEN, culprit)
        if reason:
            return emptied, culprit
        self.num_live_tokens += self._add_to_counts(changes.tolist())
        return emptied, -1

    def land_moves(self, token_ids: np.ndarray, move_of: np.ndarray, num_tables: int, bases: np.ndarray,
                   src_blocks: np.ndarray, src_offsets: np.ndarray, dst_blocks: np.ndarray, dst_offsets: np.ndarray,
                   arena_live: np.ndarray, arena_slot: np.ndarray) -> np.ndarray:
        """Landed moves of `num_tables` tables, checked by the tables (`TokenTable.apply_moves_each`),
        written in one compiled loop (kv/compiled.py, `land_moves`): the moved live tokens'
        live counts and reverse-map entries, and every moved token's slot in the arena (table
        k's entries start at `bases[k]`). Returns, per table, whether it moved a live token; raises, having
        changed nothing, the pool's refusals, and tables that are not distinct tables of this
        pool (two at one base, or one given the base -1)."""
        loops = compiled_loops()
        has_live, changes, reason, block_id = loops.land_moves(
            token_ids, move_of, num_tables, bases, src_blocks, src_offsets, dst_blocks, dst_offsets, arena_live, arena_slot,
            self._token_at, self.block_size, self._live_counts, self.ref_counts, self._count_effects,
            self.scratch("adjust_live delta", np.int64), self.scratch("adjust_live seen", bool))
        if reason == loops.NOT_DISTINCT_TABLES:
            raise VTokenError("apply_moves_each needs distinct tables of one pool")
        if reason:
            self._refuse_live_change(reason, block_id)
        self.num_live_tokens += self._add_to_counts(changes.tolist())
        return has_live

    def _refuse_live_change(self, reason: int, block_id: int) -> None:
        """Raise `change_live_counts`' refusal `reason` of `block_id`: 1 an id outside the pool,
        2 a free block, 3 a live count that would leave [0, S]."""
        if reason == 1:
            raise VTokenError(f"adjust_live() got block ids out of range [0, {self.num_blocks}): [{block_id}]")
        if reason == 2:
            raise VTokenError(f"live-count change on free blocks [{block_id}]")
        raise VTokenError(f"live count of blocks [{block_id}] would leave [0, {self.block_size}]")

    def add_live(self, block_id: int, delta: int) -> int:
        """`adjust_live` for one block: the per-token path of growth and eviction. Returns the
        block's new live count."""
        if not 0 <= block_id < self.num_blocks:
            self._refuse_live_change(1, block_id)
        if self.ref_counts.item(block_id) <= 0:
            self._refuse_live_change(2, block_id)
        old_count = self._live_counts.item(block_id)
        new_count = old_count + delta
        if not 0 <= new_count <= self.block_size:
            self._refuse_live_change(3, block_id)
        self._recount(block_id, old_count, new_count)
        self.num_live_tokens += delta
        return new_count

    def count_appended(self, block_ids: np.ndarray) -> None:
        """Tokens appended now, one in the block of each entry of `block_ids` (a block repeats
        once per token): counted at once, where a decode step's append waits for the next flush
        (a prefill's, `TokenTable._sync_many`). The appends' numpy path, not the compiled loop:
        every replay prefills, and one that neither evicts nor reclaims never imports numba."""
        self._count_appends_many(*count_by_block(block_ids))
        self.num_live_tokens += block_ids.size

    def _count_appends(self, block_id: int, num_tokens: int) -> None:
        """`num_tokens` appended to `block_id` join its live count (`flush_deferred`);
        `num_live_tokens` counted them when they were appended."""
        old_count = self._live_counts.item(block_id)
        new_count = old_count + num_tokens
        if not 0 <= new_count <= self.block_size or self.ref_counts.item(block_id) <= 0:
            raise VTokenError(f"{num_tokens} appended tokens do not fit block {block_id} ({old_count} live)")
        self._recount(block_id, old_count, new_count)

    def _count_appends_many(self, block_ids: np.ndarray, counts: np.ndarray) -> None:
        """`_count_appends` of distinct blocks (`flush_deferred`), checked first, so that
        a rejected call changes nothing."""
        new_counts = self._live_counts[block_ids] + counts
        bad = (new_counts > self.block_size) | (self.ref_counts[block_ids] <= 0)
        if np.count_nonzero(bad):
            block_id = int(block_ids[bad][0])
            raise VTokenError(f"{int(counts[bad][0])} appended tokens do not fit block {block_id} ({self._live_counts[block_id]} live)")
        self._set_live(block_ids, new_counts.astype(np.int32))  # num_live_tokens counted them when appended

    def remove_live_token(self, block_id: int) -> int:
        """One live token of an allocated block died: `add_live(block_id, -1)` for a caller
        that holds the block and knew the token live (a token table), so nothing to check.
        Returns the block's new live count."""
        old_count = self._live_counts.item(block_id)
        self._recount(block_id, old_count, old_count - 1)
        self.num_live_tokens -= 1
        return old_count - 1

    def _recount(self, block_id: int, old_count: int, new_count: int) -> None:
        """Set one block's live count; its histogram bin and the <= 50% count follow."""
        self._live_counts[block_id] = new_count
        histogram, bin_of, is_le_half = self._histogram, self._bin_list, self._is_le_half_list
        histogram[bin_of[old_count]] -= 1
        histogram[bin_of[new_count]] += 1
        self._num_blocks_le_half += is_le_half[new_count] - is_le_half[old_count]

    def _set_live(self, block_ids: np.ndarray, new_counts: np.ndarray) -> int:
        """Set distinct blocks' live counts; the histogram and the <= 50% count follow. Returns
        the change in live tokens, for the caller to add to `num_live_tokens` unless it counted
        them already (appends)."""
        old_counts = self._live_counts[block_ids]
        num_counts = self.block_size + 1
        # blocks gained minus blocks lost at each live count, then what that adds up to: the
        # histogram's bins, the <= 50% count and the live tokens, in one product
        by_count = np.bincount(new_counts, minlength=num_counts) - np.bincount(old_counts, minlength=num_counts)
        self._live_counts[block_ids] = new_counts
        return self._add_to_counts((by_count @ self._count_effects).tolist())

    def _add_to_counts(self, changes: list[int]) -> int:
        """Add a change of live counts to the histogram's bins and the <= 50% count: `changes`
        is a sum of rows of `_count_effects` (bins, <= 50%, live tokens). Returns the change
        in live tokens, for the caller to add to `num_live_tokens` unless it counted them."""
        histogram = self._histogram
        for bin_idx in range(NUM_HISTOGRAM_BINS):
            if changes[bin_idx]:
                histogram[bin_idx] += changes[bin_idx]
        self._num_blocks_le_half += changes[NUM_HISTOGRAM_BINS]
        return changes[NUM_HISTOGRAM_BINS + 1]

    def flush_deferred(self) -> None:
        """Count every pending append: its block's live count, then its reverse-map entry
        (`num_live_tokens` counted it when it was appended). The counts are checked first, so
        that a refused flush changes nothing and keeps the appends pending."""
        slots, token_ids = self.pending_slots, self.pending_token_ids
        if not slots:
            return
        if len(slots) == 1:
            self._count_appends(slots[0] // self.block_size, 1)
            self._token_at[slots.pop()] = token_ids.pop()
            return
        slot_array = np.array(slots, dtype=np.int64)
        block_ids = slot_array // self.block_size
        block_ids.sort()
        if np.count_nonzero(block_ids[1:] == block_ids[:-1]):  # a table appended more than once since the last flush
            self._count_appends_many(*count_by_block(block_ids))
        else:  # the usual step: one append per decoding request
            self._count_appends_many(block_ids, np.ones(block_ids.size, dtype=np.int64))
        self._token_at[slot_array] = token_ids
        slots.clear()
        token_ids.clear()
