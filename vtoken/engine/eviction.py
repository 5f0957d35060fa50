"""When a request's policy runs and what it sees: one implementation for every executor.

The runtime (sim, hf) and the vLLM scheduler (engine/vllm/tracker.py) both ask this module,
so the same request gets the same decisions on every executor and in every variant:

    after prefill          num_generated = 1: the policy runs on the prompt (+ first token),
                           after the prompt's last chunk
    after each chunk       as an option (`SchedulerConfig.evict_every_chunk`), for policies that need
                           no attention scores: on the prompt computed so far (`decide_mid_prompt`)
    every interval tokens  num_generated = k * interval_tokens
    after a preemption     the request is recomputed from all its tokens; the tokens it had
                           lost are evicted again right after the recompute, and the policy is
                           not asked (a new decision at a new length would make a variant that
                           preempts decide differently from one that does not)

A request's table holds its KV: `num_tokens` = prompt + generated - 1 (the last sampled token
has no KV yet). When a request reaches the eviction point past it (it resumed after a
preemption past it), the view is of the request as it was at that point: ids at or past its
length then are hidden.

The view hides the pinned shared prefix: its tokens are neither offered to the policy nor
counted in what it must keep (`num_keep_tokens` is the budget minus the pinned tokens).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from vtoken.engine.experiment import EvictionConfig
from vtoken.engine.executor import TokenScores
from vtoken.kv.token_table import TokenTable
from vtoken.policies.base import EvictionPolicy, RequestView

# (token_ids, num_tokens) -> scores of those ids at that length, for policies that need attention
ScoreSource = Callable[[np.ndarray, int], TokenScores]


class EvictionClock:
    """One request's place in the schedule. Mutable, owned by the engine's request state.

    `next_eviction_at`: evict when num_generated reaches this (1 = right after prefill).
    `resume_token_ids`: evicted before a preemption, evicted again on resume.
    `due_at`: what the two say together, the generated count from which the request is due
    (`EvictionSchedule.is_due`): the next eviction point, or 0 while a resume is pending. Their
    setters keep it, so that asking every sampled request at every step (the runtime does) is
    one comparison."""

    __slots__ = ("_next_eviction_at", "_resume_token_ids", "due_at")

    def __init__(self, next_eviction_at: int = 1, resume_token_ids: np.ndarray | None = None) -> None:
        self._next_eviction_at = next_eviction_at
        self._resume_token_ids = resume_token_ids
        self._set_due_at()

    @property
    def next_eviction_at(self) -> int:
        return self._next_eviction_at

    @next_eviction_at.setter
    def next_eviction_at(self, num_generated: int) -> None:
        self._next_eviction_at = num_generated
        self._set_due_at()

    @property
    def resume_token_ids(self) -> np.ndarray | None:
        return self._resume_token_ids

    @resume_token_ids.setter
    def resume_token_ids(self, token_ids: np.ndarray | None) -> None:
        self._resume_token_ids = token_ids
        self._set_due_at()

    def _set_due_at(self) -> None:
        self.due_at = 0 if self._resume_token_ids is not None else self._next_eviction_at

    def __repr__(self) -> str:
        return f"EvictionClock(next_eviction_at={self._next_eviction_at}, resume_token_ids={self._resume_token_ids!r})"


@dataclass(frozen=True)
class EvictionEvent:
    """Tokens a request loses when its KV holds `num_tokens` tokens (in the policy's order).

    `num_tokens` is the KV length when the tokens are evicted: the queries from that position on
    no longer read them. The policy may have decided on a shorter prefix (a request that resumed
    past the eviction point).

    `is_resume`: the request was preempted and recomputed, and the tokens it had lost were
    evicted again at this length (not a new policy decision).
    """

    num_tokens: int
    token_ids: np.ndarray
    is_resume: bool = False


class EvictionSchedule:
    def __init__(self, config: EvictionConfig, policy: EvictionPolicy) -> None:
        self.config = config
        self.policy = policy

    def is_due(self, clock: EvictionClock, num_generated: int) -> bool:
        """A resume is pending, or the request reached its next eviction point (`due_at`)."""
        return num_generated >= clock.due_at

    def decide(self, clock: EvictionClock, req_idx: int, table: TokenTable, num_generated: int,
               scores: ScoreSource | None = None) -> EvictionEvent | None:
        """The tokens to evict now, or None when nothing is due. Advances `clock`; the caller
        evicts the returned ids from `table`. `scores` is needed only when the policy needs
        attention."""
        if clock.resume_token_ids is not None:
            token_ids, clock.resume_token_ids = clock.resume_token_ids, None
            return EvictionEvent(table.num_tokens, token_ids, is_resume=True)
        if num_generated < clock.next_eviction_at:
            return None
        num_tokens = table.num_tokens - (num_generated - clock.next_eviction_at)
        interval = self.config.interval_tokens
        clock.next_eviction_at = (num_generated // interval + 1) * interval
        victims = self.policy.select_victims(build_view(req_idx, table, self.config, num_tokens, scores))
        if victims.size == 0:
            return None
        return EvictionEvent(table.num_tokens, victims)

    def decide_mid_prompt(self, req_idx: int, table: TokenTable) -> EvictionEvent | None:
        """The tokens to evict after a prompt chunk, at the length computed so far; the clock does
        not move (the policy still runs after the last chunk). Only for policies that need no
        scores: the attention-ranked ones rank by what the whole prompt's queries paid."""
        assert not self.policy.needs_attention, "a mid-prompt decision without scores"
        victims = self.policy.select_victims(build_view(req_idx, table, self.config, table.num_tokens, None))
        return EvictionEvent(table.num_tokens, victims) if victims.size else None

    def on_preempt(self, clock: EvictionClock, table: TokenTable) -> None:
        """The request loses its KV and will be recomputed: remember what it had lost."""
        evicted = table.evicted_token_ids()
        clock.resume_token_ids = evicted if evicted.size else None


def build_view(req_idx: int, table: TokenTable, config: EvictionConfig, num_tokens: int,
               scores: ScoreSource | None) -> RequestView:
    """The policy's view of a request at logical length `num_tokens` (<= table.num_tokens)."""
    budget = config.budget
    num_pinned = table.num_pinned_tokens
    token_ids = table.live_token_ids(num_pinned, num_tokens)
    num_keep = max(0, budget.num_keep_tokens(num_tokens) - num_pinned)
    stats = scores(token_ids, num_tokens) if scores is not None else (None, None, None)
    return RequestView(req_idx, token_ids, num_tokens, num_keep, budget.num_sink_tokens, budget.num_recent_tokens, *stats)
