"""An experiment and one run of it (vtoken/engine/experiment.py): what each validates, what a run
shares with its experiment, and what differs between the runs of one experiment."""

from __future__ import annotations

from dataclasses import FrozenInstanceError, replace

import pytest

from vtoken.engine import Experiment, Run, RunSpec, SchedulerConfig
from vtoken.errors import ConfigError
from vtoken.hardware import resolve_gpu
from vtoken.model_spec import resolve_model


def make_experiment(**overrides) -> Experiment:
    return Experiment(resolve_model("llama-3.1-8b"), resolve_gpu("h100"), num_blocks=100, **overrides)


@pytest.mark.parametrize(("build", "message"), [
    (lambda: make_experiment(block_size=0), "block size must be > 0 tokens, got 0"),
    (lambda: Experiment(resolve_model("llama-3.1-8b"), resolve_gpu("h100"), num_blocks=0),
     "the KV budget must be > 0 blocks, got 0"),
    (lambda: SchedulerConfig(max_num_seqs=0), "max_num_seqs must be > 0, got 0"),
    (lambda: SchedulerConfig(max_num_batched_tokens=-1), "max_num_batched_tokens must be > 0, got -1"),
    (lambda: SchedulerConfig(long_prefill_token_threshold=-1), "long_prefill_token_threshold must be >= 0, got -1"),
    (lambda: RunSpec("greedy", 4), "unknown variant 'greedy'; choose one of: native, naive-evict, vtoken"),
    (lambda: RunSpec("vtoken", 0), "concurrency must be > 0, got 0"),
    (lambda: make_experiment().run("vtoken", -2), "concurrency must be > 0, got -2"),
    (lambda: make_experiment().run("vtoken", 4).with_variant("lru"), "unknown variant 'lru'"),
])
def test_each_part_refuses_what_it_cannot_run(build, message) -> None:
    with pytest.raises(ConfigError, match=message):
        build()


def test_a_run_pairs_its_experiment_with_a_spec() -> None:
    experiment = make_experiment(scheduler=SchedulerConfig(max_num_seqs=32))
    run = experiment.run("naive-evict", None, admit_all_at_start=True)

    assert run == Run(experiment, RunSpec("naive-evict", None, True))
    assert run.experiment is experiment and run.spec.concurrency is None and run.spec.admit_all_at_start
    assert run.spec.evicts and not run.spec.reclaims
    assert RunSpec("vtoken", 1).reclaims and not RunSpec("native", 1).evicts


def test_the_variants_of_one_run_share_everything_else() -> None:
    run = make_experiment(seed=7).run("native", 8)
    other = run.with_variant("vtoken")

    assert other.experiment is run.experiment
    assert other.spec == replace(run.spec, variant="vtoken") and other.spec.concurrency == 8
    assert other != run and hash(run.with_variant("native")) == hash(run)  # a cache and a dict key


def test_experiments_and_run_specs_are_frozen() -> None:
    run = make_experiment().run("vtoken", 4)
    with pytest.raises(FrozenInstanceError):
        run.experiment.num_blocks = 5  # type: ignore[misc]
    with pytest.raises(FrozenInstanceError):
        run.spec.variant = "native"  # type: ignore[misc]
