"""What the scheduler tells the model runner each step, riding on vLLM's `SchedulerOutput`.

The scheduler attaches one `StepPlan` as `scheduler_output.vtoken`; an extra attribute on that
dataclass reaches the worker in-process and survives the pickle to worker processes. Pure data:
no vLLM import, so both sides (and tests) can build and read it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

PLAN_ATTRIBUTE = "vtoken"  # on SchedulerOutput: the StepPlan
SCORES_ATTRIBUTE = "vtoken_scores"  # on ModelRunnerOutput: {req_id: float64 [queries, live keys]}


@dataclass(frozen=True)
class StepPlan:
    """One step's vToken work for the model runner, applied before the forward.

    - copies: KV of `src_slots[i]` goes to `dst_slots[i]` (vLLM slots = block_id * S + offset),
      all gathered before any is written;
    - `num_evicted_tokens[req_id]`: logical minus physical KV length of a request. Rotary
      positions stay logical; the slots of new tokens and the KV length attention reads are
      the physical ones (position - num_evicted). Absent = 0;
    - `block_table_lengths[req_id]`: the request handed trailing blocks back; keep this many
      entries of its block table before appending this step's new blocks;
    - `score_req_ids`: requests whose attention statistics the policy needs (H2O, ...);
    - `verify_copies`: check that every destination reads back its source's bytes (I1 on the
      real KV; raises InvariantError in the worker), for `check_invariants` runs;
    - `live_slots[req_id]` / `new_slots[req_id]` (check runs only, per scheduled request): the
      vLLM slots of every live token once this step's tokens are written, ascending, and the
      slots the token table gives this step's new tokens, in order. The worker checks that
      attention reads exactly the first and writes the new K/V exactly to the second (I3).
    """

    src_slots: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    dst_slots: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    num_evicted_tokens: dict[str, int] = field(default_factory=dict)
    block_table_lengths: dict[str, int] = field(default_factory=dict)
    score_req_ids: frozenset[str] = frozenset()
    verify_copies: bool = False
    live_slots: dict[str, np.ndarray] = field(default_factory=dict)
    new_slots: dict[str, np.ndarray] = field(default_factory=dict)

    @property
    def num_moves(self) -> int:
        return int(self.src_slots.size)

    @property
    def is_empty(self) -> bool:
        return not (self.num_moves or self.num_evicted_tokens or self.block_table_lengths or self.score_req_ids)
