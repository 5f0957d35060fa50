"""The model's KV geometry and the KV block budget of a deployment, from its settings (and the
live server's KV pool), with a note for every default taken and every disagreement found."""

from __future__ import annotations

import math
from collections.abc import Mapping

from vtoken.audit.settings import Settings
from vtoken.defaults import GPU_MEMORY_UTILIZATION as DEFAULT_GPU_MEMORY_UTILIZATION
from vtoken.endpoint import LiveState
from vtoken.errors import ConfigError
from vtoken.hardware import GiB, GpuSpec, num_blocks_for_gpu
from vtoken.model_spec import DTYPE_BYTES, ModelSpec, resolve_model

# vLLM fills gpu_memory_utilization x memory with weights, KV and a reserve (activations, CUDA
# graphs, workspaces); num_gpu_blocks beside a GPU is contradictory outside this reserve range.
MAX_RESERVE_BYTES = 8 * GiB
# A server KV pool whose bytes per token differ this much from the model's is worth a note.
KV_BYTES_MISMATCH = 0.10


def max_model_len(model: ModelSpec, live: LiveState | None) -> int | None:
    """The context the replayed requests must fit: the server's (/v1/models) when it says, else
    the model's (max_position_embeddings); None when neither is known."""
    if live is not None and live.max_model_len is not None:
        return live.max_model_len
    return model.max_model_len


def resolve_model_of(s: Settings, notes: list[str]) -> ModelSpec:
    dtype_bytes = _dtype_bytes(s) if s.dtype is not None else None
    if s.geometry is not None:
        return _explicit_model(s.geometry, dtype_bytes or 2, notes)
    if s.model is None:
        raise ConfigError(f"{s.where}: no model; " + key_phrase(s, "give model.name, model.config or model.num_layers/num_kv_heads/head_dim",
                                                             "the server names none: pass --model or --model-config"))
    try:
        return resolve_model(s.model, dtype_bytes)
    except ConfigError as exc:
        if s.origin == "server" and "unknown model" in str(exc):
            raise ConfigError(f"the server's model {s.model!r} is not in the catalog; pass --model NAME or "
                              "--model-config PATH (an HF config.json)") from None
        raise ConfigError(f"{s.where}: {key_phrase(s, 'model.name', '--model')}: {exc}") from None


def _explicit_model(geometry: Mapping[str, int], dtype_bytes: int, notes: list[str]) -> ModelSpec:
    num_attention_heads = geometry.get("num_attention_heads", geometry["num_kv_heads"])
    hidden_size = geometry.get("hidden_size", num_attention_heads * geometry["head_dim"])
    num_params = geometry.get("num_params")
    if num_params is None:
        num_params = 12 * geometry["num_layers"] * hidden_size**2
        notes.append(f"num_params estimated as 12 x layers x hidden^2 = {num_params / 1e9:.2f} B "
                     "(affects step times only)")
    name = f"custom ({geometry['num_layers']} layers, {geometry['num_kv_heads']} KV heads x {geometry['head_dim']})"
    return ModelSpec(name, geometry["num_layers"], geometry["num_kv_heads"], geometry["head_dim"],
                     num_attention_heads, hidden_size, num_params, dtype_bytes)


def _dtype_bytes(s: Settings) -> int:
    name = s.dtype.lower().removeprefix("torch.")
    if name not in DTYPE_BYTES:
        raise ConfigError(f"{s.where}: {key_phrase(s, 'model.dtype', 'the server cache_dtype')} must be one of "
                          f"{', '.join(DTYPE_BYTES)}, got {s.dtype!r}")
    return DTYPE_BYTES[name]


def resolve_num_blocks(s: Settings, model: ModelSpec, gpu: GpuSpec, block_size: int, notes: list[str]) -> int:
    util = s.gpu_memory_utilization
    if s.num_gpu_blocks is not None:
        if s.gpu is not None and util is not None:
            _check_consistent(s, model, gpu, block_size)
        return s.num_gpu_blocks
    if s.gpu is None:
        raise ConfigError(f"{s.where}: no KV block budget; " + key_phrase(
            s, "give engine.num_gpu_blocks, or engine.gpu (with engine.gpu_memory_utilization)", "pass --num-blocks"))
    if util is None:
        util = DEFAULT_GPU_MEMORY_UTILIZATION
        notes.append(f"gpu_memory_utilization {util} (vLLM's default)")
    num_blocks = num_blocks_for_gpu(model, gpu, util, block_size)
    notes.append(f"{num_blocks} blocks = ({gpu.name} memory x {util} - weights - 2 GiB reserve) / block bytes")
    return num_blocks


def _check_consistent(s: Settings, model: ModelSpec, gpu: GpuSpec, block_size: int) -> None:
    """num_gpu_blocks beside gpu + gpu_memory_utilization must leave a 0-8 GiB reserve."""
    usable = math.floor(gpu.memory_bytes * s.gpu_memory_utilization) - model.weight_bytes
    reserve = usable - s.num_gpu_blocks * model.kv_bytes_per_block(block_size)
    if 0 <= reserve <= MAX_RESERVE_BYTES:
        return
    expected = num_blocks_for_gpu(model, gpu, s.gpu_memory_utilization, block_size) if usable > 2 * GiB else 0
    raise ConfigError(
        f"{s.where}: engine.num_gpu_blocks = {s.num_gpu_blocks} disagrees with engine.gpu = {s.gpu!r} at "
        f"engine.gpu_memory_utilization = {s.gpu_memory_utilization}: it leaves {reserve / GiB:.1f} GiB for neither "
        f"weights nor KV (expected 0-{MAX_RESERVE_BYTES // GiB} GiB, about {expected} blocks); give one or the other")


def kv_pool_notes(live: LiveState, model: ModelSpec, s: Settings) -> list[str]:
    cache = live.cache_config
    if None in (cache.kv_cache_memory_bytes, cache.num_gpu_blocks, cache.block_size):
        return []
    server_bytes = cache.kv_cache_memory_bytes / (cache.num_gpu_blocks * cache.block_size)
    if abs(server_bytes - model.kv_bytes_per_token) <= KV_BYTES_MISMATCH * model.kv_bytes_per_token:
        return []
    return [f"the server's KV pool ({cache.kv_cache_memory_bytes / GiB:.2f} GiB for {cache.num_gpu_blocks} blocks of "
            f"{cache.block_size} tokens) is {server_bytes:.0f} bytes/token, {model.name} needs "
            f"{model.kv_bytes_per_token}: check {key_phrase(s, 'model', '--model')} (tensor parallelism splits it)"]


def key_phrase(s: Settings, toml_phrase: str, server_phrase: str) -> str:
    return toml_phrase if s.origin == "toml" else server_phrase
