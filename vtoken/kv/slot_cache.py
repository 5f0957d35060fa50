"""The slot list of a request once a token of it is dead: the live tokens' slots (Eq. 2),
dense and in logical order, as attention reads them.

A buffer with room at the back for appends and a start that moves forward: an evicted token's
entry goes by shifting the shorter side of the list by one, through a memoryview (a memmove in
either direction, where numpy copies overlapping slices through a temporary buffer). Cost
O(L) memory traffic per eviction, no allocation; appends are O(1) amortized.
"""

from __future__ import annotations

import numpy as np


class SlotCache:
    def __init__(self) -> None:
        self._buffer = np.zeros(0, dtype=np.int64)
        self._view = memoryview(self._buffer)
        self._start = 0
        self._size = 0
        self.is_valid = False  # False: the owner rebuilds it with `reset` before the next read

    def slots(self) -> np.ndarray:
        """The cached slots: a view, valid until the cache next changes."""
        return self._buffer[self._start : self._start + self._size]

    def reset(self, num_slots: int) -> np.ndarray:
        """A fresh buffer of `num_slots` entries (and room to grow): returns them, for the
        caller to fill. The cache is valid again."""
        self._buffer = np.empty(num_slots + num_slots // 4 + 64, dtype=np.int64)
        self._view = memoryview(self._buffer)
        self._start, self._size, self.is_valid = 0, num_slots, True
        return self._buffer[:num_slots]

    def append_one(self, slot: int) -> None:
        end = self._start + self._size
        if end == self._buffer.size:
            self.append(np.array([slot]))
        else:
            self._buffer[end] = slot
            self._size += 1

    def append(self, new_slots: np.ndarray) -> None:
        start, size = self._start, self._size
        if start + size + new_slots.size > self._buffer.size:
            cached = self._buffer[start : start + size]
            self.reset(size + new_slots.size)[:size] = cached
            start = 0
        self._buffer[start + size : start + size + new_slots.size] = new_slots
        self._size = size + new_slots.size

    def remove_token(self, live: np.ndarray, token_id: int, num_tokens: int) -> None:
        """Drop the entry of `token_id`, which `live` (over `num_tokens` logical ids, the cached
        ones) still marks live: its index is the number of live tokens before it, counted from
        the nearer end, and the side of the list on that end shifts over it."""
        start, size, view = self._start, self._size, self._view
        if 2 * token_id < num_tokens:  # near the front: the live tokens before it move up one
            idx = start + np.count_nonzero(live[:token_id])
            view[start + 1 : idx + 1] = view[start:idx]
            self._start = start + 1
        else:  # near the back: the live tokens after it move down one
            idx = start + size - 1 - np.count_nonzero(live[token_id + 1 : num_tokens])
            view[idx : start + size - 1] = view[idx + 1 : start + size]
        self._size = size - 1
