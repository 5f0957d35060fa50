"""Which vLLM configurations the vToken integration supports, checked once at start-up.

Each refusal is a ConfigError that names the setting to change. Reads vLLM config objects by
attribute only, so this module imports no vLLM.
"""

from __future__ import annotations

from vtoken.engine.vllm.settings import settings_from_additional_config
from vtoken.errors import ConfigError


def check_supported(vllm_config, kv_cache_config) -> None:
    """Raise ConfigError for a setting under which evicting variants would compute wrong KV."""
    settings = settings_from_additional_config(vllm_config.additional_config)
    if not settings.evicts:
        return
    problems = []
    if vllm_config.cache_config.enable_prefix_caching:
        problems.append("prefix caching is on (pass enable_prefix_caching=False / --no-enable-prefix-caching): "
                        "an evicted token's block could be shared by another request")
    if vllm_config.scheduler_config.async_scheduling:
        problems.append("async scheduling is on (pass async_scheduling=False / --no-async-scheduling): "
                        "the next step would be scheduled before this step's eviction")
    if vllm_config.speculative_config is not None:
        problems.append("speculative decoding is on: rejected drafts would shift the token tables")
    if vllm_config.parallel_config.pipeline_parallel_size > 1:
        problems.append("pipeline parallelism is on: steps overlap")
    if vllm_config.use_v2_model_runner:
        problems.append("vLLM chose Model Runner V2; set VLLM_USE_V2_MODEL_RUNNER=0")
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1 or type(groups[0].kv_cache_spec).__name__ != "FullAttentionSpec":
        kinds = [type(g.kv_cache_spec).__name__ for g in groups]
        problems.append(f"the model needs KV cache groups {kinds}; only one full-attention group is supported")
    if problems:
        raise ConfigError(f"vToken variant '{settings.variant}' cannot run on this vLLM configuration: "
                          + "; ".join(problems))
