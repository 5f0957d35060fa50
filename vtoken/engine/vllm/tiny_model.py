"""A tiny random Llama and a locally trained tokenizer, made offline, for tests and demos.

Nothing is downloaded: the weights come from a seeded generator and the tokenizer is a
byte-level BPE trained on a built-in text. The same seed writes the same files, so vLLM and
transformers load exactly the same model. Random weights repeat themselves; compare
log-probabilities, not only greedy tokens.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

_CORPUS = (
    "The paged key value cache stores the keys and values of every token in blocks. "
    "A token level eviction policy marks tokens dead without touching memory, and the "
    "reclaimer packs live tokens so that whole blocks come free. Attention sinks keep the "
    "first tokens, a sliding window keeps the most recent ones, heavy hitters keep the "
    "tokens that received the most attention. Serving engines batch many requests at once "
    "and preempt the newest request when memory runs out. "
)


@dataclass(frozen=True)
class TinyLlamaSpec:
    """Shape of the tiny model. head_dim 64 is one the vLLM CPU attention kernels support."""

    num_layers: int = 2
    hidden_size: int = 256
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 512
    vocab_size: int = 1024
    max_position_embeddings: int = 4096
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

    directory = Path(directory)
    stamp = directory / "vtoken_tiny_spec.json"
    wanted = json.dumps(spec.__dict__, sort_keys=True)
    if stamp.exists() and stamp.read_text() == wanted:
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = _train_tokenizer(spec.vocab_size)
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
        torch_dtype="float32",
    )
    torch.manual_seed(spec.seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    with torch.no_grad():
        # Larger-than-default weights give peaked, position-sensitive attention, so a
        # wrong key, position or mask shows up in the log-probabilities.
        for name, param in model.named_parameters():
            if param.dim() == 2:
                param.normal_(0.0, 0.08 if "embed" not in name else 1.0)
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    stamp.write_text(wanted)
    return directory


def _train_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE(unk_token=None))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>")
