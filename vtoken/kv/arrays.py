"""Small array helpers of the substrate, cheap for the short arrays a step works on."""

from __future__ import annotations

import numpy as np


def block_slots(block_ids: np.ndarray, block_size: int) -> np.ndarray:
    """Every slot of `block_ids`, block by block, offsets ascending."""
    return (np.asarray(block_ids, dtype=np.int64)[:, None] * block_size + np.arange(block_size)).ravel()


def is_distinct(values: np.ndarray) -> bool:
    """No value repeats (cheap when `values` ascends, as the planners' arrays do; else a set
    for a few dozen values, a sort for more)."""
    if values.size < 2 or (values[1:] > values[:-1]).all():
        return True
    if values.size <= 64:
        return len(set(values.tolist())) == values.size
    ordered = np.sort(values)
    return bool((ordered[1:] != ordered[:-1]).all())


def isin(values: np.ndarray, members: np.ndarray) -> np.ndarray:
    """`np.isin(values, members)` for the short integer arrays of a plan or a release, by one
    sort of `members` and a binary search (`np.isin` costs several times more on them)."""
    if members.size == 0:
        return np.zeros(values.shape, dtype=bool)
    members = np.sort(members)
    idx = np.minimum(np.searchsorted(members, values), members.size - 1)
    return members[idx] == values


def count_by_block(block_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Distinct blocks (ascending) and how often each occurs, by one sort (a dict for the usual
    few dozen entries)."""
    if block_ids.size <= 64:
        counts: dict[int, int] = {}
        for block_id in block_ids.tolist():
            counts[block_id] = counts.get(block_id, 0) + 1
        distinct = sorted(counts)
        return np.array(distinct, dtype=np.int64), np.array([counts[b] for b in distinct], dtype=np.int64)
    ordered = np.sort(block_ids)
    starts = np.flatnonzero(np.concatenate(([True], ordered[1:] != ordered[:-1])))
    return ordered[starts], np.diff(np.append(starts, ordered.size))


def positions_in(held: np.ndarray, block_ids: np.ndarray) -> np.ndarray:
    """Index in `held` of each of `block_ids`, -1 where absent."""
    if held.size == 0:
        return np.full(block_ids.size, -1, dtype=np.int64)
    order = np.argsort(held, kind="stable")
    idx = np.minimum(np.searchsorted(held[order], block_ids), held.size - 1)
    found = held[order][idx] == block_ids
    return np.where(found, order[idx], -1)
