"""Eviction verbs of the token table: mark tokens dead, metadata only (no KV moves).

A mixin of `TokenTable` (token_table.py owns the state these methods read and write). Eviction
clears live bits, removes the tokens from the pool's reverse map and live counts, and keeps the
slot list dense: a single victim shifts the shorter side of the cached list by one (O(L) memory
traffic), a batch invalidates it for the next `slots()` to rebuild. The blocks it empties are
returned for the caller to release and free.
"""

from __future__ import annotations

import numpy as np

from vtoken.errors import VTokenError
from vtoken.kv.arrays import count_by_block, is_distinct

_NO_BLOCKS = np.zeros(0, dtype=np.int64)
_NO_BLOCKS.flags.writeable = False  # returned by every eviction that empties no block


class EvictionVerbs:
    """`TokenTable`'s eviction verbs (state in token_table.py)."""

    def evict_tokens(self, token_ids: np.ndarray) -> np.ndarray:
        """Mark tokens dead (metadata only: no KV moves). Returns blocks of this request that
        are now empty, which the caller may release with `release_blocks`.

        Raises (changing nothing) for an unknown, dead, pinned or repeated id.
        """
        if type(token_ids) is np.ndarray and token_ids.size == 1 and token_ids.dtype.kind in "iu":  # the per-step case
            return self._evict_one(token_ids.item())
        token_ids = np.asarray(token_ids, dtype=np.int64)
        if token_ids.size == 0:
            return _NO_BLOCKS
        if token_ids.size == 1:
            return self._evict_one(int(token_ids.flat[0]))
        self._check_evictable(token_ids)
        self.flush()
        slots = self._slot[token_ids]
        blocks, counts = count_by_block(slots // self.block_size)
        new_counts = self.pool.remove_live_tokens(blocks, counts)
        self._token_at[slots] = -1
        self._live[token_ids] = False
        self._num_dead += token_ids.size
        self._cache.is_valid = False
        self.layout_version += 1
        return blocks[new_counts == 0]

    def _evict_one(self, token_id: int) -> np.ndarray:
        """`evict_tokens` of a single id, with scalars only (same checks, same result)."""
        live = self._live
        if not 0 <= token_id < self.num_tokens:
            raise VTokenError(f"request {self.req_id}: cannot evict unknown token {token_id} (length {self.num_tokens})")
        if not live.item(token_id):
            raise VTokenError(f"request {self.req_id}: token {token_id} is already evicted")
        if token_id < self.num_pinned_tokens:
            raise VTokenError(f"request {self.req_id}: token {token_id} is in the shared prefix and cannot be evicted")
        slot = self._slot.item(token_id)
        if self._num_pending and 0 <= slot - self._tail_slot < self.block_size:
            self.flush()  # the tail's count must be whole before it can tell whether the block emptied
        self._token_at[slot] = -1
        if not self._num_dead:  # the first dead token: the cache starts as every slot but this one
            num_tokens = self.num_tokens
            cache = self._cache.reset(num_tokens - 1)
            cache[:token_id] = self._slot[:token_id]
            cache[token_id:] = self._slot[token_id + 1 : num_tokens]
        elif self._cache.is_valid:
            self._cache.remove_token(live, token_id, self.num_tokens)
        live[token_id] = False
        self._num_dead += 1
        self.layout_version += 1
        block_id = slot // self.block_size
        if self.pool.remove_live_token(block_id):
            return _NO_BLOCKS
        return np.array([block_id], dtype=np.int64)

    def _check_evictable(self, token_ids: np.ndarray) -> None:
        out_of_range = (token_ids < 0) | (token_ids >= self.num_tokens)
        if out_of_range.any():
            bad = token_ids[out_of_range][0]
            raise VTokenError(f"request {self.req_id}: cannot evict unknown token {bad} (length {self.num_tokens})")
        live = self._live[token_ids]
        if not live.all():
            bad = token_ids[~live][0]
            raise VTokenError(f"request {self.req_id}: token {bad} is already evicted")
        if token_ids.min() < self.num_pinned_tokens:
            bad = token_ids[token_ids < self.num_pinned_tokens][0]
            raise VTokenError(f"request {self.req_id}: token {bad} is in the shared prefix and cannot be evicted")
        if not is_distinct(token_ids):  # a policy's victims ascend: one comparison pass
            raise VTokenError(f"request {self.req_id}: evict_tokens got repeated ids")
