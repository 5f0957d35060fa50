"""Relocation and release verbs of the token table: adopt destination blocks, repoint moved
tokens after their copy, give back blocks that hold no live token.

A mixin of `TokenTable` (token_table.py owns the state these methods read and write). The
reclaimer decides the moves and the copy engine moves the data first; these verbs only change
the mapping, and each checks its whole input before changing anything.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from vtoken.errors import VTokenError
from vtoken.kv.arrays import block_slots, is_distinct, isin, positions_in
from vtoken.kv.block_pool import NO_BLOCKS
from vtoken.kv.moves import Moves

if TYPE_CHECKING:
    from vtoken.kv.token_table import TokenTable


class RelocationVerbs:
    """`TokenTable`'s relocation and release verbs (state in token_table.py)."""

    def adopt_blocks(self, block_ids: np.ndarray) -> None:
        """Take freshly allocated relocation destinations; they sit before the tail."""
        block_ids = np.asarray(block_ids, dtype=np.int64)
        if block_ids.size == 0:
            return
        self.flush()
        self._off_logical_layout = True  # the destinations are held before the moves land
        held = self._held[: self._num_held]
        tail = held[-1:].copy()
        tail_slot, cursor = self._tail_slot, self.tail_num_written
        self._num_held -= tail.size
        self._push_held(np.concatenate((block_ids, tail)))
        if tail.size:
            self._tail_slot, self.tail_num_written = tail_slot, cursor
        self._recount_holes()
        self.layout_version += 1

    def apply_moves(self, moves: Moves, checked_at_version: int | None = None) -> None:
        """Repoint moved tokens to their destination slots. Only after their copy completed.

        Every move's source must be the token's current slot and no destination may hold a live
        token that stays; otherwise nothing changes and VTokenError is raised. A token evicted
        while its copy was in flight is repointed without live-count changes.

        `checked_at_version`: the table's `layout_version` when the caller checked these moves
        against it (`invariants.check_plan` checks all of the above); while the table is still
        at that version nothing they depend on changed, and the check is not repeated.
        """
        self.apply_moves_each([self], [moves], [checked_at_version])

    @staticmethod
    def apply_moves_each(tables: Sequence[TokenTable], moves: Sequence[Moves],
                         checked_at_versions: Sequence[int | None],
                         end_to_end: tuple[Moves, np.ndarray] | None = None) -> None:
        """`apply_moves` of `moves[i]` on `tables[i]` (distinct tables of one pool, as the plans
        of a reclamation round that land together), with the pool's live counts and reverse map
        updated once for all of them instead of once per table. Every table's moves are checked
        first, so that a rejected call changes nothing. `end_to_end`: `moves` end to end with
        the index of the table of each, when the caller has them (a round's plans,
        moves.end_to_end), read instead of concatenating them again."""
        if not len(tables) == len(moves) == len(checked_at_versions):
            raise VTokenError(f"apply_moves_each got {len(tables)} tables, {len(moves)} moves and {len(checked_at_versions)} versions")
        work = [(table, table_moves, version) for table, table_moves, version in zip(tables, moves, checked_at_versions)
                if table_moves.num_moves]
        if not work:
            return
        pool = work[0][0].pool
        pool.flush_deferred()  # every table's tail in the reverse map before a check reads it
        for table, table_moves, version in work:
            if version != table.layout_version:
                table._check_moves(table_moves)
        # every table's moves end to end (a table without moves is left out: indices into
        # `work`); each table's entries in the pool's arena start at its base there
        if end_to_end is not None and len(work) == len(tables):
            all_moves, move_of = end_to_end
        else:
            all_moves, move_of = Moves.joined([table_moves for _, table_moves, _ in work])
        token_ids = all_moves.token_ids
        arena = pool.token_arena
        # a table of another pool has no base in this pool's arena (-1): the compiled loop
        # refuses it, and a table given twice (two at one base), before it writes anything
        bases = arena.bases([table for table, _, _ in work])
        # the pool's side and the tables' slots in one loop; a token evicted while its copy was
        # in flight is repointed without live-count changes (a table still at its checked
        # version has every moved token live)
        has_live = pool.land_moves(token_ids, move_of, len(work), bases, all_moves.src_block_ids, all_moves.src_offsets,
                                   all_moves.dst_block_ids, all_moves.dst_offsets, arena.live, arena.slot)
        for (table, table_moves, _), moved_live in zip(work, has_live.tolist()):
            table._repointed(table_moves, moved_live)

    def _repointed(self, moves: Moves, has_live: bool) -> None:
        """The table's half of `apply_moves_each`, once its moved tokens' slots are written:
        its counters (`has_live`: some of the moved tokens are live, so the slot list changed)."""
        if has_live:
            self._cache.is_valid = False
        self._off_logical_layout = True
        self.layout_version += 1

    def _check_moves(self, moves: Moves) -> None:
        ids = moves.token_ids
        if not ids.size:
            return
        if ids.min() < 0 or ids.max() >= self.num_tokens or not is_distinct(ids):
            raise VTokenError(f"request {self.req_id}: moves name unknown or repeated tokens")
        stale = self._slot[ids] != moves.src_slots(self.block_size)
        if stale.any():
            token_id = int(ids[stale][0])
            raise VTokenError(f"request {self.req_id}: move of token {token_id} names a source it does not occupy")
        dst_block_ids = moves.dst_block_ids
        held = positions_in(self._held[: self._num_held], dst_block_ids) >= 0
        if not held.all():
            raise VTokenError(f"request {self.req_id}: move into block {int(dst_block_ids[~held][0])} it does not hold")
        # a destination is taken when a live token that does not move away sits there
        dst_slots = moves.dst_slots(self.block_size)
        occupant = self._token_at[dst_slots]
        occupied = occupant >= 0
        if occupied.any():
            moving = set(ids[self._live[ids]].tolist())
            occupied[occupied] = [token_id not in moving for token_id in occupant[occupied].tolist()]
        if occupied.any() or not is_distinct(dst_slots):
            slot = int(dst_slots[occupied][0]) if occupied.any() else int(dst_slots[0])
            raise VTokenError(f"request {self.req_id}: move onto occupied slot {slot} (block {slot // self.block_size}, offset {slot % self.block_size})")

    def release_blocks(self, block_ids: np.ndarray) -> None:
        """Forget blocks that hold no live token of this request (the caller frees them).

        When the tail goes, the block before it becomes the tail (`_drop_held`).
        """
        released = np.asarray(block_ids, dtype=np.int64).ravel()
        if released.size == 0:
            return
        self.flush()
        held = self._held[: self._num_held]
        released = np.sort(released)
        if not is_distinct(released):
            released = np.unique(released)
        is_released = isin(held, released)
        if np.count_nonzero(is_released) != released.size:
            raise VTokenError(f"request {self.req_id}: releasing blocks it does not hold {np.setdiff1d(released, held).tolist()}")
        if self.pool.live_counts[released].any():  # the pool counts what the tables hold (I2)
            raise VTokenError(f"request {self.req_id}: releasing blocks that still hold live tokens")
        self._drop_held(0, is_released)

    def release_empty_blocks(self) -> np.ndarray:
        """`release_blocks` of every block past the pinned prefix that holds no live token (what
        a relocation that landed leaves: its sources, and any block evicted empty while its copy
        was in flight), found by the pool's counts, and the pool's `free` of them, in one pass,
        without the checks that blocks named by a caller need. Returns them, in held order (the
        pool has freed them)."""
        return self.release_empty_blocks_each([self])

    @staticmethod
    def release_empty_blocks_each(tables: Sequence[TokenTable]) -> np.ndarray:
        """`release_empty_blocks` of every table (distinct tables of one pool, as the plans of a
        round that landed together): every table's blocks past its pinned prefix read against
        the pool's live counts, and those without a live token freed, in one compiled pass
        (`BlockPool.release_empty`); each table that lost some keeps the rest with one write.
        Returns the blocks released, table by table in held order (the pool has freed them).
        Raises, changing nothing, for tables that are not distinct tables of one pool, as
        `apply_moves_each` does."""
        if not tables:
            return NO_BLOCKS
        pool = tables[0].pool
        starts = [table.num_pinned_tokens // table.block_size for table in tables]
        helds = [table._held[start : table._num_held] for table, start in zip(tables, starts)]
        sizes = [table_held.size for table_held in helds]
        held = helds[0] if len(helds) == 1 else np.concatenate(helds)  # one table's: a view
        # a table of another pool has no base in this pool's arena (-1), and a table given
        # twice shares one: the compiled pass refuses both before it writes anything
        kept, released, num_released = pool.release_empty(held, np.array(sizes, dtype=np.int64), pool.token_arena.bases(tables))
        if not released.size:
            return NO_BLOCKS
        first_kept, end = 0, 0
        for table, start, size, num_dropped in zip(tables, starts, sizes, num_released.tolist()):
            num_kept = size - num_dropped
            end += size
            if num_dropped:  # a table without blocks has size 0 and drops nothing
                is_tail_dropped = num_kept == 0 or kept.item(first_kept + num_kept - 1) != held.item(end - 1)
                table._keep_held(start, kept[first_kept : first_kept + num_kept], is_tail_dropped)
            first_kept += num_kept
        return released

    def _drop_held(self, start: int, is_dropped: np.ndarray) -> None:
        """Forget the held blocks from position `start` on that `is_dropped` marks (one entry
        per block from there to the tail): `_keep_held` of the others."""
        self._keep_held(start, self._held[start : self._num_held][~is_dropped], bool(is_dropped[-1]))

    def _keep_held(self, start: int, kept: np.ndarray, is_tail_dropped: bool) -> None:
        """Hold, from position `start` on, only `kept` (the blocks held from there, in order, less
        those dropped; `is_tail_dropped`: the tail is one of them). When the tail goes, the block
        before it becomes the tail. A full tail changes nothing for the next token, which opens a
        fresh block either way, so the new tail is full too (its cursor stays at S): the open tail
        is then always a block opened when the request held a multiple of S tokens, as the
        uncompacted layout's is, so compaction never makes attention read further into it
        (reopening the block the tail's tokens moved into did: tests/test_serving_fidelity.py, a
        packed full tail). An open tail that went (every token written to it evicted) hands the
        cursor to the end of the new tail's last live token."""
        was_full = self.tail_num_written == self.block_size
        self._held[start : start + kept.size] = kept
        self._num_held = start + kept.size
        if is_tail_dropped:
            self._tail_slot = int(self._held[self._num_held - 1]) * self.block_size if self._num_held else 0
            self.tail_num_written = self.block_size if was_full and self._num_held else self._cursor_after_last_live()
            self._off_logical_layout |= not was_full  # the next tokens go where the cursor was handed back
        self._recount_holes()
        self.layout_version += 1

    def set_tail_cursor(self, num_written: int) -> None:
        """Move the append cursor of the tail block, after a compaction packed its live tokens
        into the first `num_written` offsets (as an engine that writes new tokens right after
        the live ones expects). Raises, changing nothing, if a live token sits at or past it."""
        self.flush()
        if not self._num_held or not 0 <= num_written <= self.block_size:
            raise VTokenError(f"request {self.req_id}: cannot set the tail cursor to {num_written}")
        if (self._token_at[self._tail_slot + num_written : self._tail_slot + self.block_size] >= 0).any():
            raise VTokenError(f"request {self.req_id}: a live token sits at or past tail offset {num_written}")
        self.tail_num_written = num_written
        self._off_logical_layout = True
        self._recount_holes()
        self.layout_version += 1

    def live_ids_in(self, block_ids: np.ndarray) -> np.ndarray:
        """Live tokens stored in `block_ids`, in logical order, from the pool's reverse map."""
        self.flush()
        token_ids = self._token_at[block_slots(block_ids, self.block_size)]
        return np.sort(token_ids[token_ids >= 0])

    def _cursor_after_last_live(self) -> int:
        if not self._num_held:
            return 0
        in_tail = np.flatnonzero(self._token_at[self._tail_slot : self._tail_slot + self.block_size] >= 0)
        return int(in_tail[-1]) + 1 if in_tail.size else 0

    def release_all(self) -> list[int]:
        """Drop every block (request finished or preempted); returns them for the caller to free."""
        self.flush()
        block_ids = self._held[: self._num_held].tolist()
        self._num_held = 0
        self._live[: self.num_tokens] = False
        self._num_dead = self.num_tokens
        self._cache.is_valid = False
        self._off_logical_layout, self._uncompacted_floor = False, 0
        self.num_pinned_tokens = 0  # nothing held, nothing pinned
        self.tail_num_written = 0
        self._tail_slot = 0
        self._recount_holes()
        self.layout_version += 1
        return block_ids

