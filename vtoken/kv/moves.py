"""Token relocations of one request: what the reclaimer and the compaction planner decide,
what the copy engine copies, and what `TokenTable.apply_moves` repoints afterwards; and the
reclaimer's plan around them (the blocks they empty and the fresh blocks they fill)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


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

    def select(self, which: np.ndarray) -> Moves:
        """The moves that `which` picks: a mask, or indices."""
        return Moves(self.token_ids[which], self.src_block_ids[which], self.src_offsets[which],
                     self.dst_block_ids[which], self.dst_offsets[which])

    def src_slots(self, block_size: int) -> np.ndarray:
        return self.src_block_ids * block_size + self.src_offsets

    def dst_slots(self, block_size: int) -> np.ndarray:
        return self.dst_block_ids * block_size + self.dst_offsets


@dataclass(frozen=True)
class RelocationPlan:
    """Moves for one request. Sources are freed and destinations adopted when the copy completes."""

    req_id: int
    mode: str
    moves: Moves
    src_block_ids: np.ndarray  # blocks emptied by the moves, freed on completion
    dst_new_block_ids: np.ndarray  # fresh destination blocks (ordered); empty for hole-fill
    layout_version: int  # the table's version the plan was computed from

    @property
    def num_tokens_moved(self) -> int:
        return self.moves.num_moves

    @property
    def num_blocks_freed(self) -> int:
        return int(self.src_block_ids.size - self.dst_new_block_ids.size)
