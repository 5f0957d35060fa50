"""A tiny random causal LM and a tokenizer, built offline in about a second (tests, demos).

The tokenizer is a byte-level BPE trained with the `tokenizers` library on a built-in text;
the model is a random Llama, Mistral or Qwen2 with GQA. At transformers' default initializer
scale (0.02) the next-token distributions are nearly uniform and greedy decoding hangs on float
noise; the default here (0.1) gives peaked ones (mean greedy log-probability about -4 over 512
tokens) while fp32 log-probabilities still agree with the reference to about 1e-6 (larger
scales amplify the rounding of the logits).
"""

from __future__ import annotations

from pathlib import Path

_CORPUS = (
    "the quick brown fox jumps over the lazy dog while the cat sleeps on the warm mat. "
    "a paged kv cache stores keys and values in blocks of sixteen tokens; eviction marks tokens dead "
    "and a reclaimer packs the live tokens of sparse blocks so that whole blocks come free. "
    "attention reads every live token through its slot, and rotary positions stay the original ones. "
    "numbers like 0 1 2 3 4 5 6 7 8 9 10 42 128 and 4096 appear, as do words such as memory, "
    "latency, throughput, policy, heavy hitter, streaming, scissors, random, oracle and budget."
)
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")


def build_tokenizer(vocab_size: int = 512):
    """A byte-level BPE tokenizer (transformers fast tokenizer) trained on a fixed text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    backend.train_from_iterator([_CORPUS] * 4, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def build_tiny_model(folder: str | Path, arch: str = "llama", seed: int = 0, initializer_range: float = 0.1) -> Path:
    """Write a tiny random `arch` (llama, mistral or qwen2) and its tokenizer into `folder`.

    2 layers, hidden 64, 4 query heads, 2 KV heads, head dim 16, fp32 weights.
    """
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config

    tokenizer = build_tokenizer()
    common = dict(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
        initializer_range=initializer_range, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=False, dtype="float32",
    )
    configs = {
        "llama": lambda: LlamaConfig(**common),
        "mistral": lambda: MistralConfig(**common, sliding_window=None),
        "qwen2": lambda: Qwen2Config(**common, use_sliding_window=False),
    }
    if arch not in configs:
        raise ValueError(f"unknown tiny architecture {arch!r}; choose one of {', '.join(configs)}")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(configs[arch]())
    folder = Path(folder)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
