"""Attention scores for H2O-style policies: a wrapper around vLLM's CPU attention backend.

No vLLM kernel returns attention weights. `ScoringCPUAttentionBackend` is the stock backend
whose implementation, after the stock kernel has run, recomputes the attention probabilities of
the requests a `ScoreCollector` asks for (torch, from the query and the keys in the paged cache,
read through the per-ISA index map) and adds them, summed over heads, into one row per query.
Layers without a collector cost nothing extra.

`register()` overrides the CPU_ATTN entry of vLLM's backend registry with this class. It is the
function a `vllm.general_plugins` entry point would name; `VTokenWorker` also calls it, before
the model is built, so the override is in place in every worker process either way.

Rows are in physical key order (positions 0..seq_len-1 of the request's block list); the
scheduler maps positions back to logical ids with the token table of that step.
"""

from __future__ import annotations

import numpy as np
import torch
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl

from vtoken.engine.vllm.kv_layout import cpu_element_indices

BACKEND_PATH = "vtoken.engine.vllm.attention.ScoringCPUAttentionBackend"


class ScoreCollector:
    """One step's attention rows of the requests at batch rows `rows` (row -> req_id)."""

    def __init__(self, index_map: torch.Tensor) -> None:
        self.index_map = index_map  # [block_size, 2 * head_dim]
        self.rows: dict[int, str] = {}
        self.sums: dict[str, np.ndarray] = {}  # req_id -> [queries, keys], summed over heads and layers

    def begin_step(self, rows: dict[int, str]) -> None:
        self.rows = rows
        self.sums = {}

    def observe(self, query: torch.Tensor, kv_cache: torch.Tensor, metadata, scale: float, num_heads: int) -> None:
        num_blocks, num_kv_heads, block_size, _ = kv_cache.shape
        head_dim = query.shape[-1] if query.dim() == 3 else query.shape[-1] // num_heads
        query = query.view(-1, num_heads, head_dim)
        flat = kv_cache.view(-1)
        starts = metadata.query_start_loc.tolist()
        for row, req_id in self.rows.items():
            seq_len = int(metadata.seq_lens[row])
            q = query[starts[row] : starts[row + 1]].float()  # [nq, H, D]
            block_ids = metadata.block_table[row, : -(-seq_len // block_size)].to(torch.int64)
            slots = (block_ids[:, None] * block_size + torch.arange(block_size)).view(-1)[:seq_len]
            keys = flat[cpu_element_indices(slots, self.index_map, num_kv_heads)[..., :head_dim]].float()
            keys = keys.repeat_interleave(num_heads // num_kv_heads, dim=1)  # [keys, H, D]
            logits = torch.einsum("qhd,khd->hqk", q, keys) * scale
            num_queries = q.shape[0]
            causal = torch.arange(seq_len)[None, :] <= (seq_len - num_queries + torch.arange(num_queries))[:, None]
            probs = torch.softmax(logits.masked_fill(~causal, float("-inf")), dim=-1).sum(dim=0)
            rows = probs.double().numpy()
            self.sums[req_id] = self.sums.get(req_id, 0.0) + rows


class ScoringCPUAttentionImpl(CPUAttentionBackendImpl):
    vtoken_collector: ScoreCollector | None = None

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        result = super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale,
                                 output_block_scale)
        collector = self.vtoken_collector
        if collector is not None and collector.rows and attn_metadata is not None:
            collector.observe(query, kv_cache, attn_metadata, self.scale, self.num_heads)
        return result


class ScoringCPUAttentionBackend(CPUAttentionBackend):
    @staticmethod
    def get_impl_cls() -> type[ScoringCPUAttentionImpl]:
        return ScoringCPUAttentionImpl


def register() -> None:
    """Point vLLM's CPU_ATTN backend at the scoring wrapper (idempotent)."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
    from vllm.v1.attention.selector import _cached_get_attn_backend

    register_backend(AttentionBackendEnum.CPU_ATTN, BACKEND_PATH)
    _cached_get_attn_backend.cache_clear()  # an engine built earlier in this process cached the stock class


def attach(layers, collector: ScoreCollector | None) -> int:
    """Give every scoring attention layer the collector; returns how many layers took it."""
    num_layers = 0
    for layer in layers:
        impl = getattr(layer, "impl", None)
        if isinstance(impl, ScoringCPUAttentionImpl):
            impl.vtoken_collector = collector
            num_layers += 1
    return num_layers
