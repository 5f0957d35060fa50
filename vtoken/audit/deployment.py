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

A vToken server (`vtoken_info`): its policy, budget and eviction interval are replayed unless
the settings give them, and `Deployment.measured` holds the waste it measured (vtoken.audit.loop).
The model's geometry and the block budget are resolved in sizing.py.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

import vtoken
from vtoken.audit.loop import MeasuredWaste, ServerVToken, measure_server_waste, server_vtoken
from vtoken.audit.sizing import (  # noqa: F401 -- MAX_RESERVE_BYTES, KV_BYTES_MISMATCH: vtoken.audit exports them
    KV_BYTES_MISMATCH, MAX_RESERVE_BYTES, key_phrase, kv_pool_notes, max_model_len, resolve_model_of, resolve_num_blocks,
)
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
    VLLM_RECLAIM_INTERVAL_STEPS,
)
from vtoken.endpoint import OLD_SERVER_HINT, LiveState, scrape
from vtoken.http_get import redact_url
from vtoken.errors import ConfigError, EndpointError
from vtoken.hardware import GpuSpec
from vtoken.kv.reclaim import ReclaimConfig
from vtoken.model_spec import ModelSpec
from vtoken.policies import DEFAULT_AUDIT_POLICIES, resolve_policy_name
from vtoken.policies.base import Budget
from vtoken.trace import Trace, load_trace, within_context

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
    measured: MeasuredWaste | None = None  # a vToken server's own waste figures (vtoken.audit.loop)
    reclaim: ReclaimConfig = field(default_factory=ReclaimConfig)  # of the vtoken replays

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
    server, later = _server_workload(settings.endpoint_url, live, settings, overrides.timeout_s or settings.timeout_s)
    return _build_replicas(settings, (live, later), server, per_engine), live


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
    server, later = _server_workload(url, live, settings, timeout_s, later)
    return _build_replicas(settings, (live, later), server, per_engine), live


def _taken(scraped: LiveState | EndpointError) -> LiveState:
    if isinstance(scraped, EndpointError):
        raise scraped
    return scraped


def _server_workload(url: str, live: LiveState, s: Settings, timeout_s: float,
                     later: LiveState | None = None) -> tuple[ServerWorkload | None, LiveState | None]:
    """(the server's workload when the audit replays it, i.e. no trace given; the scrape
    `s.window_s` after `live`, None without a window). The second scrape (`later`, else taken
    now) gives the rates, and a vToken server's waste over the window."""
    if s.window_s is None:
        return (derive_server_workload(live) if s.trace is None else None), None
    if later is None:
        time.sleep(max(0.0, live.scraped_at_s + s.window_s - time.monotonic()))
        later = scrape(url, timeout_s)
    return (derive_server_workload(live, later) if s.trace is None else None), later


def _build_replicas(s: Settings, scrapes: tuple[LiveState, LiveState | None], server: ServerWorkload | None,
                    per_engine: bool) -> tuple[Deployment, ...]:
    """`scrapes`: the server's first scrape and the one a window later (None without a window)."""
    live, later = scrapes
    if server is None or not per_engine or len(server.replicas) == 1:
        return (_build(s, live, server, server.total if server is not None else None, later=later),)
    return tuple(_build(replace(s, where=f"{s.where} engine {r.engine}"), live, server, r, later=later)
                 for r in server.replicas)


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
           replica: ReplicaWorkload | None = None, *, later: LiveState | None = None) -> Deployment:
    notes = list(s.notes)
    model = resolve_model_of(s, notes)
    vtoken_server = server_vtoken(later or live) if live is not None else None
    gpu = lookup_gpu(s.gpu or DEFAULT_GPU, key_phrase(s, "engine.gpu", "--gpu"))
    if s.gpu is None:
        notes.append(f"step times modelled on {gpu.name} (default; memory figures barely depend on it)")
    block_size = s.block_size or DEFAULT_BLOCK_SIZE
    if s.block_size is None:
        notes.append(f"block size {block_size} tokens (vLLM's default)")
    num_blocks = resolve_num_blocks(s, model, gpu, block_size, notes)
    if live is not None:
        notes += kv_pool_notes(live, model, s)
    policies, budget, interval_tokens = _eviction(s, vtoken_server, notes)
    reclaim = _reclaim(vtoken_server, notes)
    return Deployment(
        source=s.where, model=model, gpu=gpu, block_size=block_size, num_blocks=num_blocks, policies=policies,
        budget=budget, interval_tokens=interval_tokens,
        workload=replace(_workload(s, server, replica, notes), max_model_len=max_model_len(model, live)),
        frontier_max_concurrency=s.frontier_max_concurrency or DEFAULT_FRONTIER_MAX_CONCURRENCY,
        seed=s.seed, notes=tuple(notes),
        measured=measure_server_waste(live, later, model.kv_bytes_per_token) if vtoken_server is not None else None,
        reclaim=reclaim,
    )


def _reclaim(server: ServerVToken | None, notes: list[str]) -> ReclaimConfig:
    """The reclaimer of the vtoken replays: a vToken server's mode and theta_F, checked every
    step as inside vLLM (defaults.VLLM_RECLAIM_INTERVAL_STEPS); else the sim's defaults."""
    if server is None or server.reclaim_mode is None or server.theta_f is None:
        return ReclaimConfig()
    notes.append(f"vtoken replays reclaim as the server does: {server.reclaim_mode}, theta_F {server.theta_f:g} "
                 f"(vtoken_info), checked every {VLLM_RECLAIM_INTERVAL_STEPS} step (vLLM's default; the server's "
                 "own check interval is not exported)")
    return ReclaimConfig(server.reclaim_mode, server.theta_f, check_interval_steps=VLLM_RECLAIM_INTERVAL_STEPS)


def _eviction(s: Settings, server: ServerVToken | None, notes: list[str]) -> tuple[tuple[str, ...], Budget, int]:
    """(policies, budget, interval): the settings', else a vToken server's own (vtoken_info), else the defaults."""
    if server is not None and server.policy is not None and s.policies is None:
        policies = (resolve_policy_name(server.policy),)
    else:
        policies = tuple(dict.fromkeys(resolve_policy_name(p) for p in s.policies or DEFAULT_AUDIT_POLICIES))
    evicts = server is not None and server.policy is not None
    if s.budget is None and evicts and server.budget is not None:
        budget = server.budget
    else:
        budget = parse_budget(s.budget or DEFAULT_BUDGET, key_phrase(s, "eviction.budget", "--budget"))
    interval_tokens = s.interval_tokens or (server.interval_tokens if evicts else None) or DEFAULT_INTERVAL_TOKENS
    if evicts:
        taken = [what for what, flag in (("policy", s.policies), ("budget", s.budget), ("eviction interval",
                 s.interval_tokens)) if flag is None]
        if taken:
            notes.append(f"{' and '.join(taken)} as the server runs them (vtoken_info: {server.variant}, "
                         f"{server.policy}, {budget.describe()}, every {interval_tokens} tokens)")
    return policies, budget, interval_tokens


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
