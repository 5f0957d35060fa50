"""The replayers behind `vtoken compare`: each resolves its own block budget and model geometry,
the sim replays every distinct run once, and the CLI chooses an executor through the registry
only (no `executor ==` dispatch in vtoken_cli/)."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import pytest

from vtoken import defaults
from vtoken.compare import CompareOptions, compare, num_progress_units
from vtoken.engine.experiment import EvictionConfig, Experiment, Run
from vtoken.errors import ConfigError
from vtoken.hardware import num_blocks_for_gpu, resolve_gpu
from vtoken.kv.reclaim import ReclaimConfig
from vtoken.model_spec import resolve_model
from vtoken.policies.base import Budget
from vtoken.replay import REPLAYERS, HFReplayer, SimReplayer, make_replayer, model_folder
from vtoken.runners import SerialRunner
from vtoken.trace import Request, Trace

ROOT = Path(__file__).resolve().parent.parent
REQUESTS = tuple(Request(f"r{i}", 0.1 * i, 64 + 16 * i, 24 + 4 * i) for i in range(6))
TRACE = Trace(REQUESTS, "inline", "jsonl")


def make_experiment(**overrides) -> Experiment:
    experiment = Experiment(resolve_model("llama-3.1-8b"), resolve_gpu("h100"), num_blocks=64, block_size=16,
                            eviction=EvictionConfig("h2o", Budget(keep_ratio=0.5), 8),
                            reclaim=ReclaimConfig(theta_f=0.05, check_interval_steps=1))
    return replace(experiment, **overrides)


def make_run(concurrency: int | None = 4, **overrides) -> Run:
    return make_experiment(**overrides).run("vtoken", concurrency)


class CountingRunner(SerialRunner):
    """The serial runner, counting the replays it really makes."""

    def __init__(self) -> None:
        self.replayed: list[tuple] = []  # (variant, concurrency, number of requests, all admitted at once)

    def map(self, func, jobs, on_done=None, on_tokens=None):
        self.replayed += [(j.run.spec.variant, j.run.spec.concurrency, len(j.requests), j.run.spec.admit_all_at_start)
                          for j in jobs]
        return super().map(func, jobs, on_done, on_tokens)


class CountingReplayer(SimReplayer):
    """The sim replayer on a counting runner."""

    def __init__(self, **kwargs) -> None:
        super().__init__(runner=CountingRunner(), **kwargs)

    @property
    def replayed(self) -> list[tuple]:
        return self.runner.replayed


def test_the_registry_names_every_executor() -> None:
    assert list(REPLAYERS) == ["sim", "hf", "vllm"]
    assert isinstance(make_replayer("sim"), SimReplayer)
    with pytest.raises(ConfigError, match="unknown executor 'tpu'; choose one of: sim, hf, vllm"):
        make_replayer("tpu")


def test_sim_resolves_the_budget_from_the_gpu_when_none_is_given() -> None:
    experiment = make_experiment()
    resolved = make_replayer("sim", gpu_mem_util=0.5).resolve(experiment, REQUESTS, 4, None)
    assert resolved.num_blocks == num_blocks_for_gpu(experiment.model, experiment.gpu, 0.5, 16)
    assert resolved.num_blocks > 1000 and resolved.model == experiment.model
    assert make_replayer("sim").resolve(experiment, REQUESTS, 4, 123).num_blocks == 123


def test_a_command_s_experiment_leaves_unset_limits_to_the_replayer() -> None:
    from vtoken_cli.options import build_experiment

    experiment = build_experiment(model=defaults.MODEL, gpu="h100-80gb", num_blocks=None, gpu_mem_util=0.9,
                                  block_size=16, policy="h2o", budget="50%", eviction_interval=1,
                                  reclaim_mode="hole-fill", theta_f=0.3, seed=0, sim_profile=None,
                                  scheduler={"max_num_seqs": 7})
    assert (experiment.scheduler.max_num_batched_tokens, experiment.scheduler.max_num_seqs) == (None, 7)
    resolved = SimReplayer().resolve(experiment, [], None)
    assert resolved.scheduler == experiment.scheduler.with_defaults(resolved.gpu)  # vllm serve's on the GPU
    assert resolved.scheduler.max_num_batched_tokens == 8192 and resolved.scheduler.max_num_seqs == 7


def test_hf_sizes_the_budget_for_concurrency_full_length_requests(tiny_model) -> None:
    replayer = HFReplayer(tiny_model)
    experiment = make_experiment(block_size=4)
    resolved = replayer.resolve(experiment, REQUESTS, 2, None)
    # the two longest requests at full length: (144 + 44) and (128 + 40) tokens, 4 per block, plus one
    assert resolved.num_blocks == 188 // 4 + 168 // 4 + 1
    assert resolved.model == tiny_model.spec
    assert replayer.resolve(experiment, REQUESTS, 2, 99).num_blocks == 99
    assert not (replayer.supports_sweep or replayer.supports_frontier or replayer.supports_repeats)


def test_hf_cannot_repeat_and_skips_the_sweep_and_frontier(tiny_model) -> None:
    with pytest.raises(ConfigError, match="--repeats applies to the sim executor; --executor hf runs once"):
        compare(TRACE, make_experiment(), CompareOptions((1,), repeats=2, concurrency=4), HFReplayer(tiny_model))
    replays = defaults.MEASURED_WARMUP + defaults.MEASURED_ROUNDS  # per variant: the warm-up replays are work too
    assert (num_progress_units(TRACE, CompareOptions((1, 2)), HFReplayer(tiny_model))
            == replays * 3 * sum(r.num_output_tokens for r in REQUESTS))


def test_a_default_compare_replays_each_distinct_run_once() -> None:
    options = CompareOptions((1, 2, 4), concurrency=4)  # sweep at 1, 2, 4 and C_ref 8; the headline at concurrency 4
    replayer = CountingReplayer()
    report = compare(TRACE, make_experiment(), options, replayer, num_blocks=64)
    num_sweep, num_frontier = 3 * len(options.sweep_concurrencies), 3 * len(options.concurrencies)
    assert len(replayer.replayed) == 3 + num_sweep + num_frontier - 3  # the headline runs are sweep points at C=4
    assert len(set(replayer.replayed)) == len(replayer.replayed)
    headline = {v: r for v, r in report.runs.items()}
    at_4 = {p.variant: p for p in report.sweep if p.concurrency == 4}
    assert all(at_4[v].throughput_tok_s == headline[v].throughput_tok_s for v in headline)
    fresh = compare(TRACE, make_experiment(), options, SimReplayer(), num_blocks=64)
    assert fresh.sweep == report.sweep and fresh.frontier == report.frontier


def test_a_replay_is_reused_only_for_the_same_run_and_requests() -> None:
    replayer = CountingReplayer()
    run = make_experiment().run("vtoken", 4)
    first = replayer.run(run, REQUESTS)
    assert replayer.run(make_experiment().run("vtoken", 4), REQUESTS) is first
    replayer.run(make_experiment(seed=1).run("vtoken", 4), REQUESTS)
    replayer.run(make_experiment().run("vtoken", 2), REQUESTS)
    replayer.run(run, REQUESTS[:3])
    assert len(replayer.replayed) == 4


def test_hf_hands_over_the_model_its_replays_run_on(tiny_model) -> None:
    replayer = HFReplayer(tiny_model)
    assert replayer.loaded_model() is tiny_model
    assert replayer.resolve(make_experiment(block_size=4), REQUESTS, 2).model == tiny_model.spec
    with pytest.raises(ConfigError, match="--executor hf needs --model: smollm2-135m or a local model folder"):
        HFReplayer(None).loaded_model()


def test_a_folder_is_loaded_once_and_validate_replays_on_the_replayers_model(tmp_path) -> None:
    from vtoken.calibration.engines import open_engine
    from vtoken.models.tiny import build_tiny_model

    folder = build_tiny_model(tmp_path / "tiny")
    replayer = HFReplayer(str(folder))
    model = replayer.loaded_model()
    assert model.path == folder and replayer.loaded_model() is model
    with open_engine("hf", str(folder), make_experiment(block_size=4), REQUESTS, 2) as (engine, resolved):
        assert engine.model.path == folder and resolved.model == engine.model.spec


def test_model_folder_is_the_one_resolution_of_a_real_engines_model(tmp_path) -> None:
    from vtoken.checker.vllm import VllmChecker
    from vtoken.models.tiny import build_tiny_model

    folder = build_tiny_model(tmp_path / "tiny")
    assert model_folder("vllm", str(folder)) == folder
    assert VllmChecker(str(folder)).model_folder() == folder
    with pytest.raises(ConfigError, match="--executor vllm needs --model: smollm2-135m or a local model folder"):
        model_folder("vllm", None)
    with pytest.raises(ConfigError, match="--executor vllm needs --model"):
        VllmChecker(None).model_folder()
    with pytest.raises(ConfigError, match="not 'smollm2-135m' and not a folder with a config.json"):
        model_folder("vllm", str(tmp_path / "nowhere"))


def test_the_cli_chooses_no_executor_itself() -> None:
    dispatch = re.compile(r"executor\s*(==|!=|in\s*\(|not\s+in\s*\()")
    offenders = [f"{path.relative_to(ROOT)}:{i}" for path in sorted((ROOT / "vtoken_cli").rglob("*.py"))
                 for i, line in enumerate(path.read_text().splitlines(), 1) if dispatch.search(line)]
    assert offenders == []


@pytest.fixture(scope="module")
def tiny_model():
    from vtoken.checker.hf import load_check_model

    return load_check_model(None, "cpu")
