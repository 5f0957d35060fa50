"""What the user gave an audit, parsed and type-checked: the deployment TOML (`load_settings`
-> `Settings`) and the command-line flags (`Overrides`). Nothing here is resolved against the
catalogs or a server; `vtoken.audit.deployment` does that.

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
                                                [model] and [engine] leave out, and the
                                                workload when [workload] gives no trace
                window_s = 30                   scrape twice this far apart: the request rate
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vtoken.errors import ConfigError
from vtoken.hardware import GpuSpec, resolve_gpu
from vtoken.policies import POLICIES, resolve_policy_name
from vtoken.policies.base import Budget
from vtoken.trace import TIME_UNITS, TRACE_FORMATS

DEFAULT_TIMEOUT_S = 5.0

_SCHEMA: dict[str, dict[str, str]] = {
    "model": {"name": "str", "config": "str", "num_layers": "int", "num_kv_heads": "int", "head_dim": "int",
              "num_attention_heads": "int", "hidden_size": "int", "num_params": "int", "dtype": "str"},
    "engine": {"block_size": "int", "num_gpu_blocks": "int", "gpu": "str", "gpu_memory_utilization": "fraction"},
    "eviction": {"policies": "strs", "budget": "budget", "interval_tokens": "int"},
    "workload": {"trace": "str", "format": "str", "time_unit": "str", "max_requests": "int", "concurrency": "int",
                 "frontier_max_concurrency": "int"},
    "endpoint": {"url": "str", "timeout_s": "seconds", "window_s": "seconds"},
}
_GEOMETRY_KEYS = ("num_layers", "num_kv_heads", "head_dim", "num_attention_heads", "hidden_size", "num_params")


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
    window_s: float | None = None  # seconds between two scrapes of a server (its request rate)
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
        if self.window_s is not None and not self.window_s > 0:
            raise ConfigError(f"--window must be > 0 seconds, got {self.window_s}")
        if self.policies is not None:
            check_policies(self.policies, "--policy")
        if self.budget is not None:
            parse_budget(self.budget, "--budget")
        if self.gpu is not None:
            resolve_gpu(self.gpu)


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
    window_s: float | None = None
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
        check_policies(eviction["policies"], f"{where}: eviction.policies")
    if "budget" in eviction:
        parse_budget(str(eviction["budget"]), f"{where}: eviction.budget")
    _check_choice(workload.get("format"), TRACE_FORMATS, f"{where}: workload.format")
    _check_choice(workload.get("time_unit"), tuple(TIME_UNITS), f"{where}: workload.time_unit")
    if "gpu" in engine:
        lookup_gpu(engine["gpu"], f"{where}: engine.gpu")
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
        window_s=float(endpoint["window_s"]) if "window_s" in endpoint else None,
    )


# ---- checks that name where a value came from -------------------------------------------------


def check_policies(policies: Sequence[str], where: str) -> None:
    if not policies:
        raise ConfigError(f"{where}: give at least one policy ({', '.join(POLICIES)})")
    for name in policies:
        try:
            resolve_policy_name(name)
        except ConfigError:
            raise ConfigError(f"{where}: unknown policy {name!r}; choose from {', '.join(POLICIES)}") from None


def parse_budget(text: str, where: str) -> Budget:
    """`Budget.parse`, with the ConfigError prefixed by `where` (a TOML key or a flag)."""
    try:
        return Budget.parse(text).require_count_covers_protected(where)
    except ConfigError as exc:
        message = str(exc)
        raise ConfigError(message if message.startswith(where) else f"{where}: {message}") from None


def lookup_gpu(name: str, where: str) -> GpuSpec:
    """`resolve_gpu`, with the ConfigError prefixed by `where` (a TOML key or a flag)."""
    try:
        return resolve_gpu(name)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None


def _check_choice(value: str | None, choices: Sequence[str], where: str) -> None:
    if value is not None and value not in choices:
        raise ConfigError(f"{where} must be one of {', '.join(choices)}, got {value!r}")
