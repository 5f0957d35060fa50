"""The hf executor's K/V: real, written by the model's forward, so nothing here can say what a
token's K/V must be. What a relocation must preserve is what the tokens held when it began:

    on_plan            snapshot = kv_cache.read(mapped slots) of the request's live tokens
                       (before the launch, so the sources; the shared prefix is left out)
    on_plan_completed  every snapshotted token still live reads back, at the slot it is now
                       mapped to (a moved token: its destination), exactly its snapshot

Between the two the forward writes only the new tokens' slots, which no plan moves or
overwrites, so any difference is the relocation's. The pinned shared prefix is left out: it is
never relocated (I4), and a later sharer's prefill rewrites it with K/V that may differ in the
last bits.

Reads are not checked against contents here (`misread` returns None): the I3 read checks are
the slot checks, against the copies in flight and the mapping.
"""

from __future__ import annotations

import numpy as np
import torch

from vtoken.kv.kv_cache import PagedKVCache
from vtoken.kv.moves import RelocationPlan
from vtoken.kv.token_table import TokenTable


class ModelKVSnapshots:
    """Snapshots of the model's K/V around each relocation (the `KVContents` interface)."""

    def __init__(self, kv_cache: PagedKVCache) -> None:
        self._kv_cache = kv_cache
        self._block_size = kv_cache.shape.block_size
        # req_idx -> (token ids, their K/V [num_layers, 2, n, kv_heads, head_dim]) at the plan's launch
        self._before: dict[int, tuple[np.ndarray, torch.Tensor]] = {}

    def place(self, table: TokenTable, token_ids: np.ndarray, slots: np.ndarray) -> None:
        """Nothing to write: the coming forward writes the new tokens' K/V."""

    def snapshot(self, plan: RelocationPlan, table: TokenTable) -> None:
        """Remember the K/V of the request's live, unpinned tokens before `plan` launches. A
        request has one plan in flight at most; a cancelled plan's snapshot is replaced by the next."""
        token_ids = table.live_token_ids()
        token_ids = token_ids[token_ids >= table.num_pinned_tokens]
        self._before[plan.req_id] = (token_ids, self._read(self._slots(table, token_ids)))

    def lost(self, table: TokenTable, live_ids: np.ndarray, slots: np.ndarray) -> np.ndarray:
        """Per live token after a relocation: does its mapped slot `slots[i]` hold other K/V than
        it held at the launch? Tokens not snapshotted (appended since, or pinned) are not
        compared. The lost K/V is written back, so that one lost copy is reported once."""
        mismatched = np.zeros(live_ids.size, dtype=bool)
        before = self._before.pop(table.req_id, None)
        if before is None:
            return mismatched
        token_ids, kv = before
        is_live = np.isin(token_ids, live_ids)
        idx = np.searchsorted(live_ids, token_ids[is_live])
        kv = kv[:, :, torch.from_numpy(is_live).to(kv.device)]
        got = self._read(slots[idx])
        if torch.equal(got, kv):
            return mismatched
        differs = (got != kv).transpose(0, 2).reshape(idx.size, -1).any(dim=1)
        lost = idx[differs.cpu().numpy()]
        self._kv_cache.write(torch.from_numpy(slots[lost]), kv[:, :, differs])
        mismatched[lost] = True
        return mismatched

    def misread(self, table: TokenTable, live_ids: np.ndarray, read_slots: np.ndarray) -> None:
        """Unknown: nothing says what a real token's K/V must be (see the module docstring)."""
        return None

    def _slots(self, table: TokenTable, token_ids: np.ndarray) -> np.ndarray:
        return table.token_block_ids[token_ids] * self._block_size + table.token_offsets[token_ids]

    def _read(self, slots: np.ndarray) -> torch.Tensor:
        return self._kv_cache.read(torch.from_numpy(slots))
