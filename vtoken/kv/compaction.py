"""Dense compaction: the planner for engines whose attention reads slots 0..seq_len-1 (vLLM). Pure.

The reclaimer (reclaim.py) packs lazily, because the runtime's attention reads live slots
through the token table. Stock vLLM kernels take a block table and a sequence length per
request and skip no slot, so there, after an eviction, the live tokens of a request must be
packed into the first positions of its block list before the next forward. A position is `index in block_ids_held * S + offset`:

    before (S = 4, 7 live):   [L . L L][. L . .][L L L .]      positions 0..11
    hole-fill:                [L L L L][L L L .][. . . .]      2 moves: 9 -> 1, 8 -> 4...
    ordered:                  the same packing, logical order kept: every token after
                              the first hole moves (more moves, same result)

hole-fill moves the last live tokens into the first holes (fewest moves; valid because cached
keys carry their rotary position and attention does not depend on key order). ordered keeps
the logical order (the paper's order-preserving compaction, in place). Blocks past the packed
end hold no live token afterwards; what happens to them is the variant's business.

`naive_num_blocks` is the other half of the naive-evict variant: how many blocks a layout that
never moves tokens would hold (a block goes only when every token in it is dead).
"""

from __future__ import annotations

import numpy as np

from vtoken.errors import ConfigError, VTokenError
from vtoken.kv.moves import Moves
from vtoken.kv.reclaim import RECLAIM_MODES
from vtoken.kv.token_table import TokenTable


def live_positions(table: TokenTable) -> tuple[np.ndarray, np.ndarray]:
    """Live logical ids (ascending) and their positions in the request's block list."""
    live_ids = table.live_token_ids()
    held = table.held_block_ids
    index_of_block = np.full(int(held.max(initial=-1)) + 1, -1, dtype=np.int64)
    index_of_block[held] = np.arange(held.size)
    slots = table.token_slots[live_ids]
    block_idx = index_of_block[slots // table.block_size]
    assert np.all(block_idx >= 0), "a live token maps to a block its request does not hold"
    return live_ids, block_idx * table.block_size + slots % table.block_size


def plan_compaction(table: TokenTable, mode: str) -> Moves:
    """Moves that leave the live tokens exactly at positions 0..num_live-1. Mutates nothing."""
    if mode not in RECLAIM_MODES:
        raise ConfigError(f"unknown reclaim mode '{mode}'; choose one of: {', '.join(RECLAIM_MODES)}")
    live_ids, positions = live_positions(table)
    num_live = live_ids.size
    if mode == "ordered":
        targets = np.arange(num_live, dtype=np.int64)
        moving = np.flatnonzero(positions != targets)
        dst = targets[moving]
    else:
        occupied = np.zeros(num_live, dtype=bool)
        in_front = positions < num_live
        occupied[positions[in_front]] = True
        holes = np.flatnonzero(~occupied)
        outside = np.flatnonzero(~in_front)
        moving = outside[np.argsort(-positions[outside], kind="stable")]  # the last token first
        dst = holes
    num_pinned = table.num_pinned_tokens
    # a pinned (shared) prefix fills the first blocks in order, so no move touches it
    if num_pinned and (not np.array_equal(positions[:num_pinned], np.arange(num_pinned)) or np.any(dst < num_pinned)):
        raise VTokenError(f"request {table.req_id}: a compaction would move into or out of its pinned prefix")
    return _moves(table, live_ids[moving], positions[moving], dst)


def _moves(table: TokenTable, token_ids: np.ndarray, src: np.ndarray, dst: np.ndarray) -> Moves:
    held = table.held_block_ids
    size = table.block_size
    order = np.argsort(token_ids, kind="stable")
    token_ids, src, dst = token_ids[order], src[order], dst[order]
    return Moves(token_ids.astype(np.int64), held[src // size], src % size, held[dst // size], dst % size)


def naive_num_blocks(table: TokenTable) -> int:
    """Blocks the never-compacted layout holds: those with a live token, plus the open tail."""
    if table.num_tokens == 0:
        return 0
    size = table.block_size
    naive_block_idx = np.unique(table.live_token_ids() // size)
    tail_idx = (table.num_tokens - 1) // size
    return int(naive_block_idx.size + (0 if naive_block_idx.size and naive_block_idx[-1] == tail_idx else 1))
