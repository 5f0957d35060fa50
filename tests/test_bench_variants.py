"""benchmarks/bench_variants.py runs end to end on the bundled sample: every variant's row, the
same results in every round, and with --phases the runtime's phases per variant (eviction only
where the variant evicts, reclamation only in vtoken). No timing is checked."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_variants_bench_runs_on_the_sample_with_phases() -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    completed = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_variants.py"), "--azure", str(ROOT / "sample_traces" / "azure_conv_sample.csv"),
         "--max-requests", "120", "--rounds", "2", "--phases"],
        capture_output=True, text=True, env=env, timeout=600, check=False)
    assert completed.returncode == 0, completed.stderr
    assert "same results in every round: True" in completed.stdout
    phases = {(m["variant"], m["phase"]): int(m["calls"]) for m in re.finditer(
        r"^(?P<variant>native|naive-evict|vtoken)\s+(?P<phase>schedule|execute|postprocess|_evict|_reclaim)\s+[\d.]+\s+(?P<calls>\d+)\s",
        completed.stdout, re.MULTILINE)}
    for variant in ("native", "naive-evict", "vtoken"):
        assert phases[(variant, "schedule")] >= phases[(variant, "execute")] == phases[(variant, "postprocess")] > 0
    assert ("native", "_evict") not in phases and phases[("naive-evict", "_evict")] > 0 and phases[("vtoken", "_evict")] > 0
    assert ("naive-evict", "_reclaim") not in phases and phases[("vtoken", "_reclaim")] > 0
