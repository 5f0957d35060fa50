"""benchmarks/bench_instructions.py: bad input is a one-line error with exit code 2 before
anything runs under valgrind; a loop compiled by the replay, which its count would hold, is
found; where valgrind is installed, a replay of a few requests counts instructions for every
variant it was given, its loops loaded from numba's cache (a replay that compiled one exits
with an error). No count is checked: figures come from the benchmark."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "bench_instructions.py"
SAMPLE = ROOT / "sample_traces" / "azure_conv_sample.csv"


def run(*args: str, path: str | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    if path is not None:
        env["PATH"] = path
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=env,
                          timeout=600, check=False)


@pytest.mark.parametrize(("args", "message"), [
    (("--variants", "native,fast"), "--variants: unknown variant 'fast'; known: native, naive-evict, vtoken"),
    (("--max-requests", "0"), "--max-requests must be at least 1, got 0"),
    (("--azure", "/nonexistent/trace.csv"), "--azure: no trace at /nonexistent/trace.csv"),
])
def test_bad_input_is_one_line_and_exit_2(args: tuple[str, ...], message: str) -> None:
    completed = run(*args)
    assert completed.returncode == 2
    assert completed.stderr.strip().splitlines() == [f"bench_instructions: {message}"]
    assert completed.stdout == ""


def test_without_valgrind_it_says_so_and_exits_2(tmp_path: Path) -> None:
    completed = run("--azure", str(SAMPLE), path=str(tmp_path))  # an empty directory: no valgrind on PATH
    assert completed.returncode == 2
    assert completed.stderr.strip() == "bench_instructions: valgrind is not on PATH (it counts the instructions)"


def test_a_loop_compiled_between_two_snapshots_is_named() -> None:
    """`compiled_since` names a loop that gained a typed version (here `ascending` for floats,
    which no replay passes) and nothing else."""
    code = ("import numpy as np; import bench_instructions as b; from vtoken.kv import compiled_check as c; "
            "c.ascending(np.arange(3)); before = b.compiled_signatures(); c.ascending(np.arange(3.0)); "
            "print(b.compiled_since(before, b.compiled_signatures())); print(b.compiled_since(before, before))")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "benchmarks")]))
    completed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600, check=False)
    assert completed.returncode == 0, completed.stderr
    assert completed.stdout.splitlines() == ["['vtoken.kv.compiled_check.ascending']", "[]"]


@pytest.mark.skipif(shutil.which("valgrind") is None, reason="valgrind is not installed")
def test_it_counts_a_few_requests_per_variant_and_what_loading_the_loops_costs() -> None:
    completed = run("--azure", str(SAMPLE), "--max-requests", "2", "--variants", "vtoken", "--loading-cost")
    assert completed.returncode == 0, completed.stderr
    count = next(line for line in completed.stdout.splitlines() if line.startswith("vtoken       instructions "))
    assert count.endswith(" M") and float(count.split()[2].replace(",", "")) > 0
    loading = re.search(r"left out of every count above: ([\d,.]+) M instructions \(a set-up process with them, ([\d,.]+) M, "
                        r"less one without, ([\d,.]+) M\)", completed.stdout)
    assert loading, completed.stdout
    cost, with_loops, without = (float(value.replace(",", "")) for value in loading.groups())
    assert cost > 0 and abs(with_loops - without - cost) < 0.2
