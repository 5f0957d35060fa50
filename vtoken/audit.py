"""`vtoken audit`: the KV memory token-level eviction would trap on one deployment, and what
vToken would recover.

    audit(target) = resolve_deployment(target)      TOML file, or a running vLLM server's /metrics
                  -> load_workload(...)             the deployment's trace, or the bundled sample
                  -> measure(...)                   per policy: native / naive-evict / vtoken
                  -> AuditReport (+ NVML, verdict)  report_to_json() is the `--json` object

A deployment TOML (every unknown section or key is an error; paths are relative to the file):

    [model]     name = "llama-3.1-8b"          a catalog name or HF id, or
                config = "config.json"          an HF config.json, or
                num_layers, num_kv_heads, head_dim (+ num_attention_heads, hidden_size,
                num_params);  dtype = "bf16"   the KV cache dtype, in all three forms
    [engine]    block_size = 16
                num_gpu_blocks = 4096           or gpu = "h100" + gpu_memory_utilization = 0.9
    [eviction]  policies = ["h2o", ...]         default DEFAULT_AUDIT_POLICIES
                budget = "50%"                  a keep ratio or a token count
                interval_tokens = 32
    [workload]  trace, format, time_unit, max_requests   default: the bundled Azure sample
                concurrency = 16                closed-loop clients
                frontier_max_concurrency = 64   largest C the capacity search tries
    [endpoint]  url, timeout_s = 5              read the live server too; it supplies what
                                                [model] and [engine] leave out

Every figure is a time-weighted mean of one closed-loop replay (vtoken.metrics). The
definitions that are this module's own (they are in `DEFINITIONS`, printed by the CLI):

- trapped bytes (of a policy): naive-evict's trapped bytes, (allocated blocks x S - live tokens)
  x KV bytes per token: what the policy "freed" that stays allocated.
- reclaimable bytes = max(0, trapped(naive-evict) - trapped(vtoken)): both runs make the same
  eviction decisions, so this is the memory vToken's compaction returns to the free pool on
  average; reclaimable blocks = reclaimable bytes / KV bytes per block.
- room for more requests = floor(reclaimable blocks / vtoken's retained blocks per request).
- max concurrency (per variant): the largest C <= frontier_max_concurrency at which C requests
  all resident from t = 0 never need more blocks than the budget (`analysis.frontier`), found
  by a galloping bisection that assumes feasibility is monotone in C.
"""

from __future__ import annotations

import math
import numbers
import tomllib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import vtoken
from vtoken.analysis import frontier
from vtoken.endpoint import OLD_SERVER_HINT, LiveState, redact_url, scrape
from vtoken.engine import EvictionConfig, RunConfig, run_sim
from vtoken.errors import ConfigError, EndpointError
from vtoken.hardware import GiB, GpuSpec, num_blocks_for_gpu, resolve_gpu
from vtoken.metrics import RunResult
from vtoken.model_spec import DTYPE_BYTES, ModelSpec, resolve_model
from vtoken.nvml import NvmlReport, probe_gpus
from vtoken.policies import DEFAULT_AUDIT_POLICIES, POLICIES
from vtoken.policies.base import Budget
from vtoken.trace import TIME_UNITS, TRACE_FORMATS, Request, Trace, load_trace

SAMPLE_TRACE = "azure_conv_sample.csv"
SAMPLE_ATTRIBUTION = ("bundled sample: 240 requests of the Azure LLM inference trace 2023 (conversation), "
                      "Azure Public Dataset, CC-BY 4.0 (Patel et al., Splitwise, ISCA 2024)")
DEFAULT_GPU = "h100-80gb"
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default
DEFAULT_BLOCK_SIZE = 16
DEFAULT_BUDGET = "50%"
DEFAULT_INTERVAL_TOKENS = 32
DEFAULT_CONCURRENCY = 16
DEFAULT_FRONTIER_MAX_CONCURRENCY = 64
DEFAULT_TIMEOUT_S = 5.0
# vLLM fills gpu_memory_utilization x memory with weights, KV and a reserve (activations, CUDA
# graphs, workspaces); num_gpu_blocks beside a GPU is contradictory outside this reserve range.
MAX_RESERVE_BYTES = 8 * GiB
# A server KV pool whose bytes per token differ this much from the model's is worth a note.
KV_BYTES_MISMATCH = 0.10
AUDIT_VARIANTS = ("native", "naive-evict", "vtoken")

# (JSON key, column name, definition): the CLI prints these, `--json` carries them by key.
DEFINITIONS = (
    ("waste_ratio", "F", "1 - live tokens / (allocated blocks x S), time-weighted (Eq. 1), naive-evict"),
    ("frac_blocks_le_half", "u <= 50%", "fraction of allocated blocks with at most half of their slots live"),
    ("trapped_bytes", "trapped", "naive-evict's (allocated blocks x S - live tokens) x KV bytes per token"),
    ("reclaimable_bytes", "reclaim", "max(0, trapped(naive-evict) - trapped(vtoken)); blocks: / KV bytes per block"),
    ("room_for_more_requests", "room for", "floor(reclaimable blocks / vtoken's retained blocks per request)"),
    ("retained_blocks_per_request", "blocks/req", "allocated blocks per resident request, per variant"),
    ("max_concurrency", "max C", "largest C <= the search cap whose C requests, all resident from t = 0, "
                                 "never need more blocks than the budget (analysis.frontier)"),
)

_POLICY_TITLES = {"h2o": "H2O", "streaming_llm": "StreamingLLM", "scissorhands": "Scissorhands",
                  "random": "Random", "tova": "TOVA"}

AuditProgress = Callable[[str, int, int], None]  # (stage, units done, units in all)


# ---- what an audit is about -------------------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    trace_path: Path
    format: str = "auto"
    time_unit: str | None = None
    max_requests: int | None = None
    concurrency: int = DEFAULT_CONCURRENCY
    is_bundled_sample: bool = False


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
    seed: int = 0
    notes: tuple[str, ...] = ()

    @property
    def kv_bytes_per_block(self) -> int:
        return self.model.kv_bytes_per_block(self.block_size)


@dataclass(frozen=True)
class Overrides:
    """Command-line settings: they replace a TOML's and supply or replace a server's.

    Validated here, under their flag names; a flag value is never checked against the TOML
    value it replaces (`num_gpu_blocks` replaces a GPU-derived budget too).
    """

    model: str | None = None  # catalog name, HF id or path of an HF config.json
    gpu: str | None = None
    block_size: int | None = None
    num_gpu_blocks: int | None = None
    policies: tuple[str, ...] | None = None
    budget: str | None = None
    trace: Path | None = None
    trace_format: str | None = None
    time_unit: str | None = None
    max_requests: int | None = None
    concurrency: int | None = None
    frontier_max_concurrency: int | None = None
    timeout_s: float | None = None
    seed: int | None = None

    def __post_init__(self) -> None:
        for name, flag in (("block_size", "--block-size"), ("num_gpu_blocks", "--num-blocks"),
                           ("max_requests", "--max-requests"), ("concurrency", "--concurrency"),
                           ("frontier_max_concurrency", "--frontier-max")):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ConfigError(f"{flag} must be > 0, got {value}")
        if self.timeout_s is not None and not self.timeout_s > 0:
            raise ConfigError(f"--timeout must be > 0 seconds, got {self.timeout_s}")
        if self.policies is not None:
            _check_policies(self.policies, "--policy")
        if self.budget is not None:
            _parse_budget(self.budget, "--budget")
        if self.gpu is not None:
            resolve_gpu(self.gpu)


@dataclass(frozen=True)
class Capacity:
    max_concurrency: int
    is_lower_bound: bool  # feasible at the search cap: the true maximum is at least this


@dataclass(frozen=True)
class PolicyAudit:
    """One policy on the deployment: the three runs and what vToken recovers (module docstring)."""

    policy: str
    runs: Mapping[str, RunResult]  # native, naive-evict, vtoken; native is shared by all policies
    capacity: Mapping[str, Capacity]
    reclaimable_bytes: float
    reclaimable_blocks: float
    room_for_more_requests: int

    @property
    def evicted(self) -> RunResult:
        """The naive-evict run: the waste the policy leaves without vToken."""
        return self.runs["naive-evict"]


@dataclass(frozen=True)
class AuditReport:
    deployment: Deployment
    live: LiveState | None  # when read from a server
    gpus: NvmlReport
    trace: Trace
    policies: tuple[PolicyAudit, ...]
    verdict: str

    @property
    def is_waste_measured(self) -> bool:
        """The server exports vToken's own metrics: its waste is measured there, not simulated."""
        return self.live is not None and bool(self.live.vtoken_metrics)


# ---- the one entry point ----------------------------------------------------------------------


def audit(target: str, overrides: Overrides | None = None, progress: AuditProgress | None = None) -> AuditReport:
    """Audit the deployment `target` (a TOML path or an http(s):// URL); see the module docstring.

    Raises ConfigError / TraceError / EndpointError (all VTokenError) for any bad input.
    """
    deployment, live = resolve_deployment(target, overrides or Overrides())
    trace = load_workload(deployment.workload)
    policies = measure(deployment, trace.requests, progress)
    return AuditReport(deployment, live, probe_gpus(), trace, policies, verdict(deployment, policies, live))


def resolve_deployment(target: str, overrides: Overrides) -> tuple[Deployment, LiveState | None]:
    """Read the TOML file or scrape the server at `target`, apply `overrides`, resolve the rest."""
    if "://" in target:
        return _from_server(target, overrides)
    path = Path(target)
    if not path.is_file():
        raise ConfigError(f"{redact_url(target)}: no such file; DEPLOYMENT is a TOML file or the "
                          "http:// or https:// URL of a vLLM server")
    settings = load_settings(path)
    live = None
    if settings.endpoint_url is not None:
        live = scrape(settings.endpoint_url, overrides.timeout_s or settings.timeout_s)
        settings = _fill_from_server(settings, live)
    return _build(_apply(settings, overrides), live), live


def load_workload(workload: Workload) -> Trace:
    """The workload's trace; the bundled sample must exist when it is the default."""
    if workload.is_bundled_sample and not workload.trace_path.is_file():
        raise ConfigError(f"the bundled sample trace is missing ({workload.trace_path}); give "
                          "workload.trace or --trace")
    return load_trace(workload.trace_path, workload.format, time_unit=workload.time_unit,
                      max_requests=workload.max_requests)


def bundled_sample_path() -> Path:
    return Path(vtoken.__file__).resolve().parent.parent / "sample_traces" / SAMPLE_TRACE


# ---- settings: the TOML file, the server, the flags ---------------------------------------------

_SCHEMA: dict[str, dict[str, str]] = {
    "model": {"name": "str", "config": "str", "num_layers": "int", "num_kv_heads": "int", "head_dim": "int",
              "num_attention_heads": "int", "hidden_size": "int", "num_params": "int", "dtype": "str"},
    "engine": {"block_size": "int", "num_gpu_blocks": "int", "gpu": "str", "gpu_memory_utilization": "fraction"},
    "eviction": {"policies": "strs", "budget": "budget", "interval_tokens": "int"},
    "workload": {"trace": "str", "format": "str", "time_unit": "str", "max_requests": "int", "concurrency": "int",
                 "frontier_max_concurrency": "int"},
    "endpoint": {"url": "str", "timeout_s": "seconds"},
}
_TOML_KEYS = {"model": "model.name", "dtype": "model.dtype", "block_size": "engine.block_size",
              "num_gpu_blocks": "engine.num_gpu_blocks"}
_GEOMETRY_KEYS = ("num_layers", "num_kv_heads", "head_dim", "num_attention_heads", "hidden_size", "num_params")


@dataclass(frozen=True)
class Settings:
    """Raw deployment settings before resolution; None = not given. `origin` names the keys in
    messages: "toml" (engine.num_gpu_blocks) or "server" (--num-blocks)."""

    where: str  # the TOML path or the redacted server URL
    origin: str = "toml"
    model: str | None = None  # catalog name, HF id or config.json path
    geometry: Mapping[str, int] | None = None  # explicit model.num_layers, ...
    dtype: str | None = None
    block_size: int | None = None
    num_gpu_blocks: int | None = None
    gpu: str | None = None
    gpu_memory_utilization: float | None = None
    policies: tuple[str, ...] | None = None
    budget: str | None = None
    interval_tokens: int | None = None
    trace: Path | None = None
    trace_format: str | None = None
    time_unit: str | None = None
    max_requests: int | None = None
    concurrency: int | None = None
    frontier_max_concurrency: int | None = None
    endpoint_url: str | None = field(default=None, repr=False)  # may hold credentials: never shown
    timeout_s: float = DEFAULT_TIMEOUT_S
    seed: int = 0
    notes: tuple[str, ...] = ()


def load_settings(path: Path) -> Settings:
    """Parse and type-check a deployment TOML; raises ConfigError naming the section and key."""
    where = str(path)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{where}: cannot read the deployment file ({exc})") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{where}: not valid TOML: {exc}") from None
    for section, table in data.items():
        if section not in _SCHEMA:
            raise ConfigError(f"{where}: unknown section '{section}'; known sections: {', '.join(_SCHEMA)}")
        if not isinstance(table, dict):
            raise ConfigError(f"{where}: {section} must be a table (a [{section}] section), got {table!r}")
        for key, value in table.items():
            _check_value(where, section, key, value)
    return _settings_from_toml(data, where, path.resolve().parent)


def _check_value(where: str, section: str, key: str, value: Any) -> None:
    kind = _SCHEMA[section].get(key)
    if kind is None:
        raise ConfigError(f"{where}: unknown key {section}.{key}; known keys of {section}: {', '.join(_SCHEMA[section])}")
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    checks = {
        "str": (isinstance(value, str) and value.strip() != "", "a non-empty string"),
        "int": (isinstance(value, int) and not isinstance(value, bool) and value > 0, "a positive integer"),
        "fraction": (is_number and 0 < value <= 1, "a number in (0, 1]"),
        "seconds": (is_number and value > 0, "a number of seconds > 0"),
        "strs": (isinstance(value, list) and all(isinstance(v, str) for v in value), "a list of strings"),
        "budget": (isinstance(value, str) or (is_number and value > 0), "a keep ratio ('50%', '0.5') or a token count"),
    }
    is_ok, expected = checks[kind]
    if not is_ok:
        raise ConfigError(f"{where}: {section}.{key} must be {expected}, got {value!r}")


def _settings_from_toml(data: dict, where: str, base_dir: Path) -> Settings:
    model, engine, eviction = data.get("model", {}), data.get("engine", {}), data.get("eviction", {})
    workload, endpoint = data.get("workload", {}), data.get("endpoint", {})
    given = [k for k in ("name", "config") if k in model] + (["num_layers/..."] if set(_GEOMETRY_KEYS) & set(model) else [])
    if len(given) > 1:
        raise ConfigError(f"{where}: the model section gives {' and '.join(given)}; give one of model.name, model.config, or the "
                          "explicit geometry (num_layers, num_kv_heads, head_dim)")
    geometry = {k: model[k] for k in _GEOMETRY_KEYS if k in model} or None
    if geometry is not None:
        missing = [k for k in ("num_layers", "num_kv_heads", "head_dim") if k not in geometry]
        if missing:
            raise ConfigError(f"{where}: the explicit model geometry needs model.{', model.'.join(missing)}")
    if "policies" in eviction:
        _check_policies(eviction["policies"], f"{where}: eviction.policies")
    if "budget" in eviction:
        _parse_budget(str(eviction["budget"]), f"{where}: eviction.budget")
    _check_choice(workload.get("format"), TRACE_FORMATS, f"{where}: workload.format")
    _check_choice(workload.get("time_unit"), tuple(TIME_UNITS), f"{where}: workload.time_unit")
    if "gpu" in engine:
        _resolve_gpu(engine["gpu"], f"{where}: engine.gpu")
    if "gpu_memory_utilization" in engine and "gpu" not in engine:
        raise ConfigError(f"{where}: engine.gpu_memory_utilization needs engine.gpu (a GPU from the catalog)")
    config = model.get("config")
    if config is not None and not (base_dir / config).exists():
        raise ConfigError(f"{where}: model.config: no such file {base_dir / config}")
    return Settings(
        where=where,
        model=str(base_dir / config) if config is not None else model.get("name"),
        geometry=geometry,
        dtype=model.get("dtype"),
        block_size=engine.get("block_size"),
        num_gpu_blocks=engine.get("num_gpu_blocks"),
        gpu=engine.get("gpu"),
        gpu_memory_utilization=engine.get("gpu_memory_utilization"),
        policies=tuple(eviction["policies"]) if "policies" in eviction else None,
        budget=str(eviction["budget"]) if "budget" in eviction else None,
        interval_tokens=eviction.get("interval_tokens"),
        trace=base_dir / workload["trace"] if "trace" in workload else None,
        trace_format=workload.get("format"),
        time_unit=workload.get("time_unit"),
        max_requests=workload.get("max_requests"),
        concurrency=workload.get("concurrency"),
        frontier_max_concurrency=workload.get("frontier_max_concurrency"),
        endpoint_url=endpoint.get("url"),
        timeout_s=float(endpoint.get("timeout_s", DEFAULT_TIMEOUT_S)),
    )


def _from_server(url: str, overrides: Overrides) -> tuple[Deployment, LiveState | None]:
    shown = redact_url(url)
    try:
        live = scrape(url, overrides.timeout_s or DEFAULT_TIMEOUT_S)
    except EndpointError as exc:
        # An older server has no cache config; the flags can supply it (its load is then unread).
        supplied = None not in (overrides.block_size, overrides.num_gpu_blocks, overrides.model)
        if OLD_SERVER_HINT not in str(exc) or not supplied:
            raise
        note = f"{shown} has no vllm:cache_config_info; --block-size, --num-blocks and --model supply it"
        return _build(_apply(Settings(shown, "server", notes=(note,)), overrides), None), None
    settings = _fill_from_server(Settings(live.url, "server"), live)
    return _build(_apply(settings, overrides), live), live


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


def _build(s: Settings, live: LiveState | None) -> Deployment:
    notes = list(s.notes)
    model = _model(s, notes)
    gpu = _resolve_gpu(s.gpu or DEFAULT_GPU, _key(s, "engine.gpu", "--gpu"))
    if s.gpu is None:
        notes.append(f"step times modelled on {gpu.name} (default; memory figures barely depend on it)")
    block_size = s.block_size or DEFAULT_BLOCK_SIZE
    if s.block_size is None:
        notes.append(f"block size {block_size} tokens (vLLM's default)")
    num_blocks = _num_blocks(s, model, gpu, block_size, notes)
    if live is not None:
        notes += _kv_pool_notes(live, model, s)
    policies = tuple(dict.fromkeys(s.policies or DEFAULT_AUDIT_POLICIES))
    budget = _parse_budget(s.budget or DEFAULT_BUDGET, _key(s, "eviction.budget", "--budget"))
    interval_tokens = s.interval_tokens or DEFAULT_INTERVAL_TOKENS
    return Deployment(
        source=s.where, model=model, gpu=gpu, block_size=block_size, num_blocks=num_blocks, policies=policies,
        budget=budget, interval_tokens=interval_tokens, workload=_workload(s),
        frontier_max_concurrency=s.frontier_max_concurrency or DEFAULT_FRONTIER_MAX_CONCURRENCY,
        seed=s.seed, notes=tuple(notes),
    )


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


def _workload(s: Settings) -> Workload:
    is_sample = s.trace is None
    return Workload(
        trace_path=bundled_sample_path() if is_sample else s.trace,
        format=s.trace_format or "auto",
        time_unit=s.time_unit,
        max_requests=s.max_requests,
        concurrency=s.concurrency or DEFAULT_CONCURRENCY,
        is_bundled_sample=is_sample,
    )


def _key(s: Settings, toml_phrase: str, server_phrase: str) -> str:
    return toml_phrase if s.origin == "toml" else server_phrase


def _check_policies(policies: Sequence[str], where: str) -> None:
    if not policies:
        raise ConfigError(f"{where}: give at least one policy ({', '.join(POLICIES)})")
    for name in policies:
        if name not in POLICIES:
            raise ConfigError(f"{where}: unknown policy {name!r}; choose from {', '.join(POLICIES)}")


def _check_choice(value: str | None, choices: Sequence[str], where: str) -> None:
    if value is not None and value not in choices:
        raise ConfigError(f"{where} must be one of {', '.join(choices)}, got {value!r}")


def _parse_budget(text: str, where: str) -> Budget:
    try:
        return Budget.parse(text)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None


def _resolve_gpu(name: str, where: str) -> GpuSpec:
    try:
        return resolve_gpu(name)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None


# ---- the measurement --------------------------------------------------------------------------


class _Tracker:
    """Adapts per-run completions and per-search ends to one (stage, done, total) stream."""

    def __init__(self, progress: AuditProgress | None, num_total: int) -> None:
        self.progress = progress
        self.num_total = num_total
        self.num_done = 0

    def advance(self, stage: str, num_units: int) -> None:
        self.num_done += num_units
        if self.progress is not None:
            self.progress(stage, self.num_done, self.num_total)


def num_progress_units(deployment: Deployment, num_requests: int) -> int:
    """Completed requests of every replay plus one unit per capacity search."""
    num_runs = 1 + 2 * len(deployment.policies)
    return num_runs * num_requests + num_runs


def measure(deployment: Deployment, requests: Sequence[Request],
            progress: AuditProgress | None = None) -> tuple[PolicyAudit, ...]:
    """Replay `requests` through native once and naive-evict + vtoken per policy, closed loop at
    the workload's concurrency on the deployment's block budget; then search the capacity."""
    tracker = _Tracker(progress, num_progress_units(deployment, len(requests)))
    base = run_config(deployment, deployment.policies[0])
    native = _replay(replace(base, variant="native"), requests, tracker)
    native_capacity = _capacity(replace(base, variant="native"), requests, deployment, None)
    tracker.advance("capacity native", 1)
    audits = []
    for policy in deployment.policies:
        config = run_config(deployment, policy)
        runs = {"native": native}
        capacity = {"native": native_capacity}
        guess = native_capacity.max_concurrency
        for variant in ("naive-evict", "vtoken"):
            runs[variant] = _replay(replace(config, variant=variant), requests, tracker)
            capacity[variant] = _capacity(replace(config, variant=variant), requests, deployment, guess)
            guess = capacity[variant].max_concurrency
            tracker.advance(f"capacity {policy}", 1)
        audits.append(_policy_audit(policy, runs, capacity, deployment))
    return tuple(audits)


def run_config(deployment: Deployment, policy: str) -> RunConfig:
    return RunConfig(
        variant="vtoken", model=deployment.model, gpu=deployment.gpu, num_blocks=deployment.num_blocks,
        block_size=deployment.block_size,
        eviction=EvictionConfig(policy, deployment.budget, deployment.interval_tokens),
        concurrency=deployment.workload.concurrency, seed=deployment.seed,
    )


def _replay(config: RunConfig, requests: Sequence[Request], tracker: _Tracker) -> RunResult:
    stage = config.variant if config.variant == "native" else f"{config.eviction.policy} {config.variant}"
    num_done = 0

    def on_progress(num_units: int) -> None:
        nonlocal num_done
        num_done += num_units
        tracker.advance(stage, num_units)

    result = run_sim(config, requests, on_progress)
    tracker.advance(stage, len(requests) - num_done)  # skipped requests complete nothing
    return result


def _policy_audit(policy: str, runs: dict[str, RunResult], capacity: dict[str, Capacity],
                  deployment: Deployment) -> PolicyAudit:
    reclaimable_bytes = max(0.0, runs["naive-evict"].trapped_bytes - runs["vtoken"].trapped_bytes)
    reclaimable_blocks = reclaimable_bytes / deployment.kv_bytes_per_block
    per_request = runs["vtoken"].retained_blocks_per_request
    room = math.floor(reclaimable_blocks / per_request) if per_request > 0 else 0
    return PolicyAudit(policy, runs, capacity, reclaimable_bytes, reclaimable_blocks, room)


# ---- capacity: the largest concurrency that fits ------------------------------------------------


def _capacity(config: RunConfig, requests: Sequence[Request], deployment: Deployment, guess: int | None) -> Capacity:
    """Largest C <= frontier_max_concurrency with `analysis.frontier` feasible for this variant.

    `guess` (another variant's answer; the cap when None) is probed first.
    """
    cap = deployment.frontier_max_concurrency
    is_feasible = _memoized(lambda c: frontier(config, requests, (c,), (config.variant,)).points[0].is_feasible)
    found = _largest_feasible(is_feasible, 0, cap + 1, cap if guess is None else guess)
    return Capacity(found, found == cap)


def _largest_feasible(is_feasible: Callable[[int], bool], lo: int, hi: int, guess: int) -> int:
    """Largest c in [lo, hi) with is_feasible(c), given that lo is feasible (or 0), hi is not,
    and feasibility is monotone. Probes `guess`, gallops away from it, then bisects."""
    if hi - lo <= 1:
        return lo
    guess = min(max(guess, lo + 1), hi - 1)
    if is_feasible(guess):
        lo, step = guess, 1
        while lo + step < hi and is_feasible(lo + step):
            lo, step = lo + step, step * 2
        hi = min(hi, lo + step)
    else:
        hi, step = guess, 1
        while hi - step > lo and not is_feasible(hi - step):
            hi, step = hi - step, step * 2
        lo = max(lo, hi - step)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if is_feasible(mid):
            lo = mid
        else:
            hi = mid
    return lo


def _memoized(func: Callable[[int], bool]) -> Callable[[int], bool]:
    seen: dict[int, bool] = {}

    def call(c: int) -> bool:
        if c not in seen:
            seen[c] = func(c)
        return seen[c]

    return call


# ---- the verdict and the JSON object -----------------------------------------------------------


def policy_title(policy: str) -> str:
    return _POLICY_TITLES.get(policy, policy)


def budget_phrase(budget: Budget) -> str:
    return f"{budget.keep_ratio * 100:g}%" if budget.keep_ratio is not None else f"{budget.num_tokens} tokens"


def verdict(deployment: Deployment, policies: Sequence[PolicyAudit], live: LiveState | None) -> str:
    """A few plain sentences: the most-trapping policy in the example's words, then the least."""
    worst = max(policies, key=lambda p: (p.evicted.trapped_bytes, p.policy))
    run = worst.evicted
    text = (f"With {policy_title(worst.policy)} at {budget_phrase(deployment.budget)}, "
            f"{100 * run.frac_blocks_le_half:.0f}% of allocated blocks would sit at or below half full; "
            f"{_bytes_phrase(run.trapped_bytes)} trapped")
    if worst.reclaimable_blocks >= 1:
        text += (f"; vToken frees {_bytes_phrase(worst.reclaimable_bytes)} ({worst.reclaimable_blocks:.0f} blocks), "
                 f"room for {_count(worst.room_for_more_requests, 'more concurrent request')}.")
    else:
        text += "; vToken frees less than one block here."
    before, after = worst.capacity["naive-evict"], worst.capacity["vtoken"]
    if after.max_concurrency != before.max_concurrency:
        text += (f" All admitted at once, {before.max_concurrency} requests fit without vToken and "
                 f"{after.max_concurrency}{'+' if after.is_lower_bound else ''} with it.")
    if len(policies) > 1:
        best = min(policies, key=lambda p: (p.evicted.trapped_bytes, p.policy))
        text += (f" Least affected: {policy_title(best.policy)} ({_bytes_phrase(best.evicted.trapped_bytes)} "
                 f"trapped, F = {best.evicted.waste_ratio:.2f}).")
    if live is not None and live.vtoken_metrics:
        text += " The server runs vToken: its waste is measured there, not simulated (see its vtoken metrics)."
    return text


def _bytes_phrase(num_bytes: float) -> str:
    if num_bytes >= GiB / 100:
        return f"{num_bytes / GiB:.2f} GiB"
    return f"{num_bytes / 2**20:.1f} MiB"


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}" + ("" if number == 1 else "s")


def report_to_json(report: AuditReport) -> dict:
    """The `--json` object (keys: deployment, live, gpus, workload, policies, definitions, verdict)."""
    d = report.deployment
    return _clean({
        "deployment": {
            "source": d.source, "model": d.model.name, "kv_bytes_per_token": d.model.kv_bytes_per_token,
            "block_size": d.block_size, "num_blocks": d.num_blocks, "kv_bytes_per_block": d.kv_bytes_per_block,
            "kv_cache_bytes": d.num_blocks * d.kv_bytes_per_block, "gpu": d.gpu.name,
            "budget": d.budget.describe(), "interval_tokens": d.interval_tokens,
            "frontier_max_concurrency": d.frontier_max_concurrency, "seed": d.seed, "notes": list(d.notes),
        },
        "live": _live_json(report.live),
        "waste_source": "measured" if report.is_waste_measured else "simulated",
        "gpus": {"devices": [asdict(g) for g in report.gpus.devices], "reason": report.gpus.reason},
        "workload": {
            "source": str(report.trace.source), "format": report.trace.format,
            "num_requests": len(report.trace.requests), "concurrency": d.workload.concurrency,
            "is_bundled_sample": d.workload.is_bundled_sample,
            "attribution": SAMPLE_ATTRIBUTION if d.workload.is_bundled_sample else None,
            "notes": list(report.trace.notes),
        },
        "policies": {p.policy: _policy_json(p) for p in report.policies},
        "definitions": {key: text for key, _, text in DEFINITIONS},
        "verdict": report.verdict,
    })


def _policy_json(p: PolicyAudit) -> dict:
    run = p.evicted
    return {
        "waste_ratio": run.waste_ratio,
        "frac_blocks_le_half": run.frac_blocks_le_half,
        "utilization_histogram": list(run.utilization_histogram),
        "trapped_bytes": run.trapped_bytes,
        "reclaimable_bytes": p.reclaimable_bytes,
        "reclaimable_blocks": p.reclaimable_blocks,
        "room_for_more_requests": p.room_for_more_requests,
        "retained_blocks_per_request": {v: r.retained_blocks_per_request for v, r in p.runs.items()},
        "max_concurrency": {v: c.max_concurrency for v, c in p.capacity.items()},
        "max_concurrency_is_lower_bound": {v: c.is_lower_bound for v, c in p.capacity.items()},
        "vtoken": {"waste_ratio": p.runs["vtoken"].waste_ratio,
                   "frac_blocks_le_half": p.runs["vtoken"].frac_blocks_le_half,
                   "utilization_histogram": list(p.runs["vtoken"].utilization_histogram),
                   "trapped_bytes": p.runs["vtoken"].trapped_bytes},
        "preemptions": {v: r.preemptions for v, r in p.runs.items()},
        "num_skipped": {v: len(r.skipped) for v, r in p.runs.items()},
    }


def _live_json(live: LiveState | None) -> dict | None:
    if live is None:
        return None
    cache = live.cache_config
    return {
        "url": live.url, "model_name": live.model_name, "max_model_len": live.max_model_len,
        "cache_config": {"block_size": cache.block_size, "num_gpu_blocks": cache.num_gpu_blocks,
                         "cache_dtype": cache.cache_dtype, "enable_prefix_caching": cache.enable_prefix_caching,
                         "gpu_memory_utilization": cache.gpu_memory_utilization,
                         "kv_cache_memory_bytes": cache.kv_cache_memory_bytes},
        "kv_cache_usage": live.kv_cache_usage, "num_requests_running": live.num_requests_running,
        "num_requests_waiting": live.num_requests_waiting, "num_preemptions": live.num_preemptions,
        "vtoken_metrics": dict(live.vtoken_metrics), "notes": list(live.notes),
    }


def report_rows(report: AuditReport) -> list[dict[str, Any]]:
    """One flat row per policy, for the CSV of `--output`."""
    rows = []
    for p in report.policies:
        row: dict[str, Any] = {"policy": p.policy}
        for key, value in _policy_json(p).items():
            if isinstance(value, dict):
                row.update({f"{key}.{k}": v for k, v in value.items() if not isinstance(v, list)})
            elif isinstance(value, list):
                row.update({f"{key}.{i}": v for i, v in enumerate(value)})
            else:
                row[key] = value
        rows.append(_clean(row))
    return rows


def _clean(obj: Any) -> Any:
    """JSON-safe: NaN -> None, tuples -> lists, numpy scalars -> Python numbers."""
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    if isinstance(obj, bool) or obj is None or isinstance(obj, str):
        return obj
    if isinstance(obj, numbers.Integral):
        return int(obj)
    if isinstance(obj, numbers.Real):
        return None if math.isnan(obj) else float(obj)
    return obj
