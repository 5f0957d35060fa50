"""Token copies in vLLM's CPU KV layout, byte for byte against the kernel that writes the cache."""

from __future__ import annotations

import pytest

from tests.vllm_tier.conftest import VLLM_MISSING, VLLM_PROBE

pytest.importorskip(VLLM_PROBE, reason=VLLM_MISSING)

import torch  # noqa: E402

import vllm._custom_ops  # noqa: E402,F401  (registers torch.ops._C)
from vtoken.engine.vllm.kv_layout import cpu_copied_correctly, cpu_gather, cpu_index_map, cpu_slot_copy  # noqa: E402

NUM_BLOCKS, NUM_KV_HEADS = 6, 2


def write(cache: torch.Tensor, isa: str, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor) -> None:
    num_blocks, num_heads, block_size, width = cache.shape
    key_cache, value_cache = cache.view(num_blocks, num_heads, 2 * block_size, width // 2).chunk(2, dim=2)
    torch.ops._C.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, isa, 1.0, 1.0, "auto")


def as_bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


@pytest.mark.parametrize("isa, dtype, head_dim", [
    ("vec", torch.float32, 32), ("vec", torch.float32, 64), ("vec", torch.bfloat16, 64), ("vec16", torch.float32, 32),
])
def test_copy_matches_the_kernel_writing_at_the_destination(isa, dtype, head_dim):
    block_size = 32
    g = torch.Generator().manual_seed(0)
    num_tokens = 40
    key = torch.randn(num_tokens, NUM_KV_HEADS, head_dim, generator=g).to(dtype)
    value = torch.randn(num_tokens, NUM_KV_HEADS, head_dim, generator=g).to(dtype)
    slots = torch.randperm(NUM_BLOCKS * block_size, generator=g)[: 2 * num_tokens]
    src, dst = slots[:num_tokens], slots[num_tokens:]
    moved = torch.zeros(NUM_BLOCKS, NUM_KV_HEADS, block_size, 2 * head_dim, dtype=dtype)
    expected = moved.clone()
    write(moved, isa, key, value, src)
    cpu_slot_copy([moved], src, dst, cpu_index_map(isa, block_size, head_dim, dtype))
    write(expected, isa, key, value, src)
    write(expected, isa, key, value, dst)
    assert torch.equal(as_bits(moved), as_bits(expected))


def test_a_slot_may_be_a_source_and_a_destination_in_one_copy():
    isa, dtype, head_dim, block_size = "vec", torch.float32, 32, 32
    g = torch.Generator().manual_seed(1)
    key = torch.randn(3, NUM_KV_HEADS, head_dim, generator=g)
    value = torch.randn(3, NUM_KV_HEADS, head_dim, generator=g)
    cache = torch.zeros(NUM_BLOCKS, NUM_KV_HEADS, block_size, 2 * head_dim, dtype=dtype)
    write(cache, isa, key, value, torch.tensor([5, 6, 7]))
    cpu_slot_copy([cache], torch.tensor([6, 7]), torch.tensor([5, 6]), cpu_index_map(isa, block_size, head_dim, dtype))
    expected = torch.zeros_like(cache)
    write(expected, isa, key[[1, 2, 2]], value[[1, 2, 2]], torch.tensor([5, 6, 7]))
    assert torch.equal(as_bits(cache), as_bits(expected))


def test_a_lost_copy_is_detected():
    isa, dtype, head_dim, block_size = "vec", torch.float32, 32, 32
    index_map = cpu_index_map(isa, block_size, head_dim, dtype)
    g = torch.Generator().manual_seed(2)
    cache = torch.zeros(NUM_BLOCKS, NUM_KV_HEADS, block_size, 2 * head_dim, dtype=dtype)
    write(cache, isa, torch.randn(2, NUM_KV_HEADS, head_dim, generator=g), torch.randn(2, NUM_KV_HEADS, head_dim, generator=g),
          torch.tensor([3, 4]))
    src, dst = torch.tensor([3, 4]), torch.tensor([40, 41])
    before = cpu_gather([cache], src, index_map)
    assert not cpu_copied_correctly([cache], src, dst, index_map, before)  # nothing copied yet
    cpu_slot_copy([cache], src, dst, index_map)
    assert cpu_copied_correctly([cache], src, dst, index_map, before)
