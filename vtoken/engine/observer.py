"""What the runtime tells an observer (the invariant checker) at each event of a step.

    on_synced          new tokens were placed in a table (num_tokens_before: its length before)
    on_forward         a forward is about to read the batch's KV; these plans are in flight
    on_plan            a relocation plan passed `check_plan` and is about to launch
    on_plan_completed  a plan's copy landed and its moves were applied (live ids before it)

Observers see the runtime's objects and must not change them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import numpy as np

if TYPE_CHECKING:
    from vtoken.engine.batch import Batch
    from vtoken.kv.moves import RelocationPlan
    from vtoken.kv.token_table import TokenTable


class RuntimeObserver(Protocol):
    def on_synced(self, table: TokenTable, num_tokens_before: int) -> None: ...

    def on_forward(self, batch: Batch, in_flight_plans: list[RelocationPlan]) -> None: ...

    def on_plan(self, plan: RelocationPlan, table: TokenTable) -> None: ...

    def on_plan_completed(self, plan: RelocationPlan, table: TokenTable, live_ids_before: np.ndarray) -> None: ...


class NullObserver:
    """Sees nothing: the runtime's default."""

    def on_synced(self, table: TokenTable, num_tokens_before: int) -> None:
        pass

    def on_forward(self, batch: Batch, in_flight_plans: list[RelocationPlan]) -> None:
        pass

    def on_plan(self, plan: RelocationPlan, table: TokenTable) -> None:
        pass

    def on_plan_completed(self, plan: RelocationPlan, table: TokenTable, live_ids_before: np.ndarray) -> None:
        pass
