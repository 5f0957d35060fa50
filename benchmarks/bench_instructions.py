"""Instructions per variant of one open-loop replay of the Azure conversation trace, counted by
valgrind's cachegrind: a host-independent companion of bench_variants.py, whose host seconds
move with whatever else the machine runs (one replay after another, the same code measured
vtoken at 1.50x to 1.94x native at 5,000 requests within one hour; side by side,
`--interleave`, a few hundredths). Not a test.

    python benchmarks/bench_instructions.py [--max-requests 1000] [--variants V,...] [--azure PATH]
                                            [--cache-sim] [--loading-cost]

Per variant, two processes run under `valgrind --tool=cachegrind`, with PYTHONHASHSEED=0 so that
both do the same work up to the replay: one loads the trace, builds the experiment, loads the
compiled loops (numba and every loop a replay calls, `load_compiled_loops`) and stops, the other
then replays what `vtoken compare TRACE --open-loop --no-sweep --no-frontier` replays (default
model, GPU and block budget, H2O at 50%). The replay's count is the difference: it leaves out
numba's import and the loops' loading, some 3,000 M instructions that only the variants that
evict pay, once a process (`--loading-cost` counts them: a set-up process with them less one
without), and a replay that compiled a loop the loading did not is refused
(its count would hold a compilation). The loops are built for a generic x86-64 CPU
(NUMBA_CPU_NAME=generic), the same under valgrind as outside it, and loaded from numba's cache,
which an uncounted process fills first: their code does not depend on the host's CPU features,
nor a count on whether the cache was warm. Counts of one configuration repeat within about
0.5% at 1,000 requests (vtoken's replay: 14,436.9 M at c1fb5ef, 14,505.6 M at b4e52d6), and move
by a quarter at a few requests: the garbage collector's timing, whose full collections scan
numba's objects too, and allocation addresses. `--cache-sim` also simulates the
caches, the last level set to 1 MiB as this kind of machine's per-core L2, and reports the
replay's instruction-cache misses and its data misses at both levels.

An instruction ratio is not a time ratio: the work beyond native's is numpy calls on arrays a
step has not touched yet, which cost more per instruction than the interpreter's loop over
the running requests (cache misses), so host time ratios run above these.

Needs valgrind on PATH (a one-line error and exit code 2 without it). About 100 s per variant
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
from vtoken.engine.warmup import compiled_signatures, warm_compiled_loops, warm_sim_loops

ROOT = Path(__file__).resolve().parent.parent
AZURE = ROOT.parent / "shared" / "traces" / "azure_llm_2023_conv.csv"
SCRIPT = "bench_instructions"
COUNTERS = {"instructions": r"I\s+refs:\s+([\d,]+)", "I1 misses": r"I1\s+misses:\s+([\d,]+)",
            "D1 misses": r"D1\s+misses:\s+([\d,]+)", "LL data misses": r"LLd misses:\s+([\d,]+)"}


# the children's numba target: the same CPU under valgrind (which hides some of the host's
# features) as in the uncounted process that fills the cache, so that its loops are found there
CHILD_ENV = {"PYTHONHASHSEED": "0", "NUMBA_CPU_NAME": "generic"}


def load_compiled_loops() -> None:
    """Import numba and load (or compile) every compiled loop a replay calls, for the types it
    passes: the substrate's and the policies' (`warm_compiled_loops`), and the sim's scores'."""
    warm_compiled_loops()
    warm_sim_loops()


def compiled_since(before: dict[str, int], after: dict[str, int]) -> list[str]:
    """The loops that gained a typed version between two `compiled_signatures`."""
    return sorted(name for name, count in after.items() if count > before.get(name, 0))


def replay(variant: str, azure: str, max_requests: int, setup_only: bool, load: bool = True) -> None:
    """The measured process: load and build, load the compiled loops (unless not `load`: the
    set-up without them, for `--loading-cost`); then, unless `setup_only`, replay, and exit
    with code 3 if the replay compiled a loop (both processes take the same snapshots, so that
    their difference is the replay's)."""
    experiment, requests = replayed(azure, max_requests)
    run = experiment.run(variant, None)
    if not load:
        return
    load_compiled_loops()
    loaded = compiled_signatures()
    if not setup_only:
        run_sim(run, requests)
    compiled = compiled_since(loaded, compiled_signatures())
    if compiled:
        print(f"{SCRIPT}: the replay compiled {', '.join(compiled)}, which load_compiled_loops did not load", file=sys.stderr)
        sys.exit(3)


def run_child(variant: str, args: argparse.Namespace, flags: list[str], under_valgrind: bool) -> str:
    """Run one process of `replay` (`flags`: --setup-only, --without-loops), under cachegrind or
    not; returns its standard error, or stops the benchmark with its last line."""
    command = [sys.executable, __file__, "--child", variant, "--azure", args.azure, "--max-requests", str(args.max_requests),
               *flags]
    if under_valgrind:
        command = ["valgrind", "--tool=cachegrind", "--cachegrind-out-file=/dev/null",
                   *(["--cache-sim=yes", "--LL=1048576,16,64"] if args.cache_sim else ["--cache-sim=no"]), *command]
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, **CHILD_ENV, "PYTHONPATH": str(ROOT)})
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        where = "under valgrind" if under_valgrind else "outside valgrind"
        fail(SCRIPT, f"the {variant} process {where} exited with {done.returncode}: {last}")
    return done.stderr


def counted(variant: str, args: argparse.Namespace, flags: list[str]) -> dict[str, int]:
    """Cachegrind's totals of one measured process."""
    stderr = run_child(variant, args, flags, under_valgrind=True)
    totals = {}
    for name, pattern in COUNTERS.items():
        found = re.search(pattern, stderr)
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
    parser.add_argument("--loading-cost", action="store_true",
                        help="also count what numba's import and the compiled loops' loading cost, which the counts leave out")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--setup-only", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--without-loops", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        replay(args.child, args.azure, args.max_requests, args.setup_only, not args.without_loops)
        return
    variants = checked_replay(SCRIPT, args.variants, args.azure, args.max_requests)
    if shutil.which("valgrind") is None:
        fail(SCRIPT, "valgrind is not on PATH (it counts the instructions)")
    print(f"first {args.max_requests} requests of {args.azure}, open loop, one replay per variant under cachegrind", flush=True)
    run_child(variants[0], args, ["--setup-only"], under_valgrind=False)  # uncounted: fills numba's cache for the counted ones
    rows = {}
    for variant in variants:
        setup, whole = counted(variant, args, ["--setup-only"]), counted(variant, args, [])
        rows[variant] = {name: whole[name] - setup[name] for name in whole if name in setup}
        print(f"{variant:12s} " + ", ".join(f"{name} {value / 1e6:,.1f} M" for name, value in rows[variant].items()), flush=True)
    if "native" in rows:
        print(f"\n{'variant':12s} " + " ".join(f"{name + ' / native':>26s}" for name in rows["native"]))
        for variant, row in rows.items():
            print(f"{variant:12s} " + " ".join(f"{row[name] / rows['native'][name]:26.3f}" for name in rows["native"] if rows["native"][name]))
    if args.loading_cost:
        with_loops = counted(variants[0], args, ["--setup-only"])["instructions"]
        without = counted(variants[0], args, ["--setup-only", "--without-loops"])["instructions"]
        print(f"\nnumba's import and the compiled loops' loading, left out of every count above: {(with_loops - without) / 1e6:,.1f} M "
              f"instructions (a set-up process with them, {with_loops / 1e6:,.1f} M, less one without, {without / 1e6:,.1f} M)")


if __name__ == "__main__":
    main()
