"""Speed-up of `--workers`: the quick start's compare (`vtoken compare
sample_traces/azure_conv_sample.csv --num-blocks 2000`), or with `--command audit` the example
audit (`vtoken audit examples/llama8b-l40s.toml`: four policies' replays, then the capacity
searches), with 1 and with N worker processes, alternating over rounds, no cache. Wall seconds
of the whole command (start-up included), median and range per setting, the speed-up of each
round's pair (serial / workers) with its range, the load average the machine was under, and a
check that every round printed the same JSON. Host seconds, not a test.

    python benchmarks/bench_workers.py [--command compare|audit] [--rounds 3] [--workers 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VTOKEN = Path(sys.executable).with_name("vtoken")
COMMANDS = {
    "compare": [str(VTOKEN), "compare", str(ROOT / "sample_traces" / "azure_conv_sample.csv"), "--num-blocks", "2000",
                "--json", "--no-cache"],
    "audit": [str(VTOKEN), "audit", str(ROOT / "examples" / "llama8b-l40s.toml"), "--json", "--no-cache"],
}


def timed_run(command: list[str], num_workers: int) -> tuple[float, str]:
    started = time.perf_counter()
    done = subprocess.run([*command, "--workers", str(num_workers)], check=True, capture_output=True, text=True)
    return time.perf_counter() - started, done.stdout


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--command", choices=tuple(COMMANDS), default="compare")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    settings = (1, args.workers)
    wall_s: dict[int, list[float]] = {n: [] for n in settings}
    outputs = set()
    load = os.getloadavg()
    for round_idx in range(args.rounds):
        for num_workers in settings if round_idx % 2 == 0 else reversed(settings):
            elapsed, stdout = timed_run(COMMANDS[args.command], num_workers)
            wall_s[num_workers].append(elapsed)
            outputs.add(stdout)
            print(f"round {round_idx + 1}: --workers {num_workers}: {elapsed:.1f} s", flush=True)
    for n in settings:
        print(f"--workers {n}: median {statistics.median(wall_s[n]):.1f} s (range {min(wall_s[n]):.1f}-"
              f"{max(wall_s[n]):.1f} s) over {args.rounds} rounds")
    speedup = statistics.median(wall_s[1]) / statistics.median(wall_s[args.workers])
    pairs = [serial / parallel for serial, parallel in zip(wall_s[1], wall_s[args.workers])]
    print(f"speed-up with {args.workers} workers: {speedup:.2f}x of the medians; per round {statistics.median(pairs):.2f}x "
          f"(range {min(pairs):.2f}-{max(pairs):.2f}x); identical JSON in every run: {len(outputs) == 1}")
    print(f"load average {', '.join(f'{x:.1f}' for x in load)} at the start, "
          f"{', '.join(f'{x:.1f}' for x in os.getloadavg())} at the end, on {os.cpu_count()} cores")


if __name__ == "__main__":
    main()
