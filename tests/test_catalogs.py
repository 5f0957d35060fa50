"""Model and GPU catalogs: published values, HF config parsing, name resolution, KV block budget."""

from __future__ import annotations

import json

import pytest

from vtoken.errors import ConfigError
from vtoken.hardware import DEFAULT_RESERVE_BYTES, GPUS, GpuSpec, num_blocks_for_gpu, resolve_gpu
from vtoken.model_spec import MODELS, ModelSpec, model_spec_from_hf_config, resolve_model

MiB = 2**20
GiB = 2**30

# The fields of each model's published config.json that the estimate and the context read
# (Qwen2.5: the Instruct config's 32768, served without YaRN).
HF_CONFIGS = {
    "llama-3.1-8b": {"hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
                     "num_hidden_layers": 32, "num_key_value_heads": 8, "vocab_size": 128256,
                     "tie_word_embeddings": False, "torch_dtype": "bfloat16",
                     "max_position_embeddings": 131072},
    "mistral-7b": {"hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
                   "num_hidden_layers": 32, "num_key_value_heads": 8, "vocab_size": 32000,
                   "tie_word_embeddings": False, "torch_dtype": "bfloat16",
                   "max_position_embeddings": 32768},
    "qwen2.5-7b": {"hidden_size": 3584, "intermediate_size": 18944, "num_attention_heads": 28,
                   "num_hidden_layers": 28, "num_key_value_heads": 4, "vocab_size": 152064,
                   "tie_word_embeddings": False, "torch_dtype": "bfloat16",
                   "max_position_embeddings": 32768},
    "qwen2.5-14b": {"hidden_size": 5120, "intermediate_size": 13824, "num_attention_heads": 40,
                    "num_hidden_layers": 48, "num_key_value_heads": 8, "vocab_size": 152064,
                    "tie_word_embeddings": False, "torch_dtype": "bfloat16",
                    "max_position_embeddings": 32768},
    "llama-3.1-70b": {"hidden_size": 8192, "intermediate_size": 28672, "num_attention_heads": 64,
                      "num_hidden_layers": 80, "num_key_value_heads": 8, "vocab_size": 128256,
                      "tie_word_embeddings": False, "torch_dtype": "bfloat16",
                      "max_position_embeddings": 131072},
    "smollm2-135m": {"hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9,
                     "num_hidden_layers": 30, "num_key_value_heads": 3, "vocab_size": 49152,
                     "tie_word_embeddings": True, "torch_dtype": "bfloat16",
                     "max_position_embeddings": 8192},
}


def write_config(tmp_path, config: dict, folder: str = "model") -> object:
    model_dir = tmp_path / folder
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(config))
    return model_dir


# --- model catalog ----------------------------------------------------------------------------


def test_llama_8b_kv_bytes():
    llama = MODELS["llama-3.1-8b"]
    assert llama.kv_bytes_per_token == 131072  # 2 * 32 layers * 8 heads * 128 * 2 bytes
    assert llama.kv_bytes_per_block(16) == 2 * MiB
    assert llama.weight_bytes == 16_060_000_000


@pytest.mark.parametrize("name, num_layers, num_kv_heads, head_dim, kv_bytes_per_token", [
    ("mistral-7b", 32, 8, 128, 131072),
    ("qwen2.5-7b", 28, 4, 128, 57344),
    ("qwen2.5-14b", 48, 8, 128, 196608),
    ("llama-3.1-70b", 80, 8, 128, 327680),
    ("smollm2-135m", 30, 3, 64, 23040),
])
def test_catalog_geometry(name, num_layers, num_kv_heads, head_dim, kv_bytes_per_token):
    spec = MODELS[name]
    assert (spec.num_layers, spec.num_kv_heads, spec.head_dim) == (num_layers, num_kv_heads, head_dim)
    assert spec.kv_bytes_per_token == kv_bytes_per_token


def test_catalog_keys_are_lowercase_names():
    assert sorted(MODELS) == sorted(HF_CONFIGS)
    assert all(key == spec.name == key.lower() for key, spec in MODELS.items())


@pytest.mark.parametrize("name", sorted(HF_CONFIGS))
def test_hf_config_reproduces_the_catalog(tmp_path, name):
    spec = model_spec_from_hf_config(write_config(tmp_path, HF_CONFIGS[name]))
    catalog = MODELS[name]
    assert (spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.num_attention_heads, spec.hidden_size,
            spec.dtype_bytes) == (catalog.num_layers, catalog.num_kv_heads, catalog.head_dim,
                                  catalog.num_attention_heads, catalog.hidden_size, catalog.dtype_bytes)
    assert spec.num_params == pytest.approx(catalog.num_params, rel=0.01)
    assert spec.max_model_len == catalog.max_model_len == HF_CONFIGS[name]["max_position_embeddings"]


def test_hf_config_exact_estimate_and_defaults(tmp_path):
    # No num_key_value_heads, no head_dim, no dtype, tie_word_embeddings by default (HF's default).
    config = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
              "num_hidden_layers": 2, "vocab_size": 100}
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(config))
    spec = model_spec_from_hf_config(path)
    assert spec == ModelSpec(name=tmp_path.name, num_layers=2, num_kv_heads=4, head_dim=16,
                             num_attention_heads=4, hidden_size=64, dtype_bytes=2,
                             # embeddings 100*64 + 2 layers * (attention 4*64*64 + MLP 3*64*128)
                             num_params=6400 + 2 * (16384 + 24576))
    untied = model_spec_from_hf_config(write_config(tmp_path, config | {"tie_word_embeddings": False}))
    assert untied.num_params == spec.num_params + 6400


def test_hf_config_dtype_and_explicit_head_dim(tmp_path):
    config = HF_CONFIGS["llama-3.1-8b"] | {"torch_dtype": "float32", "head_dim": 64, "_name_or_path": "my/model"}
    spec = model_spec_from_hf_config(write_config(tmp_path, config))
    assert (spec.name, spec.head_dim, spec.dtype_bytes) == ("my/model", 64, 4)


def test_hf_config_reads_text_config_of_multimodal_models(tmp_path):
    spec = model_spec_from_hf_config(write_config(tmp_path, {"text_config": HF_CONFIGS["qwen2.5-7b"]}))
    assert spec.kv_bytes_per_token == MODELS["qwen2.5-7b"].kv_bytes_per_token


@pytest.mark.parametrize("config, message", [
    ({"hidden_size": 64}, r"num_attention_heads must be a positive integer, got None"),
    (HF_CONFIGS["smollm2-135m"] | {"num_hidden_layers": "30"}, r"num_hidden_layers must be a positive integer, got '30'"),
    (HF_CONFIGS["smollm2-135m"] | {"torch_dtype": "int3"}, r"unknown dtype, choose one of .*, got 'int3'"),
    ([1, 2], r"a model config must be a JSON object, got list"),
])
def test_hf_config_errors(tmp_path, config, message):
    with pytest.raises(ConfigError, match=message):
        model_spec_from_hf_config(write_config(tmp_path, config))


def test_hf_config_not_json(tmp_path):
    path = tmp_path / "config.json"
    path.write_text("{oops")
    with pytest.raises(ConfigError, match="not a readable JSON config"):
        model_spec_from_hf_config(path)


@pytest.mark.parametrize("name, expected", [
    ("llama-3.1-8b", "llama-3.1-8b"),
    ("Llama-3.1-8B", "llama-3.1-8b"),
    ("meta-llama/Llama-3.1-8B-Instruct", "llama-3.1-8b"),
    ("meta-llama/Meta-Llama-3.1-70B-Instruct", "llama-3.1-70b"),
    ("mistralai/Mistral-7B-v0.1", "mistral-7b"),
    ("Qwen/Qwen2.5-14B-Instruct", "qwen2.5-14b"),
    ("Qwen/Qwen2.5-7B", "qwen2.5-7b"),
    ("HuggingFaceTB/SmolLM2-135M-Instruct", "smollm2-135m"),
])
def test_resolve_model_names(name, expected):
    assert resolve_model(name) is MODELS[expected]


@pytest.mark.parametrize("name", ["llama-3.1-80b", "qwen2.5-72b", "gpt-4", "llama3.1-8b", ""])
def test_resolve_model_unknown_lists_the_catalog(name):
    with pytest.raises(ConfigError, match=r"unknown model .*; choose one of llama-3.1-8b, mistral-7b, .*smollm2-135m"):
        resolve_model(name)


def test_resolve_model_from_path_and_dtype_override(tmp_path):
    model_dir = write_config(tmp_path, HF_CONFIGS["smollm2-135m"], folder="llama-3.1-8b")
    assert resolve_model(str(model_dir)).num_layers == 30  # the folder wins over the catalog name
    assert resolve_model(str(model_dir / "config.json")).num_layers == 30
    fp8 = resolve_model("llama-3.1-8b", dtype_bytes=1)
    assert (fp8.kv_bytes_per_token, fp8.weight_bytes) == (65536, MODELS["llama-3.1-8b"].weight_bytes)
    with pytest.raises(ConfigError, match="dtype_bytes must be 1, 2 or 4, got 3"):
        resolve_model("llama-3.1-8b", dtype_bytes=3)


# --- GPU catalog ------------------------------------------------------------------------------


def test_gpu_catalog_values():
    assert GPUS["h100-80gb"] == GpuSpec("h100-80gb", 81559 * MiB, 3.35e12, 989e12)
    assert GPUS["h200"] == GpuSpec("h200", 143771 * MiB, 4.8e12, 989e12)
    assert GPUS["a100-80gb"] == GpuSpec("a100-80gb", 80 * GiB, 2.039e12, 312e12)
    assert GPUS["l40s"] == GpuSpec("l40s", 46068 * MiB, 864e9, 362e12)


@pytest.mark.parametrize("name, expected", [
    ("H100", "h100-80gb"), ("h100-80gb", "h100-80gb"), ("NVIDIA H100 80GB HBM3", "h100-80gb"),
    ("H100 SXM5 80GB", "h100-80gb"), ("NVIDIA H200", "h200"), ("h200", "h200"),
    ("NVIDIA A100-SXM4-80GB", "a100-80gb"), ("a100_80gb", "a100-80gb"), ("NVIDIA L40S", "l40s"),
])
def test_resolve_gpu_names(name, expected):
    assert resolve_gpu(name) is GPUS[expected]


@pytest.mark.parametrize("name", ["H100 PCIe", "NVIDIA H100 NVL", "A100", "NVIDIA A100-SXM4-40GB", "L40", "tpu"])
def test_resolve_gpu_unknown_lists_the_catalog(name):
    with pytest.raises(ConfigError, match=r"unknown GPU .*; choose one of h100-80gb, h200, a100-80gb, l40s"):
        resolve_gpu(name)


# --- KV block budget --------------------------------------------------------------------------


def test_num_blocks_hand_computed():
    model = ModelSpec("toy", num_layers=2, num_kv_heads=2, head_dim=64, num_attention_heads=4,
                      hidden_size=256, num_params=1000)  # 1,024 bytes/token, 16 KiB per block, 2,000 weight bytes
    gpu = GpuSpec("toy-gpu", memory_bytes=1_000_000, hbm_bytes_per_s=1e9, bf16_flop_per_s=1e12)
    # floor(1e6 * 0.9) = 900,000; - 2,000 weights - 100,000 reserve = 798,000; // 16,384 = 48
    assert num_blocks_for_gpu(model, gpu, 0.9, 16, reserve_bytes=100_000) == 48


def test_num_blocks_llama_8b_on_h100():
    # floor(81559 MiB * 0.9) = 76,968,728,985 bytes; - 16.06e9 weights - 2 GiB = 58,761,245,337; / 2 MiB = 28019.5
    assert DEFAULT_RESERVE_BYTES == 2 * GiB
    assert num_blocks_for_gpu(MODELS["llama-3.1-8b"], GPUS["h100-80gb"], 0.9, 16) == 28019


@pytest.mark.parametrize("gpu_mem_util", [0, -0.5, 1.01])
def test_num_blocks_rejects_bad_memory_fraction(gpu_mem_util):
    with pytest.raises(ConfigError, match=r"GPU memory fraction \(vLLM's gpu_memory_utilization\) must be in \(0, 1\]"):
        num_blocks_for_gpu(MODELS["llama-3.1-8b"], GPUS["h100-80gb"], gpu_mem_util, 16)


def test_num_blocks_when_the_weights_do_not_fit():
    with pytest.raises(ConfigError, match=r"llama-3.1-70b does not fit on l40s at a GPU memory fraction of 0.9: "
                                          r"40.5 GiB usable - 131.5 GiB weights - 2.0 GiB reserve"):
        num_blocks_for_gpu(MODELS["llama-3.1-70b"], GPUS["l40s"], 0.9, 16)
