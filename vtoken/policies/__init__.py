"""Eviction policies, above the substrate boundary: pure functions from a request view to victim ids.

One file per policy and one line in `POLICIES`; the CLI's `--policy` choices and the policy
contract test read this registry.
"""

from __future__ import annotations

from vtoken.errors import ConfigError
from vtoken.policies.base import Budget, EvictionPolicy, RequestView, num_victims, protected_mask
from vtoken.policies.h2o import H2O
from vtoken.policies.random import RandomPolicy
from vtoken.policies.scissorhands import Scissorhands
from vtoken.policies.streaming_llm import StreamingLLM
from vtoken.policies.tova import TOVA

POLICIES: dict[str, type[EvictionPolicy]] = {
    "h2o": H2O,
    "streaming_llm": StreamingLLM,
    "scissorhands": Scissorhands,
    "random": RandomPolicy,
    "tova": TOVA,
}

# What `vtoken audit` compares when the user names none: the four policies the design must ship.
DEFAULT_AUDIT_POLICIES = ("h2o", "streaming_llm", "scissorhands", "random")


def resolve_policy_name(name: str) -> str:
    """The registry's name for `name`, read loosely: case, '-', '_' and spaces do not count
    ("H2O", "streamingllm", "Streaming-LLM" all match). Raises ConfigError for an unknown name."""
    wanted = _loose(name)
    for registered in POLICIES:
        if _loose(registered) == wanted:
            return registered
    raise ConfigError(f"unknown policy '{name}'; choose one of: {', '.join(POLICIES)}")


def make_policy(name: str, seed: int = 0) -> EvictionPolicy:
    """Build the registered policy `name` (read as `resolve_policy_name` does); raises
    ConfigError for an unknown name."""
    return POLICIES[resolve_policy_name(name)](seed=seed)


def _loose(name: str) -> str:
    return "".join(char for char in name.lower() if char not in "-_ ")


__all__ = [
    "DEFAULT_AUDIT_POLICIES",
    "POLICIES",
    "Budget",
    "EvictionPolicy",
    "H2O",
    "RandomPolicy",
    "RequestView",
    "Scissorhands",
    "StreamingLLM",
    "TOVA",
    "make_policy",
    "resolve_policy_name",
    "num_victims",
    "protected_mask",
]
