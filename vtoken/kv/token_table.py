"""The per-request token table: logical token id -> (block_id, offset) and a live bit.

Logical ids are 0..L-1 in arrival order and equal the token's rotary position, which never
changes. The table owns the mapping; the block pool owns block state, and the table reports
every live-count change to it (`BlockPool.adjust_live`). Memory is O(L) numpy arrays, grown by
doubling; there is no Python object per token.

A request holds an ordered list of blocks; the last one is the *tail*, where new tokens are
appended at `tail_num_written`. Holes are dead slots anywhere before the cursor:

    blocks:   [ b7              ][ b2              ][ b9 (tail)        ]
    slots:    L L . L L . . L L  L . . . L L L L L  L L L . . . . . . .
                  ^ hole                              ^ cursor = 3

Eviction only clears live bits. Relocation (`apply_moves`) repoints live tokens into other
slots; the reclaimer decides the moves, the copy engine moves the data first.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from vtoken.errors import VTokenError
from vtoken.kv.block_pool import BlockPool


@dataclass(frozen=True)
class Moves:
    """Token relocations of one request, one entry per moved token (int64 arrays, same length)."""

    token_ids: np.ndarray
    src_block_ids: np.ndarray
    src_offsets: np.ndarray
    dst_block_ids: np.ndarray
    dst_offsets: np.ndarray

    @property
    def num_moves(self) -> int:
        return int(self.token_ids.size)

    def src_slots(self, block_size: int) -> np.ndarray:
        return self.src_block_ids * block_size + self.src_offsets

    def dst_slots(self, block_size: int) -> np.ndarray:
        return self.dst_block_ids * block_size + self.dst_offsets


class TokenTable:
    def __init__(self, req_id: int, pool: BlockPool, capacity: int = 64) -> None:
        self.req_id = req_id
        self.pool = pool
        self.block_size = pool.block_size
        self.num_tokens = 0
        self.num_live_tokens = 0
        self.num_pinned_tokens = 0  # a shared prefix: never evicted, never relocated
        self.block_ids_held: list[int] = []
        self.tail_num_written = 0
        self.layout_version = 0  # bumped by every change a relocation plan could depend on
        self._block_ids = np.zeros(capacity, dtype=np.int64)
        self._offsets = np.zeros(capacity, dtype=np.int64)
        self._live = np.zeros(capacity, dtype=bool)
        # slots() is _slot_buffer[:_num_slots] while _is_slots_valid, with room to append into.
        # Once slots() has handed out a view of the buffer, the buffer is copied before any
        # entry it covers changes (_own_slot_buffer), so that earlier results never change.
        self._slot_buffer = np.zeros(capacity, dtype=np.int64)
        self._num_slots = 0
        self._is_slots_valid = True
        self._is_slots_read = False

    # ---- read-only views ---------------------------------------------------------------------

    @property
    def block_ids(self) -> np.ndarray:
        """Block of each logical token, [num_tokens] (stale for dead tokens)."""
        return self._block_ids[: self.num_tokens]

    @property
    def offsets(self) -> np.ndarray:
        return self._offsets[: self.num_tokens]

    @property
    def live(self) -> np.ndarray:
        return self._live[: self.num_tokens]

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids_held)

    @property
    def num_pinned_blocks(self) -> int:
        return self.num_pinned_tokens // self.block_size

    def live_token_ids(self) -> np.ndarray:
        return np.flatnonzero(self.live)

    def slots(self) -> np.ndarray:
        """Physical slots of the live tokens in logical order (Eq. 2): block_id * S + offset.

        Cached; appended to as the sequence grows, rebuilt only after eviction or relocation.
        """
        if not self._is_slots_valid:
            live_ids = self.live_token_ids()
            num_live = live_ids.size
            self._slot_buffer = np.empty(num_live + num_live // 4 + 64, dtype=np.int64)
            slots = self._slot_buffer[:num_live]
            np.take(self._block_ids, live_ids, out=slots)
            slots *= self.block_size
            slots += self._offsets[live_ids]
            self._num_slots = num_live
            self._is_slots_valid = True
        self._is_slots_read = True
        return self._slot_buffer[: self._num_slots]

    def _own_slot_buffer(self) -> np.ndarray:
        if self._is_slots_read:
            num_slots = self._num_slots
            copied = np.empty(num_slots + num_slots // 4 + 64, dtype=np.int64)
            copied[:num_slots] = self._slot_buffer[:num_slots]
            self._slot_buffer = copied
            self._is_slots_read = False
        return self._slot_buffer

    def _append_slots(self, new_slots: np.ndarray) -> None:
        if not self._is_slots_valid:
            return
        start, end = self._num_slots, self._num_slots + new_slots.size
        if end > self._slot_buffer.size:
            grown = np.empty(max(end, 2 * self._slot_buffer.size), dtype=np.int64)
            grown[:start] = self._slot_buffer[:start]
            self._slot_buffer = grown
            self._is_slots_read = False
        self._slot_buffer[start:end] = new_slots
        self._num_slots = end

    def num_free_tail_slots(self) -> int:
        return self.block_size - self.tail_num_written if self.block_ids_held else 0

    def num_new_blocks_needed(self, num_new_tokens: int) -> int:
        overflow = num_new_tokens - self.num_free_tail_slots()
        return max(0, -(-overflow // self.block_size))

    # ---- the three operations ----------------------------------------------------------------

    def attach_shared_prefix(self, block_ids: np.ndarray, num_prefix_tokens: int) -> None:
        """Map the first `num_prefix_tokens` tokens onto full blocks another request filled.

        The blocks' live counts are already in the pool (the owner counted them once); the
        caller has taken its reference with `BlockPool.share`.
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
        self.block_ids_held.extend(block_ids.tolist())
        self._place(block_ids, 0, num_prefix_tokens)
        self.num_pinned_tokens = num_prefix_tokens

    def pin_prefix(self, num_prefix_tokens: int) -> None:
        """Protect the first tokens (whole blocks) that other requests may later share."""
        if num_prefix_tokens % self.block_size or num_prefix_tokens > self.num_tokens:
            raise VTokenError(f"request {self.req_id}: cannot pin {num_prefix_tokens} tokens")
        # a sharer counts every token of a pinned block as live (the pool counts them once)
        if not np.all(self._live[:num_prefix_tokens]):
            token_id = int(np.flatnonzero(~self._live[:num_prefix_tokens])[0])
            raise VTokenError(f"request {self.req_id}: cannot pin {num_prefix_tokens} tokens, token {token_id} is evicted")
        self.num_pinned_tokens = num_prefix_tokens

    def sync_new_tokens(self, new_block_ids: np.ndarray, num_tokens: int) -> None:
        """Register the tokens up to logical length `num_tokens`, written at the cursor.

        `new_block_ids` are freshly allocated blocks for what overflows the tail, exactly
        `num_new_blocks_needed(num_tokens - self.num_tokens)` of them.
        """
        if num_tokens == self.num_tokens + 1:  # a decode step: scalars only
            num_free_tail_slots, num_new_block_ids = self.num_free_tail_slots(), len(new_block_ids)
            if num_free_tail_slots and num_new_block_ids == 0:
                self._append_one(self.block_ids_held[-1], self.tail_num_written)
                return
            if not num_free_tail_slots and num_new_block_ids == 1:
                block_id = int(new_block_ids[0])
                self._append_one(block_id, 0)
                self.block_ids_held.append(block_id)
                return
        new_block_ids = np.asarray(new_block_ids, dtype=np.int64)
        num_new_tokens = num_tokens - self.num_tokens
        if num_new_tokens < 0:
            raise VTokenError(f"request {self.req_id}: length went back from {self.num_tokens} to {num_tokens}")
        if new_block_ids.size != self.num_new_blocks_needed(num_new_tokens):
            raise VTokenError(
                f"request {self.req_id}: {num_new_tokens} new tokens need "
                f"{self.num_new_blocks_needed(num_new_tokens)} new blocks, got {new_block_ids.size}"
            )
        if num_new_tokens == 0:
            return
        if self.num_free_tail_slots():
            target_ids = np.concatenate(([self.block_ids_held[-1]], new_block_ids))
            first_offset = self.tail_num_written
        else:
            target_ids, first_offset = new_block_ids, 0
        self.block_ids_held.extend(new_block_ids.tolist())
        touched_ids, counts = self._place(target_ids, first_offset, num_new_tokens)
        self.pool.adjust_live(touched_ids, counts)
        self.layout_version += 1

    def _append_one(self, block_id: int, offset: int) -> None:
        """One token at (block_id, offset), the cursor: the decode step, with scalars only."""
        token_id = self.num_tokens
        if token_id == self._live.size:
            self._reserve(token_id + 1)
        self.pool.add_live(block_id, 1)
        self._block_ids[token_id] = block_id
        self._offsets[token_id] = offset
        self._live[token_id] = True
        self.num_tokens += 1
        self.num_live_tokens += 1
        self.tail_num_written = offset + 1
        if self._is_slots_valid:
            if self._num_slots == self._slot_buffer.size:
                self._append_slots(np.array([block_id * self.block_size + offset]))
            else:
                self._slot_buffer[self._num_slots] = block_id * self.block_size + offset
                self._num_slots += 1
        self.layout_version += 1

    def _place(self, target_ids: np.ndarray, first_offset: int, num_new_tokens: int) -> tuple[np.ndarray, np.ndarray]:
        """Write `num_new_tokens` live tokens into `target_ids` from `first_offset` on.

        Returns the touched blocks and the number of tokens each received.
        """
        start = self.num_tokens
        self._reserve(start + num_new_tokens)
        positions = first_offset + np.arange(num_new_tokens)
        block_idx = positions // self.block_size
        block_ids = target_ids[block_idx]
        offsets = positions % self.block_size
        self._block_ids[start : start + num_new_tokens] = block_ids
        self._offsets[start : start + num_new_tokens] = offsets
        self._live[start : start + num_new_tokens] = True
        self.num_tokens += num_new_tokens
        self.num_live_tokens += num_new_tokens
        self.tail_num_written = int(offsets[-1]) + 1
        self._append_slots(block_ids * self.block_size + offsets)
        counts = np.bincount(block_idx)
        touched = np.flatnonzero(counts)
        return target_ids[touched], counts[touched]

    def _reserve(self, capacity: int) -> None:
        if capacity <= self._live.size:
            return
        new_capacity = max(capacity, 2 * self._live.size)
        for name in ("_block_ids", "_offsets", "_live"):
            old = getattr(self, name)
            grown = np.zeros(new_capacity, dtype=old.dtype)
            grown[: old.size] = old
            setattr(self, name, grown)

    def evict_tokens(self, token_ids: np.ndarray) -> np.ndarray:
        """Mark tokens dead (metadata only: no KV moves). Returns blocks of this request that
        are now empty, which the caller may release with `release_blocks`.

        Raises (changing nothing) for an unknown, dead, pinned or repeated id.
        """
        token_ids = np.asarray(token_ids, dtype=np.int64)
        if token_ids.size == 0:
            return np.zeros(0, dtype=np.int64)
        if token_ids.size == 1:
            return self._evict_one(int(token_ids.flat[0]))
        self._check_evictable(token_ids)
        self._live[token_ids] = False
        self.num_live_tokens -= token_ids.size
        blocks, counts = np.unique(self._block_ids[token_ids], return_counts=True)
        self.pool.adjust_live(blocks, -counts)
        self._is_slots_valid = False
        self.layout_version += 1
        return blocks[self.pool.live_counts[blocks] == 0]

    def _evict_one(self, token_id: int) -> np.ndarray:
        """`evict_tokens` of a single id, with scalars only (same checks, same result)."""
        if not 0 <= token_id < self.num_tokens:
            raise VTokenError(f"request {self.req_id}: cannot evict unknown token {token_id} (length {self.num_tokens})")
        if not self._live[token_id]:
            raise VTokenError(f"request {self.req_id}: token {token_id} is already evicted")
        if token_id < self.num_pinned_tokens:
            raise VTokenError(f"request {self.req_id}: token {token_id} is in the shared prefix and cannot be evicted")
        block_id = int(self._block_ids[token_id])
        self.pool.add_live(block_id, -1)
        if self._is_slots_valid:
            self._remove_slot(int(np.count_nonzero(self._live[:token_id])))
        self._live[token_id] = False
        self.num_live_tokens -= 1
        self.layout_version += 1
        if self.pool.live_counts[block_id] == 0:
            return np.array([block_id], dtype=np.int64)
        return np.zeros(0, dtype=np.int64)

    def _check_evictable(self, token_ids: np.ndarray) -> None:
        out_of_range = (token_ids < 0) | (token_ids >= self.num_tokens)
        if np.any(out_of_range):
            bad = token_ids[out_of_range][0]
            raise VTokenError(f"request {self.req_id}: cannot evict unknown token {bad} (length {self.num_tokens})")
        if not np.all(self._live[token_ids]):
            bad = token_ids[~self._live[token_ids]][0]
            raise VTokenError(f"request {self.req_id}: token {bad} is already evicted")
        if np.any(token_ids < self.num_pinned_tokens):
            bad = token_ids[token_ids < self.num_pinned_tokens][0]
            raise VTokenError(f"request {self.req_id}: token {bad} is in the shared prefix and cannot be evicted")
        if np.unique(token_ids).size != token_ids.size:
            raise VTokenError(f"request {self.req_id}: evict_tokens got repeated ids")

    def _remove_slot(self, idx: int) -> None:
        """Drop entry `idx` of the slot cache: a memmove of what follows it."""
        buffer, num_slots = self._own_slot_buffer(), self._num_slots
        buffer[idx : num_slots - 1] = buffer[idx + 1 : num_slots]
        self._num_slots = num_slots - 1

    def adopt_blocks(self, block_ids: np.ndarray) -> None:
        """Take freshly allocated relocation destinations; they sit before the tail."""
        block_ids = [int(b) for b in block_ids]
        tail = self.block_ids_held[-1:]
        self.block_ids_held[-1:] = block_ids + tail
        self.layout_version += 1

    def apply_moves(self, moves: Moves) -> None:
        """Repoint moved tokens to their destination slots. Only after their copy completed.

        Every move's source must be the token's current slot and no destination may hold a live
        token that stays; otherwise nothing changes and VTokenError is raised. A token evicted
        while its copy was in flight is repointed without live-count changes.
        """
        if moves.num_moves == 0:
            return
        self._check_moves(moves)
        ids = moves.token_ids
        self._block_ids[ids] = moves.dst_block_ids
        self._offsets[ids] = moves.dst_offsets
        live = self._live[ids]
        if np.any(live):
            delta_blocks = np.concatenate((moves.src_block_ids[live], moves.dst_block_ids[live]))
            deltas = np.concatenate((-np.ones(int(live.sum()), np.int64), np.ones(int(live.sum()), np.int64)))
            blocks, inverse = np.unique(delta_blocks, return_inverse=True)
            self.pool.adjust_live(blocks, np.bincount(inverse, weights=deltas).astype(np.int64))
            if self._is_slots_valid:  # the moved live tokens keep their place in logical order
                slot_idx = np.searchsorted(self.live_token_ids(), ids[live])
                self._own_slot_buffer()[slot_idx] = moves.dst_slots(self.block_size)[live]
        self.layout_version += 1

    def _check_moves(self, moves: Moves) -> None:
        ids = moves.token_ids
        if np.any((ids < 0) | (ids >= self.num_tokens)) or np.unique(ids).size != ids.size:
            raise VTokenError(f"request {self.req_id}: moves name unknown or repeated tokens")
        stale = (self._block_ids[ids] != moves.src_block_ids) | (self._offsets[ids] != moves.src_offsets)
        if np.any(stale):
            token_id = int(ids[stale][0])
            raise VTokenError(f"request {self.req_id}: move of token {token_id} names a source it does not occupy")
        held_block_ids = set(self.block_ids_held)
        held = np.array([b in held_block_ids for b in moves.dst_block_ids.tolist()], dtype=bool)
        if not np.all(held):
            raise VTokenError(f"request {self.req_id}: move into block {int(moves.dst_block_ids[~held][0])} it does not hold")
        # only live tokens already in a destination block can stand in a move's way
        in_dst_blocks = self._live_ids_in(moves.dst_block_ids)
        is_moved = np.zeros(self.num_tokens, dtype=bool)
        is_moved[ids] = True
        staying = in_dst_blocks[~is_moved[in_dst_blocks]]
        staying_slots = np.sort(self._block_ids[staying] * self.block_size + self._offsets[staying])
        dst_slots = moves.dst_slots(self.block_size)
        idx = np.minimum(np.searchsorted(staying_slots, dst_slots), max(staying_slots.size - 1, 0))
        occupied = staying_slots[idx] == dst_slots if staying_slots.size else np.zeros(dst_slots.size, dtype=bool)
        if np.any(occupied) or np.unique(dst_slots).size != dst_slots.size:
            slot = int(dst_slots[occupied][0]) if np.any(occupied) else int(dst_slots[0])
            raise VTokenError(f"request {self.req_id}: move onto occupied slot {slot} (block {slot // self.block_size}, offset {slot % self.block_size})")

    def release_blocks(self, block_ids: np.ndarray) -> None:
        """Forget blocks that hold no live token of this request (the caller frees them).

        When the tail goes, the cursor moves to the end of the last live token of the new tail.
        """
        released = {int(b) for b in block_ids}
        if not released:
            return
        held_block_ids = set(self.block_ids_held)
        if not released.issubset(held_block_ids):
            raise VTokenError(f"request {self.req_id}: releasing blocks it does not hold {sorted(released - held_block_ids)}")
        if self._live_ids_in(np.fromiter(released, np.int64)).size:
            raise VTokenError(f"request {self.req_id}: releasing blocks that still hold live tokens")
        tail_released = self.block_ids_held[-1] in released
        if len(released) <= 8:  # the usual case: list.remove beats rebuilding the list
            for block_id in released:
                self.block_ids_held.remove(block_id)
        else:
            self.block_ids_held = [b for b in self.block_ids_held if b not in released]
        if tail_released:
            self.tail_num_written = self._cursor_after_last_live()
        self.layout_version += 1

    def _live_ids_in(self, block_ids: np.ndarray) -> np.ndarray:
        """Live tokens stored in `block_ids`, in logical order: one pass over the table."""
        is_listed = np.zeros(self.pool.num_blocks, dtype=bool)
        is_listed[block_ids] = True
        return np.flatnonzero(is_listed[self.block_ids] & self.live)

    def _cursor_after_last_live(self) -> int:
        if not self.block_ids_held:
            return 0
        in_tail = np.flatnonzero((self.block_ids == self.block_ids_held[-1]) & self.live)
        return int(self._offsets[in_tail].max()) + 1 if in_tail.size else 0

    def release_all(self) -> list[int]:
        """Drop every block (request finished or preempted); returns them for the caller to free."""
        block_ids = self.block_ids_held
        self.block_ids_held = []
        self._live[: self.num_tokens] = False
        self.num_live_tokens = 0
        self.num_pinned_tokens = 0  # nothing held, nothing pinned
        self.tail_num_written = 0
        self._is_slots_valid = False
        self.layout_version += 1
        return block_ids
