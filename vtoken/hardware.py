"""GPU catalog (memory, HBM bandwidth, dense bf16 FLOP/s) and how many KV blocks fit on a GPU.

Catalog only: probing a live GPU (NVML) lives elsewhere, so that this module imports nothing
heavier than the standard library.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from vtoken.errors import ConfigError
from vtoken.model_spec import ModelSpec

MiB = 2**20
GiB = 2**30


@dataclass(frozen=True)
class GpuSpec:
    name: str
    # The total the driver reports (nvidia-smi "memory.total", torch.cuda.mem_get_info), which is
    # what vLLM's gpu_memory_utilization is a fraction of; not the marketing GB figure.
    memory_bytes: int
    hbm_bytes_per_s: float
    bf16_flop_per_s: float  # dense tensor-core peak, no sparsity


GPUS: dict[str, GpuSpec] = {
    spec.name: spec
    for spec in (
        # "80GB HBM3": nvidia-smi shows 81559 MiB (79.6 GiB, 85.5e9 bytes). SXM5 numbers.
        GpuSpec("h100-80gb", 81559 * MiB, 3.35e12, 989e12),
        # "141GB HBM3e": nvidia-smi shows 143771 MiB (140.4 GiB).
        GpuSpec("h200", 143771 * MiB, 4.8e12, 989e12),
        # A100-SXM4-80GB: nvidia-smi shows 81920 MiB (exactly 80 GiB).
        GpuSpec("a100-80gb", 81920 * MiB, 2.039e12, 312e12),
        # "48GB GDDR6": nvidia-smi shows 46068 MiB (45.0 GiB).
        GpuSpec("l40s", 46068 * MiB, 864e9, 362e12),
    )
}

# Normalized names (lowercase, "nvidia" and separators removed) each catalog entry accepts.
# Variants with other memory or bandwidth (H100 PCIe/NVL, A100 40GB) deliberately do not match.
_GPU_NAME_PATTERNS = {
    "h100-80gb": r"h100(sxm5?)?(80gb)?(hbm3)?",
    "h200": r"h200(sxm5?)?(141gb)?(hbm3e)?",
    "a100-80gb": r"a100(sxm4?)?80gb(hbm2e)?",
    "l40s": r"l40s(48gb)?",
}

# Memory vLLM-style engines keep outside the KV cache besides the weights: activations of the
# largest batch, CUDA graphs, the NCCL/cuBLAS workspaces and allocator fragmentation.
# 2 GiB is a typical measured total for a 7-8B model at default settings.
DEFAULT_RESERVE_BYTES = 2 * GiB


def resolve_gpu(name: str) -> GpuSpec:
    """A catalog GPU by a loose name: "H100", "h100-80gb", "NVIDIA H100 80GB HBM3" all match.

    Raises ConfigError for names not in the catalog, listing the names it knows.
    """
    normalized = re.sub(r"[^a-z0-9]", "", name.lower()).removeprefix("nvidia")
    for key, pattern in _GPU_NAME_PATTERNS.items():
        if re.fullmatch(pattern, normalized):
            return GPUS[key]
    raise ConfigError(f"unknown GPU {name!r}; choose one of {', '.join(GPUS)}")


def num_blocks_for_gpu(
    model: ModelSpec,
    gpu: GpuSpec,
    gpu_mem_util: float,
    block_size: int,
    *,
    reserve_bytes: int = DEFAULT_RESERVE_BYTES,
) -> int:
    """KV blocks that fit: floor((memory * gpu_mem_util - weights - reserve) / bytes per block).

    Raises ConfigError when gpu_mem_util is outside (0, 1], block_size is not positive, or the
    weights and reserve leave no room for a single block. The messages name the quantities, not
    this function's parameters: a CLI flag or a TOML key checks its own value first.
    """
    if not 0 < gpu_mem_util <= 1:
        raise ConfigError(f"the GPU memory fraction (vLLM's gpu_memory_utilization) must be in (0, 1], "
                          f"got {gpu_mem_util!r}")
    if block_size <= 0:
        raise ConfigError(f"block_size must be > 0, got {block_size!r}")
    budget_bytes = math.floor(gpu.memory_bytes * gpu_mem_util)
    kv_bytes = budget_bytes - model.weight_bytes - reserve_bytes
    num_blocks = kv_bytes // model.kv_bytes_per_block(block_size)
    if num_blocks <= 0:
        raise ConfigError(
            f"{model.name} does not fit on {gpu.name} at a GPU memory fraction of {gpu_mem_util}: "
            f"{budget_bytes / GiB:.1f} GiB usable - {model.weight_bytes / GiB:.1f} GiB weights "
            f"- {reserve_bytes / GiB:.1f} GiB reserve leaves {kv_bytes / GiB:.2f} GiB, "
            f"less than one {block_size}-token block ({model.kv_bytes_per_block(block_size) / MiB:.1f} MiB)"
        )
    return num_blocks
