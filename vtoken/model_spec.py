"""KV geometry of a model: how many bytes one cached token and one block of tokens take.

A model comes from a small built-in catalog (the published config.json values of a few common
models) or from a Hugging Face config.json. Only the numbers that size the KV cache and the
cost model are kept; nothing here loads weights.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from vtoken.errors import ConfigError

WEIGHT_DTYPE_BYTES = 2  # weights are assumed bf16/fp16 whatever the KV cache dtype
DTYPE_BYTES = {
    "float32": 4, "fp32": 4, "float": 4,
    "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "half": 2,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1,
}


@dataclass(frozen=True)
class ModelSpec:
    """The shape of a decoder-only transformer, as far as KV memory and step cost need it."""

    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_attention_heads: int
    hidden_size: int
    num_params: int  # total parameters: weight bytes, and per-token FLOPs = 2 * num_params
    dtype_bytes: int = 2  # of the KV cache: bf16/fp16 = 2, fp8 = 1, fp32 = 4
    # Longest sequence (prompt + output tokens) the model serves: config.json's
    # max_position_embeddings, as vLLM's default max_model_len. None: not known.
    max_model_len: int | None = None

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V, every layer, every KV head: 2 * layers * kv_heads * head_dim * dtype_bytes."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    def kv_bytes_per_block(self, block_size: int) -> int:
        """Bytes of one paged-KV block of `block_size` tokens (all layers)."""
        return block_size * self.kv_bytes_per_token

    @property
    def weight_bytes(self) -> int:
        return self.num_params * WEIGHT_DTYPE_BYTES


MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        # Values from each model's published config.json; num_params from the model card. The
        # context is max_position_embeddings; Qwen2.5's 32768 is what its Instruct config.json
        # serves by default (131072 needs YaRN rope scaling turned on).
        ModelSpec("llama-3.1-8b", 32, 8, 128, 32, 4096, 8_030_000_000, max_model_len=131072),
        ModelSpec("mistral-7b", 32, 8, 128, 32, 4096, 7_240_000_000, max_model_len=32768),
        ModelSpec("qwen2.5-7b", 28, 4, 128, 28, 3584, 7_620_000_000, max_model_len=32768),
        ModelSpec("qwen2.5-14b", 48, 8, 128, 40, 5120, 14_700_000_000, max_model_len=32768),
        ModelSpec("llama-3.1-70b", 80, 8, 128, 64, 8192, 70_600_000_000, max_model_len=131072),
        ModelSpec("smollm2-135m", 30, 3, 64, 9, 576, 134_500_000, max_model_len=8192),
    )
}


def resolve_model(name_or_path: str, dtype_bytes: int | None = None) -> ModelSpec:
    """A catalog model by name, or the model an HF config.json (or its folder) describes.

    Names are case-insensitive and may be HF ids: "meta-llama/Llama-3.1-8B-Instruct" finds
    "llama-3.1-8b" because the catalog name appears in the last path component between word
    boundaries. `dtype_bytes` overrides the KV cache dtype (e.g. 1 for an fp8 cache).
    Raises ConfigError for an unknown name, listing the catalog.
    """
    if dtype_bytes is not None and dtype_bytes not in (1, 2, 4):
        raise ConfigError(f"dtype_bytes must be 1, 2 or 4, got {dtype_bytes!r}")
    if _is_config_path(Path(name_or_path)):
        spec = model_spec_from_hf_config(name_or_path)
    else:
        spec = _catalog_model(name_or_path)
    return spec if dtype_bytes is None else replace(spec, dtype_bytes=dtype_bytes)


def _is_config_path(path: Path) -> bool:
    return path.is_file() or (path / "config.json").is_file()


def _catalog_model(name: str) -> ModelSpec:
    wanted = re.sub(r"[\s_]+", "-", name.strip().rstrip("/").split("/")[-1].lower())
    matches = [key for key in MODELS if re.search(rf"(^|-){re.escape(key)}($|-)", wanted)]
    if not matches:
        raise ConfigError(f"unknown model {name!r}; choose one of {', '.join(MODELS)} "
                          "or give the path of an HF config.json")
    return MODELS[max(matches, key=len)]


def model_spec_from_hf_config(path: str | Path) -> ModelSpec:
    """Read an HF config.json (or a folder holding one) into a ModelSpec.

    num_key_value_heads defaults to num_attention_heads (no GQA), head_dim to
    hidden_size / num_attention_heads, the dtype to bf16, the context (max_model_len) to
    max_position_embeddings when it is a positive integer. Multimodal configs are read through
    their `text_config`. num_params is an ESTIMATE for a dense model: embeddings, per layer the
    q/k/v/o projections and a gated MLP (gate, up, down of intermediate_size), plus lm_head
    unless tie_word_embeddings; biases and norms are left out (< 0.1% for common models).
    """
    config_path = Path(path) / "config.json" if Path(path).is_dir() else Path(path)
    config = _read_config(config_path)
    config = {**config, **config.get("text_config", {})} if "num_hidden_layers" not in config else config
    num_heads = _config_int(config, "num_attention_heads", config_path)
    hidden_size = _config_int(config, "hidden_size", config_path)
    head_dim = config.get("head_dim") or hidden_size // num_heads
    num_kv_heads = config.get("num_key_value_heads") or num_heads
    return ModelSpec(
        name=str(config.get("_name_or_path") or config_path.parent.name or config_path.stem),
        num_layers=_config_int(config, "num_hidden_layers", config_path),
        num_kv_heads=int(num_kv_heads),
        head_dim=int(head_dim),
        num_attention_heads=num_heads,
        hidden_size=hidden_size,
        num_params=_estimate_num_params(config, int(head_dim), int(num_kv_heads), config_path),
        dtype_bytes=_config_dtype_bytes(config, config_path),
        max_model_len=_optional_positive_int(config, "max_position_embeddings"),
    )


def _read_config(config_path: Path) -> dict[str, Any]:
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{config_path}: no such model config file") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{config_path}: not a readable JSON config ({exc})") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{config_path}: a model config must be a JSON object, got {type(config).__name__}")
    return config


def _config_int(config: dict, key: str, config_path: Path) -> int:
    value = config.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{config_path}: {key} must be a positive integer, got {value!r}")
    return value


def _optional_positive_int(config: dict, key: str) -> int | None:
    value = config.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _config_dtype_bytes(config: dict, config_path: Path) -> int:
    dtype = config.get("torch_dtype") or config.get("dtype") or "bfloat16"
    name = str(dtype).lower().removeprefix("torch.")
    if name not in DTYPE_BYTES:
        raise ConfigError(f"{config_path}: unknown dtype, choose one of {', '.join(DTYPE_BYTES)}, "
                          f"got {dtype!r}")
    return DTYPE_BYTES[name]


def _estimate_num_params(config: dict, head_dim: int, num_kv_heads: int, config_path: Path) -> int:
    hidden_size = _config_int(config, "hidden_size", config_path)
    num_heads = _config_int(config, "num_attention_heads", config_path)
    embedding = _config_int(config, "vocab_size", config_path) * hidden_size
    attention = 2 * hidden_size * head_dim * (num_heads + num_kv_heads)  # q + o, k + v
    mlp = 3 * hidden_size * _config_int(config, "intermediate_size", config_path)
    lm_head = 0 if config.get("tie_word_embeddings", True) else embedding
    return embedding + lm_head + _config_int(config, "num_hidden_layers", config_path) * (attention + mlp)
