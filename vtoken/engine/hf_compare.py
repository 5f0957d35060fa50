"""What a replay on a real engine measured beyond the `RunResult`s (`MeasuredExtras`), and the
three variants on a transformers model (`compare_on_model`): measured speed, output quality
against native, and agreement between naive-evict and vtoken (the same eviction decisions must
give the same tokens and log-probabilities).

    per-token latency   TPOT of the measured forward times, mean over requests
    x native            a variant's per-token latency / native's
    engine wall         the whole engine loop (forwards, policy, reclaimer, copies)
    ROUGE-L, length     against native's text, up to the first EOS (`hf_oracle`)

Importable without torch: the types are what `vtoken.compare` reports; the model runs are
imported when they run.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from vtoken.engine.config import VARIANTS, Experiment
from vtoken.metrics import RunResult
from vtoken.trace import Request

if TYPE_CHECKING:
    from vtoken.engine.hf import HFRun
    from vtoken.engine.hf_oracle import Agreement, Quality
    from vtoken.models import LoadedModel

Progress = Callable[[str, int], None]  # (stage description, units done), as vtoken.analysis


@dataclass(frozen=True)
class VariantSpeed:
    variant: str
    num_output_tokens: int
    forward_s: float | None  # measured forward wall time, all iterations (None: not measured apart)
    engine_wall_s: float  # the whole engine loop
    tok_s: float  # output tokens / forward time (or / the replay's makespan where forwards are not timed apart)
    per_token_latency_s: float  # mean TPOT
    ratio_to_native: float  # per_token_latency_s / native's


@dataclass(frozen=True)
class MeasuredExtras:
    """A replay on a real engine: its model and speed per variant; transformers also measures
    output quality against native and naive-evict / vtoken agreement."""

    engine: str  # "transformers", "vllm"
    model: str
    num_blocks: int
    notes: tuple[str, ...]
    speed: dict[str, VariantSpeed]
    quality: dict[str, Quality]  # evicting variants against native (transformers only)
    naive_vs_vtoken: Agreement | None


def compare_on_model(experiment: Experiment, requests: Sequence[Request], concurrency: int | None, model: LoadedModel,
                     progress: Progress | None = None) -> tuple[dict[str, RunResult], MeasuredExtras]:
    """Replay `requests` with native, naive-evict and vtoken on `model` (`experiment.num_blocks`
    blocks), each with `concurrency` closed-loop clients (None: open loop)."""
    from vtoken.engine.hf import run_hf

    experiment = replace(experiment, model=model.spec)
    runs: dict[str, HFRun] = {}
    for variant in VARIANTS:
        on_progress = (lambda n, v=variant: progress(f"{v} ({model.name})", n)) if progress else None
        runs[variant] = run_hf(experiment.run(variant, concurrency), requests, model, on_progress=on_progress)
    return {v: r.result for v, r in runs.items()}, _measured(model, experiment.num_blocks, runs)


def hf_num_blocks(experiment: Experiment, requests: Sequence[Request], concurrency: int | None,
                  model: LoadedModel) -> int:
    """Enough blocks for `concurrency` of the requests at full length, as the model tokenizes them."""
    from vtoken.engine.hf import default_num_blocks, prepare_requests

    prepared = prepare_requests(requests, model.tokenizer, experiment.seed).requests
    return default_num_blocks(prepared, concurrency, experiment.block_size)


def speed_from_results(runs: dict[str, RunResult]) -> dict[str, VariantSpeed]:
    """Speed per variant from the results alone (an engine whose forwards are not timed apart):
    tokens per second over the replay's makespan."""
    native_latency_s = runs["native"].tpot.mean_s
    return {v: VariantSpeed(v, int(round(r.throughput_tok_s * r.makespan_s)), None, r.host_time_s, r.throughput_tok_s,
                            r.tpot.mean_s, _ratio(r.tpot.mean_s, native_latency_s))
            for v, r in runs.items()}


def _measured(model: LoadedModel, num_blocks: int, runs: dict[str, HFRun]) -> MeasuredExtras:
    from vtoken.engine.hf_oracle import agreement, quality_vs_native

    native_latency_s = runs["native"].result.tpot.mean_s
    speed = {v: _speed(v, r, native_latency_s) for v, r in runs.items()}
    quality = {v: quality_vs_native(runs["native"].outputs, r.outputs, model) for v, r in runs.items() if v != "native"}
    both = "naive-evict" in runs and "vtoken" in runs
    naive_vs_vtoken = agreement(runs["naive-evict"].outputs, runs["vtoken"].outputs) if both else None
    return MeasuredExtras("transformers", model.name, num_blocks, runs["native"].notes, speed, quality, naive_vs_vtoken)


def _speed(variant: str, run: HFRun, native_latency_s: float) -> VariantSpeed:
    result = run.result
    num_tokens = sum(o.logprobs.size for o in run.outputs)
    latency_s = result.tpot.mean_s
    return VariantSpeed(variant, num_tokens, run.forward_s, result.host_time_s,
                        num_tokens / run.forward_s if run.forward_s > 0 else float("nan"),
                        latency_s, _ratio(latency_s, native_latency_s))


def _ratio(latency_s: float, native_latency_s: float) -> float:
    return latency_s / native_latency_s if native_latency_s > 0 else float("nan")
