"""The decoder step of a Llama-style transformers model, run over the paged KV cache.

The model's own modules do everything except attention: embeddings, RMSNorms, q/k/v/o
projections (Qwen2's biases included), the rotary embedding (any rope scaling the config
asks for), the gated MLP and the head. Attention is replaced: the K/V of the new tokens are
written at their slots (Eq. 2), then every query reads back exactly the slots its request's
token table lists, live tokens only, in logical order. Rotary positions are the logical ids,
so a token keeps its original position whatever block it was moved to.

    prefill   one request, L tokens, all live:  causal attention over its L slots
    decode    B requests, one new token each:   attention over each request's live slots,
                                                padded to the longest with a mask

    key_slots [B, Lmax]:  s00 s01 s02 s03 s04 | pad pad      pad slots repeat a real slot
    key_mask  [B, Lmax]:   1   1   1   1   1  |  0   0       and are masked out

With `with_scores`, attention is computed explicitly and the probabilities are summed over
heads and layers into one [queries, keys] matrix per request: what H2O, Scissorhands and TOVA
score. Without it, torch's fused scaled_dot_product_attention runs instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from vtoken.kv.kv_cache import PagedKVCache


@dataclass(frozen=True)
class ForwardOut:
    logprobs: torch.Tensor  # [B, vocab] fp32 log-softmax of the next-token logits
    attention: torch.Tensor | None  # fp32, summed over heads and layers: [B, queries, keys]


@dataclass(frozen=True)
class _Step:
    """One forward's inputs: B requests with Lq new tokens each, reading Lk keys each."""

    token_ids: torch.Tensor  # [B, Lq]
    positions: torch.Tensor  # [B, Lq] rotary positions = logical ids
    new_slots: torch.Tensor  # [B * Lq] where the new tokens' K/V go
    key_slots: torch.Tensor  # [B, Lk] what each request's queries read, in logical order
    mask: torch.Tensor  # [B, 1, Lq, Lk] True = read


class PagedDecoder:
    """Runs a transformers Llama/Mistral/Qwen2 *ForCausalLM over a `PagedKVCache`."""

    def __init__(self, model, kv_cache: PagedKVCache, with_scores: bool) -> None:
        inner = model.model
        self.embed = inner.embed_tokens
        self.layers = list(inner.layers)
        self.norm = inner.norm
        self.rotary = inner.rotary_emb
        self.lm_head = model.lm_head
        attn = self.layers[0].self_attn
        self.head_dim = attn.head_dim
        self.scaling = attn.scaling
        self.num_heads = model.config.num_attention_heads
        self.num_kv_heads = model.config.num_key_value_heads
        self.kv = kv_cache
        self.device = kv_cache.device
        self.with_scores = with_scores

    @torch.inference_mode()
    def prefill(self, token_ids: torch.Tensor, slots: torch.Tensor) -> ForwardOut:
        """`token_ids` [L] at positions 0..L-1, their K/V written at `slots` [L]."""
        num_tokens = token_ids.numel()
        positions = torch.arange(num_tokens, device=self.device)[None]
        causal = torch.ones(num_tokens, num_tokens, dtype=torch.bool, device=self.device).tril()
        return self._forward(_Step(token_ids[None], positions, slots, slots[None], causal[None, None]))

    @torch.inference_mode()
    def decode(self, token_ids: torch.Tensor, positions: torch.Tensor, key_slots: torch.Tensor,
               num_keys: torch.Tensor) -> ForwardOut:
        """One new token per request: `token_ids`, `positions` [B]. Row b of `key_slots` [B, Lmax]
        holds request b's `num_keys[b]` live slots, the new token's last; the rest is padding."""
        is_key = torch.arange(key_slots.shape[1], device=self.device)[None, :] < num_keys[:, None]
        new_slots = key_slots.gather(1, (num_keys - 1)[:, None])[:, 0]
        return self._forward(_Step(token_ids[:, None], positions[:, None], new_slots, key_slots, is_key[:, None, None, :]))

    def _forward(self, step: _Step) -> ForwardOut:
        batch, num_queries = step.token_ids.shape
        num_keys = step.key_slots.shape[1]
        x = self.embed(step.token_ids)  # [B, Lq, hidden]
        cos, sin = self.rotary(x, step.positions)
        flat_keys = step.key_slots.reshape(-1)
        attention = torch.zeros(batch, num_queries, num_keys, device=self.device) if self.with_scores else None
        for layer_idx, layer in enumerate(self.layers):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            q = attn.q_proj(h).view(batch, num_queries, self.num_heads, self.head_dim).transpose(1, 2)
            k = attn.k_proj(h).view(batch, num_queries, self.num_kv_heads, self.head_dim).transpose(1, 2)
            v = attn.v_proj(h).view(batch, num_queries, self.num_kv_heads, self.head_dim).transpose(1, 2)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            cache_k, cache_v = self.kv.flat[layer_idx, 0], self.kv.flat[layer_idx, 1]  # [slots, kv_heads, head_dim]
            cache_k.index_copy_(0, step.new_slots, k.transpose(1, 2).reshape(-1, self.num_kv_heads, self.head_dim))
            cache_v.index_copy_(0, step.new_slots, v.transpose(1, 2).reshape(-1, self.num_kv_heads, self.head_dim))
            keys = cache_k.index_select(0, flat_keys).view(batch, num_keys, self.num_kv_heads, self.head_dim).transpose(1, 2)
            values = cache_v.index_select(0, flat_keys).view(batch, num_keys, self.num_kv_heads, self.head_dim).transpose(1, 2)
            out = self._attend(q, keys, values, step.mask, attention)  # [B, heads, Lq, head_dim]
            x = x + attn.o_proj(out.transpose(1, 2).reshape(batch, num_queries, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        logits = self.lm_head(self.norm(x[:, -1]))
        return ForwardOut(torch.log_softmax(logits.float(), dim=-1), attention)

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                attention: torch.Tensor | None) -> torch.Tensor:
        """q [B, H, Lq, D]; keys, values [B, kv_heads, Lk, D]; mask [B, 1, Lq, Lk] (True = read).

        With `attention` given, adds this layer's probabilities summed over heads into it.
        """
        if attention is None:
            return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=self.scaling, enable_gqa=True)
        batch, _, num_queries, head_dim = q.shape
        group = self.num_heads // self.num_kv_heads  # query heads i*group .. i*group+group-1 read KV head i
        grouped = q.reshape(batch, self.num_kv_heads, group * num_queries, head_dim)
        scores = torch.matmul(grouped, keys.transpose(-1, -2)) * self.scaling  # [B, kv_heads, group*Lq, Lk]
        scores = scores.view(batch, self.num_kv_heads, group, num_queries, -1).masked_fill(~mask[:, :, None], float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
        attention += probs.sum(dim=(1, 2))
        out = torch.matmul(probs.to(q.dtype).view(batch, self.num_kv_heads, group * num_queries, -1), values)
        return out.view(batch, self.num_heads, num_queries, head_dim)
