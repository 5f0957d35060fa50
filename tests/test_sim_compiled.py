"""The sim's compiled attention loops give what their numpy forms gave, bit for bit, so that a
policy's scores, and every decision made on them, are unchanged."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vtoken.engine.sim_compiled import pareto_plus_one, weighted_by_age


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), sizes=st.lists(st.integers(0, 5000), min_size=1, max_size=4),
       alpha=st.sampled_from([0.7, 1.0, 1.5, 3.0]))
def test_pareto_plus_one_is_numpys_pareto_of_the_same_draws(seed, sizes, alpha) -> None:
    """Drawn in pieces, as a request's stream grows: every value equals numpy's, and the
    generators stay in step (the next draw of each is the same)."""
    ours, numpys = np.random.default_rng(seed), np.random.default_rng(seed)
    for size in sizes:
        out = np.full(size, np.nan)
        pareto_plus_one(ours.standard_exponential(size), alpha, out)
        assert np.array_equal(out, numpys.pareto(alpha, size) + 1.0)
    assert ours.random() == numpys.random()


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**16), num_tokens=st.integers(1, 3000), share=st.floats(0.0, 1.0))
def test_weighted_by_age_is_the_gather_and_product(seed, num_tokens, share) -> None:
    rng = np.random.default_rng(seed)
    weights = rng.pareto(1.5, num_tokens + 7) + 1.0
    by_age = rng.random(num_tokens + 100)
    token_ids = np.flatnonzero(rng.random(num_tokens) < share)
    want = weights[token_ids] * by_age[num_tokens - 1 :: -1][token_ids]
    assert np.array_equal(weighted_by_age(weights, by_age, num_tokens, token_ids), want)


@pytest.mark.parametrize("token_id", [-1, 10])
def test_weighted_by_age_refuses_an_id_outside_the_length(token_id) -> None:
    with pytest.raises(IndexError):
        weighted_by_age(np.ones(20), np.ones(20), 10, np.array([0, token_id]))
