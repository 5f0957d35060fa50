"""vtoken.rounds: warm-up dropped, variants rotated over rounds, the spread of every figure."""

from __future__ import annotations

import math

import pytest

from vtoken.errors import ConfigError
from vtoken.rounds import figure_spreads, median_round, round_order, run_rounds, spread_of


def test_rounds_rotate_the_variants_after_a_dropped_warm_up():
    calls = []

    def replay(variant, round_idx):
        calls.append((variant, round_idx))
        return f"{variant}@{round_idx}"

    rounds = run_rounds(("a", "b", "c"), replay, num_rounds=4, num_warmup=1)
    assert calls == [("a", None), ("b", None), ("c", None),
                     ("a", 0), ("b", 0), ("c", 0), ("b", 1), ("c", 1), ("a", 1),
                     ("c", 2), ("a", 2), ("b", 2), ("a", 3), ("b", 3), ("c", 3)]
    assert rounds.record.order == (("a", "b", "c"), ("b", "c", "a"), ("c", "a", "b"), ("a", "b", "c"))
    assert rounds.record.num_rounds == 4 and rounds.record.num_warmup == 1
    # the warm-up's results are nowhere; every variant has one result per round, in round order
    assert rounds.results == {v: tuple(f"{v}@{r}" for r in range(4)) for v in "abc"}


def test_two_warm_ups_and_one_round():
    calls = []
    rounds = run_rounds(("x", "y"), lambda v, r: calls.append((v, r)) or r, num_rounds=1, num_warmup=2)
    assert calls == [("x", None), ("y", None), ("x", None), ("y", None), ("x", 0), ("y", 0)]
    assert rounds.results == {"x": (0,), "y": (0,)}


@pytest.mark.parametrize("num_rounds, num_warmup, message", [(0, 1, "--rounds must be > 0"), (2, -1, "--warmup")])
def test_bad_rounds_are_config_errors(num_rounds, num_warmup, message):
    with pytest.raises(ConfigError, match=message):
        run_rounds(("a",), lambda v, r: None, num_rounds, num_warmup)


def test_round_order_wraps():
    assert [round_order(("a", "b"), r) for r in range(3)] == [("a", "b"), ("b", "a"), ("a", "b")]


def test_spread_min_median_max_in_round_order():
    spread = spread_of([3.0, 1.0, 2.0, 10.0])
    assert (spread.min, spread.median, spread.max) == (1.0, 2.5, 10.0)
    assert spread.values == (3.0, 1.0, 2.0, 10.0)
    with_nan = spread_of([float("nan"), 4.0, 2.0])
    assert (with_nan.min, with_nan.median, with_nan.max) == (2.0, 3.0, 4.0) and math.isnan(with_nan.values[0])
    assert math.isnan(spread_of([float("nan")]).median)


def test_median_round_is_the_lower_middle_and_nan_last():
    assert median_round([5.0, 1.0, 3.0]) == 2
    assert median_round([4.0, 1.0, 3.0, 2.0]) == 3  # sorted 1, 2, 3, 4: the lower middle is 2.0, round 3
    assert median_round([float("nan"), 2.0, 1.0]) == 1
    assert median_round([7.0]) == 0


def test_figure_spreads_cover_every_run_figure(sim_run):
    spreads = figure_spreads([sim_run, sim_run])
    assert {"throughput_tok_s", "latency_p95_s", "ttft_p50_s", "tpot_p50_s", "makespan_s", "waste_ratio"} <= set(spreads)
    assert spreads["throughput_tok_s"].values == (sim_run.throughput_tok_s,) * 2


@pytest.fixture(scope="module")
def sim_run():
    from vtoken.engine import run_sim
    from vtoken.trace import Request
    from vtoken_cli.options import build_experiment

    experiment = build_experiment(model="llama-3.1-8b", gpu="h100-80gb", num_blocks=200, gpu_mem_util=0.9,
                                  block_size=16, policy="h2o", budget="50%", eviction_interval=16,
                                  reclaim_mode="hole-fill", theta_f=0.25, seed=0, sim_profile=None)
    return run_sim(experiment.run("vtoken", 2), [Request(str(i), 0.0, 64 + 8 * i, 32) for i in range(3)])
