"""The per-request token table: logical token id -> (block_id, offset) and a live bit.

Logical ids are 0..L-1 in arrival order and equal the token's rotary position, which never
changes. The table owns the mapping; the block pool owns block state (ref counts, live counts,
and `token_at`, the reverse map slot -> logical id of the live token stored there). Memory is
O(L) numpy arrays, grown by doubling; there is no Python object per token. The per-token arrays
(slot and live bit) are views of the table's range in the pool's arena (token_arena.py), so
that one call can read and write many tables' tokens at once (`evict_one_each`).

A request holds an ordered list of blocks; the last one is the *tail*, where new tokens are
appended at `tail_num_written`. Holes are dead slots anywhere before the cursor:

    blocks:   [ b7              ][ b2              ][ b9 (tail)        ]
    slots:    L L . L L . . L L  L . . . L L L L L  L L L . . . . . . .
                  ^ hole                              ^ cursor = 3

Eviction only clears live bits. Relocation (`apply_moves`) repoints live tokens into other
slots; the reclaimer decides the moves, the copy engine moves the data first. This module holds
the state, its read-only views and growth (the decode step's path); the verbs that take tokens
away are mixins with the same state: eviction in table_eviction.py, relocation and release in
table_relocation.py; the layout counts the reclaimer reads in table_layout.py.

Cost model. A decode step appends one token with Python integers and one array store: the
pool's total live count is bumped at once, the tail block's count and the reverse map catch up
lazily, every table's at once, when the pool is next read (`BlockPool.live_counts`, `token_at`,
the histogram) or a table's verb needs them (`flush`), so every read sees exact numbers. Until
the first eviction every token is live, and the slot list (Eq. 2) is the per-token slot array
itself; after it, a separate slot cache is built by the first `slots()` and kept for the reads
after it: an eviction only records the token, and the next read drops its entry
(slot_cache.py), so an eviction costs O(1) whether or not anything reads the list; a batch
eviction or a relocation makes the next read rebuild it. Reclamation reads `token_at`, so
planning and applying cost O(blocks touched x S), not O(L). A `slots()` result is a view,
valid until the table changes.
"""

from __future__ import annotations

import numpy as np

from vtoken.errors import VTokenError
from vtoken.kv.arrays import block_slots, is_distinct, positions_in
from vtoken.kv.block_pool import BlockPool
from vtoken.kv.slot_cache import SlotCache
from vtoken.kv.table_eviction import EvictionVerbs
from vtoken.kv.table_layout import LayoutCounts
from vtoken.kv.table_relocation import RelocationVerbs


class TokenTable(EvictionVerbs, RelocationVerbs, LayoutCounts):
    def __init__(self, req_id: int, pool: BlockPool, capacity: int = 64) -> None:
        self.req_id = req_id
        self.pool = pool
        self.block_size = pool.block_size
        self._token_at = pool.token_at  # the pool's reverse map; the same array for the pool's life
        self.num_tokens = 0
        self._num_dead = 0
        self._num_holes = 0  # the O(1) reclaimable bound's free slots (table_layout.py)
        self.num_pinned_tokens = 0  # a shared prefix: never evicted, never relocated
        self.tail_num_written = 0
        self._tail_slot = 0  # slot of offset 0 of the tail block
        self.layout_version = 0  # bumped by every change a relocation plan could depend on
        # for `num_blocks_over_uncompacted` (table_layout.py): whether a token may sit off its
        # uncompacted position (a token was moved, a destination adopted, or the tail cursor set
        # back) since the table was last empty, and a lower bound of `num_uncompacted_blocks()`
        self._off_logical_layout = False
        self._uncompacted_floor = 0
        # per logical token, views of this table's range of the pool's arena (token_arena.py):
        # _slot, block_id * S + offset, stale for dead tokens; _live, True past num_tokens, so
        # appending need not write it. _capacity is _slot.size for the decode step: reading
        # ndarray.size there costs ~5% of it
        self._capacity = max(capacity, 1)
        self._arena = pool.token_arena
        self.use_range(self._arena.take(self, self._capacity), self._arena.slot, self._arena.live)
        self._held = np.zeros(16, dtype=np.int64)
        self._num_held = 0
        self._cache = SlotCache()  # the slot list once a token is dead

    # ---- read-only views ---------------------------------------------------------------------
    # One name per concept. Per logical token ([num_tokens], stale for dead tokens):
    # `token_slots`, `token_block_ids`, `token_offsets`, `live_mask`. Per block the request holds
    # ([num_blocks], the tail last): `held_block_ids`. Views are read-only and valid until the
    # table next changes; only the table's verbs change its mapping.

    @property
    def token_slots(self) -> np.ndarray:
        """block_id * S + offset of each logical token."""
        return _read_only(self._slot[: self.num_tokens])

    @property
    def token_block_ids(self) -> np.ndarray:
        """Block of each logical token (a new array)."""
        return self._slot[: self.num_tokens] // self.block_size

    @property
    def token_offsets(self) -> np.ndarray:
        """Offset inside its block of each logical token (a new array)."""
        return self._slot[: self.num_tokens] % self.block_size

    @property
    def live_mask(self) -> np.ndarray:
        """True for each logical token still live."""
        return _read_only(self._live[: self.num_tokens])

    @property
    def num_live_tokens(self) -> int:
        return self.num_tokens - self._num_dead

    @property
    def held_block_ids(self) -> np.ndarray:
        """The blocks this request holds, in order, the tail last."""
        return _read_only(self._held[: self._num_held])

    @property
    def num_blocks(self) -> int:
        return self._num_held

    @property
    def num_pinned_blocks(self) -> int:
        return self.num_pinned_tokens // self.block_size

    def live_token_ids(self, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Live logical ids, ascending; only those in [start, stop) when given (stop at most
        num_tokens)."""
        stop = self.num_tokens if stop is None else min(stop, self.num_tokens)
        if start <= 0:
            return self._live[:stop].nonzero()[0]  # np.flatnonzero, without its Python wrapper's ravel
        return self._live[start:stop].nonzero()[0] + start

    def evicted_token_ids(self) -> np.ndarray:
        return np.flatnonzero(~self._live[: self.num_tokens])

    def slots(self) -> np.ndarray:
        """Physical slots of the live tokens in logical order (Eq. 2): block_id * S + offset.

        A view that stays valid until the table next changes (copy it to keep it). Built on
        the first read after a token died; then appended to as the sequence grows, the entries
        of single evictions dropped at the next read, and rebuilt after a batch eviction or a
        relocation (slot_cache.py).
        """
        if not self._num_dead:
            return self._slot[: self.num_tokens]
        cache = self._cache
        if not cache.is_valid:
            self._rebuild_slot_cache()
        elif cache.has_pending:
            cache.catch_up(self._live, self.num_tokens)
        return cache.slots()

    def _rebuild_slot_cache(self) -> None:
        live_slots = self._slot[: self.num_tokens][self._live[: self.num_tokens]]
        self._cache.reset(live_slots.size)[:] = live_slots

    def num_free_tail_slots(self) -> int:
        return self.block_size - self.tail_num_written if self._num_held else 0

    def num_new_blocks_needed(self, num_new_tokens: int) -> int:
        overflow = num_new_tokens - (self.block_size - self.tail_num_written if self._num_held else 0)
        return -(-overflow // self.block_size) if overflow > 0 else 0

    # ---- the pool's deferred view of the tail ------------------------------------------------

    def flush(self) -> None:
        """Count the pending appends in the pool, live counts and reverse-map entries: every
        table's, which the pool holds in one list (`BlockPool.flush_deferred`), so that the
        first verb of a step to need them counts the whole step's appends in one batch."""
        if self.pool.pending_slots:
            self.pool.flush_deferred()

    # ---- the three operations ----------------------------------------------------------------

    def attach_shared_prefix(self, block_ids: np.ndarray, num_prefix_tokens: int) -> None:
        """Map the first `num_prefix_tokens` tokens onto full blocks another request filled.

        The blocks' live counts and reverse-map entries are already in the pool (the owner
        wrote them once, with the same logical ids); the caller has taken its reference with
        `BlockPool.share`.
        """
        block_ids = np.asarray(block_ids, dtype=np.int64)
        if self.num_tokens:
            raise VTokenError(f"request {self.req_id}: a shared prefix must come before any token")
        if num_prefix_tokens != block_ids.size * self.block_size:
            raise VTokenError(
                f"request {self.req_id}: a shared prefix covers whole blocks, got "
                f"{num_prefix_tokens} tokens for {block_ids.size} blocks of {self.block_size}"
            )
        if num_prefix_tokens == 0:
            return
        self._push_held(block_ids)
        self._reserve(num_prefix_tokens)
        self._slot[:num_prefix_tokens] = block_slots(block_ids, self.block_size)
        self.num_tokens = num_prefix_tokens
        self.tail_num_written = self.block_size
        self.num_pinned_tokens = num_prefix_tokens
        self.layout_version += 1

    def pin_prefix(self, num_prefix_tokens: int) -> None:
        """Protect the first tokens (whole blocks) that other requests may later share."""
        if num_prefix_tokens % self.block_size or num_prefix_tokens > self.num_tokens:
            raise VTokenError(f"request {self.req_id}: cannot pin {num_prefix_tokens} tokens")
        # a sharer counts every token of a pinned block as live (the pool counts them once)
        if not np.all(self._live[:num_prefix_tokens]):
            token_id = int(np.flatnonzero(~self._live[:num_prefix_tokens])[0])
            raise VTokenError(f"request {self.req_id}: cannot pin {num_prefix_tokens} tokens, token {token_id} is evicted")
        self.flush()  # a sharer reads the prefix's reverse-map entries
        self.num_pinned_tokens = num_prefix_tokens

    def sync_new_tokens(self, new_block_ids: np.ndarray, num_tokens: int) -> None:
        """Register the tokens up to logical length `num_tokens`, written at the cursor.

        `new_block_ids` are freshly allocated blocks for what overflows the tail, exactly
        `num_new_blocks_needed(num_tokens - self.num_tokens)` of them.

        A decode step (one token) is inlined here, because it runs once per request per step
        and a further call would cost as much as the rest of it; anything else, and any
        wrong block count, goes through `_sync_many`.
        """
        token_id = self.num_tokens
        if num_tokens == token_id + 1:  # a decode step: Python integers and one array store
            cursor = self.tail_num_written
            if cursor == self.block_size or not self._num_held:  # the tail is full: open a new one
                if len(new_block_ids) == 1:
                    self._open_tail(int(new_block_ids[0]))
                    cursor = 0
                else:
                    cursor = -1  # a wrong block count: the general path says so
            elif len(new_block_ids):
                cursor = -1
            if cursor >= 0:
                if token_id == self._capacity:
                    self._reserve(token_id + 1)
                slot = self._tail_slot + cursor
                self._slot[token_id] = slot
                if self._num_dead and self._cache.is_valid:
                    self._cache.append_one(slot)
                pool = self.pool
                pool.num_live_tokens += 1
                pool.pending_slots.append(slot)  # counted by the pool's next flush
                pool.pending_token_ids.append(token_id)
                self.num_tokens = num_tokens
                self.tail_num_written = cursor + 1
                return  # the layout a plan reads (every block but the open tail) did not change
        self._sync_many(np.asarray(new_block_ids, dtype=np.int64), num_tokens)

    def _sync_many(self, new_block_ids: np.ndarray, num_tokens: int) -> None:
        """`sync_new_tokens` for a prefill, several fused steps, or a call to refuse."""
        token_id = self.num_tokens
        num_new_tokens = num_tokens - token_id
        if num_new_tokens < 0:
            raise VTokenError(f"request {self.req_id}: length went back from {token_id} to {num_tokens}")
        if new_block_ids.size != self.num_new_blocks_needed(num_new_tokens):
            raise VTokenError(
                f"request {self.req_id}: {num_new_tokens} new tokens need "
                f"{self.num_new_blocks_needed(num_new_tokens)} new blocks, got {new_block_ids.size}"
            )
        if num_new_tokens == 0:
            return
        self._check_fresh(new_block_ids)
        self.flush()
        self._reserve(num_tokens)
        num_in_tail = min(num_new_tokens, self.num_free_tail_slots())
        # slots: the rest of the tail, then the new blocks from offset 0
        positions = np.arange(num_new_tokens - num_in_tail)
        new_slots = new_block_ids[positions // self.block_size] * self.block_size + positions % self.block_size
        if num_in_tail:
            tail_first = self._tail_slot + self.tail_num_written
            new_slots = np.concatenate((np.arange(tail_first, tail_first + num_in_tail), new_slots))
        self.pool.count_appended(new_slots // self.block_size)
        self._slot[token_id:num_tokens] = new_slots
        self._token_at[new_slots] = np.arange(token_id, num_tokens)
        if self._num_dead and self._cache.is_valid:
            self._cache.append(new_slots)
        self._push_held(new_block_ids)
        self.num_tokens = num_tokens
        last_slot = int(new_slots[-1])
        self._tail_slot = last_slot - last_slot % self.block_size
        self.tail_num_written = last_slot % self.block_size + 1
        self.layout_version += 1

    def _check_fresh(self, block_ids: np.ndarray) -> None:
        """New blocks must be allocated to this request alone, empty, distinct and not held yet."""
        if block_ids.size == 0:
            return
        pool = self.pool
        if block_ids.min() < 0 or block_ids.max() >= pool.num_blocks or not is_distinct(np.sort(block_ids)):
            raise VTokenError(f"request {self.req_id}: new blocks {block_ids.tolist()} are out of range or repeated")
        stale = (pool.ref_counts[block_ids] != 1) | (pool.live_counts[block_ids] != 0) | (positions_in(self._held[: self._num_held], block_ids) >= 0)
        if stale.any():
            raise VTokenError(f"request {self.req_id}: block {int(block_ids[stale][0])} is not a freshly allocated block")

    def _open_tail(self, block_id: int) -> None:
        """A fresh block becomes the tail (the decode step's case of `_push_held`)."""
        pool = self.pool
        is_tail = self._num_held and block_id * self.block_size == self._tail_slot
        if is_tail or not 0 <= block_id < pool.num_blocks or pool.ref_counts.item(block_id) != 1:
            raise VTokenError(f"request {self.req_id}: block {block_id} is not a freshly allocated block")
        if self._num_held == self._held.size:
            self._held = np.concatenate((self._held, np.zeros_like(self._held)))
        self._held[self._num_held] = block_id
        self._num_held += 1
        self._tail_slot = block_id * self.block_size
        self.tail_num_written = 0

    def _push_held(self, block_ids: np.ndarray) -> None:
        """Append blocks to the held list; the last one becomes the tail."""
        if block_ids.size == 0:
            return
        end = self._num_held + block_ids.size
        if end > self._held.size:
            grown = np.zeros(max(end, 2 * self._held.size), dtype=np.int64)
            grown[: self._num_held] = self._held[: self._num_held]
            self._held = grown
        self._held[self._num_held : end] = block_ids
        self._num_held = end
        self._tail_slot = int(block_ids[-1]) * self.block_size
        self.tail_num_written = 0

    def _reserve(self, capacity: int) -> None:
        """Room for `capacity` tokens: a range twice as large (at least) in the arena, the
        current one copied into it."""
        if capacity <= self._capacity:
            return
        new_capacity = max(capacity, 2 * self._capacity)
        arena = self._arena
        base = arena.take(self, new_capacity)  # may move the current range: read it after
        old_slot, old_live, old_capacity = self._slot, self._live, self._capacity
        self._capacity = new_capacity
        self.use_range(base, arena.slot, arena.live)
        self._slot[:old_capacity] = old_slot
        self._live[:old_capacity] = old_live

    def use_range(self, base: int, slot: np.ndarray, live: np.ndarray) -> None:
        """Point this table's per-token views at `_capacity` entries from `base` of the
        arena's arrays (the arena calls it when it moves the range)."""
        self._base = base
        self._slot = slot[base : base + self._capacity]
        self._live = live[base : base + self._capacity]


def _read_only(array: np.ndarray) -> np.ndarray:
    view = array.view()
    view.flags.writeable = False
    return view
