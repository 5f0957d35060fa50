"""The physical KV block pool: a free list, ref counts and per-block live-token counts.

The pool is the only owner of block state. Token tables tell it how many tokens of a block
became live or dead (`adjust_live`) and which logical token sits in each slot (`token_at`, the
reverse map the reclaimer plans from); the runtime allocates and frees through it. The waste
ratio F (DESIGN.md Eq. 1) and the 10-bin utilization histogram are kept incrementally: every
operation updates only the blocks it touches, so reading them is O(1).

A decode step's append reaches the pool lazily: it adds to `num_live_tokens` at once (so F is
always exact) and its slot and logical id to the pool's two pending lists; `flush_deferred`
counts every pending append, whichever table made it, in a fixed number of numpy calls (the
reverse-map entries in one store, the blocks' live counts in one update), before any read of
live counts, the histogram or `token_at` through the pool, so that every read is exact. A
step appends to every decoding request, so the pool's first read after it meets them all and
counts the step's appends in one batch, not a few calls per request.

    F = 1 - sum(n_i) / (N * S)   over the N allocated blocks, n_i live tokens in block i
"""

from __future__ import annotations

import numpy as np

from vtoken.errors import ConfigError, VTokenError
from vtoken.kv.arrays import block_slots, is_distinct
from vtoken.kv.live_counts import NUM_HISTOGRAM_BINS, LiveCounts, compiled_loops
from vtoken.kv.token_arena import TokenArena

NO_BLOCKS = np.zeros(0, dtype=np.int64)
NO_BLOCKS.flags.writeable = False  # returned by every eviction that empties no block

class BlockPool(LiveCounts):
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks <= 0:
            raise ConfigError(f"num_blocks must be > 0, got {num_blocks}")
        if block_size <= 0:
            raise ConfigError(f"block_size must be > 0, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # A stack: allocate() pops from the end, so a fresh pool hands out 0, 1, 2, ...
        # and `peek_free` can tell a planner exactly which ids the next allocation returns.
        self._free_ids: list[int] = list(range(num_blocks - 1, -1, -1))
        self.ref_counts = np.zeros(num_blocks, dtype=np.int32)
        self._live_counts = np.zeros(num_blocks, dtype=np.int32)
        # slot -> logical id of the live token stored there (-1: none); written by the tables
        self._token_at = np.full(num_blocks * block_size, -1, dtype=np.int64)
        # appends not yet counted (`flush_deferred`): slot and logical id, one entry per token
        # until the pool's next read (every engine step reads it: the memory sample); a token
        # table's decode step appends to both lists itself
        self.pending_slots: list[int] = []
        self.pending_token_ids: list[int] = []
        self.token_arena = TokenArena()  # the per-token arrays of this pool's tables (token_arena.py)
        self._scratch: dict[str, np.ndarray] = {}  # `scratch`'s arrays, by name
        self._histogram: list[int] = [0] * NUM_HISTOGRAM_BINS + [num_blocks]  # a list: scalar updates are cheap
        # per live count c: the histogram bin of a block holding c (by u = c / S; bin 10 holds the
        # free blocks and is never reported) and whether c <= S/2, as lists for the scalar path
        # (`_recount`), and for the array path (`_set_live`) what such a block adds to the pool's
        # counts: its bin one-hot, whether c <= S/2, and c
        counts = np.arange(block_size + 1)
        bin_of_count = np.minimum(counts * NUM_HISTOGRAM_BINS // block_size, NUM_HISTOGRAM_BINS - 1)
        is_le_half = (2 * counts <= block_size).astype(np.int64)
        self._bin_list: list[int] = bin_of_count.tolist()
        self._is_le_half_list: list[int] = is_le_half.tolist()
        self._count_effects = np.zeros((block_size + 1, NUM_HISTOGRAM_BINS + 2), dtype=np.int64)
        self._count_effects[counts, bin_of_count] = 1
        self._count_effects[:, NUM_HISTOGRAM_BINS] = is_le_half
        self._count_effects[:, NUM_HISTOGRAM_BINS + 1] = counts
        self.num_live_tokens = 0  # exact at all times: appends count here at once
        self._num_blocks_le_half = 0

    # ---- allocation ------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_ids)

    @property
    def num_allocated_blocks(self) -> int:
        return self.num_blocks - len(self._free_ids)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free_ids)

    def peek_free(self, num_blocks: int) -> np.ndarray:
        """The ids that `allocate(num_blocks)` would return now, in the same order."""
        if num_blocks < 0:
            raise VTokenError(f"cannot take a negative number of blocks, got {num_blocks}")
        if num_blocks > len(self._free_ids):
            raise VTokenError(f"cannot peek {num_blocks} blocks, {len(self._free_ids)} free")
        if num_blocks == 0:
            return np.zeros(0, dtype=np.int64)
        return np.array(self._free_ids[-1 : -num_blocks - 1 : -1], dtype=np.int64)

    def allocate(self, num_blocks: int) -> np.ndarray:
        """Take `num_blocks` free blocks (ref count 1, no live tokens). Raises when short."""
        if num_blocks == 0:  # the common decode step
            return np.zeros(0, dtype=np.int64)
        if num_blocks == 1 and self._free_ids:
            block_id = self._free_ids.pop()
            self.ref_counts[block_id] = 1
            self._histogram[NUM_HISTOGRAM_BINS] -= 1
            self._histogram[0] += 1
            self._num_blocks_le_half += 1
            return np.array([block_id], dtype=np.int64)
        block_ids = self.peek_free(num_blocks)
        if num_blocks:
            del self._free_ids[-num_blocks:]
            self.ref_counts[block_ids] = 1
            self._histogram[NUM_HISTOGRAM_BINS] -= num_blocks
            self._histogram[0] += num_blocks
            self._num_blocks_le_half += num_blocks
        return block_ids

    def share(self, block_ids: np.ndarray) -> None:
        """Add a reference to allocated blocks (another request reuses a common prefix)."""
        block_ids = self._checked_ids(block_ids, "share")
        if not is_distinct(block_ids):
            raise VTokenError(f"share() got repeated block ids {block_ids.tolist()}")
        if np.any(self.ref_counts[block_ids] <= 0):
            raise VTokenError(f"cannot share free blocks {block_ids[self.ref_counts[block_ids] <= 0].tolist()}")
        self.ref_counts[block_ids] += 1

    def free(self, block_ids: np.ndarray) -> None:
        """Drop one reference per block; blocks left without references return to the free list.

        Live tokens of a block that goes free are forgotten: the owner has stopped reading it.
        """
        block_ids = np.asarray(block_ids, dtype=np.int64)
        if block_ids.size == 0:
            return
        if self.pending_slots:
            self.flush_deferred()
        if block_ids.size == 1:
            self._free_one(int(block_ids.flat[0]))
            return
        block_ids = self._checked_ids(block_ids, "free")
        if (self.ref_counts[block_ids] <= 0).any():
            raise VTokenError(f"double free of blocks {block_ids[self.ref_counts[block_ids] <= 0].tolist()}")
        if not is_distinct(block_ids):
            raise VTokenError(f"free() got repeated block ids {block_ids.tolist()}")
        self.ref_counts[block_ids] -= 1
        released = np.sort(block_ids[self.ref_counts[block_ids] == 0])
        if released.size == 0:
            return
        with_live = released[self._live_counts[released] > 0]  # usually none: the owner emptied them
        if with_live.size:
            self.num_live_tokens += self._set_live(with_live, np.zeros(with_live.size, dtype=np.int32))
            # the reverse map names live tokens only (I2): a block without one has nothing to clear
            self._token_at[block_slots(with_live, self.block_size)] = -1
        self._hand_back(released)

    def _hand_back(self, released: np.ndarray) -> None:
        """Blocks left without a reference and without a live token (ascending) join the free
        list: out of the histogram's lowest bin and the <= 50% count, into the free bin; in
        reverse, so that the lowest id of a batch is handed out first next time."""
        self._histogram[0] -= released.size
        self._histogram[NUM_HISTOGRAM_BINS] += released.size
        self._num_blocks_le_half -= released.size
        self._free_ids.extend(released[::-1].tolist())

    def release_empty(self, held: np.ndarray, sizes: np.ndarray, bases: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Of tables' held blocks (`held`, end to end, `sizes[k]` of table k: int64; `bases[k]`
        where table k's tokens start in this pool's arena, TokenArena.bases), split off
        those without a live token and free them, in one compiled pass
        (compiled.release_empty_blocks), as `free` of them does (the same checks, raising
        having changed nothing, and the same result; they hold no live token, so there is none
        to forget). Returns the blocks kept, in order; those split off, table by table in
        order; and how many of each table's they are (int64). A landing's release and free in
        one call, where the two took some thirty numpy calls
        (`TokenTable.release_empty_blocks_each`). Tables that are not distinct tables of this
        pool (two at one base, or one given the base -1) are refused too, before anything is
        written."""
        loops = compiled_loops()
        kept, released, num_released, freed, reason, block_id = loops.release_empty_blocks(
            held, sizes, bases, self.live_counts, self.ref_counts)
        if reason == loops.NOT_DISTINCT_TABLES:
            raise VTokenError("release_empty_blocks_each needs distinct tables of one pool")
        if reason == 1:
            raise VTokenError(f"release of block ids out of range [0, {self.num_blocks}): [{block_id}]")
        if reason == 2:
            raise VTokenError(f"double free of blocks [{block_id}]")
        if reason == 3:
            raise VTokenError(f"free() got repeated block ids [{block_id}]")
        if freed.size:
            self._hand_back(freed)  # as `free` does
        return kept, released, num_released

    def _free_one(self, block_id: int) -> None:
        """`free` of a single block, with scalars only (same checks, same result)."""
        if not 0 <= block_id < self.num_blocks:
            raise VTokenError(f"free() got block ids out of range [0, {self.num_blocks}): [{block_id}]")
        if self.ref_counts[block_id] <= 0:
            raise VTokenError(f"double free of blocks [{block_id}]")
        self.ref_counts[block_id] -= 1
        if self.ref_counts[block_id] > 0:
            return
        num_live = int(self._live_counts[block_id])
        self._live_counts[block_id] = 0
        self._token_at[block_id * self.block_size : (block_id + 1) * self.block_size] = -1
        self.num_live_tokens -= num_live
        self._num_blocks_le_half -= self._is_le_half_list[num_live]
        self._histogram[self._bin_list[num_live]] -= 1
        self._histogram[NUM_HISTOGRAM_BINS] += 1
        self._free_ids.append(block_id)

    def _checked_ids(self, block_ids: np.ndarray, verb: str) -> np.ndarray:
        # numpy would wrap a negative id around to the end of the pool
        block_ids = np.asarray(block_ids, dtype=np.int64)
        bad = (block_ids < 0) | (block_ids >= self.num_blocks)
        if np.count_nonzero(bad):  # np.any's Python layers cost twice the check
            raise VTokenError(f"{verb}() got block ids out of range [0, {self.num_blocks}): {block_ids[bad].tolist()}")
        return block_ids

    def is_shared(self, block_ids: np.ndarray) -> np.ndarray:
        return self.ref_counts[np.asarray(block_ids, dtype=np.int64)] > 1

    # ---- reads (exact: deferred appends are counted first) -----------------------------------

    @property
    def live_counts(self) -> np.ndarray:
        """Live tokens per block, [num_blocks] (read-only by convention: change through the tables)."""
        if self.pending_slots:
            self.flush_deferred()
        return self._live_counts

    def scratch(self, name: str, dtype: type) -> np.ndarray:
        """A pool-sized array (one entry per block) named `name`, for a caller that writes
        every entry it reads first: made at the first call and handed out again after, holding
        what the last caller left. A fresh pool-sized array at every call pays for the first
        touch of each memory page it writes, unless the allocator hands back memory already
        touched: at 1,024 requests x 8K, bench_substrate.py's pool has 1.6 million blocks, 13 MB
        an int64 array."""
        array = self._scratch.get(name)
        if array is None:
            array = self._scratch[name] = np.empty(self.num_blocks, dtype=dtype)
        return array

    @property
    def token_at(self) -> np.ndarray:
        """Logical id of the live token in each slot, -1 for none, [num_blocks * S]."""
        if self.pending_slots:
            self.flush_deferred()
        return self._token_at

    @property
    def num_blocks_le_half(self) -> int:
        if self.pending_slots:
            self.flush_deferred()
        return self._num_blocks_le_half

    # ---- metrics (O(1)) ----------------------------------------------------------------------

    def waste_ratio(self) -> float:
        """F (Eq. 1) over the allocated blocks; 0.0 for an empty pool."""
        return waste_ratio(self.num_live_tokens, self.num_allocated_blocks, self.block_size)

    def utilization_histogram(self) -> np.ndarray:
        """Allocated blocks per bin of u = live / S: [0, .1), [.1, .2), ..., [.9, 1.0]."""
        if self.pending_slots:
            self.flush_deferred()
        return np.array(self._histogram[:NUM_HISTOGRAM_BINS], dtype=np.int64)

    def frac_blocks_le_half(self) -> float:
        if self.pending_slots:
            self.flush_deferred()
        num_allocated = self.num_allocated_blocks
        return self._num_blocks_le_half / num_allocated if num_allocated else 0.0


def waste_ratio(num_live_tokens: int, num_allocated_blocks: int, block_size: int) -> float:
    """F (Eq. 1) = 1 - live tokens / (allocated blocks x S); 0.0 with no block allocated."""
    if num_allocated_blocks == 0:
        return 0.0
    return 1.0 - num_live_tokens / (num_allocated_blocks * block_size)
