"""A vLLM engine starts in a process where vToken's reclamation rounds already ran, and loads
vToken's compiled loops where it starts, not at its first eviction.

The substrate's loops and the policies' selection are compiled with numba (vtoken/jit.py),
imported at a process's first eviction or where a vLLM engine starts. A vLLM 0.32 CPU worker
scans every module attribute when it initializes (vllm/triton_utils/dispatcher.py,
`_rebind_kernels`), and numba's llvmlite used to make that scan raise: `vtoken compare --executor vllm` starts one engine per variant in one process, the
next one after vtoken's rounds.
"""

from __future__ import annotations

import sys

import pytest

from tests.vllm_tier.conftest import VLLM_MISSING, VLLM_PROBE, prompts

pytest.importorskip(VLLM_PROBE, reason=VLLM_MISSING)

from vtoken.engine.vllm.engine import EngineSpec, generate, open_llm, scheduler_of  # noqa: E402
from vtoken.engine.vllm.settings import settings_from_additional_config  # noqa: E402


def settings(variant: str):
    return settings_from_additional_config({"vtoken": {
        "variant": variant, "policy": "h2o", "budget": 40, "num_sink_tokens": 4, "num_recent_tokens": 16,
        "interval_tokens": 8, "theta_f": 0.01, "check_invariants": True}})


def test_an_engine_starts_and_generates_after_another_engines_rounds(tiny_model_dir):
    spec = EngineSpec(tiny_model_dir, kv_cache_memory_bytes=8 << 20, max_model_len=1024)
    with open_llm(spec, settings("vtoken")) as llm:
        generate(llm, prompts(), 32)
        counters = scheduler_of(llm).vtoken.counters
        assert counters.tokens_moved > 0, "the first engine should have run reclamation rounds"
    assert "vtoken.kv.compiled" in sys.modules
    with open_llm(spec, settings("native")) as llm:
        generations = generate(llm, prompts(), 32)
    assert [len(g.token_ids) for g in generations] == [32, 32, 32]


FIRST_EVICTION_SCRIPT = """
import json
import sys

import numba

from tests.vllm_tier.conftest import prompts
from vtoken.engine.vllm.engine import EngineSpec, generate, open_llm, scheduler_of
from vtoken.engine.vllm.settings import settings_from_additional_config
from vtoken.kv import compiled
from vtoken.policies import selection


def signatures():
    return {f"{module.__name__}.{name}": len(value.signatures) for module in (compiled, selection)
            for name, value in vars(module).items() if isinstance(value, numba.core.registry.CPUDispatcher)
            and not name.startswith("_")}


settings = settings_from_additional_config({"vtoken": {
    "variant": "vtoken", "policy": "h2o", "budget": 40, "num_sink_tokens": 4, "num_recent_tokens": 16,
    "interval_tokens": 8, "theta_f": 0.01}})
with open_llm(EngineSpec(sys.argv[1], kv_cache_memory_bytes=8 << 20, max_model_len=1024), settings) as llm:
    at_start = signatures()
    generate(llm, prompts(), 32)
    counters = scheduler_of(llm).vtoken.counters
    print(json.dumps({"at_start": at_start, "after": signatures(), "evicted": counters.tokens_evicted,
                      "moved": counters.tokens_moved}))
"""


def test_an_engines_first_eviction_compiles_nothing(tiny_model_dir):
    """The engine loaded every compiled loop when it started (engine/warmup.py): its evictions
    and compactions, in a process that had compiled nothing before, add no compiled version."""
    import json
    import subprocess
    from pathlib import Path

    done = subprocess.run([sys.executable, "-c", FIRST_EVICTION_SCRIPT, tiny_model_dir], capture_output=True,
                          text=True, timeout=600, cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["evicted"] > 0 and report["moved"] > 0
    assert all(report["at_start"].values()), report["at_start"]
    assert report["after"] == report["at_start"]
