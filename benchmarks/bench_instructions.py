"""Instructions per variant of one open-loop replay of the Azure conversation trace, counted by
valgrind's cachegrind: a host-independent companion of bench_variants.py, whose host seconds
move with whatever else the machine runs (one replay after another, the same code measured
vtoken at 1.50x to 1.94x native at 5,000 requests within one hour; side by side,
`--interleave`, a few hundredths). Not a test.

    python benchmarks/bench_instructions.py [--max-requests 1000] [--variants V,...] [--azure PATH]
                                            [--cache-sim]

Per variant, two processes run under `valgrind --tool=cachegrind`, with PYTHONHASHSEED=0 so that
both do the same work up to the replay: one loads the trace, builds the experiment and stops,
the other then replays what `vtoken compare TRACE --open-loop --no-sweep --no-frontier` replays
(default model, GPU and block budget, H2O at 50%). The replay's count is the difference.
Counts of one configuration repeat within about 0.3% (allocation addresses, the garbage
collector's timing). `--cache-sim` also simulates the caches, the last level set to 1 MiB as
this kind of machine's per-core L2, and reports the replay's instruction-cache misses and its
data misses at both levels.

An instruction ratio is not a time ratio: the work beyond native's is numpy calls on arrays a
step has not touched yet, which cost more per instruction than the interpreter's loop over
the running requests (cache misses), so host time ratios run above these.

Needs valgrind on PATH (a one-line error and exit code 2 without it). About 80 s per variant
at 1,000 requests.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from replay_inputs import checked_replay, fail, replayed

from vtoken.engine import VARIANTS, run_sim

ROOT = Path(__file__).resolve().parent.parent
AZURE = ROOT.parent / "shared" / "traces" / "azure_llm_2023_conv.csv"
SCRIPT = "bench_instructions"
COUNTERS = {"instructions": r"I\s+refs:\s+([\d,]+)", "I1 misses": r"I1\s+misses:\s+([\d,]+)",
            "D1 misses": r"D1\s+misses:\s+([\d,]+)", "LL data misses": r"LLd misses:\s+([\d,]+)"}


def replay(variant: str, azure: str, max_requests: int, setup_only: bool) -> None:
    """The measured process: load and build; then, unless `setup_only`, replay."""
    experiment, requests = replayed(azure, max_requests)
    run = experiment.run(variant, None)
    if not setup_only:
        run_sim(run, requests)


def counted(variant: str, args: argparse.Namespace, setup_only: bool) -> dict[str, int]:
    """Cachegrind's totals of one measured process."""
    valgrind = ["valgrind", "--tool=cachegrind", "--cachegrind-out-file=/dev/null"]
    valgrind += ["--cache-sim=yes", "--LL=1048576,16,64"] if args.cache_sim else ["--cache-sim=no"]
    child = [sys.executable, __file__, "--child", variant, "--azure", args.azure, "--max-requests", str(args.max_requests)]
    if setup_only:
        child.append("--setup-only")
    done = subprocess.run(valgrind + child, capture_output=True, text=True,
                          env={**os.environ, "PYTHONHASHSEED": "0", "PYTHONPATH": str(ROOT)})
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        fail(SCRIPT, f"the {variant} replay under valgrind exited with {done.returncode}: {last}")
    totals = {}
    for name, pattern in COUNTERS.items():
        found = re.search(pattern, done.stderr)
        if found:
            totals[name] = int(found.group(1).replace(",", ""))
    if "instructions" not in totals:
        fail(SCRIPT, f"valgrind printed no instruction count for the {variant} replay")
    return totals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--azure", default=str(AZURE))
    parser.add_argument("--max-requests", type=int, default=1000)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--cache-sim", action="store_true", help="also count data cache misses (slower)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--setup-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        replay(args.child, args.azure, args.max_requests, args.setup_only)
        return
    variants = checked_replay(SCRIPT, args.variants, args.azure, args.max_requests)
    if shutil.which("valgrind") is None:
        fail(SCRIPT, "valgrind is not on PATH (it counts the instructions)")
    print(f"first {args.max_requests} requests of {args.azure}, open loop, one replay per variant under cachegrind", flush=True)
    rows = {}
    for variant in variants:
        setup, whole = counted(variant, args, True), counted(variant, args, False)
        rows[variant] = {name: whole[name] - setup[name] for name in whole if name in setup}
        print(f"{variant:12s} " + ", ".join(f"{name} {value / 1e6:,.1f} M" for name, value in rows[variant].items()), flush=True)
    if "native" in rows:
        print(f"\n{'variant':12s} " + " ".join(f"{name + ' / native':>26s}" for name in rows["native"]))
        for variant, row in rows.items():
            print(f"{variant:12s} " + " ".join(f"{row[name] / rows['native'][name]:26.3f}" for name in rows["native"] if rows["native"][name]))


if __name__ == "__main__":
    main()
