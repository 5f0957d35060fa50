"""Instructions per variant of one open-loop replay of the Azure conversation trace, counted by
valgrind's cachegrind: a host-independent companion of bench_variants.py, whose host seconds
move with whatever else the machine runs (one replay after another, the same code measured
vtoken at 1.50x to 1.94x native at 5,000 requests within one hour; side by side,
`--interleave`, a few hundredths). Not a test.

    python benchmarks/bench_instructions.py [--max-requests 1000] [--variants V,...] [--azure PATH]
                                            [--cache-sim]

Per variant, two processes run under `valgrind --tool=cachegrind`, with PYTHONHASHSEED=0 so that
both do the same work up to the replay: one loads the trace, builds the experiment, loads the
compiled loops (numba and every loop a replay calls, `load_compiled_loops`) and stops, the other
then replays what `vtoken compare TRACE --open-loop --no-sweep --no-frontier` replays (default
model, GPU and block budget, H2O at 50%). The replay's count is the difference: it leaves out
numba's import and the loops' loading, some 3,000 M instructions that only the variants that
evict pay, once a process, and a replay that compiled a loop the loading did not is refused
(its count would hold a compilation). The loops are built for a generic x86-64 CPU
(NUMBA_CPU_NAME=generic), the same under valgrind as outside it, and loaded from numba's cache,
which an uncounted process fills first: their code does not depend on the host's CPU features,
nor a count on whether the cache was warm. Counts of one configuration repeat within about
0.3% (allocation addresses, the garbage collector's timing). `--cache-sim` also simulates the
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

ROOT = Path(__file__).resolve().parent.parent
AZURE = ROOT.parent / "shared" / "traces" / "azure_llm_2023_conv.csv"
SCRIPT = "bench_instructions"
COUNTERS = {"instructions": r"I\s+refs:\s+([\d,]+)", "I1 misses": r"I1\s+misses:\s+([\d,]+)",
            "D1 misses": r"D1\s+misses:\s+([\d,]+)", "LL data misses": r"LLd misses:\s+([\d,]+)"}


# the children's numba target: the same CPU under valgrind (which hides some of the host's
# features) as in the uncounted process that fills the cache, so that its loops are found there
CHILD_ENV = {"PYTHONHASHSEED": "0", "NUMBA_CPU_NAME": "generic"}
COMPILED_MODULES = ("vtoken.kv.compiled", "vtoken.kv.compiled_check", "vtoken.kv.compiled_evict",
                    "vtoken.engine.sim_compiled", "vtoken.policies.selection")


def load_compiled_loops() -> None:
    """Import numba and load (or compile) every compiled loop a replay calls, for the types it
    passes: the substrate's and the policies' (engine/warmup.py), and the sim's scores'."""
    import numpy as np

    from vtoken.engine import sim_compiled
    from vtoken.engine.warmup import warm_compiled_loops

    warm_compiled_loops()
    sim_compiled.pareto_plus_one(np.ones(2), 1.5, np.empty(2))
    sim_compiled.weighted_by_age(np.ones(2), np.ones(2), 2, np.zeros(1, dtype=np.int64))


def compiled_signatures() -> dict[str, int]:
    """How many typed versions each compiled loop of COMPILED_MODULES holds now."""
    import importlib

    counts = {}
    for module_name in COMPILED_MODULES:
        for value in vars(importlib.import_module(module_name)).values():
            if hasattr(value, "signatures") and hasattr(value, "py_func"):  # a numba dispatcher, under its own name
                counts[f"{value.py_func.__module__}.{value.py_func.__qualname__}"] = len(value.signatures)
    return counts


def compiled_since(before: dict[str, int], after: dict[str, int]) -> list[str]:
    """The loops that gained a typed version between two `compiled_signatures`."""
    return sorted(name for name, count in after.items() if count > before.get(name, 0))


def replay(variant: str, azure: str, max_requests: int, setup_only: bool) -> None:
    """The measured process: load and build, load the compiled loops; then, unless
    `setup_only`, replay, and exit with code 3 if the replay compiled a loop (both processes
    take the same snapshots, so that their difference is the replay's)."""
    experiment, requests = replayed(azure, max_requests)
    run = experiment.run(variant, None)
    load_compiled_loops()
    loaded = compiled_signatures()
    if not setup_only:
        run_sim(run, requests)
    compiled = compiled_since(loaded, compiled_signatures())
    if compiled:
        print(f"{SCRIPT}: the replay compiled {', '.join(compiled)}, which load_compiled_loops did not load", file=sys.stderr)
        sys.exit(3)


def fill_numba_cache(variant: str, args: argparse.Namespace) -> None:
    """Run the setup process once outside valgrind, uncounted, so that numba's cache holds
    the children's loops and no counted process compiles one."""
    child = [sys.executable, __file__, "--child", variant, "--azure", args.azure, "--max-requests", str(args.max_requests),
             "--setup-only"]
    done = subprocess.run(child, capture_output=True, text=True, env={**os.environ, **CHILD_ENV, "PYTHONPATH": str(ROOT)})
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        fail(SCRIPT, f"loading the compiled loops outside valgrind exited with {done.returncode}: {last}")


def counted(variant: str, args: argparse.Namespace, setup_only: bool) -> dict[str, int]:
    """Cachegrind's totals of one measured process."""
    valgrind = ["valgrind", "--tool=cachegrind", "--cachegrind-out-file=/dev/null"]
    valgrind += ["--cache-sim=yes", "--LL=1048576,16,64"] if args.cache_sim else ["--cache-sim=no"]
    child = [sys.executable, __file__, "--child", variant, "--azure", args.azure, "--max-requests", str(args.max_requests)]
    if setup_only:
        child.append("--setup-only")
    done = subprocess.run(valgrind + child, capture_output=True, text=True,
                          env={**os.environ, **CHILD_ENV, "PYTHONPATH": str(ROOT)})
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
    fill_numba_cache(variants[0], args)
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
