"""vToken settings of a vLLM engine, read from `additional_config["vtoken"]`. Pure: no vLLM import.

The same dictionary reaches the scheduler and the workers (vLLM copies `additional_config` into
every process), so both sides build identical settings from it:

    {"variant": "vtoken", "policy": "streaming_llm", "budget": "50%", "num_sink_tokens": 4,
     "num_recent_tokens": 64, "interval_tokens": 32, "reclaim_mode": "hole-fill",
     "theta_f": 0.25, "check_interval_steps": 1, "seed": 0, "check_invariants": false,
     "prefix_protection": "prompt"}

Every key is optional; `variant` defaults to "vtoken" and the rest to the sim's defaults.
`prefix_protection` matters only with vLLM's prefix caching on (prefix_cache.py): which leading
blocks of a request are never evicted from, relocated or rewritten.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from vtoken.engine.experiment import VARIANTS, EvictionConfig, VariantRole
from vtoken import defaults
from vtoken.errors import ConfigError
from vtoken.kv.reclaim import ReclaimConfig
from vtoken.policies.base import Budget

CONFIG_KEY = "vtoken"
_KNOWN_KEYS = frozenset({
    "variant", "policy", "budget", "num_sink_tokens", "num_recent_tokens", "interval_tokens",
    "reclaim_mode", "theta_f", "check_interval_steps", "seed", "check_invariants", "prefix_protection",
})
PREFIX_PROTECTIONS = ("prompt", "shared")  # prefix_cache.py


@dataclass(frozen=True)
class VllmSettings(VariantRole):
    """What the scheduler and the model runner need to agree on.

    `reclaim.theta_f` and `reclaim.check_interval_steps` gate when the vtoken variant hands
    emptied blocks back to vLLM's pool (stage 1 of the reclaimer). Moving tokens is not gated:
    vLLM's attention kernels read slots 0..seq_len-1 of a request, so every eviction is
    followed by a compaction before the next forward, in every evicting variant.
    """

    variant: str = defaults.VARIANT
    eviction: EvictionConfig = field(default_factory=lambda: EvictionConfig(policy=defaults.VLLM_POLICY))
    reclaim: ReclaimConfig = field(
        default_factory=lambda: ReclaimConfig(check_interval_steps=defaults.VLLM_RECLAIM_INTERVAL_STEPS))
    seed: int = defaults.SEED
    check_invariants: bool = False  # I1 (ids) and I2 after every eviction; slow, for tests
    prefix_protection: str = PREFIX_PROTECTIONS[0]

    def __post_init__(self) -> None:
        if self.variant not in VARIANTS:
            raise ConfigError(f"additional_config.vtoken.variant: unknown variant '{self.variant}'; "
                              f"choose one of: {', '.join(VARIANTS)}")
        if self.prefix_protection not in PREFIX_PROTECTIONS:
            raise ConfigError(f"additional_config.vtoken.prefix_protection: unknown value '{self.prefix_protection}'; "
                              f"choose one of: {', '.join(PREFIX_PROTECTIONS)}")

    def to_dict(self) -> dict[str, Any]:
        """The `additional_config["vtoken"]` dictionary that builds these settings again."""
        budget = self.eviction.budget
        return {
            "variant": self.variant,
            "policy": self.eviction.policy,
            "budget": budget.num_tokens if budget.num_tokens is not None else budget.keep_ratio,
            "num_sink_tokens": budget.num_sink_tokens,
            "num_recent_tokens": budget.num_recent_tokens,
            "interval_tokens": self.eviction.interval_tokens,
            "reclaim_mode": self.reclaim.mode,
            "theta_f": self.reclaim.theta_f,
            "check_interval_steps": self.reclaim.check_interval_steps,
            "seed": self.seed,
            "check_invariants": self.check_invariants,
            "prefix_protection": self.prefix_protection,
        }


def settings_from_additional_config(additional_config: Mapping[str, Any] | None) -> VllmSettings:
    """Build settings from vLLM's `additional_config`; raises ConfigError naming the bad key."""
    raw = (additional_config or {}).get(CONFIG_KEY, {})
    if not isinstance(raw, Mapping):
        raise ConfigError(f"additional_config.{CONFIG_KEY} must be a JSON object, got {raw!r}")
    unknown = sorted(set(raw) - _KNOWN_KEYS)
    if unknown:
        raise ConfigError(f"additional_config.{CONFIG_KEY}: unknown keys {unknown}; known: {sorted(_KNOWN_KEYS)}")
    budget = _budget(raw)
    eviction = EvictionConfig(
        policy=str(raw.get("policy", defaults.VLLM_POLICY)),
        budget=budget,
        interval_tokens=_int(raw, "interval_tokens", defaults.EVICTION_INTERVAL_TOKENS),
    )
    reclaim = ReclaimConfig(
        mode=str(raw.get("reclaim_mode", defaults.RECLAIM_MODE)),
        theta_f=float(raw.get("theta_f", defaults.THETA_F)),
        check_interval_steps=_int(raw, "check_interval_steps", defaults.VLLM_RECLAIM_INTERVAL_STEPS),
    )
    return VllmSettings(str(raw.get("variant", defaults.VARIANT)), eviction, reclaim, _int(raw, "seed", defaults.SEED),
                        bool(raw.get("check_invariants", False)),
                        str(raw.get("prefix_protection", PREFIX_PROTECTIONS[0])))


def _budget(raw: Mapping[str, Any]) -> Budget:
    sinks = _int(raw, "num_sink_tokens", defaults.NUM_SINK_TOKENS)
    recent = _int(raw, "num_recent_tokens", defaults.NUM_RECENT_TOKENS)
    value = raw.get("budget", defaults.BUDGET)
    if isinstance(value, bool):
        raise ConfigError(f"additional_config.{CONFIG_KEY}.budget: expected a ratio or a count, got {value!r}")
    if isinstance(value, float):
        return Budget(keep_ratio=value, num_sink_tokens=sinks, num_recent_tokens=recent)
    return Budget.parse(str(value), num_sink_tokens=sinks, num_recent_tokens=recent)


def _int(raw: Mapping[str, Any], key: str, default: int) -> int:
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"additional_config.{CONFIG_KEY}.{key} must be an integer, got {value!r}")
    return value
