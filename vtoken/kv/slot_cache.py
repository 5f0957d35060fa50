"""The slot list of a request once a token of it is dead: the live tokens' slots (Eq. 2),
dense and in logical order, as a reader of it (the hf executor's attention, the checker) takes
it. Built on the first read and kept up to date for the reads after it.

An eviction does not touch the list: it records the token (`remove_later`), and the next read
applies what was recorded (`catch_up`). So the eviction path costs O(1) whether or not anything
reads the list (the sim and vLLM executors never do), and a reader pays for an entry's removal
once, when it reads. A removal shifts the shorter side of the list by one, through a memoryview
(a memmove in either direction, where numpy copies overlapping slices through a temporary
buffer): O(L) memory traffic, no allocation. Past `MAX_PENDING_REMOVALS` unread removals the
list is dropped instead, and the next read rebuilds it from the table (one gather costs about
what a few shifts do). Appends are O(1) amortized.

    buffer:   [ . . . | s0 s1 s2 s3 s4 s5 | . . . . . ]
                      ^ start              ^ start + size: appends go here
    remove s1 (near the front): s0 moves up one, start + 1
    remove s4 (near the back):  s5 moves down one
"""

from __future__ import annotations

import numpy as np

MAX_PENDING_REMOVALS = 4


class SlotCache:
    def __init__(self) -> None:
        self._buffer = np.zeros(0, dtype=np.int64)
        self._view = memoryview(self._buffer)
        self._start = 0
        self._size = 0
        self._pending: list[int] = []  # token ids removed since the last read, still in the list
        self.is_valid = False  # False: the owner rebuilds it with `reset` before the next read

    @property
    def has_pending(self) -> bool:
        return bool(self._pending)

    def slots(self) -> np.ndarray:
        """The cached slots: a view, valid until the cache next changes. Only with nothing
        pending (`catch_up` first)."""
        assert not self._pending, "slots read before catch_up"
        return self._buffer[self._start : self._start + self._size]

    def reset(self, num_slots: int) -> np.ndarray:
        """A fresh buffer of `num_slots` entries (and room to grow): returns them, for the
        caller to fill. The cache is valid again, with nothing pending."""
        self._buffer = np.empty(num_slots + num_slots // 4 + 64, dtype=np.int64)
        self._view = memoryview(self._buffer)
        self._start, self._size, self.is_valid = 0, num_slots, True
        self._pending.clear()
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
            pending = self._pending.copy()
            self.reset(size + new_slots.size)[:size] = cached
            self._pending.extend(pending)
            start = 0
        self._buffer[start + size : start + size + new_slots.size] = new_slots
        self._size = size + new_slots.size

    def remove_later(self, token_id: int) -> None:
        """`token_id`, still in the list, is dead: its entry goes at the next read. Past
        MAX_PENDING_REMOVALS unread removals the list is dropped (is_valid False) instead."""
        if len(self._pending) == MAX_PENDING_REMOVALS:
            self._pending.clear()
            self.is_valid = False
        else:
            self._pending.append(token_id)

    def catch_up(self, live: np.ndarray, num_tokens: int) -> None:
        """Drop the entries of the pending removals. `live` (over `num_tokens` logical ids, the
        cached ones) marks every cached token live but the pending ones. The largest id goes
        first: then the entries after it are exactly the live tokens after it, and the entries
        before it the live tokens and the pending removals before it."""
        pending = sorted(self._pending)
        self._pending.clear()
        for num_pending_before in range(len(pending) - 1, -1, -1):
            self._drop(live, pending[num_pending_before], num_tokens, num_pending_before)

    def _drop(self, live: np.ndarray, token_id: int, num_tokens: int, num_pending_before: int) -> None:
        start, size, view = self._start, self._size, self._view
        if 2 * token_id < num_tokens:  # near the front: the entries before it move up one
            idx = start + np.count_nonzero(live[:token_id]) + num_pending_before
            view[start + 1 : idx + 1] = view[start:idx]
            self._start = start + 1
        else:  # near the back: the entries after it move down one
            idx = start + size - 1 - np.count_nonzero(live[token_id + 1 : num_tokens])
            view[idx : start + size - 1] = view[idx + 1 : start + size]
        self._size = size - 1
