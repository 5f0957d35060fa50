"""A policy's selection of its k lowest scores, compiled (numba): `base.lowest_positions`.

The rule is the policies' (base.py says it in full): the positions of everything strictly
below the k-th smallest value, then as many of the values tied with it as still fit, lowest
positions first; NaN sorts last and equals nothing, so a k-th smallest that is NaN selects
nothing. Here it is two loops, chosen by the share k is of the values:

    few (k * HEAP_MAX_SHARE <= n)  a max-heap of the k smallest (value, position) pairs seen
                                   so far, one pass: a compare per value, a sift of log k
                                   for each that enters, no copy of the values.
                                   A policy's periodic run (16 of a few thousand) is this.
    many                           a partition of a copy of the values finds the k-th
                                   smallest, then one pass counts what lies below it and
                                   one takes the positions. A request's first run (half of
                                   its prompt) is this.

Neither calls anything per value. Warm (benchmarks/bench_selection.py, which times numpy's
selection as it was against both loops): at 1,400 values and k = 16, numpy's partition with
its compare and nonzero passes took 14.7 us a call, the heap takes 2.3; at 8,000, numpy's
search below a strided sample's bound 13.3, the heap 6.5; at 3,000 values and k = 375, numpy 31.5,
the partition 10.0. At 32,000 values and k = 16 numpy's sampled search is the faster, 13.2
against the heap's 20.1: its compare runs over the values in vector instructions, the heap's
scan one value at a time, about 0.3 ns each, plus some hundred replacements of the largest kept.
"""

from __future__ import annotations

import numpy as np

from vtoken.jit import njit

# the heap pays while k is at most this share of the values (bench_selection.py's crossover)
HEAP_MAX_SHARE = 32


@njit
def lowest_positions(values, k):
    """Positions of the k smallest of `values` (1 <= k <= values.size), ascending, ties at the
    k-th smallest to the lower positions; int64."""
    if k * HEAP_MAX_SHARE <= values.size:
        return _lowest_by_heap(values, k)
    return _lowest_by_partition(values, k)


@njit
def unprotected_slice(token_ids, num_sink_tokens, first_recent_id, num_keep_tokens):
    """The policies' victim rule (base.py's `unprotected_range` and `num_victims` read it here):
    (lo, hi, num_victims), where [lo, hi) are the positions of the ascending `token_ids` in
    [num_sink_tokens, first_recent_id) (the sinks are a prefix of them and the recent window a
    suffix, found by bisection), and num_victims how many to evict to come down to
    `num_keep_tokens` without reaching a protected id."""
    lo = np.searchsorted(token_ids, num_sink_tokens)
    hi = max(lo, np.searchsorted(token_ids, first_recent_id))
    num_ids = token_ids.size
    return lo, hi, max(0, num_ids - max(num_keep_tokens, num_ids - (hi - lo)))


@njit
def lowest_unprotected_ids(token_ids, scores, num_sink_tokens, first_recent_id, num_keep_tokens):
    """`base.evict_lowest` in one call: of the `unprotected_slice` of the ascending
    `token_ids`, its count of ids with the lowest `scores` (aligned with the ids); int64,
    ascending. A policy's periodic run is a few numpy calls around the selection otherwise,
    each about what the selection itself costs."""
    lo, hi, num_evict = unprotected_slice(token_ids, num_sink_tokens, first_recent_id, num_keep_tokens)
    if num_evict == 0:
        return np.empty(0, np.int64)
    positions = lowest_positions(scores[lo:hi], num_evict)
    victims = np.empty(positions.size, np.int64)
    for i in range(positions.size):
        victims[i] = token_ids[lo + positions[i]]
    return victims


@njit
def _above(value_a, position_a, value_b, position_b):
    """(value_a, position_a) ranks above (value_b, position_b): a larger value, NaN the
    largest, then a larger position."""
    if value_a != value_a:  # NaN
        return value_b == value_b or position_a > position_b
    return value_a > value_b or (value_a == value_b and position_a > position_b)  # False for a NaN value_b


@njit
def _lowest_by_heap(values, k):
    heap_values = np.empty(k, values.dtype)
    heap_positions = np.empty(k, np.int64)
    for i in range(k):  # fill: sift each pair up
        child = i
        while child > 0:
            parent = (child - 1) >> 1
            if not _above(values[i], i, heap_values[parent], heap_positions[parent]):
                break
            heap_values[child], heap_positions[child] = heap_values[parent], heap_positions[parent]
            child = parent
        heap_values[child], heap_positions[child] = values[i], i
    # then every later value below the largest kept replaces it (a later position ranks below
    # only a smaller value, or any number while the largest kept is NaN); most values are not
    # below it, and a tight loop skips them
    i = k
    while i < values.size:
        top = heap_values[0]
        if top == top:
            while i < values.size and not values[i] < top:
                i += 1
            if i == values.size:
                break
        value = values[i]
        # (a NaN while the largest kept is NaN swaps one NaN for another: the k-th stays NaN)
        child = 0  # replace the largest kept, sift down
        while True:
            larger = 2 * child + 1
            if larger >= k:
                break
            right = larger + 1
            if right < k and _above(heap_values[right], heap_positions[right],
                                    heap_values[larger], heap_positions[larger]):
                larger = right
            if not _above(heap_values[larger], heap_positions[larger], value, i):
                break
            heap_values[child], heap_positions[child] = heap_values[larger], heap_positions[larger]
            child = larger
        heap_values[child], heap_positions[child] = value, i
        i += 1
    if heap_values[0] != heap_values[0]:  # the k-th smallest is NaN
        return np.empty(0, np.int64)
    return np.sort(heap_positions)


@njit
def _lowest_by_partition(values, k):
    kth_value = np.partition(values, k - 1)[k - 1]
    num_below = 0
    for i in range(values.size):
        if values[i] < kth_value:
            num_below += 1
    num_ties = k - num_below
    positions = np.empty(k, np.int64)
    num_chosen = 0
    for i in range(values.size):
        value = values[i]
        if value < kth_value:
            positions[num_chosen] = i
            num_chosen += 1
        elif value == kth_value and num_ties > 0:
            positions[num_chosen] = i
            num_chosen += 1
            num_ties -= 1
    return positions[:num_chosen]
