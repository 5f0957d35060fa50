"""What a replay on a real engine measured beyond the `RunResult`s (`MeasuredExtras`), and the
three variants on a transformers model (`compare_on_model`): measured speed, output quality
against native, and agreement between naive-evict and vtoken (the same eviction decisions must
give the same tokens and log-probabilities).

    per-token latency   TPOT of the measured forward times, mean over requests
    x native            a variant's per-token latency / native's
    engine wall         the whole engine loop (forwards, policy, reclaimer, copies)
    ROUGE-L, length     against native's text, up to the first EOS (`hf_oracle`)

Every variant is measured over rounds (vtoken.rounds): a warm-up replay of each, dropped, then
`num_rounds` rounds with the variants rotated; the figures shown are each variant's round of
median throughput, and `MeasuredExtras.spread` holds every figure's min / median / max.

What naive-evict's measured speed is on each engine (`NAIVE_EVICT_SPEED`): neither engine reads
dead slots for it the way a paged kernel over Naive-Evict's block tables would, so its memory
figures are Naive-Evict's and its speed is not.

Importable without torch: the types are what `vtoken.compare` reports; the model runs are
imported when they run.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from vtoken.engine.experiment import VARIANTS, Experiment
from vtoken.metrics import RunResult
from vtoken.rounds import Rounds, RoundsRecord, Spread, figure_spreads, median_round, run_rounds, spread_of
from vtoken.trace import Request

if TYPE_CHECKING:
    from vtoken.engine.hf import HFRun
    from vtoken.engine.hf_oracle import Agreement, Quality
    from vtoken.models import LoadedModel

Progress = Callable[[str, int], None]  # (stage description, units done), as vtoken.analysis

# engine -> what a measured naive-evict is there (shown beside every measured naive-evict speed)
NAIVE_EVICT_SPEED = {
    "transformers": (
        "naive-evict's measured speed is not Naive-Evict's: in the hf executor every variant's attention gathers "
        "exactly the live slots (hf_forward.PagedDecoder), so naive-evict reads no dead slot, as vtoken does, and "
        "copies nothing; a paged kernel (vLLM's) would read every slot of the blocks Naive-Evict holds. Its memory "
        "figures are Naive-Evict's"),
    "vllm": (
        "naive-evict's measured speed is not Naive-Evict's: inside vLLM it compacts like vtoken (vLLM's kernels read "
        "slots 0..n-1 of a request: every eviction is followed by the same compaction and the same copies, and it "
        "reports tokens moved) and only holds the blocks a never-compacted layout would; its speed is vtoken's "
        "with more blocks held. Its memory figures are Naive-Evict's"),
}


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
    rounds: RoundsRecord | None = None
    shown_round: dict[str, int] | None = None  # variant -> the round its figures (speed, RunResult) are from
    spread: dict[str, dict[str, Spread]] | None = None  # variant -> figure -> over the rounds
    naive_evict_speed: str = ""  # what naive-evict's measured speed is on this engine (NAIVE_EVICT_SPEED)


def measured_extras(engine: str, model: str, num_blocks: int, rounds: Rounds[RunResult], *,
                    speeds: Sequence[dict[str, VariantSpeed]], notes: tuple[str, ...] = ()) -> MeasuredExtras:
    """What a measurement over rounds reports: each variant's figures from its round of median
    throughput, every figure's spread over the rounds (`run_figures`' and the speed's), the
    rounds' order. `speeds`: one {variant: VariantSpeed} per round."""
    shown = {v: median_round([r.throughput_tok_s for r in results]) for v, results in rounds.results.items()}
    spread = {}
    for variant, results in rounds.results.items():
        per_round = [s[variant] for s in speeds]
        spread[variant] = {**figure_spreads(results),
                           **{key: spread_of([getattr(s, key) for s in per_round]) for key in SPEED_FIGURES}}
    return MeasuredExtras(engine, model, num_blocks, notes, {v: speeds[shown[v]][v] for v in shown}, {}, None,
                          rounds.record, shown, spread, NAIVE_EVICT_SPEED.get(engine, ""))


SPEED_FIGURES = ("tok_s", "per_token_latency_s", "ratio_to_native", "engine_wall_s")


def compare_on_model(experiment: Experiment, requests: Sequence[Request], concurrency: int | None, model: LoadedModel,
                     progress: Progress | None = None, num_rounds: int = 1,
                     num_warmup: int = 0) -> tuple[dict[str, RunResult], MeasuredExtras]:
    """Replay `requests` with native, naive-evict and vtoken on `model` (`experiment.num_blocks`
    blocks), each with `concurrency` closed-loop clients (None: open loop): `num_warmup` dropped
    replays of each, then `num_rounds` alternated rounds."""
    from vtoken.engine.hf import run_hf
    from vtoken.engine.hf_oracle import agreement, quality_vs_native

    experiment = replace(experiment, model=model.spec)

    def replay(variant: str, round_idx: int | None) -> HFRun:
        stage = f"{variant} ({model.name}, {'warm-up' if round_idx is None else f'round {round_idx + 1}'})"
        on_progress = (lambda n: progress(stage, n)) if progress else None
        return run_hf(experiment.run(variant, concurrency), requests, model, on_progress=on_progress)

    rounds = run_rounds(VARIANTS, replay, num_rounds, num_warmup)
    results = Rounds(rounds.record, {v: tuple(run.result for run in runs) for v, runs in rounds.results.items()})
    speeds = []
    for round_idx in range(num_rounds):
        native_latency_s = rounds.results["native"][round_idx].result.tpot.mean_s
        speeds.append({v: _speed(v, runs[round_idx], native_latency_s) for v, runs in rounds.results.items()})
    measured = measured_extras("transformers", model.name, experiment.num_blocks, results, speeds=speeds)
    runs = {v: rounds.results[v][idx] for v, idx in measured.shown_round.items()}
    quality = {v: quality_vs_native(runs["native"].outputs, r.outputs, model) for v, r in runs.items() if v != "native"}
    measured = replace(measured, notes=runs["native"].notes, quality=quality,
                       naive_vs_vtoken=agreement(runs["naive-evict"].outputs, runs["vtoken"].outputs))
    return {v: r.result for v, r in runs.items()}, measured


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


def _speed(variant: str, run: HFRun, native_latency_s: float) -> VariantSpeed:
    result = run.result
    num_tokens = sum(o.logprobs.size for o in run.outputs)
    latency_s = result.tpot.mean_s
    return VariantSpeed(variant, num_tokens, run.forward_s, result.host_time_s,
                        num_tokens / run.forward_s if run.forward_s > 0 else float("nan"),
                        latency_s, _ratio(latency_s, native_latency_s))


def _ratio(latency_s: float, native_latency_s: float) -> float:
    return latency_s / native_latency_s if native_latency_s > 0 else float("nan")
