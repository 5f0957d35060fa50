"""A tiny random Llama for the vLLM tier, made offline; the tokenizer is `vtoken.models.tiny`'s.

`vtoken.models.tiny.build_tiny_model` (the hf executor's) has head dim 16, which vLLM's CPU
attention kernels do not support (32, 64, 80, ...), so the vLLM tests build this one: the same
tokenizer, head dim 32. Nothing is downloaded and the same seed writes the same weights, so vLLM
and transformers load exactly the same model. Compare log-probabilities, not only greedy tokens.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

@dataclass(frozen=True)
class TinyLlamaSpec:
    """Shape of the tiny model: head_dim 32 (one the vLLM CPU kernels support), small enough that
    vLLM and transformers agree within ~4e-7 in fp32 while an eviction moves log-probs by ~1e-3."""

    num_layers: int = 2
    hidden_size: int = 128
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 256
    vocab_size: int = 512
    max_position_embeddings: int = 4096
    weight_std: float = 0.02
    embedding_std: float = 1.0
    seed: int = 0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


def make_tiny_llama(directory: Path, spec: TinyLlamaSpec = TinyLlamaSpec()) -> Path:
    """Write config, safetensors weights and a tokenizer into `directory`; returns it.

    Idempotent: a directory that already holds a model made with the same spec is kept.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from vtoken.models.tiny import build_tokenizer

    directory = Path(directory)
    stamp = directory / "vtoken_tiny_spec.json"
    wanted = json.dumps(spec.__dict__, sort_keys=True)
    if stamp.exists() and stamp.read_text() == wanted:
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(spec.vocab_size)
    config = LlamaConfig(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        dtype="float32",
    )
    torch.manual_seed(spec.seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    with torch.no_grad():
        # Unit-scale embeddings make every token's hidden state distinct, so a wrong key,
        # position or mask shows up in the log-probabilities.
        for name, param in model.named_parameters():
            if param.dim() == 2:
                param.normal_(0.0, spec.embedding_std if "embed" in name else spec.weight_std)
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    stamp.write_text(wanted)
    return directory
