"""`--executor vllm` takes every model name `--executor hf` takes: `smollm2-135m` resolves to the
converted folder in the user cache (vtoken.models.resolve_model_dir), as a folder path does."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from tests.vllm_tier.conftest import VLLM_MISSING, VLLM_PROBE

pytest.importorskip(VLLM_PROBE, reason=VLLM_MISSING)

from vtoken.checker.vllm import VllmChecker  # noqa: E402
from vtoken.errors import ConfigError  # noqa: E402
from vtoken.models import resolve_model_dir  # noqa: E402
from vtoken.replay import make_replayer  # noqa: E402
from vtoken.trace import Request  # noqa: E402
from vtoken_cli.app import app  # noqa: E402


def test_a_folder_resolves_to_itself_and_a_wrong_name_says_what_is_accepted(tiny_model_dir, tmp_path):
    assert str(resolve_model_dir(tiny_model_dir)) == tiny_model_dir
    with pytest.raises(ConfigError, match=r"--model 'smollm3': not 'smollm2-135m' and not a folder with a config.json"):
        resolve_model_dir("smollm3")
    with pytest.raises(ConfigError, match="--executor vllm needs --model: smollm2-135m or a local model folder"):
        make_replayer("vllm", model=None).resolve(None, [], None)


@pytest.mark.parametrize("name", ["smollm2-135m", "SmolLM2-135M-Instruct"])
def test_the_replayer_and_the_checker_resolve_the_catalog_name(smollm2_dir, name):
    assert str(make_replayer("vllm", model=name).model_folder()) == smollm2_dir
    assert str(VllmChecker(name).model_folder()) == smollm2_dir


# a guard against a hang, not a speed check: compare starts the engine for each variant it
# replays, and on a host whose cores are busy with other work that has passed 300 s
@pytest.mark.timeout(600)
def test_compare_on_vllm_runs_smollm2_by_name(smollm2_dir, tmp_path):
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": i, "input_length": 96, "output_length": 24}) + "\n" for i in range(2)))
    result = CliRunner().invoke(app, ["compare", str(trace), "--executor", "vllm", "--model", "smollm2-135m",
                                      "--policy", "streaming_llm", "--budget", "72", "--concurrency", "2", "--block-size", "32",
                                      "--no-sweep", "--no-frontier", "--json"])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout[result.stdout.index("{"):])
    assert payload["config"]["executor"] == "vllm"
    assert payload["vllm"]["model"] == "smollm2-135m-instruct"
    assert payload["variants"]["vtoken"]["tokens_evicted"] > 0


def test_the_replayer_hands_over_its_engine_spec(tiny_model_dir):
    from vtoken_cli.options import build_experiment

    replayer = make_replayer("vllm", model=tiny_model_dir)
    experiment = build_experiment(model="smollm2-135m", gpu="h100-80gb", num_blocks=None, gpu_mem_util=0.9,
                                  block_size=32, policy="streaming_llm", budget="50%", eviction_interval=8,
                                  reclaim_mode="hole-fill", theta_f=0.25, seed=3, sim_profile=None)
    requests = [Request("a", 0.0, 40, 8), Request("b", 0.0, 100, 30)]
    experiment = replayer.resolve(experiment, requests, 2)
    spec = replayer.engine_spec(experiment, 2)
    # two of the longest request (130 tokens: 5 blocks of 32) plus vLLM's null block
    assert experiment.num_blocks == 2 * 5 + 1
    assert (spec.model, spec.block_size, spec.num_gpu_blocks_override, spec.max_num_seqs, spec.seed) == \
        (tiny_model_dir, 32, 11, 2, 3)
    assert spec.max_model_len == 10 * 32  # the pool's usable blocks bound a sequence
