"""The vocabulary of `vtoken check-invariants`, importable without torch: the invariants and what
one check of each is, the faults and the invariant that catches each, the executors, the
default block-budget pressure and how far traces are cut down.

The CLI renders `--help` from these names and must start without torch; `vtoken.checker`'s
`__init__` imports nothing heavy, so importing this module costs numpy at most.
"""

from __future__ import annotations

from dataclasses import dataclass

from vtoken.errors import ConfigError

INVARIANTS = ("I1", "I2", "I3", "I4")
INVARIANT_NAMES = {
    "I1": "token conservation",
    "I2": "unique mapping",
    "I3": "pre-attention visibility",
    "I4": "layout-aware planning",
}
# What one check of each invariant is, for the report.
CHECK_UNITS = {
    "I1": "completed relocations",
    "I2": "scans of all tables and the pool",
    "I3": "attention reads (one request in one forward)",
    "I4": "plans before launch",
}

# `--inject-fault` kinds (the `Fault` subclasses in checker/faults.py) and the invariant that catches each.
FAULT_KINDS = ("drop-copy", "stale-slot", "double-map", "early-read", "shared-block")
FAULT_DETECTED_BY = {"drop-copy": "I1", "stale-slot": "I3", "double-map": "I2", "early-read": "I3", "shared-block": "I4"}

EXECUTORS = ("sim", "hf", "vllm")
# Share of the peak blocks of the `concurrency` largest requests that the default budget gives:
# below 1, so that the pool is under pressure (reclamation, preemption, block reuse).
PRESSURE = 0.6


@dataclass(frozen=True)
class TraceLimits:
    """How far traces are cut down so that a full check stays fast (None: no limit)."""

    max_requests: int | None = 32
    max_prompt_tokens: int | None = 4096
    max_output_tokens: int | None = 256

    def __post_init__(self) -> None:
        for name in ("max_requests", "max_prompt_tokens", "max_output_tokens"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be > 0, got {value}")


# The hf executor runs a real model: every sample trace still, cut down harder. With the tiny
# default model on one CPU core that is about 150 relocations in 5 s.
HF_LIMITS = TraceLimits(max_requests=8, max_prompt_tokens=512, max_output_tokens=64)


# vLLM on CPU replays each request four times (two variants x two reclaim modes) with every
# check on: a handful of short requests.
VLLM_LIMITS = TraceLimits(max_requests=6, max_prompt_tokens=192, max_output_tokens=48)

DEFAULT_LIMITS = {"sim": TraceLimits(), "hf": HF_LIMITS, "vllm": VLLM_LIMITS}

# What one check of each invariant is inside vLLM (checker/vllm.py): the scheduler checks after
# every eviction, the worker at every KV copy and before every forward.
VLLM_CHECK_UNITS = {
    "I1": "live ids after an eviction, or a step's KV copies read back byte for byte",
    "I2": "a scan of all tables and the pool after an eviction",
    "I3": "dense live layout after an eviction, what one request reads and writes in one forward, "
          "or a step's copies landed before its forward",
    "I4": "nothing (see the notes)",
}


def default_limits(executor: str) -> TraceLimits:
    """How far traces are cut down unless the options say otherwise."""
    if executor not in DEFAULT_LIMITS:
        raise ConfigError(f"unknown executor '{executor}'; check-invariants runs on: {', '.join(EXECUTORS)}")
    return DEFAULT_LIMITS[executor]
