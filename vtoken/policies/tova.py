"""TOVA: keep the tokens the latest query attends to most."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from vtoken.policies.base import RequestView, evict_lowest, require_scores


@dataclass(frozen=True)
class TOVA:
    """Token Omission Via Attention (Oren et al., "Transformers are Multi-State RNNs", 2024).
    Scores each token only by the attention the most recent query gives it
    (`RequestView.attention_last`, averaged over heads as in the reference, which keeps one
    shared set per layer) and evicts the unprotected tokens with the lowest score, older first
    on ties. Unlike H2O it has no memory of earlier queries. `seed` is unused.
    """

    name: ClassVar[str] = "tova"
    needs_attention: ClassVar[bool] = True
    score_fields: ClassVar[tuple[str, ...]] = ("attention_last",)

    seed: int = 0

    def select_victims(self, view: RequestView) -> np.ndarray:
        return evict_lowest(view, require_scores(view.attention_last, self.name, "attention_last"))
