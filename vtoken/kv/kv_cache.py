"""The paged KV tensor, materialized only when asked (small shapes in tests and checks).

One tensor for all layers, K and V, addressed by slot = block_id * S + offset (Eq. 2):

    data: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
    flat: [num_layers, 2, num_blocks * block_size, num_kv_heads, head_dim]   (a view)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vtoken.errors import ConfigError


@dataclass(frozen=True)
class KVShape:
    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if value <= 0:
                raise ConfigError(f"KV cache {name} must be > 0, got {value}")

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size


class PagedKVCache:
    def __init__(self, shape: KVShape, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> None:
        self.shape = shape
        self.device = torch.device(device)
        self.data = torch.zeros(
            (shape.num_layers, 2, shape.num_blocks, shape.block_size, shape.num_kv_heads, shape.head_dim),
            dtype=dtype,
            device=self.device,
        )
        self.flat = self.data.view(shape.num_layers, 2, shape.num_slots, shape.num_kv_heads, shape.head_dim)

    def write(self, slots: torch.Tensor, kv: torch.Tensor) -> None:
        """Store `kv` [num_layers, 2, n, kv_heads, head_dim] at `slots` [n]."""
        self.flat.index_copy_(2, slots.to(self.device), kv.to(self.device, self.flat.dtype))

    def read(self, slots: torch.Tensor) -> torch.Tensor:
        """Gather [num_layers, 2, n, kv_heads, head_dim] from `slots` [n]."""
        return self.flat.index_select(2, slots.to(self.device))

    def copy_slots(self, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
        """dst <- src for every pair. The gather completes before the scatter, so a slot may be
        both a destination and (for another token) a source."""
        self.flat.index_copy_(2, dst_slots, self.flat.index_select(2, src_slots))
