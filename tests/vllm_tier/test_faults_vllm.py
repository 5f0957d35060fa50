"""Faults inside vLLM (`check-invariants --executor vllm --inject-fault KIND`).

Each fault corrupts the real thing inside one in-process engine (the model runner's KV copies or
read lengths, or the scheduler's token tables: parts the engine is given, `put_fault`), and
the check that runs inside vLLM's scheduler and worker catches it with the invariant
FAULT_DETECTED_BY names. With the checks off, the same
fault makes the engine compute something else than the transformers reference it matches
without the fault (test_exactness.py), or break down.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from tests.vllm_tier.conftest import VLLM_MISSING, VLLM_PROBE, prompts

pytest.importorskip(VLLM_PROBE, reason=VLLM_MISSING)

from vtoken.checker.faults import FAULT_DETECTED_BY, FAULT_KINDS, FAULTS, make_fault  # noqa: E402
from vtoken.engine.vllm.engine import EngineSpec, generate, model_runner_of, open_llm, scheduler_of  # noqa: E402
from vtoken.engine.vllm.reference import reference_logprobs  # noqa: E402
from vtoken.checker.vllm import put_fault  # noqa: E402
from vtoken.engine.vllm.settings import settings_from_additional_config  # noqa: E402
from vtoken.errors import InvariantError, VTokenError  # noqa: E402
from vtoken_cli.app import app  # noqa: E402

VLLM_FAULTS = [kind for kind in FAULT_KINDS if FAULTS[kind].vllm_refusal is None]
MAX_TOKENS = 24
runner = CliRunner()


def settings(check_invariants: bool):
    return settings_from_additional_config({"vtoken": {
        "variant": "vtoken", "policy": "streaming_llm", "budget": 40, "num_sink_tokens": 4, "num_recent_tokens": 16,
        "interval_tokens": 8, "reclaim_mode": "hole-fill", "theta_f": 0.01, "check_invariants": check_invariants}})


def spec(model_dir: str) -> EngineSpec:
    return EngineSpec(model_dir, kv_cache_memory_bytes=8 << 20, max_model_len=1024)


def test_every_fault_but_shared_block_goes_into_vllm():
    assert VLLM_FAULTS == ["drop-copy", "stale-slot", "double-map", "early-read"]


@pytest.mark.parametrize("kind", VLLM_FAULTS)
def test_each_fault_exits_1_caught_by_the_invariant_it_breaks(kind, tiny_model_dir):
    result = runner.invoke(app, ["check-invariants", "--executor", "vllm", "--model", tiny_model_dir,
                                 "--max-requests", "3", "--inject-fault", kind, "--json"])
    assert result.exit_code == 1, result.output
    payload = json.loads(result.stdout[result.stdout.index("{"):])
    expected = FAULT_DETECTED_BY[kind]
    assert payload["passed"] is False and payload["config"]["executor"] == "vllm"
    assert {name for name, tally in payload["invariants"].items() if tally["violations"]} == {expected}
    assert payload["fault"]["kind"] == kind and payload["fault"]["expected_invariant"] == expected
    assert payload["fault"]["num_injected"] > 0
    first = payload["invariants"][expected]["first_violation"]
    assert first["invariant"] == expected and first["message"].startswith(f"{expected} violated")
    assert (first["scenario"], first["policy"], first["reclaim_mode"]) == ("azure_conv_sample.csv naive-evict", "h2o",
                                                                           "hole-fill")
    (run,) = payload["runs"]  # the check stops at the first violation
    assert run["stopped"] == f"stopped after an {expected} violation raised inside vLLM's step"


@pytest.mark.parametrize("kind", ["drop-copy", "stale-slot", "early-read"])
def test_with_the_checks_off_the_fault_changes_what_the_model_computes(kind, tiny_model_dir, reference_model):
    fault = make_fault(kind)
    with open_llm(spec(tiny_model_dir), settings(check_invariants=False), record_events=True) as llm:
        put_fault(llm, fault)
        generations = generate(llm, prompts(), MAX_TOKENS)
    assert fault.num_injected > 0
    errors = [np.abs(np.array(g.logprobs) - reference_logprobs(reference_model, g.prompt_ids, g.token_ids, g.events)).max()
              for g in generations]
    assert all(g.events for g in generations), "the budget should have forced evictions"
    assert max(errors) > 1e-4, f"{kind}: the engine still matches the reference (max |log p error| {max(errors):.1e})"


def test_with_the_checks_off_a_double_map_breaks_the_next_compaction(tiny_model_dir):
    fault = make_fault("double-map")
    with open_llm(spec(tiny_model_dir), settings(check_invariants=False)) as llm:
        put_fault(llm, fault)
        with pytest.raises(VTokenError):
            generate(llm, prompts(), MAX_TOKENS)
    assert fault.num_injected > 0


class LogicalWriteSlots:
    """New K/V goes to each token's logical position, not its physical one (a runner part)."""

    def read_offsets(self, num_evicted):
        return num_evicted

    def write_offsets(self, num_evicted):
        return {}


def test_a_new_token_written_off_its_table_slot_is_an_i3_violation(tiny_model_dir):
    """The write half of the worker's I3 check: new K/V at the logical position instead of the
    physical one the token table gives it (no fault kind corrupts this)."""
    with open_llm(spec(tiny_model_dir), settings(check_invariants=True)) as llm:
        model_runner_of(llm).vtoken_use(lengths=LogicalWriteSlots())
        with pytest.raises(InvariantError, match=r"I3 violated: request \S+ writes a new token's K/V to block \d+"):
            generate(llm, prompts(), MAX_TOKENS)
        assert scheduler_of(llm).vtoken.counters.eviction_events > 0
