"""Where a policy's selection of its k lowest scores should sample: the two ways
`vtoken.policies.base.lowest_positions` can select, side by side. A benchmark, not a test.

    python benchmarks/bench_selection.py [--sizes 600,1400,2048,3000,4000,8000,32000] [--ks 8,16,64] [--rounds 7]

    full      a partition of every value, then its compare and nonzero passes (`_lowest_of`)
    sampled   the same over the values up to a strided sample's bound (`_lowest_below_sampled_bound`)

Each (size, k) times both over the same Pareto(1.5) scores, alternating them round by round
(the first call of each is a warm-up, not timed); a round is the mean of enough calls to take
about 20 ms. Prints the median microseconds a call and the min-max over rounds, and the
smallest size at which sampling is the cheaper for every k: `SAMPLED_SELECTION_MIN_VALUES`
should sit near it. Both ways give the same positions (checked here, and by
tests/test_policies.py).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from vtoken.policies.base import SAMPLED_SELECTION_MIN_VALUES, _lowest_below_sampled_bound, _lowest_of


def per_call_us(select, values: np.ndarray, k: int, num_calls: int) -> float:
    started = time.process_time()
    for _ in range(num_calls):
        select(values, k)
    return (time.process_time() - started) / num_calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="600,1400,2048,3000,4000,8000,32000")
    parser.add_argument("--ks", default="8,16,64")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    sizes = [int(size) for size in args.sizes.split(",")]
    ks = [int(k) for k in args.ks.split(",")]
    rng = np.random.default_rng(0)
    print(f"{'values':>7} {'k':>4} {'full us (range)':>22} {'sampled us (range)':>22}")
    cheaper_from = None
    for size in sizes:
        values = rng.pareto(1.5, size) + 1.0
        sampled_wins = True
        for k in ks:
            if k * 32 > size:
                continue
            sampled = _lowest_below_sampled_bound(values, k)
            assert sampled is not None and np.array_equal(sampled, _lowest_of(values, k)), "the two ways disagree"
            num_calls = max(10, int(0.02 / max(1e-6, per_call_us(_lowest_of, values, k, 20) * 1e-6)))
            times = {"full": [], "sampled": []}
            for round_idx in range(args.rounds):
                order = [("full", _lowest_of), ("sampled", _lowest_below_sampled_bound)]
                for name, select in order if round_idx % 2 == 0 else order[::-1]:
                    times[name].append(per_call_us(select, values, k, num_calls))
            full, sample = statistics.median(times["full"]), statistics.median(times["sampled"])
            sampled_wins &= sample < full
            print(f"{size:7d} {k:4d} {full:8.1f} ({min(times['full']):5.1f}-{max(times['full']):5.1f})"
                  f" {sample:8.1f} ({min(times['sampled']):5.1f}-{max(times['sampled']):5.1f})")
        if sampled_wins and cheaper_from is None:
            cheaper_from = size
        elif not sampled_wins:
            cheaper_from = None
    where = f"from {cheaper_from} values on" if cheaper_from is not None else "at none of the largest sizes"
    print(f"sampling is the cheaper for every k {where}; lowest_positions samples from {SAMPLED_SELECTION_MIN_VALUES}")


if __name__ == "__main__":
    main()
