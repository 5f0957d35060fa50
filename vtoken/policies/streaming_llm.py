"""StreamingLLM: keep the attention sinks and a sliding window of the most recent tokens."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from vtoken.policies.base import RequestView, evict_lowest


@dataclass(frozen=True)
class StreamingLLM:
    """Attention sinks (Xiao et al., "Efficient Streaming Language Models with Attention
    Sinks", ICLR 2024). Scores nothing: it is positional, keeping the first
    `num_sink_tokens` and evicting every other token oldest first, so what survives is the
    sinks plus the most recent tokens the budget allows. Needs no attention, so it runs on
    FlashAttention engines. `seed` is unused.
    """

    name: ClassVar[str] = "streaming_llm"
    needs_attention: ClassVar[bool] = False
    score_fields: ClassVar[tuple[str, ...]] = ()

    seed: int = 0

    def select_victims(self, view: RequestView) -> np.ndarray:
        # The logical id is the age: the lowest unprotected id is the oldest token.
        return evict_lowest(view, view.token_ids)
