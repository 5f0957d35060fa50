"""The policy contract: a token budget, a read-only view of one request, and the victim rule.

Policies sit above the substrate boundary. They see logical token ids (equal to rotary
positions) and per-token scores, never blocks, and they mutate nothing: `select_victims`
returns the ids to evict and the runtime hands them to the token table.

Which ids a policy may touch, for one request with `num_logical_tokens` = n:

    logical id:  0 .. S-1 | S ............................... n-R-1 | n-R .. n-1
                 sinks    | evictable (holes where already evicted) | recent window
                 protected                                          | protected

Only ids still live appear in `RequestView.token_ids`; a policy evicts down to
`num_keep_tokens` but never below the protected count.
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass
from typing import ClassVar, Protocol

import numpy as np

from vtoken import defaults
from vtoken.errors import ConfigError
from vtoken.lazy import imported_at_first_call

_PERCENT_PATTERN = re.compile(r"(\d+(?:\.\d*)?|\.\d+)%")
_COUNT_PATTERN = re.compile(r"\d+")
_RATIO_PATTERN = re.compile(r"\d*\.\d+|\d+\.")
_BUDGET_FORMS = "a keep ratio ('50%' or '0.5') or a token count ('512')"


@functools.lru_cache(maxsize=1 << 16)
def _num_keep_at_ratio(keep_ratio: float, num_logical_tokens: int) -> int:
    """ceil(keep_ratio * n), rounded first so that float noise (0.1 * 30 = 3.0000000000000004)
    does not add a token; remembered, since every eviction event asks it (round's correctly
    rounded conversion costs several times the lookup)."""
    return math.ceil(round(keep_ratio * num_logical_tokens, 6))


@dataclass(frozen=True)
class Budget:
    """How many tokens a request keeps: a keep ratio of its logical length, or a fixed token
    count, plus protected sinks and a recent window. Invalid values raise ConfigError."""

    keep_ratio: float | None = None  # (0, 1] of the request's logical length
    num_tokens: int | None = None  # > 0
    num_sink_tokens: int = defaults.NUM_SINK_TOKENS
    num_recent_tokens: int = defaults.NUM_RECENT_TOKENS

    def __post_init__(self) -> None:
        if (self.keep_ratio is None) == (self.num_tokens is None):
            raise ConfigError(
                "budget needs exactly one of keep_ratio and num_tokens, "
                f"got keep_ratio={self.keep_ratio!r}, num_tokens={self.num_tokens!r}"
            )
        if self.keep_ratio is not None and not 0.0 < self.keep_ratio <= 1.0:
            raise ConfigError(f"budget keep_ratio must be in (0, 1], got {self.keep_ratio!r}")
        if self.num_tokens is not None and not _is_int(self.num_tokens, minimum=1):
            raise ConfigError(f"budget num_tokens must be an integer > 0, got {self.num_tokens!r}")
        if not _is_int(self.num_sink_tokens, minimum=0):
            raise ConfigError(f"budget num_sink_tokens must be an integer >= 0, got {self.num_sink_tokens!r}")
        if not _is_int(self.num_recent_tokens, minimum=0):
            raise ConfigError(
                f"budget num_recent_tokens must be an integer >= 0, got {self.num_recent_tokens!r}"
            )

    def num_keep_tokens(self, num_logical_tokens: int) -> int:
        """Tokens to keep out of `num_logical_tokens`: ceil(ratio * n), or min(count, n)."""
        if self.num_tokens is not None:
            return min(self.num_tokens, num_logical_tokens)
        return _num_keep_at_ratio(self.keep_ratio, num_logical_tokens)

    @classmethod
    def parse(cls, text: str, num_sink_tokens: int = defaults.NUM_SINK_TOKENS,
              num_recent_tokens: int = defaults.NUM_RECENT_TOKENS, *, where: str = "budget") -> Budget:
        """Read a user's budget: '50%' or '0.5' is a keep ratio, '512' a token count; raises
        ConfigError for any other form, its message starting with `where` (the flag or key the
        text came from)."""
        stripped = text.strip()
        protected = {"num_sink_tokens": num_sink_tokens, "num_recent_tokens": num_recent_tokens}
        if _COUNT_PATTERN.fullmatch(stripped) and int(stripped) > 0:
            return cls(num_tokens=int(stripped), **protected)
        keep_ratio = _parse_keep_ratio(stripped)
        if keep_ratio is None or not 0.0 < keep_ratio <= 1.0:
            raise ConfigError(f"{where} must be {_BUDGET_FORMS}, above 0 and at most 100%, got '{text}'")
        return cls(keep_ratio=keep_ratio, **protected)

    @property
    def num_protected_tokens(self) -> int:
        return self.num_sink_tokens + self.num_recent_tokens

    def require_count_covers_protected(self, where: str = "budget") -> Budget:
        """This budget, or ConfigError when it is a count below the protected tokens (sinks +
        recent): such a budget keeps sinks + recent tokens, not what it says. Budgets built
        directly with such a count stay valid (the fuzz scenarios draw them); user input is
        checked here, the message starting with `where`."""
        if self.num_tokens is not None and self.num_tokens < self.num_protected_tokens:
            raise ConfigError(
                f"{where} {self.num_tokens} is below the {self.num_protected_tokens} tokens no policy evicts "
                f"({self.num_sink_tokens} sinks + {self.num_recent_tokens} recent): give at least "
                f"{self.num_protected_tokens} tokens or a ratio")
        return self

    def describe(self) -> str:
        """One line for tables and logs, e.g. 'keep 50% (4 sinks, 64 recent)'."""
        kept = f"{self.keep_ratio * 100:g}%" if self.keep_ratio is not None else f"{self.num_tokens} tokens"
        return f"keep {kept} ({self.num_sink_tokens} sinks, {self.num_recent_tokens} recent)"


def _is_int(value: object, minimum: int) -> bool:
    # bool is an int subclass; 'True tokens' is a caller bug, not a count.
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool) and value >= minimum


def _parse_keep_ratio(text: str) -> float | None:
    """'50%' -> 0.5, '0.5' -> 0.5; None for anything that is not one of those forms."""
    if _PERCENT_PATTERN.fullmatch(text):
        return float(text[:-1]) / 100.0
    if _RATIO_PATTERN.fullmatch(text):
        return float(text)
    return None


@dataclass(frozen=True, eq=False)
class RequestView:
    """Read-only view of one request, handed to a policy. Logical ids equal rotary positions.

    Built by the runtime on the hot path, so it is not validated here. Score arrays are
    aligned with `token_ids` and are None unless the policy declares `needs_attention`.
    `eq=False`: field-wise == on numpy arrays is ambiguous, so views compare by identity.
    """

    req_id: int
    token_ids: np.ndarray  # int64 [n] live logical ids the policy may evict from, ascending
    num_logical_tokens: int  # prompt + generated so far; every id < num_logical_tokens
    num_keep_tokens: int  # how many of token_ids must stay live after the call
    num_sink_tokens: int  # ids < num_sink_tokens are protected
    num_recent_tokens: int  # ids >= num_logical_tokens - num_recent_tokens are protected
    attention_sum: np.ndarray | None = None  # float64 [n] accumulated attention mass (H2O)
    attention_last: np.ndarray | None = None  # float64 [n] attention of the latest query (TOVA)
    # int32 [n] queries in the history window for which the token was important (Scissorhands)
    importance_count: np.ndarray | None = None


class EvictionPolicy(Protocol):
    """A pure function of one request's view. Constructed as `Policy(seed=0)`."""

    name: ClassVar[str]
    needs_attention: ClassVar[bool]  # True: the runtime must fill the view's score arrays
    score_fields: ClassVar[tuple[str, ...]]  # which of them it reads (the others may be None)

    def select_victims(self, view: RequestView) -> np.ndarray:
        """Logical ids to evict: int64, ascending, distinct, a subset of view.token_ids,
        exactly num_victims(view) long, never a protected id. Mutates nothing."""
        ...


def protected_mask(view: RequestView) -> np.ndarray:
    """bool [n], aligned with view.token_ids: True for sinks and the recent window."""
    first_recent_id = view.num_logical_tokens - view.num_recent_tokens
    return (view.token_ids < view.num_sink_tokens) | (view.token_ids >= first_recent_id)


def unprotected_range(view: RequestView) -> tuple[int, int]:
    """[lo, hi): the positions of view.token_ids that `protected_mask` leaves out. The ids
    ascend, so the sinks are a prefix of them and the recent window a suffix."""
    lo, hi, _ = _unprotected_slice(view)
    return lo, hi


def num_victims(view: RequestView) -> int:
    """How many tokens to evict: down to the budget, but never a protected token."""
    return _unprotected_slice(view)[2]


def _unprotected_slice(view: RequestView) -> tuple[int, int, int]:
    """(lo, hi, num_victims) of the view, by the one implementation of the rule, compiled
    with the selection that `evict_lowest` runs (policies/selection.py, `unprotected_slice`)."""
    lo, hi, count = _selection().unprotected_slice(view.token_ids, view.num_sink_tokens,
                                                   view.num_logical_tokens - view.num_recent_tokens, view.num_keep_tokens)
    return int(lo), int(hi), int(count)


def evict_lowest(view: RequestView, scores: np.ndarray) -> np.ndarray:
    """The num_victims(view) unprotected ids with the lowest scores, ties to the lower id; int64 ascending.

    `scores` is aligned with view.token_ids. Because token_ids ascend, the unprotected ids are
    one slice of them (`unprotected_range`), and a stable selection over it breaks equal
    scores toward the older token. One compiled call (policies/selection.py,
    `lowest_unprotected_ids`) finds the slice, the count and the ids."""
    return _selection().lowest_unprotected_ids(view.token_ids, scores, view.num_sink_tokens,
                                               view.num_logical_tokens - view.num_recent_tokens, view.num_keep_tokens)


_selection = imported_at_first_call("vtoken.policies.selection")  # numba is not imported with the policies


def lowest_positions(values: np.ndarray, k: int) -> np.ndarray:
    """Positions of the k smallest of `values` (1 <= k <= values.size), ascending, ties at the
    k-th smallest to the lower positions: everything strictly below the k-th smallest, then as
    many of the ties at it as still fit. Without ties past the k-th (the usual case for
    real-valued scores) that is every value up to it. (A NaN sorts last, and compares neither
    below nor equal: a k-th smallest that is NaN selects nothing.)

    O(n), not a sort, compiled (policies/selection.py): a policy's periodic run selects a few
    dozen of a few hundred to a few thousand scores at every eviction event, where numpy's
    partition and the passes around it cost 2-6x the compiled loop, warm
    (benchmarks/bench_selection.py; at 32,000 values numpy's search below a sampled bound was
    the faster)."""
    return _selection().lowest_positions(values, k)


def require_scores(scores: np.ndarray | None, policy_name: str, field_name: str) -> np.ndarray:
    """Return `scores`, or raise ConfigError when the runtime did not supply them."""
    if scores is None:
        raise ConfigError(
            f"policy '{policy_name}' needs attention scores (RequestView.{field_name}), got None; "
            "replay a trace that records attention or choose a positional policy"
        )
    return scores
