"""H2O: keep the heavy hitters, the tokens with the most accumulated attention."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from vtoken.policies.base import RequestView, evict_lowest, require_scores


@dataclass(frozen=True)
class H2O:
    """Heavy-Hitter Oracle (Zhang et al., "H2O: Heavy-Hitter Oracle for Efficient Generative
    Inference of Large Language Models", NeurIPS 2023). Scores each token by the attention
    mass it has accumulated from every query so far (`RequestView.attention_sum`, summed over
    heads by the runtime, where the reference keeps a set per head) and evicts the unprotected
    tokens with the lowest sum, older first on ties. `seed` is unused; every policy takes one.
    """

    name: ClassVar[str] = "h2o"
    needs_attention: ClassVar[bool] = True
    score_fields: ClassVar[tuple[str, ...]] = ("attention_sum",)

    seed: int = 0

    def select_victims(self, view: RequestView) -> np.ndarray:
        return evict_lowest(view, require_scores(view.attention_sum, self.name, "attention_sum"))
