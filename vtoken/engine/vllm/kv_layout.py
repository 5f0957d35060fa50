"""Token copies inside vLLM's paged KV tensors, in the layout the attention kernels wrote.

A vLLM CPU KV tensor per layer is `[num_blocks, num_kv_heads, block_size, 2 * head_dim]`, but
the inside of each (block, kv head) region of 2 * block_size * head_dim elements is packed per
instruction set (`layer.isa`): `vec`/`vec16` store K transposed ([head_dim, block_size]) then V
([block_size, head_dim]); `amx` tiles both. Rather than hard-coding each packing, the map from
(offset in block, K/V element) to the element's place in the region is read off the kernel
that writes the cache, `cpu_attn_reshape_and_cache`, once per (isa, block size, head dim,
dtype): what that kernel writes is, by construction, where the attention kernel reads. A test
checks the copies byte for byte against the kernel writing the same tokens at the destinations.

    region of one (block, kv head):   [ 2 * block_size * head_dim elements ]
    index_map[offset, e]              place of K[e] (e < D) or V[e - D] (e >= D) of the token

On CUDA the layouts are the plain ones of the flash-attention backends (a token is one
[num_kv_heads, head_dim] row per K and V); `cuda_slot_copy` moves those rows.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

_DIGIT_BASE = 64  # values 1..64 are exact in fp32, fp16 and bf16


@functools.lru_cache(maxsize=16)
def cpu_index_map(isa: str, block_size: int, head_dim: int, dtype: torch.dtype) -> torch.Tensor:
    """int64 [block_size, 2 * head_dim]: where each element of a token lives in its region.

    Derived by writing a full block with `torch.ops._C.cpu_attn_reshape_and_cache` into a
    one-block, one-head cache, every element carrying its own code offset * 2D + e, and reading
    back where each code landed. Codes are written as base-64 digits, one pass per digit, so
    every value is exact in bf16 and fp16 too.
    """
    import vllm._custom_ops  # noqa: F401  (registers torch.ops._C)

    num_elements = 2 * head_dim
    num_codes = block_size * num_elements
    num_digits = max(1, int(np.ceil(np.log(num_codes) / np.log(_DIGIT_BASE))))
    codes = torch.arange(num_codes, dtype=torch.int64).view(block_size, num_elements)
    decoded = torch.zeros(num_codes, dtype=torch.int64)
    for digit in range(num_digits):
        values = (codes // _DIGIT_BASE**digit) % _DIGIT_BASE + 1
        region = _write_block(isa, block_size, head_dim, dtype, values)
        if torch.any(region == 0):
            raise RuntimeError(f"isa {isa}: a full block left {int((region == 0).sum())} elements unwritten")
        decoded += (region.round().to(torch.int64) - 1) * _DIGIT_BASE**digit
    index_map = torch.full((num_codes,), -1, dtype=torch.int64)
    index_map[decoded] = torch.arange(num_codes, dtype=torch.int64)
    if torch.any(index_map < 0):
        raise RuntimeError(f"isa {isa}: the kernel's block layout is not a permutation of the tokens' elements")
    return index_map.view(block_size, num_elements)


def _write_block(isa: str, block_size: int, head_dim: int, dtype: torch.dtype, values: torch.Tensor) -> torch.Tensor:
    """values [block_size, 2 * head_dim] (K then V per token) -> the block region, flat fp32."""
    cache = torch.zeros((1, 1, block_size, 2 * head_dim), dtype=dtype)
    key = values[:, :head_dim].to(dtype).view(block_size, 1, head_dim)
    value = values[:, head_dim:].to(dtype).view(block_size, 1, head_dim)
    key_cache, value_cache = cache.view(1, 1, 2 * block_size, head_dim).chunk(2, dim=2)
    slots = torch.arange(block_size, dtype=torch.int64)
    torch.ops._C.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, isa, 1.0, 1.0, "auto")
    return cache.view(-1).to(torch.float32)


def cpu_element_indices(slots: torch.Tensor, index_map: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """Flat element indices [n, num_kv_heads, 2 * head_dim] of the tokens at `slots` [n].

    Into `kv.view(-1)` of a `[num_blocks, num_kv_heads, block_size, 2 * head_dim]` tensor.
    """
    block_size, num_elements = index_map.shape
    region_size = block_size * num_elements
    block_ids, offsets = slots // block_size, slots % block_size
    heads = torch.arange(num_kv_heads, dtype=torch.int64)
    region_starts = (block_ids[:, None] * num_kv_heads + heads[None, :]) * region_size  # [n, H]
    return region_starts[:, :, None] + index_map[offsets][:, None, :]


def cpu_slot_copy(kv_caches: list[torch.Tensor], src_slots: torch.Tensor, dst_slots: torch.Tensor,
                  index_map: torch.Tensor) -> int:
    """dst <- src for every pair, in every layer. Gather completes before scatter, so a slot may
    be a destination and another token's source in the same call. Returns bytes copied."""
    if src_slots.numel() == 0:
        return 0
    num_kv_heads = kv_caches[0].shape[1]
    src = cpu_element_indices(src_slots, index_map, num_kv_heads).view(-1)
    dst = cpu_element_indices(dst_slots, index_map, num_kv_heads).view(-1)
    num_bytes = 0
    for kv in _distinct(kv_caches):
        flat = kv.view(-1)
        flat[dst] = flat[src]
        num_bytes += src.numel() * kv.element_size()
    return num_bytes


def cpu_copied_correctly(kv_caches: list[torch.Tensor], src_slots: torch.Tensor, dst_slots: torch.Tensor,
                         index_map: torch.Tensor, before: list[torch.Tensor]) -> bool:
    """After `cpu_slot_copy`: does every destination hold the bytes its source held before?

    `before` is `cpu_gather(kv_caches, src_slots, index_map)` taken before the copy.
    """
    return all(torch.equal(b.view(torch.uint8), a.view(torch.uint8))
               for b, a in zip(before, cpu_gather(kv_caches, dst_slots, index_map)))


def cpu_mismatched_tokens(kv_caches: list[torch.Tensor], slots: torch.Tensor, index_map: torch.Tensor,
                          expected: list[torch.Tensor]) -> np.ndarray:
    """bool [n]: which of the `n` tokens at `slots` do not hold, byte for byte in every layer,
    the K/V in `expected` (a `cpu_gather` of n tokens taken earlier, e.g. of copy sources)."""
    num_tokens = slots.numel()
    mismatched = torch.zeros(num_tokens, dtype=torch.bool)
    for want, have in zip(expected, cpu_gather(kv_caches, slots, index_map)):
        mismatched |= (want.view(torch.uint8).view(num_tokens, -1) != have.view(torch.uint8).view(num_tokens, -1)).any(dim=1)
    return mismatched.numpy()


def cpu_gather(kv_caches: list[torch.Tensor], slots: torch.Tensor, index_map: torch.Tensor) -> list[torch.Tensor]:
    """The K/V elements of the tokens at `slots`, per distinct layer tensor (copies)."""
    indices = cpu_element_indices(slots, index_map, kv_caches[0].shape[1]).view(-1)
    return [kv.view(-1)[indices].clone() for kv in _distinct(kv_caches)]


def cuda_slot_copy(kv_caches: list[torch.Tensor], src_slots: torch.Tensor, dst_slots: torch.Tensor,
                   block_size: int) -> int:
    """The same on the flash-attention layouts `[2, num_blocks, block_size, num_kv_heads, head_dim]`
    (NHD) or `[2, num_blocks, num_kv_heads, block_size, head_dim]` (HND). Returns bytes copied."""
    if src_slots.numel() == 0:
        return 0
    num_bytes = 0
    src_blocks, src_offsets = src_slots // block_size, src_slots % block_size
    dst_blocks, dst_offsets = dst_slots // block_size, dst_slots % block_size
    for kv in _distinct(kv_caches):
        if kv.dim() != 5 or kv.shape[0] != 2:
            raise RuntimeError(f"unsupported CUDA KV cache shape {tuple(kv.shape)}; expected [2, blocks, ...]")
        if kv.shape[2] == block_size:  # NHD: a token is a [num_kv_heads, head_dim] row
            kv[:, dst_blocks, dst_offsets] = kv[:, src_blocks, src_offsets]
        elif kv.shape[3] == block_size:  # HND
            kv[:, dst_blocks, :, dst_offsets] = kv[:, src_blocks, :, src_offsets]
        else:
            raise RuntimeError(f"CUDA KV cache shape {tuple(kv.shape)} has no block_size {block_size} dimension")
        num_bytes += 2 * src_slots.numel() * (kv[0, 0].numel() // block_size) * kv.element_size()
    return num_bytes


def _distinct(kv_caches: list[torch.Tensor]) -> list[torch.Tensor]:
    """Layers that share one KV tensor (KV sharing) are copied once."""
    seen: set[int] = set()
    distinct = []
    for kv in kv_caches:
        if kv.data_ptr() not in seen:
            seen.add(kv.data_ptr())
            distinct.append(kv)
    return distinct
