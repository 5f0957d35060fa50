"""A policy's selection of its k lowest scores (`vtoken.policies.base.lowest_positions`): the
compiled loops against numpy. A benchmark, not a test.

    python benchmarks/bench_selection.py [--sizes 600,1400,3000,8000,32000] [--ks 16,64,0.125,0.5] [--rounds 7]
                                         [--scores pareto|h2o]

    numpy      the selection before it was compiled, kept here as the baseline: below 3,000
               values a partition of every value, then its compare and nonzero passes; from
               3,000 on (with k at most 1/32 of them) the same over the values up to a
               strided sample's bound
    heap       the compiled max-heap of the k smallest (policies/selection.py)
    partition  the compiled partition and two passes

A k below 1 is that share of the values. Each (size, k) times the three over the same scores:
Pareto(1.5) in random order (`pareto`, the default), or shaped as H2O's in the sim (`h2o`: the
same weights times the accumulated recency of each position's age, `SimProfile`'s defaults,
so that the scores fall from the oldest token to the newest, the heap's hard case), alternating them round by round (the first call of each is a warm-up, not
timed); a round is the mean of enough calls to take about 20 ms. Prints the median microseconds
a call, the min-max over rounds, and which loop `lowest_positions` takes there (the heap while
k * HEAP_MAX_SHARE <= values): it should be the cheaper of the two. All three give the same
positions (checked here; tests/test_policies.py checks the compiled ones against numpy's
partition on adversarial orders, ties, NaN and integer counts).

These are warm figures: one call after another on the same values. In a replay an eviction
event's selection runs between other work, cold, and costs several times its figure here.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from vtoken.engine.sim import SimProfile, _cumulative_recency
from vtoken.policies.selection import HEAP_MAX_SHARE, _lowest_by_heap, _lowest_by_partition


def numpy_lowest(values: np.ndarray, k: int) -> np.ndarray:
    if values.size >= 3000 and k * 32 <= values.size:
        sample = np.sort(values[:: values.size // 64])
        bound = sample[min(sample.size - 1, 4 * k * sample.size // values.size + 1)]
        candidates = (values <= bound).nonzero()[0]
        if candidates.size >= k:
            return candidates[numpy_lowest_of(values[candidates], k)]
    return numpy_lowest_of(values, k)


def numpy_lowest_of(values: np.ndarray, k: int) -> np.ndarray:
    kth_value = np.partition(values, k - 1)[k - 1]
    chosen = values <= kth_value
    positions = chosen.nonzero()[0]
    if positions.size <= k:
        return positions
    chosen = values < kth_value
    tied = (values == kth_value).nonzero()[0][: k - int(np.count_nonzero(chosen))]
    chosen[tied] = True
    return chosen.nonzero()[0]


WAYS = (("numpy", numpy_lowest), ("heap", _lowest_by_heap), ("partition", _lowest_by_partition))


def per_call_us(select, values: np.ndarray, k: int, num_calls: int) -> float:
    started = time.process_time()
    for _ in range(num_calls):
        select(values, k)
    return (time.process_time() - started) / num_calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="600,1400,3000,8000,32000")
    parser.add_argument("--ks", default="16,64,0.125,0.5")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--scores", choices=("pareto", "h2o"), default="pareto")
    args = parser.parse_args()
    sizes = [int(size) for size in args.sizes.split(",")]
    rng = np.random.default_rng(0)
    print(f"{'values':>7} {'k':>6} " + " ".join(f"{name + ' us (range)':>22}" for name, _ in WAYS) + "  lowest_positions takes")
    for size in sizes:
        values = rng.pareto(1.5, size) + 1.0
        if args.scores == "h2o":  # attention_sum at length `size`: weight x sum of r(d) up to the age
            profile = SimProfile()
            age = np.arange(size - 1, -1, -1, dtype=np.float64)
            values *= _cumulative_recency(age, profile.recency_tau, profile.recency_beta)
        ks = sorted({max(1, int(float(k) * size)) if float(k) < 1 else int(k) for k in args.ks.split(",")})
        for k in (k for k in ks if k <= size):
            expected = numpy_lowest(values, k)
            for name, select in WAYS:
                assert np.array_equal(select(values, k), expected), f"{name} disagrees at {size} values, k = {k}"
            num_calls = max(10, int(0.02 / max(1e-6, per_call_us(numpy_lowest, values, k, 20) * 1e-6)))
            times: dict[str, list[float]] = {name: [] for name, _ in WAYS}
            for round_idx in range(args.rounds):
                for name, select in WAYS if round_idx % 2 == 0 else WAYS[::-1]:
                    times[name].append(per_call_us(select, values, k, num_calls))
            taken = "heap" if k * HEAP_MAX_SHARE <= size else "partition"
            cells = " ".join(f"{statistics.median(times[name]):9.1f} ({min(times[name]):5.1f}-{max(times[name]):5.1f})"
                             for name, _ in WAYS)
            print(f"{size:7d} {k:6d} {cells}  {taken}")


if __name__ == "__main__":
    main()
