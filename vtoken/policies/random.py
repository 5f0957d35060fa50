"""Random: evict uniformly at random among unprotected tokens; the baseline every score must beat."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from vtoken.errors import ConfigError
from vtoken.policies.base import RequestView, evict_lowest


@dataclass(frozen=True)
class RandomPolicy:
    """Uniform random eviction, the baseline of NVIDIA kvpress (`RandomPress`). Scores each
    unprotected token with an independent uniform draw and evicts the lowest, which picks
    a uniformly random subset. The generator is seeded from (seed, req_id,
    num_logical_tokens), so the victims are a pure function of the seed and the view: the
    same replay evicts the same tokens, and different requests or steps draw independently.
    """

    name: ClassVar[str] = "random"
    needs_attention: ClassVar[bool] = False
    score_fields: ClassVar[tuple[str, ...]] = ()

    seed: int = 0

    def __post_init__(self) -> None:
        # numpy's SeedSequence accepts only non-negative integers.
        if not isinstance(self.seed, (int, np.integer)) or isinstance(self.seed, bool) or self.seed < 0:
            raise ConfigError(f"random policy seed must be an integer >= 0, got {self.seed!r}")

    def select_victims(self, view: RequestView) -> np.ndarray:
        rng = np.random.default_rng([self.seed, view.req_id, view.num_logical_tokens])
        return evict_lowest(view, rng.random(len(view.token_ids)))
