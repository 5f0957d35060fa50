"""Which vLLM configurations the vToken integration supports, checked once at start-up.

Each problem is one phrase naming the setting and the flag that changes it; a refusal is one
ConfigError listing them all. Checked twice: by the plugin when vLLM builds its config
(plugin.py, before any process starts or any weight loads) and by the scheduler, which also
sees the KV cache groups (a `--scheduler-cls` launch without the plugin gets the same answer).
Reads vLLM config objects by attribute only, so this module imports no vLLM.
"""

from __future__ import annotations

from vtoken.engine.vllm.settings import settings_from_additional_config
from vtoken.errors import ConfigError

CPU_BLOCK_MULTIPLE = 32  # vLLM's CPU attention kernels; 16 fails inside vLLM after the weights load


def config_problems(vllm_config) -> list[str]:
    """What in `vllm_config` an evicting variant would compute wrong KV under; [] when nothing
    (or when the variant evicts nothing). Raises ConfigError for bad `additional_config.vtoken`."""
    settings = settings_from_additional_config(vllm_config.additional_config)
    if not settings.evicts:
        return []
    problems = []  # prefix caching is handled (prefix_cache.py)
    if vllm_config.scheduler_config.async_scheduling:
        problems.append("async scheduling is on (pass --no-async-scheduling / async_scheduling=False): "
                        "the next step would be scheduled before this step's eviction")
    if not vllm_config.model_config.enforce_eager:
        problems.append("CUDA graphs / torch.compile are on (pass --enforce-eager / enforce_eager=True): "
                        "vToken rewrites seq_lens and slot mappings per step and runs eager only")
    if vllm_config.use_v2_model_runner:
        problems.append("vLLM chose Model Runner V2 (set VLLM_USE_V2_MODEL_RUNNER=0): vToken hooks the V1 runner")
    block_size = vllm_config.cache_config.block_size
    if vllm_config.device_config.device_type == "cpu" and block_size % CPU_BLOCK_MULTIPLE:
        problems.append(f"--block-size {block_size} is not a multiple of {CPU_BLOCK_MULTIPLE} "
                        "(vLLM's CPU attention kernels; pass --block-size 32)")
    if vllm_config.speculative_config is not None:
        problems.append("speculative decoding is on: rejected drafts would shift the token tables")
    if vllm_config.parallel_config.pipeline_parallel_size > 1:
        problems.append("pipeline parallelism is on: steps overlap")
    return problems


def check_config(vllm_config) -> None:
    """Raise ConfigError listing `config_problems`, in one line."""
    _raise_for(vllm_config, config_problems(vllm_config))


def check_supported(vllm_config, kv_cache_config) -> None:
    """`check_config` plus the model's KV cache groups (known once the scheduler is built)."""
    problems = config_problems(vllm_config)
    groups = kv_cache_config.kv_cache_groups
    kinds = [type(g.kv_cache_spec).__name__ for g in groups]
    evicts = settings_from_additional_config(vllm_config.additional_config).evicts
    if evicts and kinds != ["FullAttentionSpec"]:
        problems.append(f"the model needs KV cache groups {kinds}; only one full-attention group is supported")
    _raise_for(vllm_config, problems)


def _raise_for(vllm_config, problems: list[str]) -> None:
    if problems:
        variant = settings_from_additional_config(vllm_config.additional_config).variant
        raise ConfigError(f"vToken variant '{variant}' cannot run on this vLLM configuration: " + "; ".join(problems))
