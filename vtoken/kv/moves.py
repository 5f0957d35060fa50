"""Token relocations of one request: what the reclaimer and the compaction planner decide,
what the copy engine copies, and what `TokenTable.apply_moves` repoints afterwards; and the
reclaimer's plan around them (the blocks they empty and the fresh blocks they fill).

A round's plans come from one planning pass (kv/planning.py, `plan_hole_fill_each`), which lays
their moves and sources end to end, plan after plan, in a `PlanBatch`; each plan's arrays are
views of its stretch. The round's I4 check and its landing read every plan's arrays at once:
`end_to_end` hands them the batch's arrays when the plans are its first ones in order (what a
round launches), and concatenates the plans' own arrays otherwise.

    batch.moves:  [ plan 0's moves | plan 1's | plan 2's | plan 3's ]
    move_of:      [ 0 0 0 0 0 0 0  | 1 1 1 1  | 2 2 2 2  | 3 3 3    ]
    launched plans 0-2: the first 15 entries, as views
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

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

    @staticmethod
    def joined(moves: Sequence[Moves]) -> tuple[Moves, np.ndarray]:
        """Several requests' moves end to end, and the index in `moves` of the one each came
        from (at least one)."""
        return (Moves(np.concatenate([m.token_ids for m in moves]), np.concatenate([m.src_block_ids for m in moves]),
                      np.concatenate([m.src_offsets for m in moves]), np.concatenate([m.dst_block_ids for m in moves]),
                      np.concatenate([m.dst_offsets for m in moves])),
                np.repeat(np.arange(len(moves)), [m.num_moves for m in moves]))

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
    # the planning pass that laid its moves and sources end to end with other plans'
    batch: PlanBatch | None = field(default=None, compare=False, repr=False)

    @property
    def num_tokens_moved(self) -> int:
        return self.moves.num_moves

    @property
    def num_blocks_freed(self) -> int:
        return int(self.src_block_ids.size - self.dst_new_block_ids.size)


@dataclass(frozen=True)
class PlanBatch:
    """The plans of one planning pass, their moves and sources end to end, plan after plan:
    plan k's moves are entries [move_ends[k - 1], move_ends[k]) of `moves` (from 0 for plan 0),
    `move_of` names the plan of each, and likewise its sources. `plan_moves[k]` and
    `plan_sources[k]` are plan k's own `moves` and `src_block_ids`, views of those stretches:
    a plan whose arrays are not these (one copied with other moves) is not read here."""

    moves: Moves
    move_of: np.ndarray
    sources: np.ndarray
    source_of: np.ndarray
    move_ends: list[int]
    source_ends: list[int]
    plan_moves: list[Moves]
    plan_sources: list[np.ndarray]


def end_to_end(plans: Sequence[RelocationPlan]) -> tuple[Moves, np.ndarray, np.ndarray, np.ndarray]:
    """Every plan's moves end to end, with the index in `plans` of the plan of each, and every
    plan's sources likewise: (moves, move_of, sources, source_of). Views of the plans' batch when
    they are its first plans in order, their own arrays its views; else the plans' arrays
    concatenated."""
    batch = plans[0].batch if plans else None
    if batch is not None and len(plans) <= len(batch.plan_moves) and all(
            plan.batch is batch and plan.moves is own_moves and plan.src_block_ids is own_sources
            for plan, own_moves, own_sources in zip(plans, batch.plan_moves, batch.plan_sources)):
        num_moves, num_sources = batch.move_ends[len(plans) - 1], batch.source_ends[len(plans) - 1]
        moves = batch.moves
        if num_moves == moves.num_moves and num_sources == batch.sources.size:  # every plan of the batch
            return moves, batch.move_of, batch.sources, batch.source_of
        return (Moves(moves.token_ids[:num_moves], moves.src_block_ids[:num_moves], moves.src_offsets[:num_moves],
                      moves.dst_block_ids[:num_moves], moves.dst_offsets[:num_moves]),
                batch.move_of[:num_moves], batch.sources[:num_sources], batch.source_of[:num_sources])
    if not plans:
        none = np.zeros(0, dtype=np.int64)
        return Moves(none, none, none, none, none), none, none, none
    moves, move_of = Moves.joined([plan.moves for plan in plans])
    return (moves, move_of, np.concatenate([plan.src_block_ids for plan in plans]),
            np.repeat(np.arange(len(plans)), [plan.src_block_ids.size for plan in plans]))

