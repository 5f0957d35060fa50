"""Resolving what an audit is about: settings (TOML, flags) and the live server into one
`Deployment` (model, GPU, block budget, policies, budget, `Workload`), with a note for every
default taken and every disagreement found.

    resolve_deployment(target, overrides)
        TOML path -> load_settings -> [endpoint.url: scrape, fill gaps] -> apply flags -> build
        URL       -> scrape -> fill from the server -> apply flags -> build
    resolve_replicas(target, overrides)      the same, one Deployment per engine of the server

The workload (`Workload.source`): the trace given ("trace"); else, when a server is read, what
it has served ("server": `vtoken.audit.workload` derives it from the scrape, or from two
scrapes `window_s` apart); else, or when the server has finished no request yet, the bundled
sample ("bundled-sample", with a note saying why).
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path

import vtoken
from vtoken.audit.settings import DEFAULT_TIMEOUT_S, Overrides, Settings, load_settings, lookup_gpu, parse_budget
from vtoken.audit.workload import (
    MAX_SYNTHETIC_REQUESTS, ReplicaWorkload, ServerWorkload, derive_server_workload, synthetic_traces,
)
from vtoken.defaults import (  # the names vtoken.audit has always exported
    BLOCK_SIZE as DEFAULT_BLOCK_SIZE,
    BUDGET as DEFAULT_BUDGET,
    CONCURRENCY as DEFAULT_CONCURRENCY,
    EVICTION_INTERVAL_TOKENS as DEFAULT_INTERVAL_TOKENS,
    FRONTIER_MAX_CONCURRENCY as DEFAULT_FRONTIER_MAX_CONCURRENCY,
    GPU as DEFAULT_GPU,
    GPU_MEMORY_UTILIZATION as DEFAULT_GPU_MEMORY_UTILIZATION,
    SAMPLE_TRACE,
    SEED,
)
from vtoken.endpoint import OLD_SERVER_HINT, LiveState, redact_url, scrape
from vtoken.errors import ConfigError, EndpointError
from vtoken.hardware import GiB, GpuSpec, num_blocks_for_gpu
from vtoken.model_spec import DTYPE_BYTES, ModelSpec, resolve_model
from vtoken.policies import DEFAULT_AUDIT_POLICIES, resolve_policy_name
from vtoken.policies.base import Budget
from vtoken.trace import Trace, load_trace, within_context

# vLLM fills gpu_memory_utilization x memory with weights, KV and a reserve (activations, CUDA
# graphs, workspaces); num_gpu_blocks beside a GPU is contradictory outside this reserve range.
MAX_RESERVE_BYTES = 8 * GiB
# A server KV pool whose bytes per token differ this much from the model's is worth a note.
KV_BYTES_MISMATCH = 0.10

_TOML_KEYS = {"model": "model.name", "dtype": "model.dtype", "block_size": "engine.block_size",
              "num_gpu_blocks": "engine.num_gpu_blocks"}


@dataclass(frozen=True)
class Workload:
    """What the audit replays: a trace file, or (`replica` set) the workload a server served."""

    trace_path: Path | None  # None for a server's workload
    format: str = "auto"
    time_unit: str | None = None
    max_requests: int | None = None
    concurrency: int = DEFAULT_CONCURRENCY
    is_bundled_sample: bool = False
    server: ServerWorkload | None = None  # the server's workload, when one was read
    replica: ReplicaWorkload | None = None  # the part of it replayed (an engine, or all); None: a file
    seed: int = SEED  # of the synthetic trace
    notes: tuple[str, ...] = ()  # why this workload, what was assumed
    max_model_len: int | None = None  # tokens; a trace file's longer requests are skipped (None: keep all)

    @property
    def source(self) -> str:
        """"server", "trace" or "bundled-sample"."""
        if self.replica is not None:
            return "server"
        return "bundled-sample" if self.is_bundled_sample else "trace"


@dataclass(frozen=True)
class Deployment:
    """A resolved deployment: everything the measurement needs, no credentials."""

    source: str  # the TOML path, or the server's URL with credentials removed
    model: ModelSpec
    gpu: GpuSpec  # of the sim cost model (step times); memory figures hardly depend on it
    block_size: int  # tokens
    num_blocks: int  # the KV block budget
    policies: tuple[str, ...]
    budget: Budget
    interval_tokens: int
    workload: Workload
    frontier_max_concurrency: int = DEFAULT_FRONTIER_MAX_CONCURRENCY
    seed: int = SEED
    notes: tuple[str, ...] = ()

    @property
    def kv_bytes_per_block(self) -> int:
        return self.model.kv_bytes_per_block(self.block_size)


def resolve_deployment(target: str, overrides: Overrides) -> tuple[Deployment, LiveState | None]:
    """Read the TOML file or scrape the server at `target`, apply `overrides`, resolve the rest.

    A server with several engines is one deployment here, its workload theirs together on one
    engine's pool; `resolve_replicas` gives one deployment per engine.
    """
    deployments, live = resolve_replicas(target, overrides, per_engine=False)
    return deployments[0], live


@dataclass(frozen=True)
class Scrapes:
    """A server's scrapes taken beforehand (several replicas' windows at the same moments): the
    first, and the one `window_s` later (None without a window); an EndpointError where one failed."""

    first: LiveState | EndpointError
    later: LiveState | EndpointError | None = None


def resolve_replicas(target: str, overrides: Overrides, per_engine: bool = True,
                     scrapes: Scrapes | None = None) -> tuple[tuple[Deployment, ...], LiveState | None]:
    """`resolve_deployment`, with one Deployment per engine of a data-parallel server (when
    `per_engine` and the workload is the server's; else one). A URL's `scrapes`, when given, are
    used instead of scraping it."""
    if "://" in target:
        return _from_server(target, overrides, per_engine, scrapes)
    path = Path(target)
    if path.is_dir():
        raise ConfigError(f"{target}: is a directory; DEPLOYMENT is a TOML file or the "
                          "http:// or https:// URL of a vLLM server")
    if not path.is_file():
        raise ConfigError(f"{redact_url(target)}: no such file; DEPLOYMENT is a TOML file or the "
                          "http:// or https:// URL of a vLLM server")
    settings = load_settings(path)
    if settings.endpoint_url is None:
        return (_build(_apply(settings, overrides), None),), None
    live = scrape(settings.endpoint_url, overrides.timeout_s or settings.timeout_s)
    settings = _apply(_fill_from_server(settings, live), overrides)
    server = _server_workload(settings.endpoint_url, live, settings, overrides.timeout_s or settings.timeout_s)
    return _build_replicas(settings, live, server, per_engine), live


def load_workload(workload: Workload) -> Trace:
    """The workload's trace (for a server's workload: the synthetic "mid" trace); the bundled
    sample must exist when it is the default."""
    return workload_traces(workload)["mid"]


def workload_traces(workload: Workload) -> dict[str, Trace]:
    """{"mid": the trace}, and for a server's workload also "low" and "high": the same requests
    at their buckets' lower and upper bounds (vtoken.audit.workload). A trace file loses the
    requests longer than `workload.max_model_len` (with a note): the server would refuse them."""
    if workload.replica is not None:
        num_requests = min(workload.replica.num_requests_observed, MAX_SYNTHETIC_REQUESTS,
                           workload.max_requests or MAX_SYNTHETIC_REQUESTS)
        return synthetic_traces(workload.server, workload.replica, num_requests, workload.seed)
    if workload.is_bundled_sample and not workload.trace_path.is_file():
        raise ConfigError(f"the bundled sample trace is missing ({workload.trace_path}); give "
                          "workload.trace or --trace")
    trace = load_trace(workload.trace_path, workload.format, time_unit=workload.time_unit,
                       max_requests=workload.max_requests)
    return {"mid": within_context(trace, workload.max_model_len)}


def bundled_sample_path() -> Path:
    return Path(vtoken.__file__).resolve().parent.parent / "sample_traces" / SAMPLE_TRACE


# ---- the server, the flags -----------------------------------------------------------------------


def _from_server(url: str, overrides: Overrides, per_engine: bool,
                 scrapes: Scrapes | None) -> tuple[tuple[Deployment, ...], LiveState | None]:
    shown = redact_url(url)
    timeout_s = overrides.timeout_s or DEFAULT_TIMEOUT_S
    try:
        live = scrape(url, timeout_s) if scrapes is None else _taken(scrapes.first)
    except EndpointError as exc:
        # An older server has no cache config; the flags can supply it (its load is then unread).
        supplied = None not in (overrides.block_size, overrides.num_gpu_blocks, overrides.model)
        if OLD_SERVER_HINT not in str(exc) or not supplied:
            raise
        note = f"{shown} has no vllm:cache_config_info; --block-size, --num-blocks and --model supply it"
        return (_build(_apply(Settings(shown, "server", notes=(note,)), overrides), None),), None
    settings = _apply(_fill_from_server(Settings(live.url, "server"), live), overrides)
    later = None if scrapes is None or scrapes.later is None else _taken(scrapes.later)
    server = _server_workload(url, live, settings, timeout_s, later)
    return _build_replicas(settings, live, server, per_engine), live


def _taken(scraped: LiveState | EndpointError) -> LiveState:
    if isinstance(scraped, EndpointError):
        raise scraped
    return scraped


def _server_workload(url: str, live: LiveState, s: Settings, timeout_s: float,
                     later: LiveState | None = None) -> ServerWorkload | None:
    """The server's workload when the audit replays it (no trace given): `s.window_s` after
    `live`, a second scrape (`later`, else taken now) gives the rates."""
    if s.trace is not None:
        return None
    if s.window_s is not None and later is None:
        time.sleep(max(0.0, live.scraped_at_s + s.window_s - time.monotonic()))
        later = scrape(url, timeout_s)
    return derive_server_workload(live, later if s.window_s is not None else None)


def _build_replicas(s: Settings, live: LiveState, server: ServerWorkload | None,
                    per_engine: bool) -> tuple[Deployment, ...]:
    if server is None or not per_engine or len(server.replicas) == 1:
        return (_build(s, live, server, server.total if server is not None else None),)
    return tuple(_build(replace(s, where=f"{s.where} engine {r.engine}"), live, server, r) for r in server.replicas)


def _fill_from_server(settings: Settings, live: LiveState) -> Settings:
    """Take from the server what the settings leave out; note where they disagree."""
    cache = live.cache_config
    notes = list(settings.notes)
    server = {"model": live.model_name, "block_size": cache.block_size, "num_gpu_blocks": cache.num_gpu_blocks}
    if cache.cache_dtype not in (None, "auto"):
        server["dtype"] = cache.cache_dtype
    changes = {}
    for key, value in server.items():
        mine = getattr(settings, key)
        if key == "model" and settings.geometry is not None:
            continue
        if mine is None and value is not None and not (key == "num_gpu_blocks" and settings.gpu_memory_utilization):
            changes[key] = value
        elif mine is not None and value is not None and str(mine) != str(value) and settings.origin == "toml":
            notes.append(f"{_TOML_KEYS[key]} = {mine} from {settings.where}, the server has {value}; the audit uses {mine}")
    return replace(settings, notes=tuple(notes), **changes)


def _apply(settings: Settings, overrides: Overrides) -> Settings:
    changes = {f.name: getattr(overrides, f.name) for f in fields(overrides)
               if f.name != "timeout_s" and getattr(overrides, f.name) is not None}
    if overrides.model is not None:
        changes["geometry"] = None
    if overrides.num_gpu_blocks is not None:
        changes["gpu_memory_utilization"] = None  # the flag replaces a GPU-derived budget
    if overrides.trace is not None:
        changes.setdefault("trace_format", None)
        changes.setdefault("time_unit", None)
    return replace(settings, **changes)


# ---- resolution -------------------------------------------------------------------------------


def _build(s: Settings, live: LiveState | None, server: ServerWorkload | None = None,
           replica: ReplicaWorkload | None = None) -> Deployment:
    notes = list(s.notes)
    model = _model(s, notes)
    gpu = lookup_gpu(s.gpu or DEFAULT_GPU, _key(s, "engine.gpu", "--gpu"))
    if s.gpu is None:
        notes.append(f"step times modelled on {gpu.name} (default; memory figures barely depend on it)")
    block_size = s.block_size or DEFAULT_BLOCK_SIZE
    if s.block_size is None:
        notes.append(f"block size {block_size} tokens (vLLM's default)")
    num_blocks = _num_blocks(s, model, gpu, block_size, notes)
    if live is not None:
        notes += _kv_pool_notes(live, model, s)
    policies = tuple(dict.fromkeys(resolve_policy_name(p) for p in s.policies or DEFAULT_AUDIT_POLICIES))
    budget = parse_budget(s.budget or DEFAULT_BUDGET, _key(s, "eviction.budget", "--budget"))
    interval_tokens = s.interval_tokens or DEFAULT_INTERVAL_TOKENS
    return Deployment(
        source=s.where, model=model, gpu=gpu, block_size=block_size, num_blocks=num_blocks, policies=policies,
        budget=budget, interval_tokens=interval_tokens,
        workload=replace(_workload(s, server, replica, notes), max_model_len=_max_model_len(model, live)),
        frontier_max_concurrency=s.frontier_max_concurrency or DEFAULT_FRONTIER_MAX_CONCURRENCY,
        seed=s.seed, notes=tuple(notes),
    )


def _max_model_len(model: ModelSpec, live: LiveState | None) -> int | None:
    """The context the replayed requests must fit: the server's (/v1/models) when it says, else
    the model's (max_position_embeddings); None when neither is known."""
    if live is not None and live.max_model_len is not None:
        return live.max_model_len
    return model.max_model_len


def _model(s: Settings, notes: list[str]) -> ModelSpec:
    dtype_bytes = _dtype_bytes(s) if s.dtype is not None else None
    if s.geometry is not None:
        return _explicit_model(s.geometry, dtype_bytes or 2, notes)
    if s.model is None:
        raise ConfigError(f"{s.where}: no model; " + _key(s, "give model.name, model.config or model.num_layers/num_kv_heads/head_dim",
                                                             "the server names none: pass --model or --model-config"))
    try:
        return resolve_model(s.model, dtype_bytes)
    except ConfigError as exc:
        if s.origin == "server" and "unknown model" in str(exc):
            raise ConfigError(f"the server's model {s.model!r} is not in the catalog; pass --model NAME or "
                              "--model-config PATH (an HF config.json)") from None
        raise ConfigError(f"{s.where}: {_key(s, 'model.name', '--model')}: {exc}") from None


def _explicit_model(geometry: Mapping[str, int], dtype_bytes: int, notes: list[str]) -> ModelSpec:
    num_attention_heads = geometry.get("num_attention_heads", geometry["num_kv_heads"])
    hidden_size = geometry.get("hidden_size", num_attention_heads * geometry["head_dim"])
    num_params = geometry.get("num_params")
    if num_params is None:
        num_params = 12 * geometry["num_layers"] * hidden_size**2
        notes.append(f"num_params estimated as 12 x layers x hidden^2 = {num_params / 1e9:.2f} B "
                     "(affects step times only)")
    name = f"custom ({geometry['num_layers']} layers, {geometry['num_kv_heads']} KV heads x {geometry['head_dim']})"
    return ModelSpec(name, geometry["num_layers"], geometry["num_kv_heads"], geometry["head_dim"],
                     num_attention_heads, hidden_size, num_params, dtype_bytes)


def _dtype_bytes(s: Settings) -> int:
    name = s.dtype.lower().removeprefix("torch.")
    if name not in DTYPE_BYTES:
        raise ConfigError(f"{s.where}: {_key(s, 'model.dtype', 'the server cache_dtype')} must be one of "
                          f"{', '.join(DTYPE_BYTES)}, got {s.dtype!r}")
    return DTYPE_BYTES[name]


def _num_blocks(s: Settings, model: ModelSpec, gpu: GpuSpec, block_size: int, notes: list[str]) -> int:
    util = s.gpu_memory_utilization
    if s.num_gpu_blocks is not None:
        if s.gpu is not None and util is not None:
            _check_consistent(s, model, gpu, block_size)
        return s.num_gpu_blocks
    if s.gpu is None:
        raise ConfigError(f"{s.where}: no KV block budget; " + _key(
            s, "give engine.num_gpu_blocks, or engine.gpu (with engine.gpu_memory_utilization)", "pass --num-blocks"))
    if util is None:
        util = DEFAULT_GPU_MEMORY_UTILIZATION
        notes.append(f"gpu_memory_utilization {util} (vLLM's default)")
    num_blocks = num_blocks_for_gpu(model, gpu, util, block_size)
    notes.append(f"{num_blocks} blocks = ({gpu.name} memory x {util} - weights - 2 GiB reserve) / block bytes")
    return num_blocks


def _check_consistent(s: Settings, model: ModelSpec, gpu: GpuSpec, block_size: int) -> None:
    """num_gpu_blocks beside gpu + gpu_memory_utilization must leave a 0-8 GiB reserve."""
    usable = math.floor(gpu.memory_bytes * s.gpu_memory_utilization) - model.weight_bytes
    reserve = usable - s.num_gpu_blocks * model.kv_bytes_per_block(block_size)
    if 0 <= reserve <= MAX_RESERVE_BYTES:
        return
    expected = num_blocks_for_gpu(model, gpu, s.gpu_memory_utilization, block_size) if usable > 2 * GiB else 0
    raise ConfigError(
        f"{s.where}: engine.num_gpu_blocks = {s.num_gpu_blocks} disagrees with engine.gpu = {s.gpu!r} at "
        f"engine.gpu_memory_utilization = {s.gpu_memory_utilization}: it leaves {reserve / GiB:.1f} GiB for neither "
        f"weights nor KV (expected 0-{MAX_RESERVE_BYTES // GiB} GiB, about {expected} blocks); give one or the other")


def _kv_pool_notes(live: LiveState, model: ModelSpec, s: Settings) -> list[str]:
    cache = live.cache_config
    if None in (cache.kv_cache_memory_bytes, cache.num_gpu_blocks, cache.block_size):
        return []
    server_bytes = cache.kv_cache_memory_bytes / (cache.num_gpu_blocks * cache.block_size)
    if abs(server_bytes - model.kv_bytes_per_token) <= KV_BYTES_MISMATCH * model.kv_bytes_per_token:
        return []
    return [f"the server's KV pool ({cache.kv_cache_memory_bytes / GiB:.2f} GiB for {cache.num_gpu_blocks} blocks of "
            f"{cache.block_size} tokens) is {server_bytes:.0f} bytes/token, {model.name} needs "
            f"{model.kv_bytes_per_token}: check {_key(s, 'model', '--model')} (tensor parallelism splits it)"]


def _workload(s: Settings, server: ServerWorkload | None, replica: ReplicaWorkload | None,
              notes: list[str]) -> Workload:
    """The trace given, else the server's workload, else the bundled sample (module docstring).
    Appends to `notes` why the bundled sample or which concurrency was taken."""
    if s.trace is None and replica is not None and replica.num_requests_observed > 0:
        concurrency, why = _server_concurrency(s, server, replica)
        if why is not None:
            notes.append(why)
        return Workload(trace_path=None, max_requests=s.max_requests, concurrency=concurrency, server=server,
                        replica=replica, seed=s.seed, notes=replica.notes)
    workload_notes = ()
    if s.trace is None and replica is not None:
        workload_notes = (f"{s.where} has finished no request yet (vllm:request_prompt_tokens_count is 0): "
                          "replaying the bundled sample instead of its workload",)
        notes += workload_notes
    is_sample = s.trace is None
    return Workload(
        trace_path=bundled_sample_path() if is_sample else s.trace,
        format=s.trace_format or "auto",
        time_unit=s.time_unit,
        max_requests=s.max_requests,
        concurrency=s.concurrency or DEFAULT_CONCURRENCY,
        is_bundled_sample=is_sample,
        seed=s.seed,
        notes=workload_notes,
    )


def _server_concurrency(s: Settings, server: ServerWorkload, replica: ReplicaWorkload) -> tuple[int, str | None]:
    """(closed-loop clients, a note on where they come from): the flag, else what the server runs."""
    if s.concurrency is not None:
        return s.concurrency, None
    seen = replica.concurrency
    if seen is None or round(seen) < 1:
        return DEFAULT_CONCURRENCY, (f"the server had no request in flight: {DEFAULT_CONCURRENCY} closed-loop "
                                     "clients (default; --concurrency sets them)")
    how = ("its mean requests in flight over the window (Little's law: e2e seconds / window seconds)"
           if server.window_s is not None else "requests running + waiting at the scrape")
    per = " per engine" if replica.engine == "all" and len(server.replicas) > 1 else ""
    return round(seen), f"{round(seen)} closed-loop clients{per}: the server's {how}"


def _key(s: Settings, toml_phrase: str, server_phrase: str) -> str:
    return toml_phrase if s.origin == "toml" else server_phrase
