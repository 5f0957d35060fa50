"""`vtoken compare|check-invariants --executor vllm` from the command line (CliRunner)."""

from __future__ import annotations

import importlib.util
import io
import json

import pytest
from rich.console import Console
from typer.testing import CliRunner

from vtoken.engine.vllm.run import VllmCheckReport, VllmViolation
from vtoken_cli.app import app
from vtoken_cli.render.check import vllm_check_report

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
    assert list(payload["invariants"]) == ["I1", "I2", "I3"]
    assert all(t["checked"] > 0 and t["violations"] == 0 for t in payload["invariants"].values())
    # I3 runs in the worker before every forward, once per scheduled request: far more often than per eviction
    assert payload["invariants"]["I3"]["checked"] > 10 * payload["evictions_checked"]
    assert payload["fault"] is None and payload["stopped"] is None


def test_shared_block_cannot_be_injected_into_vllm_and_says_why(tmp_path):
    result = runner.invoke(app, ["check-invariants", "--executor", "vllm", "--model", str(tmp_path),
                                 "--inject-fault", "shared-block"])
    assert result.exit_code == 2
    assert "--inject-fault shared-block cannot run on --executor vllm" in result.output
    assert "prefix caching off" in result.output and "Traceback" not in result.output
    assert len(result.output.strip().splitlines()) == 1


def test_a_caught_fault_in_table_form_names_the_invariant_and_the_run():
    report = VllmCheckReport(
        runs={"naive-evict/hole-fill": {"eviction_events": 3, "relocation_events": 3}},
        num_checks={"I1": 4, "I2": 3, "I3": 6}, elapsed_s=1.5,
        violation=VllmViolation("I3", "I3 violated: request 0 reads 193 slots for its 97 live tokens",
                                "naive-evict/hole-fill", block_id=5, offset=2),
        fault="stale-slot", num_faults_injected=3)
    console = Console(file=io.StringIO(), width=200)
    console.print(vllm_check_report(report, "trace.csv", "h2o", []))
    text = console.file.getvalue()
    assert "fault stale-slot: injected 3 times; detected by I3 (expected I3)" in text
    assert "FAILED I3 violated in naive-evict/hole-fill" in text and "1 of 4 runs" in text
    assert "request 0 reads 193 slots" in text and "vLLM block 5, offset 2" in text


@pytest.mark.skipif(not VLLM_PRESENT, reason="vLLM is not installed: the vLLM tier runs in .venv-vllm")
def test_check_invariants_on_vllm_needs_a_model_folder(tmp_path):
    result = runner.invoke(app, ["check-invariants", "--executor", "vllm", "--model", str(tmp_path / "nope")])
    assert result.exit_code == 2
    assert "local model folder" in result.output
