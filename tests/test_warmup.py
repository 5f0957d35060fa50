"""`warm_compiled_loops` loads every compiled loop for the types the runtime passes: after it,
replays that evict and reclaim every way (each policy that ranks by a score, both planning
modes, lazy rounds, pressure and the layout trigger, a vLLM tracker's compaction) compile
nothing more. Run in a fresh process, where nothing was compiled before."""

from __future__ import annotations

import json
import subprocess
import sys

SCRIPT = """
import json
from dataclasses import replace

import numpy as np

from vtoken.engine.warmup import compiled_signatures, warm_compiled_loops


def signatures():  # the substrate's loops, as kv/compiled.py gives them to their callers, and the policies'
    return compiled_signatures(("vtoken.kv.compiled", "vtoken.policies.selection"))


warm_compiled_loops()
after_warmup = signatures()

from vtoken.engine import Experiment, run_sim
from vtoken.engine.experiment import EvictionConfig
from vtoken.policies import Budget
from vtoken.engine.vllm.settings import VllmSettings
from vtoken.engine.vllm.tracker import VTokenTracker
from vtoken.hardware import resolve_gpu
from vtoken.kv.reclaim import ReclaimConfig
from vtoken.model_spec import resolve_model
from vtoken.trace import Request

rng = np.random.default_rng(0)
requests = [Request(str(i), 0.05 * i, int(rng.integers(40, 900)), int(rng.integers(20, 300))) for i in range(40)]
counts = {}
for policy in ("h2o", "scissorhands", "tova", "streaming_llm"):
    for mode in ("hole-fill", "ordered"):
        base = Experiment(resolve_model("llama-3.1-8b"), resolve_gpu("h100"), num_blocks=300)
        experiment = replace(base, eviction=replace(base.eviction, policy=policy),
                             reclaim=ReclaimConfig(mode=mode, check_interval_steps=1))
        result = run_sim(experiment.run("vtoken", 16), requests)
        counts[f"{policy} {mode}"] = [result.tokens_evicted, result.tokens_moved, result.lazy_reclaim.num_rounds,
                                      result.pressure_reclaim.num_rounds, result.layout_reclaim.num_rounds]
# FIFO eviction after lazy hole-fill: the layout trigger re-packs (tests/test_serving_fidelity.py)
fifo = EvictionConfig("streaming_llm", Budget(keep_ratio=0.6, num_sink_tokens=4, num_recent_tokens=8), 16)
result = run_sim(replace(Experiment(resolve_model("llama-3.1-8b"), resolve_gpu("h100"), num_blocks=4000),
                         eviction=fifo).run("vtoken", 4), [Request("0", 0.0, 33, 162)])
counts["fifo layout"] = [result.tokens_evicted, result.tokens_moved, result.lazy_reclaim.num_rounds,
                         result.pressure_reclaim.num_rounds, result.layout_reclaim.num_rounds]
tracker = VTokenTracker(VllmSettings(), num_blocks=64, block_size=16)
tracker.sync("a", 100, list(range(7)))
tracker.after_step("a", 1, 100)
counts["vllm tracker"] = [tracker.counters.tokens_evicted, tracker.counters.tokens_moved, 0, 0, 0]
print(json.dumps({"after_warmup": after_warmup, "after_replays": signatures(), "counts": counts}))
"""


def test_no_compiled_loop_compiles_again_after_the_warmup():
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["after_warmup"], "no compiled loop found"
    assert all(report["after_warmup"].values()), f"loops the warmup left cold: {report['after_warmup']}"
    assert report["after_replays"] == report["after_warmup"]
    counts = report["counts"]
    for run, (num_evicted, num_moved, *_) in counts.items():  # the replays did evict and move
        assert num_evicted > 0 and num_moved > 0, run
    for trigger, column in (("lazy", 2), ("pressure", 3), ("layout", 4)):  # and reclaimed every way
        assert any(run_counts[column] for run_counts in counts.values()), f"no {trigger} round: {counts}"


TRACKER_SCRIPT = """
from vtoken.engine.vllm.settings import VllmSettings
from vtoken.engine.vllm.tracker import VTokenTracker
from vtoken.engine.warmup import compiled_signatures

VTokenTracker(VllmSettings(), num_blocks=64, block_size=16)
print(sorted(name for name, count in compiled_signatures(("vtoken.kv.compiled", "vtoken.policies.selection")).items() if not count))
"""


def test_a_vllm_tracker_loads_the_compiled_loops_where_the_engine_starts():
    """The vLLM scheduler builds its tracker at engine start: from then on no loop is cold."""
    done = subprocess.run([sys.executable, "-c", TRACKER_SCRIPT], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
