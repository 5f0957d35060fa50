"""Host time of each `vtoken paper` experiment and of the whole Azure conversation trace
(19,366 requests through the three variants at C = 32, `compare --no-sweep --no-frontier`):
the whole process (start-up, trace reading, tokenizer loading included), no run cache, one
round after another with the commands in a rotated order each round, so that a slow spell of
a shared machine does not fall on one command only. Median, range, and user + system CPU
seconds (of the command and its workers), which a busy machine inflates less than wall time.
Also checks that every round of a command printed the same JSON. Host seconds, not a test.

    python benchmarks/bench_paper.py [--rounds 3] [--only fig7,fig9,azure] [--workers 1]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VTOKEN = str(Path(sys.executable).with_name("vtoken"))
AZURE_CONV = ROOT.parent / "shared" / "traces" / "azure_llm_2023_conv.csv"
COMMANDS = {
    "fig7": ["paper", "fig7"],
    "fig7-sharegpt": ["paper", "fig7", "--trace", "sharegpt", "--max-requests", "1000", "--tokenizer", "smollm2-135m"],
    "fig8": ["paper", "fig8", "--tokenizer", "smollm2-135m"],
    "fig9": ["paper", "fig9"],
    "fig10": ["paper", "fig10"],
    "sensitivity": ["paper", "sensitivity"],
    "prefix-sharing": ["paper", "prefix-sharing"],
    "azure": ["compare", os.environ.get("VTOKEN_AZURE_CONV", str(AZURE_CONV)), "--concurrency", "32",
              "--no-sweep", "--no-frontier"],
}


def timed_run(args: list[str], num_workers: int) -> tuple[float, float, str]:
    """Wall seconds, CPU seconds of the command and its children, and its stdout."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    done = subprocess.run([VTOKEN, *args, "--json", "--no-cache", "--workers", str(num_workers)], check=True,
                          capture_output=True, text=True, cwd=ROOT)
    wall_s = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_s = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall_s, cpu_s, done.stdout


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", default=",".join(COMMANDS), help="comma-separated names of COMMANDS")
    parser.add_argument("--workers", type=int, default=1)
    args = parser.parse_args()
    names = [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = [n for n in names if n not in COMMANDS]
    if unknown:
        parser.error(f"unknown command {unknown[0]!r}; choose from {', '.join(COMMANDS)}")
    wall_s = {n: [] for n in names}
    cpu_s = {n: [] for n in names}
    outputs = {n: set() for n in names}
    for round_idx in range(args.rounds):
        shift = round_idx % len(names)
        for name in names[shift:] + names[:shift]:
            wall, cpu, stdout = timed_run(COMMANDS[name], args.workers)
            wall_s[name].append(wall)
            cpu_s[name].append(cpu)
            outputs[name].add(stdout)
            print(f"round {round_idx + 1}: {name}: {wall:.1f} s wall, {cpu:.1f} s CPU", flush=True)
    print(f"\n{'command':<16} {'wall median':>12} {'wall range':>16} {'CPU median':>11}  same JSON")
    for name in names:
        print(f"{name:<16} {statistics.median(wall_s[name]):>10.1f} s {min(wall_s[name]):>7.1f}-"
              f"{max(wall_s[name]):.1f} s {statistics.median(cpu_s[name]):>9.1f} s  {len(outputs[name]) == 1}")


if __name__ == "__main__":
    main()
