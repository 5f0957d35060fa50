"""The invariant checker on the hf executor, with a tiny random Llama built offline: I1 compares
the model's real K/V across every relocation, clean runs pass, each fault is caught by the
invariant it breaks, copies stay in flight across real forwards, and the CLI's exit codes and
--json contract."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from vtoken.checker import (
    FAULT_DETECTED_BY, FAULT_KINDS, HF_LIMITS, INVARIANTS, CheckOptions, TraceLimits, check_invariants, report_to_json,
)
from vtoken.checker import observer as observer_module
from vtoken.checker.hf import TINY_MODEL_NAME, load_check_model
from vtoken.checker.snapshots import ModelKVSnapshots
from vtoken.engine.experiment import Experiment
from vtoken.kv.block_pool import BlockPool
from vtoken.kv.kv_cache import KVShape, PagedKVCache
from vtoken.kv.reclaim import ReclaimConfig, Reclaimer
from vtoken.kv.token_table import TokenTable
from vtoken.trace import load_trace
from vtoken_cli.app import app
from vtoken_cli.options import build_experiment

# Two requests share a 64-token prefix (4 pinned blocks: the shared-block fault needs them);
# all have free tokens to evict and relocate.
TRACE_LINES = (
    '{"request_id": "doc-0", "timestamp": 0, "input_length": 200, "output_length": 40, "prefix_id": "doc", "prefix_length": 64}',
    '{"request_id": "doc-1", "timestamp": 0, "input_length": 180, "output_length": 40, "prefix_id": "doc", "prefix_length": 64}',
    '{"request_id": "solo-2", "timestamp": 0, "input_length": 150, "output_length": 40}',
    '{"request_id": "solo-3", "timestamp": 0, "input_length": 220, "output_length": 36}',
)
ONE = CheckOptions(policies=("h2o",), reclaim_modes=("hole-fill",), executor="hf", limits=TraceLimits(None, None, None))
ONE_RUN = ["--executor", "hf", "--policy", "h2o", "--reclaim-mode", "hole-fill", "--eviction-interval", "16"]

runner = CliRunner()


@pytest.fixture(scope="module")
def tiny():
    return load_check_model(None, "cpu")


@pytest.fixture(scope="module")
def trace_path(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("hf_check") / "prefixed.jsonl"
    path.write_text("\n".join(TRACE_LINES) + "\n")
    return path


def make_base() -> Experiment:
    """What `vtoken check-invariants --eviction-interval 16` builds."""
    return build_experiment(model="llama-3.1-8b", gpu="h100-80gb", num_blocks=None, gpu_mem_util=0.9, block_size=16,
                            policy="h2o", budget="50%", eviction_interval=16, reclaim_mode="hole-fill", theta_f=0.05,
                            seed=0, sim_profile=None, reclaim_interval=1)


def violated(report) -> set[str]:
    return {name for name, tally in report.tallies.items() if tally.violations}


def without_timings(payload: dict) -> dict:
    payload = {k: v for k, v in payload.items() if k not in ("elapsed_s", "relocation_events_per_s")}
    payload["runs"] = [{k: v for k, v in run.items() if k != "elapsed_s"} for run in payload["runs"]]
    return payload


# ---- I1 on real K/V: snapshots ----------------------------------------------------------------------


def test_snapshots_compare_each_token_bit_for_bit_where_it_is_mapped_now() -> None:
    """block 0: [0 . . 3]  block 1: [4 5 6 7]  block 2: [8 9 . .]  block 3 (tail): [12 13 . .];
    the hole-fill plan moves tokens 8, 9 into slots 1, 2 (block 0)."""
    kv_cache = PagedKVCache(KVShape(num_layers=2, num_blocks=8, block_size=4, num_kv_heads=2, head_dim=8))
    kv_cache.data.copy_(torch.randn(kv_cache.data.shape, generator=torch.Generator().manual_seed(0)))
    pool = BlockPool(8, 4)
    table = TokenTable(0, pool)
    table.sync_new_tokens(pool.allocate(4), 14)
    table.evict_tokens(np.array([1, 2, 10, 11]))
    (plan,) = Reclaimer(ReclaimConfig(mode="hole-fill"), pool).plan([table])
    assert plan.moves.token_ids.tolist() == [8, 9] and plan.moves.dst_slots(4).tolist() == [1, 2]
    snapshots = ModelKVSnapshots(kv_cache)
    live_ids = table.live_token_ids()

    snapshots.snapshot(plan, table)
    kv_cache.copy_slots(torch.tensor([8, 9]), torch.tensor([1, 2]))
    table.apply_moves(plan.moves)
    assert not snapshots.lost(table, live_ids, table.slots()).any()

    snapshots.snapshot(plan, table)  # the next plan's: now token 9 lives in slot 2
    want = kv_cache.read(torch.tensor([2])).clone()
    element = kv_cache.flat[1, 0, 2, 1, 7]  # one element of one token, in the last layer, one ulp up
    kv_cache.flat[1, 0, 2, 1, 7] = torch.nextafter(element, element + 1)
    lost = snapshots.lost(table, live_ids, table.slots())
    assert live_ids[lost].tolist() == [9]
    assert torch.equal(kv_cache.read(torch.tensor([2])), want)  # restored: reported once


def test_snapshots_skip_the_pinned_prefix_and_tokens_evicted_in_flight() -> None:
    kv_cache = PagedKVCache(KVShape(num_layers=1, num_blocks=8, block_size=4, num_kv_heads=1, head_dim=4))
    pool = BlockPool(8, 4)
    table = TokenTable(0, pool)
    table.sync_new_tokens(pool.allocate(4), 14)
    table.pin_prefix(4)
    table.evict_tokens(np.array([5, 6, 10, 11]))
    (plan,) = Reclaimer(ReclaimConfig(mode="hole-fill"), pool).plan([table])
    snapshots = ModelKVSnapshots(kv_cache)
    snapshots.snapshot(plan, table)
    kv_cache.flat[:, :, 0:4] = 7.0  # a sharer's prefill rewrites the pinned prefix
    kv_cache.flat[:, :, 12] = 7.0  # token 12 changes, but it is evicted before the copy lands
    table.evict_tokens(np.array([12]))
    live_ids = table.live_token_ids()
    assert not snapshots.lost(table, live_ids, table.slots()).any()


# ---- the library on the tiny model ----------------------------------------------------------------


def test_a_clean_run_on_the_model_passes_in_both_modes(tiny, trace_path) -> None:
    options = replace(ONE, policies=("h2o", "streaming_llm"), reclaim_modes=("hole-fill", "ordered"))
    report = check_invariants([load_trace(trace_path)], make_base(), options, model=tiny)
    assert report.passed, [t.first_violation for t in report.tallies.values()]
    assert [(r.policy, r.reclaim_mode) for r in report.runs] == [
        ("h2o", "hole-fill"), ("h2o", "ordered"), ("streaming_llm", "hole-fill"), ("streaming_llm", "ordered")]
    assert all(run.relocation_events > 0 and run.num_completed == run.num_requests == 4 for run in report.runs)
    assert report.tallies["I1"].checked == report.relocation_events
    assert report.tallies["I4"].checked >= report.relocation_events and report.tallies["I3"].checked > 0
    assert (report.device, report.copy_mode) == ("cpu", "deferred")
    assert vars(report.kv_layout) == {"num_layers": 2, "num_kv_heads": 2, "head_dim": 16, "dtype": "float32"}
    assert report.base.model.name == TINY_MODEL_NAME and any("temporary directory" in note for note in report.notes)


def test_forwards_run_while_copies_are_in_flight_and_read_only_their_sources(tiny, trace_path, monkeypatch) -> None:
    """The deferred copy engine keeps each plan in flight across the model's next forward: the
    I3 checks of those forwards see the plan, and still pass (the table is repointed later)."""
    num_in_flight = []
    on_forward = observer_module.CheckingObserver.on_forward

    def counting(self, batch, in_flight_plans):
        num_in_flight.append(len(in_flight_plans))
        on_forward(self, batch, in_flight_plans)

    monkeypatch.setattr(observer_module.CheckingObserver, "on_forward", counting)
    report = check_invariants([load_trace(trace_path)], make_base(), ONE, model=tiny)
    assert report.passed and report.relocation_events > 0
    assert sum(num_in_flight) >= report.relocation_events  # every plan, counted at each forward it spans


@pytest.mark.parametrize("fault", FAULT_KINDS)
def test_each_fault_is_caught_on_the_model_by_the_invariant_it_breaks(tiny, trace_path, fault) -> None:
    report = check_invariants([load_trace(trace_path)], make_base(), replace(ONE, fault=fault), model=tiny)
    expected = FAULT_DETECTED_BY[fault]
    assert violated(report) == {expected}
    assert sum(run.faults_injected for run in report.runs) > 0
    first = report.tallies[expected].first_violation
    assert first.invariant == expected and first.request_id is not None and first.block_id is not None


def test_a_dropped_copy_is_reported_where_the_token_now_lives(tiny, trace_path) -> None:
    report = check_invariants([load_trace(trace_path)], make_base(), replace(ONE, fault="drop-copy"), model=tiny)
    first = report.tallies["I1"].first_violation
    assert "reads wrong K/V" in first.message and first.token_id is not None and first.offset is not None
    assert report.tallies["I3"].violations == 0  # the lost K/V was restored after the report


def test_without_a_model_the_hf_check_runs_a_tiny_random_llama() -> None:
    report = check_invariants([], make_base(), ONE)
    assert report.base.model.name == TINY_MODEL_NAME and report.runs == ()
    assert any("temporary directory" in note for note in report.notes)


# ---- the CLI -------------------------------------------------------------------------------------------


def invoke(*args: str):
    return runner.invoke(app, ["check-invariants", *args])


def test_the_default_hf_check_passes_on_a_tiny_model_and_says_so() -> None:
    result = invoke("--executor", "hf")
    assert result.exit_code == 0, result.output
    printed = " ".join(result.stdout.replace("│", " ").split())  # as one line: rich wraps inside its panel
    for text in ("model tiny-random-llama (K/V of 2 layers", "executor hf;", "a random 2-layer Llama built in a temporary directory",
                 "azure_conv_sample.csv", "shared_prefix.jsonl", "streaming_llm", "ordered", "PASSED",
                 f"first {HF_LIMITS.max_requests} of"):
        assert text in printed


@pytest.mark.parametrize("fault", FAULT_KINDS)
def test_each_fault_exits_1_on_the_model(trace_path, fault) -> None:
    result = invoke(str(trace_path), *ONE_RUN, "--inject-fault", fault, "--json")
    assert result.exit_code == 1, result.output
    payload = json.loads(result.stdout)
    expected = FAULT_DETECTED_BY[fault]
    assert payload["passed"] is False
    assert {name for name, tally in payload["invariants"].items() if tally["violations"]} == {expected}
    assert payload["fault"] == {"kind": fault, "expected_invariant": expected, "num_injected": payload["fault"]["num_injected"]}
    assert payload["fault"]["num_injected"] > 0
    first = payload["invariants"][expected]["first_violation"]
    assert first["invariant"] == expected and expected in first["message"] and first["block_id"] >= 0


def test_json_on_the_model_has_the_sim_keys_and_equals_the_library_result(trace_path, tiny) -> None:
    result = invoke(str(trace_path), *ONE_RUN, "--reclaim-mode", "both", "--json")
    assert result.exit_code == 0, result.output
    printed = json.loads(result.stdout)
    sim = json.loads(invoke(str(trace_path), "--policy", "h2o", "--max-requests", "2", "--json").stdout)
    assert printed.keys() == sim.keys() and printed["config"].keys() == sim["config"].keys()
    assert list(printed["invariants"]) == list(INVARIANTS) and printed["passed"] is True and printed["fault"] is None
    config = printed["config"]
    assert (config["executor"], config["model"], config["device"], config["copy_mode"]) == (
        "hf", TINY_MODEL_NAME, "cpu", "deferred")
    assert config["kv_shape"] == {"num_layers": 2, "num_kv_heads": 2, "head_dim": 16, "dtype": "float32"}
    assert config["limits"] == vars(HF_LIMITS)
    assert any("temporary directory" in note for note in printed["notes"])
    assert printed["relocation_events"] > 0
    assert [(g["policy"], g["reclaim_mode"]) for g in printed["by_policy_mode"]] == [("h2o", "hole-fill"), ("h2o", "ordered")]

    options = replace(ONE, reclaim_modes=("hole-fill", "ordered"), limits=HF_LIMITS)
    report = check_invariants([load_trace(trace_path)], make_base(), options, model=tiny)
    assert without_timings(printed) == without_timings(json.loads(json.dumps(report_to_json(report))))


@pytest.mark.parametrize("args, message", [
    (["--executor", "hf", "--model", "/no/such/model"], "--model '/no/such/model': not 'smollm2-135m'"),
])
def test_bad_hf_input_is_one_line_and_exit_2(args, message) -> None:
    result = invoke(*args)
    assert result.exit_code == 2, result.output
    assert message in result.output and "Traceback" not in result.output
    assert result.output.strip().count("\n") == 0
