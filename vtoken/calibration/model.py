"""A step-time model fitted to one engine on one machine: a fixed cost plus a price per unit of work.

For one step (one forward, as vLLM V1 schedules it: n decoding requests and prompt chunks together):

    t = overhead_s                                         scheduling, input preparation, launch
      + n                   * per_decode_token_s           projections, MLP, LM head, sampling per token
      + kv_slots_read       * per_kv_slot_s                paged attention over the decodes' KV extents
      + prefill_tokens      * per_prefill_token_s          projections and MLP of prompt tokens
      + prefill_requests    * per_prefill_request_s        a prompt's own cost (hf: one forward each;
                                                           vLLM: its LM-head row and sampled token)
      + prefill_kv_pairs    * per_prefill_kv_pair_s        causal attention of the prompt chunks over
                                                           their context and themselves
      + copy_s                                             relocation copies on the critical path

    copy_s = copied_tokens * per_copied_token_s, less what the post-forward window hides

The features are exactly `StepLoad`'s counts (vtoken/engine/executor.py), so the sim costs with
this model the same steps the runtime schedules. Every coefficient is >= 0 (the fit is NNLS).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING

import numpy as np

from vtoken.errors import ConfigError

if TYPE_CHECKING:  # the sim imports this module; the engine package must not be imported back
    from vtoken.engine.executor import StepLoad

# column order of the design matrix; `overhead_s` multiplies the number of forwards
FEATURES = ("overhead_s", "per_decode_token_s", "per_kv_slot_s", "per_prefill_token_s", "per_prefill_request_s",
            "per_prefill_kv_pair_s")


@dataclass(frozen=True)
class Provenance:
    """What a calibration ran against: engine, model, machine, date."""

    engine: str  # "vllm" or "hf"
    model: str
    cpu: str
    num_cores: int
    torch_version: str
    vllm_version: str  # "" for hf
    device: str  # "cpu" or a CUDA device name
    date: str  # ISO 8601, UTC

    def describe(self) -> str:
        versions = f"torch {self.torch_version}" + (f", vLLM {self.vllm_version}" if self.vllm_version else "")
        return (f"{self.engine} {self.model} on {self.device} ({self.cpu}, {self.num_cores} cores; {versions}), "
                f"{self.date}")


@dataclass(frozen=True)
class StepTimeModel:
    """Fitted coefficients (seconds per unit) and what they were fitted on."""

    overhead_s: float
    per_decode_token_s: float
    per_kv_slot_s: float
    per_prefill_token_s: float
    per_prefill_request_s: float
    per_prefill_kv_pair_s: float
    per_copied_token_s: float
    provenance: Provenance | None = None

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name != "provenance" and not (isinstance(value, (int, float)) and value >= 0):
                raise ConfigError(f"step model: {f.name} must be a number >= 0, got {value!r}")

    @property
    def coefficients(self) -> np.ndarray:
        return np.array([getattr(self, name) for name in FEATURES])

    def forward_time_s(self, load: StepLoad, reads_extent: bool = True) -> float:
        """The step without its copies."""
        return float(step_features(load, reads_extent) @ self.coefficients)

    def copy_time_s(self, num_copied_tokens: int) -> float:
        """Relocation copies of `num_copied_tokens` tokens, all of it (before any overlap)."""
        return num_copied_tokens * self.per_copied_token_s

    def as_dict(self) -> dict:
        return asdict(self)


def step_features(load: StepLoad, reads_extent: bool = True) -> np.ndarray:
    """The row of the design matrix for `load`, in FEATURES order. `reads_extent`: attention
    reads each decode's KV extent (paged kernels) rather than its live tokens."""
    kv_read = load.num_kv_slots_read if reads_extent else load.num_live_kv_tokens
    is_forward = 1 if load.num_decoding_requests or load.prefill_chunks else 0
    return np.array([is_forward, load.num_decoding_requests, kv_read, load.num_prefill_tokens,
                     load.num_prefill_requests, load.prefill_kv_pairs(reads_extent)], dtype=np.float64)

