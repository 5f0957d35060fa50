"""`vtoken compare|check-invariants --executor vllm` from the command line (CliRunner)."""

from __future__ import annotations

import importlib.util
import io
import json

import pytest
from rich.console import Console
from typer.testing import CliRunner

from vtoken.checker import VLLM_CHECK_UNITS, CheckOptions, CheckReport, KVLayout, RunCheck, Tally, Violation
from vtoken.engine.experiment import EvictionConfig, Experiment
from vtoken.hardware import resolve_gpu
from vtoken.model_spec import resolve_model
from vtoken.policies.base import Budget
from vtoken_cli.app import app
from vtoken_cli.render.check import check_report

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
    assert payload["passed"] is True and payload["config"]["executor"] == "vllm"
    assert [(r["scenario"], r["reclaim_mode"]) for r in payload["runs"]] == [
        ("azure_conv_sample.csv naive-evict", "hole-fill"), ("azure_conv_sample.csv naive-evict", "ordered"),
        ("azure_conv_sample.csv vtoken", "hole-fill"), ("azure_conv_sample.csv vtoken", "ordered")]
    assert payload["relocation_events"] > 0 and payload["config"]["block_size"] == 32
    assert list(payload["invariants"]) == ["I1", "I2", "I3", "I4"]
    assert all(payload["invariants"][name]["checked"] > 0 for name in ("I1", "I2", "I3"))
    assert payload["invariants"]["I4"]["checked"] == 0 and any("I4 has nothing to check" in n for n in payload["notes"])
    # I3 runs in the worker before every forward, once per scheduled request: far more often than per relocation
    assert payload["invariants"]["I3"]["checked"] > 10 * payload["relocation_events"]
    assert payload["fault"] is None and all(r["stopped"] is None for r in payload["runs"])


def test_shared_block_cannot_be_injected_into_vllm_and_says_why(tmp_path):
    result = runner.invoke(app, ["check-invariants", "--executor", "vllm", "--model", str(tmp_path),
                                 "--inject-fault", "shared-block"])
    assert result.exit_code == 2
    assert "--inject-fault shared-block cannot run on --executor vllm" in result.output
    assert "prefix caching off" in result.output and "Traceback" not in result.output
    assert len(result.output.strip().splitlines()) == 1


def test_a_caught_fault_in_table_form_names_the_invariant_and_the_run():
    violation = Violation("I3", "I3 violated: request 0 reads 193 slots for its 97 live tokens", "trace.csv naive-evict",
                          "h2o", "hole-fill", block_id=5, offset=2)
    tallies = {"I1": Tally(4), "I2": Tally(3), "I3": Tally(6, 1, violation), "I4": Tally()}
    run = RunCheck("trace.csv naive-evict", "h2o", "hole-fill", 32, 16, 3, 1, 3, 40, 0, 3,
                   "stopped after an I3 violation raised inside vLLM's step", tallies, 1.5)
    base = Experiment(resolve_model("smollm2-135m"), resolve_gpu("h100-80gb"), num_blocks=16, block_size=32,
                      eviction=EvictionConfig("h2o", Budget(keep_ratio=0.5), 32))
    report = CheckReport((run,), base, CheckOptions(policies=("h2o",), executor="vllm", fault="stale-slot"), "cpu", "sync",
                         (), 1.5, KVLayout(30, 3, 64, "float32"), dict(VLLM_CHECK_UNITS), model_kv=True)
    console = Console(file=io.StringIO(), width=200)
    console.print(check_report(report))
    text = " ".join(console.file.getvalue().split())
    assert "fault stale-slot: injected 3 times; detected by I3 (expected I3)" in text
    assert "FAILED I3 violated" in text and "runs stopped early" in text and "inside vLLM's step" in text
    assert "request 0 reads 193 slots" in text and "block 5, offset 2" in text
    assert "model smollm2-135m" in text and "executor vllm;" in text


@pytest.mark.skipif(not VLLM_PRESENT, reason="vLLM is not installed: the vLLM tier runs in .venv-vllm")
def test_check_invariants_on_vllm_needs_a_model_folder(tmp_path):
    result = runner.invoke(app, ["check-invariants", "--executor", "vllm", "--model", str(tmp_path / "nope")])
    assert result.exit_code == 2
    assert "not a folder with a config.json" in result.output
