"""`vtoken compare` as one library call: the three variants, the sweep, the SLA rule, the
frontier and repeats over seeds, returned as one plain record.

    compare(trace, experiment, options, replayer, progress, num_blocks=None)
        replayer.resolve        the executor's block budget and model geometry (replay.py)
        replayer.run_many       the sim: every seed's variants and the sweep, one batch of
                                independent replays (on the replayer's runner: local processes
                                or Ray; identical runs reused, cached ones read back)
        replayer.run_variants   a real engine (hf, vllm): native, naive-evict, vtoken, measured
                                over `options.rounds` alternated rounds after `options.warmup`
                                dropped replays of each (vtoken.rounds); the spread comes with
                                the report's `measured`
        frontier                analysis.py, through `replayer.run_many`: two batches (unbounded,
                                then in the budget where needed)

What the replayer does not support (hf and vllm: the sweep, the frontier, repeats) is skipped
and noted; a real engine's measured extras (speed, quality, agreement) come with the report.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

import numpy as np

from vtoken.analysis import (Frontier, Interval, Progress, SlaResult, SweepPoint, frontier, frontier_num_tokens, interval,
                             sla_selection, sweep_jobs, sweep_points)
from vtoken import defaults
from vtoken.engine import VARIANTS, Experiment, SimProfile
from vtoken.engine.batch_limits import vllm_batch_defaults
from vtoken.engine.hf_compare import MeasuredExtras
from vtoken.errors import ConfigError
from vtoken.jsonsafe import make_json_safe
from vtoken.metrics import RunResult
from vtoken.replay import Replayer, check_sim_rounds
from vtoken.runners import ReplayJob, ReplayProgress
from vtoken.trace import Request, Trace, num_output_tokens

NO_SLA_NOTE = "no SLA selection: --variants leaves out naive-evict, whose p95 sets the SLA"


@dataclass(frozen=True)
class CompareOptions:
    concurrencies: tuple[int, ...]  # the frontier's (the sweep's, with the reference concurrency)
    sla_metric: str = "e2e"
    sla_factor: float = 1.05
    reference_concurrency: int = 8
    repeats: int = 1
    with_sweep: bool = True
    with_frontier: bool = True
    variants: tuple[str, ...] = VARIANTS  # which run, in VARIANTS' order
    concurrency: int | None = defaults.CONCURRENCY  # the headline runs' closed-loop clients; None = open loop
    rounds: int | None = None  # a measured executor's rounds (None: the replayer's default_rounds)
    warmup: int | None = None  # replays of each variant before the rounds, dropped (None: default_warmup)

    def __post_init__(self) -> None:
        object.__setattr__(self, "variants", check_variants(self.variants))
        if self.concurrency is not None and self.concurrency <= 0:
            raise ConfigError(f"concurrency must be > 0, got {self.concurrency}")
        if self.repeats <= 0:
            raise ConfigError(f"--repeats must be > 0, got {self.repeats}")
        if not self.concurrencies or min(self.concurrencies) <= 0:
            raise ConfigError(f"concurrencies must be positive integers, got {list(self.concurrencies)}")
        if self.sla_factor <= 0:
            raise ConfigError(f"the SLA factor must be > 0, got {self.sla_factor}")

    @property
    def sweep_concurrencies(self) -> tuple[int, ...]:
        return tuple(sorted(set(self.concurrencies) | {self.reference_concurrency}))


@dataclass(frozen=True)
class CompareReport:
    trace: Trace
    experiment: Experiment  # its block budget and model geometry resolved by the replayer
    options: CompareOptions
    runs: dict[str, RunResult]  # seed `experiment.seed`
    headline_ci: dict[str, dict[str, Interval]]  # variant -> figure -> mean and 95% CI over repeats
    sweep: tuple[SweepPoint, ...]
    sla: SlaResult | None
    frontier: Frontier | None
    executor: str = "sim"
    measured: MeasuredExtras | None = None  # a real engine's (hf, vllm): speed, and with hf quality and agreement


def compare(trace: Trace, experiment: Experiment, options: CompareOptions, replayer: Replayer,
            progress: Progress | None = None, *, num_blocks: int | None = None) -> CompareReport:
    """Replay `trace` on `replayer`'s executor. `num_blocks` None: the executor's default budget."""
    requests = trace.requests
    options = supported_options(options, replayer)
    experiment = replayer.resolve(experiment, requests, options.concurrency, num_blocks)
    variants = options.variants
    if replayer.supports_sweep:  # the sim: independent replays, all of them in one batch
        repeats, points = _headline_and_sweep(experiment, requests, options, replayer, progress)
    else:  # a real engine runs the variants together (their outputs are compared)
        repeats, points = [replayer.run_variants(experiment, requests, options.concurrency, progress, options.rounds,
                                                 options.warmup)], []
    headline_ci = {
        variant: {key: interval([r[variant].headline()[key] for r in repeats]) for key in repeats[0][variant].headline()}
        for variant in variants
    }
    sla = None
    notes = replayer.notes()
    if points and "naive-evict" in variants:
        sla = sla_selection(points, options.sla_metric, options.sla_factor, options.reference_concurrency)
    elif points:
        notes += (NO_SLA_NOTE,)
    frontier_result = None
    if options.with_frontier:
        frontier_result = frontier(experiment, requests, options.concurrencies, variants, progress, replay=replayer.run,
                                   run_many=replayer.run_many)
    trace = replace(trace, notes=trace.notes + notes)
    return CompareReport(trace, experiment, options, repeats[0], headline_ci, tuple(points), sla, frontier_result,
                         replayer.executor, replayer.measured)


def _headline_and_sweep(experiment: Experiment, requests: tuple[Request, ...], options: CompareOptions,
                        replayer: Replayer, progress: Progress | None
                        ) -> tuple[list[dict[str, RunResult]], list[SweepPoint]]:
    """Every seed's variants and, with the sweep, every sweep point: one `run_many` batch."""
    variants = options.variants
    headline = [ReplayJob(replace(experiment, seed=experiment.seed + i).run(v, options.concurrency), requests)
                for i in range(options.repeats) for v in variants]
    swept = sweep_jobs(experiment, requests, options.sweep_concurrencies, variants) if options.with_sweep else []

    def label(idx: int) -> str:
        if idx < len(headline):
            return headline[idx].run.spec.variant
        return f"sweep C={swept[idx - len(headline)].run.spec.concurrency}"

    tracker = ReplayProgress(progress, headline + swept, label) if progress else None
    results = replayer.run_many(headline + swept, *(tracker.on_done, tracker.on_tokens) if tracker else ())
    repeats = [dict(zip(variants, results[i * len(variants):(i + 1) * len(variants)])) for i in range(options.repeats)]
    return repeats, sweep_points(swept, results[len(headline):], options.sla_metric)


def check_variants(variants: tuple[str, ...] | list[str]) -> tuple[str, ...]:
    """`--variants`: known names, each once, at least one; returned in VARIANTS' order."""
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise ConfigError(f"--variants: unknown variant '{unknown[0]}'; choose from: {', '.join(VARIANTS)}")
    if not variants or len(set(variants)) != len(variants):
        raise ConfigError(f"--variants: give each of {', '.join(VARIANTS)} at most once and at least one, "
                          f"got {','.join(variants) or 'none'}")
    return tuple(v for v in VARIANTS if v in variants)


def supported_options(options: CompareOptions, replayer: Replayer) -> CompareOptions:
    """`options` without what `replayer` cannot run, its rounds and warm-up resolved; ConfigError
    for repeats it cannot make, rounds the sim would repeat identically."""
    if options.repeats != 1 and not replayer.supports_repeats:
        raise ConfigError(f"--repeats applies to the sim executor; --executor {replayer.executor} runs once, "
                          f"got --repeats {options.repeats}")
    if options.variants != VARIANTS and not replayer.supports_sweep:
        raise ConfigError(f"--variants applies to the sim executor; --executor {replayer.executor} runs all three, "
                          f"got --variants {','.join(options.variants)}")
    num_rounds = replayer.default_rounds if options.rounds is None else options.rounds
    num_warmup = replayer.default_warmup if options.warmup is None else options.warmup
    if num_rounds <= 0 or num_warmup < 0:
        raise ConfigError(f"--rounds must be > 0 and --warmup >= 0, got --rounds {num_rounds} --warmup {num_warmup}")
    if replayer.is_deterministic:
        check_sim_rounds(num_rounds, num_warmup)
    return replace(options, with_sweep=options.with_sweep and replayer.supports_sweep,
                   with_frontier=options.with_frontier and replayer.supports_frontier, rounds=num_rounds,
                   warmup=num_warmup)


def num_progress_units(trace: Trace, options: CompareOptions, replayer: Replayer) -> int:
    """Progress units `compare` reports: the tokens its replays generate (headline, sweep,
    frontier), each replay's exactly."""
    options = supported_options(options, replayer)
    num_variants = len(options.variants)
    num_tokens = num_output_tokens(trace.requests)
    num_replays = options.repeats * (options.rounds + options.warmup)
    units = num_replays * num_variants * num_tokens
    if options.with_sweep:
        units += len(options.sweep_concurrencies) * num_variants * num_tokens
    if options.with_frontier:
        units += sum(frontier_num_tokens(trace.requests, c) for c in options.concurrencies) * num_variants
    return units


def step_times_json(profile: SimProfile, executor: str) -> dict:
    """Where the run's step times come from: measured on a real engine, fitted to one by
    `vtoken calibrate` (against what, when), or the sim's catalog roofline."""
    if executor != "sim":
        return {"source": "measured", "description": f"measured on the {executor} engine"}
    model = profile.step_model
    if model is None:
        return {"source": "roofline", "description": profile.describe_step_times()}
    return {"source": "calibrated", "description": profile.describe_step_times(),
            "provenance": asdict(model.provenance) if model.provenance is not None else None}


def report_to_json(report: CompareReport) -> dict:
    """The `--json` object: variants, sweep, sla, frontier, and what the run was."""
    cfg = report.experiment
    variants = {}
    for name, result in report.runs.items():
        entry = variant_to_json(result)
        if report.options.repeats > 1:
            entry["ci95"] = {k: [_num(i.low), _num(i.high)] for k, i in report.headline_ci[name].items()}
        variants[name] = entry
    out = {
        "trace": {"source": report.trace.source, "format": report.trace.format, "num_requests": len(report.trace.requests),
                  "notes": list(report.trace.notes)},
        "config": {
            "model": cfg.model.name, "kv_bytes_per_token": cfg.model.kv_bytes_per_token, "gpu": cfg.gpu.name,
            "block_size": cfg.block_size, "num_blocks": cfg.num_blocks, "concurrency": report.options.concurrency,
            "policy": cfg.eviction.policy, "budget": cfg.eviction.budget.describe(),
            "eviction_interval_tokens": cfg.eviction.interval_tokens, "reclaim": asdict(cfg.reclaim),
            "seed": cfg.seed, "repeats": report.options.repeats, "sim_profile": cfg.sim.as_dict(),
            "step_times": step_times_json(cfg.sim, report.executor),
            "percentile_method": "linear", "executor": report.executor, "scheduler": scheduler_to_json(cfg),
        },
        "variants": variants,
        "sweep": [asdict(p) for p in report.sweep],
        "sla": None,
        "frontier": None,
    }
    if report.measured is not None:
        out[report.executor] = asdict(report.measured)
    if report.sla is not None:
        out["sla"] = {"metric": report.sla.metric, "factor": report.sla.factor,
                      "reference_concurrency": report.sla.reference_concurrency,
                      "threshold_s": report.sla.threshold_s, "c_sel": report.sla.c_sel}
    if report.frontier is not None:
        fr = report.frontier
        out["frontier"] = {
            "budget_blocks": fr.budget_blocks,
            "max_feasible_concurrency": fr.max_feasible_concurrency,
            "ideal_max_concurrency": fr.ideal_max_concurrency,
            "block_demand": [asdict(p) for p in fr.points],
        }
    return make_json_safe(out)


def scheduler_to_json(experiment: Experiment) -> dict:
    """The scheduler's settings of a run, and vLLM's defaults on its GPU with where they come from."""
    vllm = vllm_batch_defaults(experiment.gpu)
    return {**asdict(experiment.scheduler),
            "vllm_defaults": {"max_num_batched_tokens": vllm.max_num_batched_tokens, "max_num_seqs": vllm.max_num_seqs,
                              "source": vllm.source}}


def variant_to_json(result: RunResult) -> dict:
    """One variant's figures under `--json`'s "variants" (compare's, and each sweep point's)."""
    entry = {k: _num(v) for k, v in result.headline().items()}
    entry["utilization_histogram"] = list(result.utilization_histogram)
    entry["preemptions"] = result.preemptions
    entry["tokens_moved"] = result.tokens_moved
    entry["blocks_reclaimed"] = result.blocks_reclaimed
    entry["pressure_packing"] = {k: _num(v) if isinstance(v, float) else v for k, v in result.pressure_packing().items()}
    entry.update(relocation_events=result.relocation_events, tokens_evicted=result.tokens_evicted,
                 peak_allocated_blocks=result.peak_allocated_blocks, num_completed=result.num_completed,
                 num_skipped=len(result.skipped), makespan_s=_num(result.makespan_s),
                 ttft_p50_s=_num(result.ttft.p50_s), tpot_p50_s=_num(result.tpot.p50_s))
    return entry


def _num(value: float) -> float | None:
    return None if value is None or (isinstance(value, float) and np.isnan(value)) else float(value)
