"""`vtoken compare|check-invariants --executor vllm` from the command line (CliRunner)."""

from __future__ import annotations

import json
import importlib.util

import pytest
from typer.testing import CliRunner

from vtoken_cli.app import app

VLLM_PRESENT = importlib.util.find_spec("vllm") is not None and importlib.util.find_spec("vllm.v1") is not None
runner = CliRunner()


@pytest.mark.skipif(VLLM_PRESENT, reason="vLLM is installed here: the missing-vLLM message cannot show")
@pytest.mark.parametrize("command", ["check-invariants", "compare"])
def test_without_vllm_the_executor_is_a_one_line_error(command, tmp_path):
    args = [command] + (["sample_traces/azure_conv_sample.csv"] if command == "compare" else [])
    result = runner.invoke(app, [*args, "--executor", "vllm", "--model", str(tmp_path)])
    assert result.exit_code == 2
    assert "--executor vllm needs vLLM" in result.output
    assert "Traceback" not in result.output


@pytest.mark.skipif(not VLLM_PRESENT, reason="vLLM is not installed: the vLLM tier runs in .venv-vllm")
def test_check_invariants_on_vllm_passes_and_reports_json(tiny_model_dir):
    result = runner.invoke(app, ["check-invariants", "--executor", "vllm", "--model", tiny_model_dir,
                                 "--max-requests", "3", "--json"])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout[result.stdout.index("{"):])
    assert payload["passed"] is True and payload["executor"] == "vllm"
    assert set(payload["runs"]) == {"naive-evict/hole-fill", "naive-evict/ordered", "vtoken/hole-fill", "vtoken/ordered"}
    assert payload["evictions_checked"] > 0 and payload["copies_verified"] > 0


@pytest.mark.skipif(not VLLM_PRESENT, reason="vLLM is not installed: the vLLM tier runs in .venv-vllm")
def test_check_invariants_on_vllm_needs_a_model_folder(tmp_path):
    result = runner.invoke(app, ["check-invariants", "--executor", "vllm", "--model", str(tmp_path / "nope")])
    assert result.exit_code == 2
    assert "local model folder" in result.output
