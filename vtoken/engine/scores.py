"""Per-token attention statistics of one request, as the policies read them. Pure numpy.

Shared by the hf and vllm executors, from rows of attention probabilities summed over heads
and layers, one row per query:

    attention_sum[j]     sum over queries of the attention j received              (H2O)
    attention_last[j]    the latest query's attention to j, / (heads * layers)      (TOVA)
    importance_count[j]  queries among the last W whose row gave j at least the row's mean
                         (1 / keys read, per head and layer)                        (Scissorhands)
"""

from __future__ import annotations

from collections import deque

import numpy as np

IMPORTANCE_WINDOW = 64  # W, in queries (the sim's default)


class AttentionStats:
    def __init__(self, num_heads_layers: int, window: int = IMPORTANCE_WINDOW) -> None:
        self.attention_sum = np.zeros(0)
        self.attention_last = np.zeros(0)
        self.importance_count = np.zeros(0, dtype=np.int32)
        self._num_heads_layers = num_heads_layers
        self._window: deque[np.ndarray] = deque()
        self._window_size = window

    def add(self, key_ids: np.ndarray, rows: np.ndarray, num_keys_read: np.ndarray | None = None) -> None:
        """`rows` [queries, keys] over `key_ids`; query i read `num_keys_read[i]` of the keys (the
        rest of its row is 0). Default: causal, query i is the (keys - queries + i)-th key."""
        self._reserve(int(key_ids.max(initial=-1)) + 1)
        num_queries, num_keys = rows.shape
        if num_keys_read is None:
            num_keys_read = num_keys - num_queries + 1 + np.arange(num_queries)
        self.attention_sum[key_ids] += rows.sum(axis=0)
        self.attention_last[:] = 0.0
        self.attention_last[key_ids] = rows[-1] / self._num_heads_layers
        first = max(0, num_queries - self._window_size)
        thresholds = self._num_heads_layers / np.asarray(num_keys_read)[first:, None]  # the row's mean, unnormalized
        for important in rows[first:] >= thresholds:
            self._push(key_ids[important])

    def _push(self, important_ids: np.ndarray) -> None:
        self.importance_count[important_ids] += 1
        self._window.append(important_ids)
        if len(self._window) > self._window_size:
            self.importance_count[self._window.popleft()] -= 1

    def _reserve(self, capacity: int) -> None:
        if capacity <= self.attention_sum.size:
            return
        capacity = max(capacity, 2 * self.attention_sum.size)
        for name in ("attention_sum", "attention_last", "importance_count"):
            old = getattr(self, name)
            grown = np.zeros(capacity, dtype=old.dtype)
            grown[: old.size] = old
            setattr(self, name, grown)

    def of(self, token_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(attention_sum, attention_last, importance_count) of `token_ids` (0 if never seen)."""
        self._reserve(int(token_ids.max(initial=-1)) + 1)
        return (self.attention_sum[token_ids].copy(), self.attention_last[token_ids].copy(),
                self.importance_count[token_ids].copy())
