"""The three variants on a real model: measured speed, output quality against native, and
agreement between naive-evict and vtoken (the same eviction decisions must give the same
tokens and log-probabilities).

    per-token latency   TPOT of the measured forward times, mean over requests
    x native            a variant's per-token latency / native's
    engine wall         the whole engine loop (forwards, policy, reclaimer, copies)
    ROUGE-L, length     against native's text, up to the first EOS (`hf_oracle`)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from vtoken.engine.config import VARIANTS, RunConfig
from vtoken.engine.hf import HFRun, default_num_blocks, prepare_requests, run_hf
from vtoken.engine.hf_oracle import Agreement, Quality, agreement, quality_vs_native
from vtoken.metrics import RunResult
from vtoken.models import LoadedModel
from vtoken.trace import Request

Progress = Callable[[str, int], None]  # (stage description, units done), as vtoken.analysis


@dataclass(frozen=True)
class HFVariantSpeed:
    variant: str
    num_output_tokens: int
    forward_s: float  # measured forward wall time, all iterations
    engine_wall_s: float  # the whole engine loop
    tok_s: float  # output tokens / forward time
    per_token_latency_s: float  # mean TPOT
    ratio_to_native: float  # per_token_latency_s / native's


@dataclass(frozen=True)
class HFReport:
    model: str
    num_blocks: int
    notes: tuple[str, ...]
    speed: dict[str, HFVariantSpeed]
    quality: dict[str, Quality]  # evicting variants against native
    naive_vs_vtoken: Agreement | None


def compare_on_model(config: RunConfig, requests: Sequence[Request], model: LoadedModel,
                     num_blocks: int | None = None, progress: Progress | None = None) -> tuple[dict[str, RunResult], HFReport]:
    """Replay `requests` with native, naive-evict and vtoken on `model`.

    `num_blocks` None: enough blocks for `config.concurrency` requests at full length.
    """
    if num_blocks is None:
        prepared = prepare_requests(requests, model.tokenizer, config.seed).requests
        num_blocks = default_num_blocks(prepared, config.concurrency, config.block_size)
    base = replace(config, num_blocks=num_blocks, model=model.spec)
    runs: dict[str, HFRun] = {}
    for variant in VARIANTS:
        on_progress = (lambda n, v=variant: progress(f"{v} ({model.name})", n)) if progress else None
        runs[variant] = run_hf(replace(base, variant=variant), requests, model, on_progress=on_progress)
    return {v: r.result for v, r in runs.items()}, _report(model, num_blocks, runs)


def _report(model: LoadedModel, num_blocks: int, runs: dict[str, HFRun]) -> HFReport:
    native_latency_s = runs["native"].result.tpot.mean_s
    speed = {v: _speed(v, r, native_latency_s) for v, r in runs.items()}
    quality = {v: quality_vs_native(runs["native"].outputs, r.outputs, model) for v, r in runs.items() if v != "native"}
    both = "naive-evict" in runs and "vtoken" in runs
    naive_vs_vtoken = agreement(runs["naive-evict"].outputs, runs["vtoken"].outputs) if both else None
    return HFReport(model.name, num_blocks, runs["native"].notes, speed, quality, naive_vs_vtoken)


def _speed(variant: str, run: HFRun, native_latency_s: float) -> HFVariantSpeed:
    result = run.result
    num_tokens = sum(o.logprobs.size for o in run.outputs)
    latency_s = result.tpot.mean_s
    return HFVariantSpeed(variant, num_tokens, run.forward_s, result.host_time_s,
                          num_tokens / run.forward_s if run.forward_s > 0 else float("nan"),
                          latency_s, latency_s / native_latency_s if native_latency_s > 0 else float("nan"))
