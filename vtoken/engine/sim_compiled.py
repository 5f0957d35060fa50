"""The sim executor's synthetic attention, compiled (numba, vtoken/jit.py): what a policy that
reads attention pays for its scores at every eviction event, every interval tokens of every
request, and for each request's importance stream as it grows.

Each loop computes what its numpy form computed, the same operations on the same doubles in
the same order, so the scores and every decision made on them are unchanged
(tests/test_sim.py compares them bit for bit). Imported by the sim at its first scores, so that
a replay whose policy reads none never imports numba for them.
"""

from __future__ import annotations

import math

import numpy as np

from vtoken.jit import njit


@njit
def pareto_plus_one(exponentials, alpha, out):
    """out[i] = 1 + Pareto(alpha) of exponentials[i], standard exponential draws: expm1(e / alpha)
    + 1, what numpy's `Generator.pareto` computes of each draw it takes
    (numpy/random/src/distributions/distributions.c, `random_pareto`) plus one, with the same
    C library's expm1, where `pareto` pays a call through its generic filler per value."""
    for i in range(exponentials.size):
        out[i] = math.expm1(exponentials[i] / alpha) + 1.0


@njit
def weighted_by_age(weights, by_age, num_tokens, token_ids):
    """weights[j] * by_age[num_tokens - 1 - j] for each j of `token_ids`: a token's weight times
    a recency table read at its age at length num_tokens, one pass where numpy gathers twice
    and multiplies. `weights` and `by_age` hold at least num_tokens values; an id outside
    [0, num_tokens) raises, as numpy's gather did."""
    out = np.empty(token_ids.size, np.float64)
    last = num_tokens - 1
    for i in range(token_ids.size):
        j = token_ids[i]
        if j < 0 or j > last:
            raise IndexError("a token id outside [0, num_tokens)")
        out[i] = weights[j] * by_age[last - j]
    return out
