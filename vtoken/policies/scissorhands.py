"""Scissorhands: keep the tokens that were repeatedly important in a recent history window."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from vtoken.policies.base import RequestView, evict_lowest, require_scores


@dataclass(frozen=True)
class Scissorhands:
    """Persistence of importance (Liu et al., "Scissorhands: Exploiting the Persistence of
    Importance Hypothesis for LLM KV Cache Compression at Test Time", NeurIPS 2023). Scores
    each token by how many queries in the history window found it important
    (`RequestView.importance_count`; the reference counts attention above the row's 90th
    percentile) and evicts the lowest counts first, so never-important tokens (count 0) go
    first and equal counts go oldest first. `seed` is unused.
    """

    name: ClassVar[str] = "scissorhands"
    needs_attention: ClassVar[bool] = True
    score_fields: ClassVar[tuple[str, ...]] = ("importance_count",)

    seed: int = 0

    def select_victims(self, view: RequestView) -> np.ndarray:
        return evict_lowest(view, require_scores(view.importance_count, self.name, "importance_count"))
