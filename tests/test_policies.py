"""Eviction policies: budget parsing, the victim rule, each policy at hand-checkable sizes, the
contract for every registered policy, and the substrate boundary (no kv / torch / CLI imports)."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vtoken.errors import ConfigError
from vtoken.policies import (
    DEFAULT_AUDIT_POLICIES,
    H2O,
    POLICIES,
    TOVA,
    Budget,
    RandomPolicy,
    RequestView,
    Scissorhands,
    StreamingLLM,
    make_policy,
    resolve_policy_name,
    num_victims,
    protected_mask,
)
from vtoken.policies.base import evict_lowest, lowest_positions, unprotected_range
from vtoken.policies.selection import HEAP_MAX_SHARE

POLICY_DIR = Path(__file__).resolve().parents[1] / "vtoken" / "policies"
FORBIDDEN_MODULES = ("vtoken.kv", "torch", "typer", "rich")


def make_view(
    num_logical_tokens: int,
    num_keep_tokens: int,
    token_ids: list[int] | None = None,
    *,
    req_id: int = 0,
    num_sink_tokens: int = 2,
    num_recent_tokens: int = 3,
    attention_sum: list[float] | None = None,
    attention_last: list[float] | None = None,
    importance_count: list[int] | None = None,
) -> RequestView:
    """A view over all ids 0..n-1 (or the given live ids) with 2 sinks and 3 recent by default."""
    ids = list(range(num_logical_tokens)) if token_ids is None else token_ids
    return RequestView(
        req_id=req_id,
        token_ids=np.asarray(ids, dtype=np.int64),
        num_logical_tokens=num_logical_tokens,
        num_keep_tokens=num_keep_tokens,
        num_sink_tokens=num_sink_tokens,
        num_recent_tokens=num_recent_tokens,
        attention_sum=None if attention_sum is None else np.asarray(attention_sum, dtype=np.float64),
        attention_last=None if attention_last is None else np.asarray(attention_last, dtype=np.float64),
        importance_count=None if importance_count is None else np.asarray(importance_count, dtype=np.int32),
    )


# --- Budget -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "keep_ratio", "num_tokens"),
    [
        ("50%", 0.5, None),
        ("12.5%", 0.125, None),
        ("100%", 1.0, None),
        ("0.5", 0.5, None),
        (".25", 0.25, None),
        ("1.0", 1.0, None),
        ("512", None, 512),
        ("1", None, 1),  # Budget.parse reads the form; the CLI refuses counts below the protected tokens
        (" 64 ", None, 64),
    ],
)
def test_budget_parse_valid(text: str, keep_ratio: float | None, num_tokens: int | None) -> None:
    budget = Budget.parse(text, num_sink_tokens=2, num_recent_tokens=16)
    assert (budget.keep_ratio, budget.num_tokens) == (keep_ratio, num_tokens)
    assert (budget.num_sink_tokens, budget.num_recent_tokens) == (2, 16)


@pytest.mark.parametrize(
    "text",
    ["", "abc", "0", "0%", "0.0", "-5", "-50%", "150%", "100.1%", "1.5", "50 %", "5%%",
     "nan", "inf", "1e3", "1_000", "0x10"],
)
def test_budget_parse_invalid(text: str) -> None:
    with pytest.raises(ConfigError, match="budget must be") as raised:
        Budget.parse(text)
    assert f"got '{text}'" in str(raised.value)


@pytest.mark.parametrize(
    ("fields", "bad_value"),
    [
        ({}, "keep_ratio=None"),
        ({"keep_ratio": 0.5, "num_tokens": 8}, "num_tokens=8"),
        ({"keep_ratio": 0.0}, "0.0"),
        ({"keep_ratio": 1.5}, "1.5"),
        ({"num_tokens": 0}, "0"),
        ({"num_tokens": -3}, "-3"),
        ({"num_tokens": True}, "True"),
        ({"num_tokens": 8, "num_sink_tokens": -1}, "-1"),
        ({"num_tokens": 8, "num_recent_tokens": -2}, "-2"),
    ],
)
def test_budget_rejects_bad_fields(fields: dict, bad_value: str) -> None:
    with pytest.raises(ConfigError, match="budget") as raised:
        Budget(**fields)
    assert bad_value in str(raised.value)


@pytest.mark.parametrize(
    ("budget", "num_logical_tokens", "num_keep_tokens"),
    [
        (Budget(keep_ratio=0.5), 10, 5),
        (Budget(keep_ratio=0.5), 11, 6),  # ceil: a ratio never keeps fewer than asked
        (Budget(keep_ratio=0.5), 0, 0),
        (Budget(keep_ratio=0.1), 30, 3),  # 0.1 * 30 is 3.0000000000000004 in floats
        (Budget(keep_ratio=1.0), 7, 7),
        (Budget(num_tokens=512), 100, 100),
        (Budget(num_tokens=512), 1000, 512),
    ],
)
def test_budget_num_keep_tokens(budget: Budget, num_logical_tokens: int, num_keep_tokens: int) -> None:
    assert budget.num_keep_tokens(num_logical_tokens) == num_keep_tokens


def test_budget_describe() -> None:
    assert Budget(keep_ratio=0.5).describe() == "keep 50% (4 sinks, 64 recent)"
    assert Budget.parse("12.5%").describe() == "keep 12.5% (4 sinks, 64 recent)"
    budget = Budget(num_tokens=512, num_sink_tokens=2, num_recent_tokens=16)
    assert budget.describe() == "keep 512 tokens (2 sinks, 16 recent)"


# --- The victim rule --------------------------------------------------------------------------


def test_protected_mask_covers_sinks_and_recent_window_over_holes() -> None:
    view = make_view(12, 5, token_ids=[0, 1, 3, 4, 6, 7, 8, 10, 11], num_recent_tokens=2)
    assert protected_mask(view).tolist() == [True, True, False, False, False, False, False, True, True]


def test_num_victims_evicts_down_to_budget() -> None:
    assert num_victims(make_view(12, 7)) == 5
    assert num_victims(make_view(12, 12)) == 0
    assert num_victims(make_view(12, 20)) == 0


def test_num_victims_never_reaches_into_protected_tokens() -> None:
    # 4 sinks + 4 recent = 8 protected out of 10: a budget of 2 can only evict the other 2.
    assert num_victims(make_view(10, 2, num_sink_tokens=4, num_recent_tokens=4)) == 2


# --- Each policy at a hand-checkable size -----------------------------------------------------
#
#   id:          0    1  |  2    3    4    5    6    7    8  |  9   10   11
#                sinks   |          evictable                |  recent (3)

H2O_SUMS = [9.0, 9.0, 0.5, 3.0, 0.1, 2.0, 0.5, 4.0, 0.2, 0.0, 0.0, 0.0]


def test_h2o_evicts_lowest_accumulated_attention() -> None:
    view = make_view(12, 7, attention_sum=H2O_SUMS)
    assert H2O().select_victims(view).tolist() == [2, 4, 5, 6, 8]


def test_h2o_breaks_ties_toward_the_older_token() -> None:
    # ids 2 and 6 both score 0.5; with 3 victims only one of them goes, and it is id 2.
    view = make_view(12, 9, attention_sum=H2O_SUMS)
    assert H2O().select_victims(view).tolist() == [2, 4, 8]


@pytest.mark.parametrize("policy_name", [name for name, cls in POLICIES.items() if cls.needs_attention])
def test_attention_policies_need_their_scores(policy_name: str) -> None:
    with pytest.raises(ConfigError, match=f"policy '{policy_name}' needs attention scores"):
        make_policy(policy_name).select_victims(make_view(12, 7))


@pytest.mark.parametrize("policy_name", list(POLICIES))
def test_a_policy_reads_only_the_scores_it_names(policy_name: str) -> None:
    """`score_fields` is what the sim computes for a policy: given only those, it decides as
    with every score (and a policy that needs none names none)."""
    rng = np.random.default_rng(3)
    scores = {"attention_sum": rng.random(12).tolist(), "attention_last": rng.random(12).tolist(),
              "importance_count": rng.integers(0, 4, 12).tolist()}
    policy = make_policy(policy_name)
    assert set(policy.score_fields) <= set(scores) and bool(policy.score_fields) == policy.needs_attention
    only_named = make_view(12, 6, **{name: scores[name] for name in policy.score_fields})
    assert policy.select_victims(only_named).tolist() == policy.select_victims(make_view(12, 6, **scores)).tolist()


def test_streaming_llm_keeps_sinks_and_the_newest_tokens() -> None:
    view = make_view(12, 5, token_ids=[0, 1, 3, 4, 6, 7, 8, 10, 11], num_recent_tokens=2)
    assert StreamingLLM().select_victims(view).tolist() == [3, 4, 6, 7]


def test_streaming_llm_ignores_scores() -> None:
    view = make_view(12, 7, attention_sum=H2O_SUMS)
    assert StreamingLLM().select_victims(view).tolist() == [2, 3, 4, 5, 6]


def test_streaming_llm_stops_at_protected_tokens() -> None:
    view = make_view(10, 2, num_sink_tokens=4, num_recent_tokens=4)
    assert StreamingLLM().select_victims(view).tolist() == [4, 5]


SCISSORHANDS_COUNTS = [0, 0, 3, 0, 1, 0, 2, 3, 0, 0, 0, 0]


def test_scissorhands_evicts_never_important_tokens_first() -> None:
    # Counts 0 at ids 3, 5, 8, then count 1 at id 4; sinks and recent with count 0 stay.
    view = make_view(12, 8, importance_count=SCISSORHANDS_COUNTS)
    assert Scissorhands().select_victims(view).tolist() == [3, 4, 5, 8]


def test_scissorhands_breaks_ties_toward_the_older_token() -> None:
    # Six victims: the four above, id 6 (count 2), then id 2 before id 7 (both count 3).
    view = make_view(12, 6, importance_count=SCISSORHANDS_COUNTS)
    assert Scissorhands().select_victims(view).tolist() == [2, 3, 4, 5, 6, 8]


def test_tova_evicts_lowest_latest_attention_not_the_sum() -> None:
    last = [0.3, 0.1, 0.05, 0.2, 0.01, 0.05, 0.1, 0.02, 0.3, 0.0, 0.0, 0.0]
    view = make_view(12, 8, attention_last=last, attention_sum=H2O_SUMS)
    assert TOVA().select_victims(view).tolist() == [2, 4, 5, 7]


def test_random_is_a_pure_function_of_seed_and_view() -> None:
    first = RandomPolicy(seed=3).select_victims(make_view(12, 8, req_id=5))
    again = RandomPolicy(seed=3).select_victims(make_view(12, 8, req_id=5))
    assert first.tolist() == again.tolist()
    # default_rng([0, 5, 12]).random(12) ranks ids 4, 3, 6, 8 lowest among the evictable 2..8.
    assert RandomPolicy(seed=0).select_victims(make_view(12, 8, req_id=5)).tolist() == [3, 4, 6, 8]


def test_random_draws_differ_across_requests() -> None:
    policy = RandomPolicy()
    victim_sets = {tuple(policy.select_victims(make_view(12, 8, req_id=req_id))) for req_id in range(10)}
    assert len(victim_sets) > 1


def test_random_is_uniform_over_unprotected_tokens() -> None:
    # One victim among the 7 evictable ids (2..8) for 700 requests: about 100 each.
    policy = RandomPolicy()
    victim_ids = np.concatenate([policy.select_victims(make_view(12, 11, req_id=req_id)) for req_id in range(700)])
    num_evictions_per_id = np.bincount(victim_ids, minlength=12)
    assert num_evictions_per_id[[0, 1, 9, 10, 11]].tolist() == [0, 0, 0, 0, 0]
    assert num_evictions_per_id[2:9].min() > 60 and num_evictions_per_id[2:9].max() < 140


@pytest.mark.parametrize("seed", [-1, True, 1.5])
def test_random_rejects_bad_seed(seed: object) -> None:
    with pytest.raises(ConfigError, match="seed"):
        RandomPolicy(seed=seed)


# --- Registry ---------------------------------------------------------------------------------


def test_registry_names_match_classes() -> None:
    assert list(POLICIES) == ["h2o", "streaming_llm", "scissorhands", "random", "tova"]
    for name in POLICIES:
        assert make_policy(name).name == name
    assert set(DEFAULT_AUDIT_POLICIES) <= set(POLICIES)


def test_make_policy_passes_the_seed() -> None:
    assert make_policy("random", seed=7) == RandomPolicy(seed=7)


def test_make_policy_rejects_unknown_name() -> None:
    expected = "unknown policy 'lru'; choose one of: h2o, streaming_llm, scissorhands, random, tova"
    with pytest.raises(ConfigError, match=expected):
        make_policy("lru")


# --- The contract, for every registered policy ------------------------------------------------


def scored_view(rng: np.random.Generator, token_ids: np.ndarray, **fields) -> RequestView:
    """A view with every score array filled, so any policy can run on it."""
    num_live_tokens = len(token_ids)
    return RequestView(
        token_ids=token_ids,
        attention_sum=rng.random(num_live_tokens),
        attention_last=rng.random(num_live_tokens),
        importance_count=rng.integers(0, 4, num_live_tokens).astype(np.int32),
        **fields,
    )


def assert_contract(victim_ids: np.ndarray, view: RequestView) -> None:
    assert victim_ids.dtype == np.int64
    assert np.all(np.diff(victim_ids) > 0), "ascending and distinct"
    assert np.isin(victim_ids, view.token_ids).all()
    assert len(victim_ids) == num_victims(view)
    assert not np.isin(victim_ids, view.token_ids[protected_mask(view)]).any()


def fixed_view(num_keep_tokens: int) -> RequestView:
    rng = np.random.default_rng(1234)
    token_ids = np.sort(rng.choice(40, size=30, replace=False)).astype(np.int64)
    return scored_view(
        rng, token_ids, req_id=9, num_logical_tokens=40, num_keep_tokens=num_keep_tokens,
        num_sink_tokens=4, num_recent_tokens=8,
    )


@pytest.mark.parametrize("policy_name", list(POLICIES))
def test_policy_contract(policy_name: str) -> None:
    view = fixed_view(num_keep_tokens=12)
    victim_ids = make_policy(policy_name).select_victims(view)
    assert num_victims(view) > 0
    assert_contract(victim_ids, view)
    assert make_policy(policy_name).select_victims(view).tolist() == victim_ids.tolist()


@pytest.mark.parametrize("policy_name", list(POLICIES))
@pytest.mark.parametrize("num_extra_tokens", [0, 5])
def test_policy_evicts_nothing_within_budget(policy_name: str, num_extra_tokens: int) -> None:
    view = fixed_view(num_keep_tokens=30 + num_extra_tokens)
    victim_ids = make_policy(policy_name).select_victims(view)
    assert victim_ids.dtype == np.int64 and victim_ids.tolist() == []


@st.composite
def request_views(draw: st.DrawFn) -> RequestView:
    num_logical_tokens = draw(st.integers(0, 48))
    is_live = draw(st.lists(st.booleans(), min_size=num_logical_tokens, max_size=num_logical_tokens))
    token_ids = np.flatnonzero(is_live).astype(np.int64)
    num_live_tokens = len(token_ids)
    # Few distinct score values, so ties are common and the tie rule is exercised.
    small_ints = st.lists(st.integers(0, 3), min_size=num_live_tokens, max_size=num_live_tokens)
    return RequestView(
        req_id=draw(st.integers(0, 2**32)),
        token_ids=token_ids,
        num_logical_tokens=num_logical_tokens,
        num_keep_tokens=draw(st.integers(0, num_logical_tokens + 2)),
        num_sink_tokens=draw(st.integers(0, 6)),
        num_recent_tokens=draw(st.integers(0, 12)),
        attention_sum=np.asarray(draw(small_ints), dtype=np.float64),
        attention_last=np.asarray(draw(small_ints), dtype=np.float64),
        importance_count=np.asarray(draw(small_ints), dtype=np.int32),
    )


@settings(max_examples=200, deadline=None)
@given(view=request_views(), seed=st.integers(0, 1000))
def test_policy_contract_property(view: RequestView, seed: int) -> None:
    for policy_cls in POLICIES.values():
        victim_ids = policy_cls(seed=seed).select_victims(view)
        assert_contract(victim_ids, view)
        assert policy_cls(seed=seed).select_victims(view).tolist() == victim_ids.tolist()
        if len(view.token_ids) <= view.num_keep_tokens:
            assert victim_ids.tolist() == []


def score_of(view: RequestView, policy_name: str) -> np.ndarray:
    return {
        "h2o": view.attention_sum,
        "tova": view.attention_last,
        "scissorhands": view.importance_count,
        "streaming_llm": view.token_ids,
    }[policy_name]


@settings(max_examples=200, deadline=None)
@given(view=request_views())
@pytest.mark.parametrize("policy_name", ["h2o", "tova", "scissorhands", "streaming_llm"])
def test_every_victim_ranks_below_every_kept_evictable_token(policy_name: str, view: RequestView) -> None:
    # Rank is (score, logical id): lowest score goes first, and equal scores go oldest first.
    victim_ids = make_policy(policy_name).select_victims(view)
    is_victim = np.isin(view.token_ids, victim_ids)
    is_kept_evictable = ~is_victim & ~protected_mask(view)
    scores = score_of(view, policy_name)
    victim_ranks = list(zip(scores[is_victim].tolist(), view.token_ids[is_victim].tolist()))
    kept_ranks = list(zip(scores[is_kept_evictable].tolist(), view.token_ids[is_kept_evictable].tolist()))
    assert not victim_ranks or not kept_ranks or max(victim_ranks) < min(kept_ranks)


@st.composite
def score_arrays(draw: st.DrawFn) -> np.ndarray:
    """Scores few and many, in orders that put the smallest anywhere (random, ascending,
    descending, a sawtooth, or at a strided sample's places), with ties from few distinct
    values, and an odd NaN, or NaN nearly everywhere (so that the k-th smallest of few is NaN)."""
    num_values = draw(st.one_of(st.integers(1, 600), st.integers(3000, 4000)))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    values = rng.pareto(1.5, num_values) if draw(st.booleans()) else rng.integers(0, draw(st.integers(1, 6)), num_values).astype(np.float64)
    order = draw(st.sampled_from(["random", "ascending", "descending", "sawtooth", "small-at-strides"]))
    if order == "ascending":
        values = np.sort(values)
    elif order == "descending":
        values = np.sort(values)[::-1].copy()
    elif order == "sawtooth":
        values = np.sort(values)[np.argsort(np.arange(num_values) % 64, kind="stable")]
    elif order == "small-at-strides":  # the smallest at every 64th place
        sampled = values[:: max(1, num_values // 64)]
        sampled[:] = values.min() - 1.0 - np.arange(sampled.size)
    nans = draw(st.sampled_from(["none", "one", "nearly all"]))
    if nans == "one" and num_values > 1:
        values[rng.integers(0, num_values)] = np.nan
    elif nans == "nearly all":
        values[rng.permutation(num_values)[: num_values - num_values // 64]] = np.nan
    elif draw(st.booleans()) and np.array_equal(values, np.round(values)):  # Scissorhands' counts are int32
        values = values.astype(np.int32)
    return values


@settings(max_examples=300, deadline=None)
@given(values=score_arrays(), data=st.data())
def test_lowest_positions_are_what_a_full_partition_selects(values: np.ndarray, data) -> None:
    """The heap (few of many) and the partition (many) give the positions numpy's partition of
    every value selects: all below the k-th smallest, then the lowest positions of its ties."""
    k = data.draw(st.one_of(st.integers(1, max(1, values.size // HEAP_MAX_SHARE)), st.integers(1, values.size)))  # few: the heap
    kth_value = np.partition(values, k - 1)[k - 1]
    chosen = values <= kth_value
    if np.count_nonzero(chosen) > k:
        chosen = values < kth_value
        chosen[np.flatnonzero(values == kth_value)[: k - int(np.count_nonzero(chosen))]] = True
    assert lowest_positions(values, k).tolist() == np.flatnonzero(chosen).tolist()



@settings(max_examples=300, deadline=None)
@given(view=request_views(), field=st.sampled_from(["attention_sum", "importance_count", "token_ids"]))
def test_evict_lowest_is_the_selection_over_the_unprotected_slice(view: RequestView, field: str) -> None:
    """The one compiled call selects what a sort of the tokens outside `protected_mask` by
    (score, id) gives, as many as `num_victims`; and its slice is the mask's complement."""
    scores = getattr(view, field)
    evictable = np.flatnonzero(~protected_mask(view))
    lo, hi = unprotected_range(view)
    assert evictable.tolist() == list(range(lo, hi))
    ranked = evictable[np.lexsort((view.token_ids[evictable], scores[evictable]))]
    expected = np.sort(view.token_ids[ranked[: num_victims(view)]])
    victim_ids = evict_lowest(view, scores)
    assert victim_ids.dtype == np.int64
    assert victim_ids.tolist() == expected.tolist()

# --- The substrate boundary -------------------------------------------------------------------


def imported_modules(source: str, package: str = "vtoken.policies") -> list[str]:
    """Absolute names of every module a source file imports, relative imports resolved."""
    names = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            names += [module] + [f"{module}.{alias.name}" for alias in node.names]
    return names


def is_forbidden(module: str) -> bool:
    return any(module == name or module.startswith(f"{name}.") for name in FORBIDDEN_MODULES)


def test_import_checker_catches_forbidden_imports() -> None:
    forbidden_sources = ["import torch", "import rich.console", "from typer import Typer",
                         "from vtoken.kv import pool", "from ..kv import pool", "from .. import kv"]
    for source in forbidden_sources:
        assert any(is_forbidden(module) for module in imported_modules(source)), source
    allowed_source = "import numpy as np\nfrom vtoken.errors import ConfigError\nfrom .base import RequestView"
    assert not any(is_forbidden(module) for module in imported_modules(allowed_source))


def test_policies_never_import_the_substrate_torch_or_the_cli() -> None:
    source_paths = sorted(POLICY_DIR.glob("*.py"))
    assert len(source_paths) >= 7
    for path in source_paths:
        forbidden = [module for module in imported_modules(path.read_text()) if is_forbidden(module)]
        assert forbidden == [], f"{path.name} imports {forbidden}"


@pytest.mark.parametrize("name, expected", [
    ("h2o", "h2o"), ("H2O", "h2o"), ("streamingllm", "streaming_llm"), ("Streaming-LLM", "streaming_llm"),
    ("streaming_llm", "streaming_llm"), ("TOVA", "tova"), ("Scissor_Hands", "scissorhands"),
])
def test_policy_names_are_read_loosely(name: str, expected: str) -> None:
    assert resolve_policy_name(name) == expected
    assert make_policy(name).name == expected


def test_an_unknown_policy_name_lists_the_registry() -> None:
    with pytest.raises(ConfigError, match=r"unknown policy 'lru'; choose one of: h2o, streaming_llm"):
        resolve_policy_name("lru")


def test_a_count_below_the_protected_tokens_is_refused_where_asked() -> None:
    budget = Budget.parse("10")
    assert budget.num_protected_tokens == 68 and budget.num_keep_tokens(100) == 10
    with pytest.raises(ConfigError, match=r"^--budget 10 is below the 68 tokens no policy evicts \(4 sinks \+ 64 recent\)"):
        budget.require_count_covers_protected("--budget")
    for fine in (Budget.parse("68"), Budget.parse("1%"), Budget.parse("10", 2, 8)):
        assert fine.require_count_covers_protected() is fine


def test_parse_names_where_the_budget_came_from() -> None:
    with pytest.raises(ConfigError, match=r"^--budget must be a keep ratio"):
        Budget.parse("lots", where="--budget")
