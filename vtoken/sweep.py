"""`vtoken sweep TRACE --vary KEY=V1,V2,...`: the variants over a sweep of run parameters.

    sweep(trace, base, options, replayer, progress, num_blocks=None) -> SweepReport

A point is a `Run` (an experiment and its run spec: the concurrency), whose variant each of
`options.variants` replaces. One factor at a time (default): each varied key takes each of its
values while every other key keeps the base run's value. Grid: every combination, the first key
varying slowest. Points whose parameters coincide (a base value listed under two keys) are one
point. Every point's variants are independent replays, sent to `replayer.run_many` as one batch (local processes or
Ray, vtoken.runners; cached replays are read back).

A point's block budget: its `num_blocks` when that key is varied, else `num_blocks`, else the
replayer's default for the point's model, GPU and block size (what `compare` would use).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from vtoken.analysis import Progress
from vtoken.compare import check_variants, variant_to_json
from vtoken.engine import VARIANTS, Run
from vtoken.errors import ConfigError
from vtoken.jsonsafe import make_json_safe
from vtoken.kv.reclaim import reclaim_budget_text
from vtoken.metrics import RunResult
from vtoken.policies.base import Budget
from vtoken.replay import Replayer
from vtoken.runners import ReplayJob, ReplayProgress
from vtoken.trace import Trace, num_output_tokens


@dataclass(frozen=True)
class Parameter:
    """A run parameter a sweep can vary: how to read it from a run, set it, and write it."""

    get: Callable[[Run], object]
    set: Callable[[Run, object], Run]
    describe: Callable[[object], object] = lambda value: value  # a JSON-able value


def _experiment(name: str) -> Parameter:
    """A field of the experiment."""
    return Parameter(lambda r: getattr(r.experiment, name),
                     lambda r, v: replace(r, experiment=replace(r.experiment, **{name: v})))


def _eviction(name: str) -> Callable[[Run, object], Run]:
    return lambda r, v: replace(r, experiment=replace(r.experiment, eviction=replace(r.experiment.eviction, **{name: v})))


def _reclaim(name: str) -> Callable[[Run, object], Run]:
    return lambda r, v: replace(r, experiment=replace(r.experiment, reclaim=replace(r.experiment.reclaim, **{name: v})))


PARAMETERS: dict[str, Parameter] = {
    "block_size": _experiment("block_size"),
    "budget": Parameter(lambda r: r.experiment.eviction.budget, _eviction("budget"), lambda b: _budget_text(b)),
    "theta_f": Parameter(lambda r: r.experiment.reclaim.theta_f, _reclaim("theta_f")),
    "policy": Parameter(lambda r: r.experiment.eviction.policy, _eviction("policy")),
    "eviction_interval": Parameter(lambda r: r.experiment.eviction.interval_tokens, _eviction("interval_tokens")),
    "model": replace(_experiment("model"), describe=lambda m: m.name),
    "gpu": replace(_experiment("gpu"), describe=lambda g: g.name),
    "concurrency": Parameter(lambda r: r.spec.concurrency,
                             lambda r, v: replace(r, spec=replace(r.spec, concurrency=v))),
    "num_blocks": _experiment("num_blocks"),
    "reclaim_mode": Parameter(lambda r: r.experiment.reclaim.mode, _reclaim("mode")),
    "reclaim_budget": Parameter(lambda r: r.experiment.reclaim.max_moves_per_step, _reclaim("max_moves_per_step"),
                                reclaim_budget_text),
    "reclaim_interval": Parameter(lambda r: r.experiment.reclaim.check_interval_steps, _reclaim("check_interval_steps")),
    "reclaim_batch_blocks": Parameter(lambda r: r.experiment.reclaim.max_src_blocks, _reclaim("max_src_blocks")),
}


@dataclass(frozen=True)
class Vary:
    """One `--vary KEY=V1,V2,...`: a key of PARAMETERS and its values, parsed."""

    key: str
    values: tuple[object, ...]

    def __post_init__(self) -> None:
        if self.key not in PARAMETERS:
            raise ConfigError(f"--vary: unknown key '{self.key}'; choose one of: {', '.join(PARAMETERS)}")
        described = [PARAMETERS[self.key].describe(v) for v in self.values]
        if not described:
            raise ConfigError(f"--vary {self.key}: give at least one value")
        repeated = [d for i, d in enumerate(described) if d in described[:i]]
        if repeated:
            raise ConfigError(f"--vary {self.key}: {repeated[0]} is given twice")


@dataclass(frozen=True)
class SweepOptions:
    varies: tuple[Vary, ...]
    is_grid: bool = False
    variants: tuple[str, ...] = VARIANTS

    def __post_init__(self) -> None:
        object.__setattr__(self, "variants", check_variants(self.variants))
        keys = [v.key for v in self.varies]
        if not keys:
            raise ConfigError("vtoken sweep needs at least one --vary KEY=V1,V2,...")
        repeated = [k for i, k in enumerate(keys) if k in keys[:i]]
        if repeated:
            raise ConfigError(f"--vary {repeated[0]}: given twice; list all its values in one --vary")

    @property
    def keys(self) -> tuple[str, ...]:
        return tuple(v.key for v in self.varies)


@dataclass(frozen=True)
class SweepPointRuns:
    params: dict[str, object]  # every varied key -> its value at this point, as `Parameter.describe` writes it
    run: Run  # the point's run (variant: the last one run), its block budget resolved
    runs: dict[str, RunResult]  # variant -> result


@dataclass(frozen=True)
class SweepReport:
    trace: Trace
    base: Run
    options: SweepOptions
    points: tuple[SweepPointRuns, ...]

    def along(self, key: str) -> tuple[SweepPointRuns, ...]:
        """The points where only `key` moves: every other varied key at its anchor, the base
        value (one factor at a time) or its first value (grid)."""
        anchor = dict(self.points[0].params) if self.options.is_grid else {
            k: PARAMETERS[k].describe(PARAMETERS[k].get(self.base)) for k in self.options.keys}
        return tuple(p for p in self.points if all(p.params[k] == anchor[k] for k in self.options.keys if k != key))


def point_settings(base: Run, options: SweepOptions) -> list[dict[str, object]]:
    """Every point's value of each varied key (parsed values), in sweep order, without repeats."""
    base_values = {v.key: PARAMETERS[v.key].get(base) for v in options.varies}
    if options.is_grid:
        settings = [dict(zip(options.keys, combo)) for combo in itertools.product(*(v.values for v in options.varies))]
    else:
        settings = [{**base_values, vary.key: value} for vary in options.varies for value in vary.values]
    unique: dict[tuple, dict[str, object]] = {}
    for setting in settings:
        unique.setdefault(tuple(_described(setting).items()), setting)
    return list(unique.values())


def num_points(base: Run, options: SweepOptions) -> int:
    return len(point_settings(base, options))


def num_progress_units(trace: Trace, base: Run, options: SweepOptions) -> int:
    """Progress units `sweep` reports: the tokens its replays generate, each replay's exactly."""
    return num_points(base, options) * len(options.variants) * num_output_tokens(trace.requests)


def sweep(trace: Trace, base: Run, options: SweepOptions, replayer: Replayer,
          progress: Progress | None = None, *, num_blocks: int | None = None) -> SweepReport:
    """Replay `trace` with `options.variants` at every point of the sweep (module docstring)."""
    if not replayer.supports_sweep:
        raise ConfigError(f"vtoken sweep runs on the sim executor, not {replayer.executor}")
    requests = trace.requests
    variants = options.variants
    point_runs = []
    for setting in point_settings(base, options):
        run = base
        for key, value in setting.items():
            run = PARAMETERS[key].set(run, value)
        experiment = replayer.resolve(run.experiment, requests, run.spec.concurrency, setting.get("num_blocks", num_blocks))
        point_runs.append(replace(run, experiment=experiment))
    jobs = [ReplayJob(r.with_variant(v), requests) for r in point_runs for v in variants]
    tracker = (ReplayProgress(progress, jobs, lambda idx: f"point {idx // len(variants) + 1}/{len(point_runs)}")
               if progress else None)
    results = replayer.run_many(jobs, *(tracker.on_done, tracker.on_tokens) if tracker else ())
    points = []
    for i, (setting, run) in enumerate(zip(point_settings(base, options), point_runs)):
        runs = dict(zip(variants, results[i * len(variants):(i + 1) * len(variants)]))
        points.append(SweepPointRuns(_described(setting), run.with_variant(variants[-1]), runs))
    return SweepReport(trace, base, options, tuple(points))


def report_to_json(report: SweepReport) -> dict:
    """The `--json` object: one point per configuration, its parameters and its variants'
    figures (each as `compare --json` gives them under "variants")."""
    return make_json_safe({
        "trace": {"source": report.trace.source, "format": report.trace.format,
                  "num_requests": len(report.trace.requests), "notes": list(report.trace.notes)},
        "varied": list(report.options.keys),
        "grid": report.options.is_grid,
        "points": [{"params": dict(p.params), "num_blocks": p.run.experiment.num_blocks,
                    "variants": {v: variant_to_json(r) for v, r in p.runs.items()}} for p in report.points],
    })


def _budget_text(budget: Budget) -> str:
    """'50%' or '512': as `--budget` reads it (the protected tokens are not varied)."""
    return f"{100 * budget.keep_ratio:g}%" if budget.keep_ratio is not None else str(budget.num_tokens)


def _described(setting: dict[str, object]) -> dict[str, object]:
    return {key: PARAMETERS[key].describe(value) for key, value in setting.items()}
