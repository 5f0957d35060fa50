"""The vLLM private names the integration relies on still exist."""

from __future__ import annotations

import pytest

from tests.vllm_tier.conftest import VLLM_MISSING, VLLM_PROBE

pytest.importorskip(VLLM_PROBE, reason=VLLM_MISSING)

from vtoken.engine.vllm import contract  # noqa: E402


def test_vllm_version_is_the_one_the_integration_was_written_for():
    import vllm

    assert vllm.__version__.split("+")[0] == contract.VLLM_VERSION, (
        f"vLLM {vllm.__version__} is installed; the integration targets {contract.VLLM_VERSION}: "
        "run this tier and update vtoken/engine/vllm/contract.py before relying on it")


def test_private_names_exist():
    missing = contract.missing_names()
    assert not missing, ("vLLM names the vToken integration relies on are gone (update "
                         "vtoken/engine/vllm/ and contract.py):\n  " + "\n  ".join(missing))


def test_the_plugin_hook_is_still_where_the_plugin_relies_on_it():
    missing = contract.missing_source_texts()
    assert not missing, ("vLLM code the vToken plugin relies on changed (update vtoken/engine/vllm/plugin.py "
                         "and contract.py):\n  " + "\n  ".join(missing))
