"""A vLLM engine starts in a process where vToken's reclamation rounds already ran.

The round step's loops are compiled with numba (vtoken/kv/compiled.py), imported at a process's
first round. A vLLM 0.32 CPU worker scans every module attribute when it initializes
(vllm/triton_utils/dispatcher.py, `_rebind_kernels`), and numba's llvmlite used to make that
scan raise: `vtoken compare --executor vllm` starts one engine per variant in one process, the
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
