"""Synthetic K/V for the sim executor: what every token's K and V must be (`kv_content`,
`KVBook`), and the writes and checks of one run's KV cache against it (`KVContents`).

The KV is tiny per token (2 layers x K,V x 2 heads x 8 dims x fp32 = 256 bytes), so thousands
of blocks cost a few MiB. The block budget and block size come from the run's config.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from vtoken.checker.report import KVLayout
from vtoken.kv.kv_cache import PagedKVCache
from vtoken.kv.moves import RelocationPlan
from vtoken.kv.token_table import TokenTable
from vtoken.trace import Request

KV_NUM_LAYERS, KV_NUM_HEADS, KV_HEAD_DIM = 2, 2, 8
KV_DTYPE = torch.float32
SYNTHETIC_KV_LAYOUT = KVLayout(KV_NUM_LAYERS, KV_NUM_HEADS, KV_HEAD_DIM, str(KV_DTYPE).removeprefix("torch."))


def kv_content(owner: int, token_ids: np.ndarray) -> np.ndarray:
    """K/V of tokens `token_ids` of `owner`: [num_layers, 2, n, kv_heads, head_dim] float32.

    A pure function of (owner, token id). Element [l, k, :, 0, 0] is owner + 1 and [l, k, :, 0, 1]
    token + 1 in every layer for K and V, so no two tokens hold the same K or V; the rest is
    a hash. Values stay below 2**23, exact in float32.
    """
    token_ids = np.asarray(token_ids, dtype=np.int64)
    num_elems = KV_NUM_LAYERS * 2 * KV_NUM_HEADS * KV_HEAD_DIM
    key = (owner + 1) * 1_000_003 + token_ids + 1
    x = (key[:, None] * 2_654_435_761 + np.arange(num_elems, dtype=np.int64)[None, :] * 40_503) % 2_147_483_647
    x = (x * 48_271) % 2_147_483_647 & 0x7FFFFF
    x = x.reshape(-1, KV_NUM_LAYERS, 2, KV_NUM_HEADS, KV_HEAD_DIM)
    x[:, :, :, 0, 0] = owner + 1
    x[:, :, :, 0, 1] = token_ids[:, None, None] + 1
    return np.ascontiguousarray(x.transpose(1, 2, 0, 3, 4), dtype=np.float32)


class KVBook:
    """The K/V every token of a request list must hold, computed once per owner and shared by
    every scenario over the same requests.

    A token's owner is its request, except for tokens of a pinned (shared) prefix: those belong
    to the prefix, and every request that shares it reads the same physical K/V.
    """

    def __init__(self, requests: Sequence[Request]) -> None:
        prefix_ids = sorted({r.prefix_id for r in requests if r.prefix_id is not None})
        self._owner_of_prefix = {prefix_id: len(requests) + i for i, prefix_id in enumerate(prefix_ids)}
        self._requests = requests
        self._num_tokens_of = [r.num_prompt_tokens + r.num_output_tokens for r in requests] + [0] * len(prefix_ids)
        for r in requests:
            if r.prefix_id is not None:
                owner = self._owner_of_prefix[r.prefix_id]
                self._num_tokens_of[owner] = max(self._num_tokens_of[owner], r.num_prompt_tokens)
        self._contents: dict[int, np.ndarray] = {}  # owner -> [num_layers, 2, num_tokens, kv_heads, head_dim]

    def expected(self, table: TokenTable, token_ids: np.ndarray) -> np.ndarray:
        """[num_layers, 2, n, kv_heads, head_dim] for ascending `token_ids` of `table`."""
        num_prefix = int(np.searchsorted(token_ids, table.num_pinned_tokens))
        if num_prefix == 0:
            return self._of(table.req_id, token_ids)
        prefix = self._of(self._owner_of_prefix[self._requests[table.req_id].prefix_id], token_ids[:num_prefix])
        if num_prefix == token_ids.size:
            return prefix
        return np.concatenate((prefix, self._of(table.req_id, token_ids[num_prefix:])), axis=2)

    def _of(self, owner: int, token_ids: np.ndarray) -> np.ndarray:
        contents = self._contents.get(owner)
        num_needed = int(token_ids[-1]) + 1 if token_ids.size else 0
        if contents is None or contents.shape[2] < num_needed:
            contents = kv_content(owner, np.arange(max(num_needed, self._num_tokens_of[owner])))
            self._contents[owner] = contents
        return np.take(contents, token_ids, axis=2)


class KVContents:
    """The sim executor's K/V: written here at every `on_synced` from a `KVBook`, so that every
    token's K/V is known and every slot can be checked against it.

    Comparisons run in numpy on the host: on CPU over a view of the cache tensor, on CUDA
    through `PagedKVCache.read` (ordered on the compute stream after the copies it waits for).
    `ModelKVSnapshots` (snapshots.py) is the same interface over a model's real K/V.
    """

    def __init__(self, book: KVBook, kv_cache: PagedKVCache) -> None:
        self.book = book
        self._kv_cache = kv_cache
        self._host_view = kv_cache.flat.numpy() if kv_cache.device.type == "cpu" else None

    def place(self, table: TokenTable, token_ids: np.ndarray, slots: np.ndarray) -> None:
        """New tokens were mapped at `slots`: write their K/V (the sim's forward writes none)."""
        self.write(table, token_ids, slots)

    def snapshot(self, plan: RelocationPlan, table: TokenTable) -> None:
        """Nothing to remember before a relocation: the book knows every token's K/V."""

    def lost(self, table: TokenTable, live_ids: np.ndarray, slots: np.ndarray) -> np.ndarray:
        """Per live token after a relocation: does its mapped slot `slots[i]` hold other K/V than
        its own? The lost K/V is written back, so that one lost copy is reported once."""
        mismatched = self.mismatched(table, live_ids, slots)
        if np.any(mismatched):
            self.write(table, live_ids[mismatched], slots[mismatched])
        return mismatched

    def misread(self, table: TokenTable, live_ids: np.ndarray, read_slots: np.ndarray) -> np.ndarray:
        """Per live token about to be read at `read_slots[i]`: is that other K/V than its own?"""
        return self.mismatched(table, live_ids, read_slots)

    def write(self, table: TokenTable, token_ids: np.ndarray, slots: np.ndarray) -> None:
        self._kv_cache.write(torch.from_numpy(slots), torch.from_numpy(self.book.expected(table, token_ids)))

    def read(self, slots: np.ndarray) -> np.ndarray:
        if self._host_view is not None:
            return np.take(self._host_view, slots, axis=2)
        return self._kv_cache.read(torch.from_numpy(slots)).cpu().numpy()

    def mismatched(self, table: TokenTable, token_ids: np.ndarray, slots: np.ndarray) -> np.ndarray:
        """Per token: does the KV cache at `slots[i]` differ from token_ids[i]'s K/V?"""
        got, want = self.read(slots), self.book.expected(table, token_ids)
        if np.array_equal(got, want):
            return np.zeros(token_ids.size, dtype=bool)
        return (got != want).any(axis=(0, 1, 3, 4))
