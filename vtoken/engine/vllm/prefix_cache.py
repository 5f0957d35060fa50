"""vToken with vLLM's prefix caching on: which blocks stay untouched, and which hashes go.

How vLLM 0.32 caches (v1/core/block_pool.py, single_type_kv_cache_manager.py,
kv_cache_manager.py): `allocate_slots` ends with `cache_blocks`, which registers every *full*
block of a request under the chained hash of its logical tokens (`request.block_hashes[i]`
for block i) in `BlockPool.cached_block_hash_to_block`; a later request's
`get_computed_blocks` walks its own hashes and `touch`es every block found (`ref_cnt` + 1).
A freed block keeps its hash and waits in the free queue as an eviction candidate; only
`get_new_blocks` (reuse) or `evict_blocks` (`_maybe_evict_cached_block`) drops it. So once a
block is registered, any request may read it as the KV of those logical tokens, and a block
with `ref_cnt > 1` is read by another running request right now.

vToken rewrites blocks (eviction leaves holes, compaction fills them, trailing blocks go back),
so the rules are:

1. A protected prefix: the leading blocks of a request that are never evicted from, moved
   from or into, or handed back. `prefix_protection` chooses it, once an eviction is due:
     "prompt" (default)  the request's full prompt blocks (floor(prompt / S)); the same
                         blocks whether the prompt hit the cache or not, so a hit and a miss
                         give the same outputs, and the prompt stays cached for later requests.
                         The policy evicts among the partial prompt tail and generated tokens.
     "shared"            the leading blocks up to the last one another request holds now
                         (`ref_cnt > 1`): the paper's section 4.6, private prompt suffixes are
                         reclaimed too; a later request hits only what was shared.
   The policy never sees protected tokens and they count against its budget
   (eviction.build_view, `TokenTable.pin_prefix`). Protection only grows.
2. Before a request's first change to its layout, every block past the protected prefix loses
   its hash (`KVCacheManager.evict_blocks`), and from then on the request's new blocks are
   never registered (`allocate_slots(..., delay_cache_blocks=True)`): a compacted block is
   never matched as cached (the class of tenstorrent/vllm#415, KV corrupted only on cache
   hits, and of local-inference-lab/vllm#480, phantom hits after eviction).
3. Checked on every step plan, always: every block a move reads or writes and every block
   handed back has `ref_cnt == 1` and no hash (I2); a violation raises InvariantError.

A prefix-cache hit arrives as `num_computed_tokens > 0` at a request's first schedule: the
tracker places those tokens in the hit blocks like its own (tracker.sync). A block shared by
two requests is then in both token tables (two ledger ids, one vLLM block); it stays whole in
both, which `VTokenTracker.stats` uses to count its tokens once.

Reads vLLM objects by attribute only: no vLLM import.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from vtoken.errors import InvariantError


class PrefixCache:
    """The scheduler's view of vLLM's prefix cache, for the tracker (tracker.PrefixCacheView)."""

    def __init__(self, kv_cache_manager, protection: str, num_prompt_tokens: Callable[[str], int]) -> None:
        self.kv_cache_manager = kv_cache_manager
        self.block_pool = kv_cache_manager.block_pool
        self.block_size = kv_cache_manager.coordinator.single_type_managers[0].block_size
        self.protection = protection
        self.num_prompt_tokens = num_prompt_tokens
        self.num_hashes_dropped = 0

    def num_protected_blocks(self, req_id: str, vllm_block_ids: np.ndarray) -> int:
        """Leading blocks of the request (its block list `vllm_block_ids`) to protect now."""
        if self.protection == "prompt":
            return min(self.num_prompt_tokens(req_id) // self.block_size, len(vllm_block_ids))
        blocks = self.block_pool.blocks
        shared = [i for i, block_id in enumerate(vllm_block_ids.tolist()) if blocks[block_id].ref_cnt > 1]
        return shared[-1] + 1 if shared else 0

    def uncache(self, vllm_block_ids: np.ndarray) -> None:
        """Drop the prefix-cache hashes of these blocks (the request is about to rewrite them)."""
        blocks = self.block_pool.blocks
        hashed = {int(b) for b in vllm_block_ids.tolist() if blocks[b].block_hash is not None}
        if hashed:
            self.check_private(np.fromiter(hashed, dtype=np.int64), "loses its prefix-cache hash")
            self.kv_cache_manager.evict_blocks(hashed)
            self.num_hashes_dropped += len(hashed)

    def check_private(self, vllm_block_ids: np.ndarray, what: str, hashed_ok: bool = True) -> None:
        """I2: these blocks are held by one request only (and hold no hash unless `hashed_ok`)."""
        blocks = self.block_pool.blocks
        for block_id in np.unique(vllm_block_ids).tolist():
            block = blocks[block_id]
            if block.ref_cnt != 1 or (not hashed_ok and block.block_hash is not None):
                state = f"ref_cnt {block.ref_cnt}" + (", registered in the prefix cache" if block.block_hash else "")
                raise InvariantError("I2", f"vLLM block {block_id} ({state}) {what}; it may be read by another "
                                     "request", block_id=block_id)
