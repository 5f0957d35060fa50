"""What the reclaimer and the runtime's layout trigger read of a token table's layout: how many
blocks a packing could give back (the O(1) bound), how many its uncompacted layout would hold,
and how many it holds beyond that; and, for a round's planning and its I4 check, many tables'
blocks end to end at once.

A mixin of `TokenTable` (token_table.py owns the state these methods read: the held blocks, the
live bits, for `num_blocks_over_uncompacted` a flag and a bound that the eviction and relocation
verbs keep, and for the O(1) bound a count they keep, recounted here). Nothing here changes the
mapping.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from vtoken.kv.token_table import TokenTable

# block sizes whose live bits pack into one unsigned word (np.packbits: 8 bits a byte), for
# num_uncompacted_blocks
_BLOCK_BITS_WORD = {8: np.uint8, 16: np.uint16, 32: np.uint32, 64: np.uint64}


class LayoutCounts:
    """`TokenTable`'s layout counts (state in token_table.py)."""

    def max_reclaimable_blocks(self) -> int:
        """An upper bound, in O(1), of the blocks a perfect packing of the relocatable live
        tokens would give back: the held blocks past the pinned prefix but the open tail, as if
        none were shared, with at most the cursor's count of live tokens taken out for the
        tail. A bound, because leaving out a block with at most S live tokens never raises the
        count, nor does counting fewer live tokens (the reclaimer's cheap pre-filter).

        Those blocks less ceil(the live tokens counted / S) is floor(S per block less those
        tokens, / S): `_num_holes` is that difference, which the verbs keep (`_recount_holes`),
        so that a round's ranking reads one number per request."""
        return self._num_holes // self.block_size

    def _recount_holes(self) -> None:
        """`_num_holes` from the table's counters, after a verb dropped or added held blocks or
        set the tail cursor back. The other verbs leave it as it is or add to it:

        - an append, of one token or many: into an open tail, no counted block or live token
          changes (the tail is left out); filling the tail counts one block more and S live
          tokens more; opening a new tail counts the full one and leaves the open one out;
        - pinning a prefix takes whole blocks of S live tokens out of both counts, and a shared
          prefix is attached to a table with no token (nothing counted before or after);
        - an eviction adds one free slot, wherever the token sat (a dead token is counted out of
          the live ones), and the eviction verbs add it;
        - a move changes none of the counts it is made from (held blocks, tokens, the cursor)."""
        block_size, num_pinned = self.block_size, self.num_pinned_tokens
        num_blocks = self._num_held - num_pinned // block_size
        num_live = self.num_tokens - self._num_dead - num_pinned
        if num_blocks > 0 and self.tail_num_written < block_size:
            num_blocks -= 1
            num_live -= self.tail_num_written
        self._num_holes = block_size * num_blocks - num_live

    @staticmethod
    def candidate_blocks_each(tables: Sequence[TokenTable]) -> tuple[np.ndarray, np.ndarray]:
        """The blocks a relocation plan of each table may touch but for the shared ones (which
        planning.Movables leaves out by their ref counts): held, past the pinned prefix, the
        open tail left out. Every table's end to end, and how many of each (int64; one table's
        blocks are a view of its own array)."""
        held, sizes = [], []
        for table in tables:
            block_size = table.block_size
            start, end = table.num_pinned_tokens // block_size, table._num_held
            end -= end > start and table.tail_num_written < block_size
            held.append(table._held[start:end])
            sizes.append(end - start)
        return held[0] if len(held) == 1 else np.concatenate(held), np.array(sizes, dtype=np.int64)

    @staticmethod
    def held_blocks_each(tables: Sequence[TokenTable]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """What a round's I4 check reads of its tables' blocks (invariants.plans_pass): every
        table's held blocks end to end and where each table's end, the blocks of their pinned
        prefixes end to end, and the open tail of each table with one (int64; one table's are
        views of its own arrays, as a paced round step checks one plan)."""
        held, ends, pinned, open_tails = [], [], [], []
        num_blocks = 0
        for table in tables:
            num_held, block_size = table._num_held, table.block_size
            table_held = table._held[:num_held]
            held.append(table_held)
            num_blocks += num_held
            ends.append(num_blocks)
            pinned.append(table_held[: table.num_pinned_tokens // block_size])
            if num_held and table.tail_num_written < block_size:
                open_tails.append(table._held.item(num_held - 1))
        if len(tables) == 1:
            return held[0], np.array(ends, dtype=np.int64), pinned[0], np.array(open_tails, dtype=np.int64)
        return np.concatenate(held), np.array(ends, dtype=np.int64), np.concatenate(pinned), np.array(open_tails, dtype=np.int64)

    def num_uncompacted_blocks(self) -> int:
        """Blocks the request would hold had nothing ever been moved (naive-evict's layout):
        every logical block of S token ids with a live token, and the one being written.

            token ids:  [0..S) [S..2S) [2S..3S) [3S..4S)      live ids 1, 2S+3, 3S+1 (writing)
            held:        yes    no      yes      yes           -> 3 blocks
        """
        if not self.num_tokens:
            return 0
        block_size = self.block_size
        num_before_writing = (self.num_tokens - 1) // block_size  # the block being written counts, live or not
        live = self._live[: num_before_writing * block_size]
        word = _BLOCK_BITS_WORD.get(block_size)
        if word is None:
            return int(np.count_nonzero(live.reshape(num_before_writing, block_size).any(axis=1))) + 1
        # a block's live bits packed into one unsigned word: nonzero when any of them is set
        return int(np.count_nonzero(np.packbits(live).view(word))) + 1

    def num_blocks_over_uncompacted(self) -> int:
        """max(0, num_blocks - num_uncompacted_blocks()): the blocks this request holds beyond
        what it would hold had nothing ever been moved, which the runtime's `layout` trigger
        packs away after an eviction. Counted only when it can be above 0 (the count reads
        every live bit):

        - a table whose tokens all sit where the uncompacted layout puts them (none was moved,
          no destination adopted, and its tail cursor was never set back: a new block opens at
          every S-th token) holds that layout's blocks less those it released, so no more (a
          request with a copy in flight, whose emptied blocks wait for the landing, is not
          asked). Dropping an open tail that an eviction emptied hands the cursor back to the
          block before it, and the tokens after it land off their positions;
        - the uncompacted count never falls under an append (a new block being written replaces
          the last one in the count) or a move, and falls by at most one block per token evicted:
          the last count less the tokens evicted since is a lower bound, and holding no more
          blocks than that bound leaves nothing over it.
        """
        if not self._off_logical_layout or self._num_held <= self._uncompacted_floor:
            return 0
        if self._num_held <= -(-self.num_live_tokens // self.block_size):
            return 0  # no layout holds fewer blocks than its live tokens fill
        num_uncompacted = self._uncompacted_floor = self.num_uncompacted_blocks()
        return max(0, self._num_held - num_uncompacted)
