"""The scheduler defaults vtoken copies from vLLM (vtoken/defaults.py VLLM_BATCH_DEFAULTS) are
what the installed vLLM gives `vllm serve` on every catalog GPU, and vtoken reads them from vLLM
once it is loaded."""

from __future__ import annotations

import pytest

from tests.vllm_tier.conftest import VLLM_MISSING, VLLM_PROBE

pytest.importorskip(VLLM_PROBE, reason=VLLM_MISSING)

import vllm.engine.arg_utils  # noqa: E402,F401  (loaded: vllm_batch_defaults reads it)
from vllm.config.scheduler import SchedulerConfig  # noqa: E402

from vtoken import defaults  # noqa: E402
from vtoken.engine.batch_limits import documented_batch_defaults, vllm_batch_defaults  # noqa: E402
from vtoken.hardware import GPUS  # noqa: E402


@pytest.mark.parametrize("gpu", sorted(GPUS))
def test_documented_batch_defaults_are_the_installed_vllm_s(gpu):
    read = vllm_batch_defaults(GPUS[gpu])
    documented = documented_batch_defaults(GPUS[gpu])
    assert read.source.startswith(f"vLLM {vllm.__version__} (loaded)"), read.source
    assert (read.max_num_batched_tokens, read.max_num_seqs) == (documented.max_num_batched_tokens,
                                                                documented.max_num_seqs)


def test_chunked_prefill_and_the_chunk_cap_default_as_vllm_s():
    fields = SchedulerConfig.__dataclass_fields__
    assert fields["enable_chunked_prefill"].default is defaults.ENABLE_CHUNKED_PREFILL
    assert fields["long_prefill_token_threshold"].default.default == defaults.LONG_PREFILL_TOKEN_THRESHOLD


def test_the_engine_runs_with_the_experiment_s_scheduler_limits(tiny_model_dir):
    from vtoken.engine.experiment import Experiment, SchedulerConfig
    from vtoken.engine.vllm.engine import open_llm, scheduler_of
    from vtoken.engine.vllm.run import engine_spec_for
    from vtoken.engine.vllm.settings import VllmSettings
    from vtoken.model_spec import resolve_model

    experiment = Experiment(resolve_model("smollm2-135m"), GPUS["h100-80gb"], 64, 32,
                            scheduler=SchedulerConfig(max_num_batched_tokens=96, long_prefill_token_threshold=32))
    with open_llm(engine_spec_for(experiment, 3, tiny_model_dir, max_model_len=512), VllmSettings("vtoken")) as llm:
        config = scheduler_of(llm).scheduler_config
    assert (config.max_num_batched_tokens, config.max_num_seqs, config.enable_chunked_prefill,
            config.long_prefill_token_threshold) == (96, 3, True, 32)


def test_limits_not_given_are_the_engine_s_own_defaults_on_this_machine():
    from vllm.engine.arg_utils import EngineArgs
    from vllm.usage.usage_lib import UsageContext

    from vtoken.engine.experiment import Experiment, SchedulerConfig
    from vtoken.engine.vllm.run import engine_spec_for, with_engine_defaults
    from vtoken.model_spec import resolve_model

    tokens, seqs = EngineArgs.get_batch_defaults(1)
    experiment = Experiment(resolve_model("smollm2-135m"), GPUS["h100-80gb"], 64, 32,
                            scheduler=SchedulerConfig(max_num_seqs=6))
    filled, note = with_engine_defaults(experiment)
    assert (filled.scheduler.max_num_batched_tokens, filled.scheduler.max_num_seqs) == (tokens[UsageContext.LLM_CLASS], 6)
    assert note.startswith(f"scheduler: max_num_batched_tokens {tokens[UsageContext.LLM_CLASS]:,} as vLLM takes them")
    assert engine_spec_for(experiment, None, "model-dir").llm_kwargs()["max_num_batched_tokens"] == tokens[UsageContext.LLM_CLASS]
    assert with_engine_defaults(filled) == (filled, "")  # every limit given: nothing filled, no note
    assert seqs[UsageContext.LLM_CLASS] > 0


def test_the_cli_s_experiment_runs_vllm_with_the_engine_s_defaults():
    # a command's flags leave unset limits to the replayer: the vllm executor must not get the
    # catalog GPU's (vllm serve on an H100: 8,192 tokens, 1,024 sequences)
    from vllm.engine.arg_utils import EngineArgs
    from vllm.usage.usage_lib import UsageContext

    from vtoken.replay import make_replayer
    from vtoken.trace import Request
    from vtoken_cli.options import build_experiment

    experiment = build_experiment(model="smollm2-135m", gpu="h100-80gb", num_blocks=None, gpu_mem_util=0.9,
                                  block_size=32, policy="h2o", budget="50%", eviction_interval=1,
                                  reclaim_mode="hole-fill", theta_f=0.3, seed=0, sim_profile=None)
    resolved = make_replayer("vllm", model="smollm2-135m").resolve(experiment, [Request("r", 0.0, 64, 8)], 2)
    tokens, seqs = EngineArgs.get_batch_defaults(1)
    assert (resolved.scheduler.max_num_batched_tokens, resolved.scheduler.max_num_seqs) == \
        (tokens[UsageContext.LLM_CLASS], seqs[UsageContext.LLM_CLASS])
