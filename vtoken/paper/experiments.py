"""The paper's experiments over vtoken's entry points (see the package docstring).

Where the paper states a figure, it is written here once, as the paper gives it, in the `Claim`
next to vtoken's measured one; where vtoken's figure differs, the claim says by how much.
Relative changes are vtoken against naive-evict: (vtoken - naive) / naive.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace

from vtoken import defaults
from vtoken.analysis import Progress
from vtoken.compare import CompareOptions, CompareReport, compare
from vtoken.engine import VARIANTS, Run
from vtoken.hardware import GPUS, num_blocks_for_gpu
from vtoken.jsonsafe import make_json_safe
from vtoken.model_spec import resolve_model
from vtoken.paper.workloads import PREFIX_TOKENS, SUFFIX_TOKENS, shared_prefix_trace
from vtoken.policies.base import Budget
from vtoken.replay import Replayer
from vtoken.sweep import PARAMETERS, SweepOptions, Vary, sweep
from vtoken.trace import Trace

EVICTING = ("naive-evict", "vtoken")
FIG7_POLICIES = ("h2o", "scissorhands", "random")
FIG8_MODELS = ("llama-3.1-8b", "mistral-7b")
FIG8_CONCURRENCIES = (1, 2, 4, 8, 12, 16, 22, 32, 48)
# Fig. 8's budget: native's peak block demand at this concurrency in an unbounded pool, so that
# every C above it is memory-bound for a variant that does not reclaim, and C_ref = 8 fits.
FIG8_BUDGET_CONCURRENCY = 16
# §4.5, one factor at a time around the defaults. An eviction ratio r keeps 1 - r of the tokens.
SENSITIVITY = {"block_size": (16, 32, 48), "eviction_ratio": (0.3, 0.4, 0.5, 0.6, 0.7),
               "theta_f": (0.05, 0.1, 0.25, 0.5, 0.9)}
PREFIX_DEGREES = (1, 2, 4, 8)
# §4.6: the shared prefix is pinned (never evicted) and half of the private suffix is kept.
PREFIX_BUDGET = str(PREFIX_TOKENS + SUFFIX_TOKENS // 2)


@dataclass(frozen=True)
class Claim:
    """One figure of the paper and vtoken's: `paper` as the paper states it, `vtoken` as
    measured (text), `values` the numbers behind vtoken's text."""

    figure: str
    paper: str
    vtoken: str
    values: dict[str, object] = field(default_factory=dict)


@dataclass(frozen=True)
class PaperFigure:
    experiment: str
    title: str
    settings: dict[str, object]  # what was run; a block budget says how it was chosen
    rows: tuple[dict[str, object], ...]  # one per configuration, keys in column order
    claims: tuple[Claim, ...]
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class FrontierCase:
    """One budget of the capacity frontier and what the paper reports there (max feasible C)."""

    label: str  # the model as the paper names it
    model: str
    num_blocks: int | None  # None: what `gpu` holds of the model at the default memory fraction
    concurrencies: tuple[int, ...]
    paper: dict[str, int]  # variant or "ideal" -> the paper's max feasible C
    gpu: str | None = None

    def budget(self) -> tuple[int, str]:
        """The block budget and how it was chosen."""
        if self.num_blocks is not None:
            return self.num_blocks, "the paper's budget"
        spec, gpu = resolve_model(self.model), GPUS[self.gpu]
        num_blocks = num_blocks_for_gpu(spec, gpu, defaults.GPU_MEMORY_UTILIZATION, defaults.BLOCK_SIZE)
        return num_blocks, (f"{gpu.name} at gpu_memory_utilization {defaults.GPU_MEMORY_UTILIZATION:g}, as vtoken "
                            "sizes a budget (weights and a 2 GiB reserve subtracted)")


FIG9_CASES = (
    FrontierCase("Llama-3.1-8B", "llama-3.1-8b", 5427, (4, 5, 6, 7, 8, 9, 10, 11),
                 {"native": 5, "naive-evict": 5, "vtoken": 8, "ideal": 10}),
    FrontierCase("Llama-3.1-8B", "llama-3.1-8b", 11519, (10, 11, 12, 16, 17, 18, 22, 23),
                 {"native": 11, "naive-evict": 11, "vtoken": 22, "ideal": 22}),
)
# The paper: native and naive-evict fail at C = 4, vToken is feasible through 6. Its budget is
# not restated here; an L40S's is the one where a full 16K request (1,020 blocks) fits 3 times.
FIG10_CASES = (
    FrontierCase("Qwen2.5-14B", "qwen2.5-14b", None, (2, 3, 4, 5, 6, 7, 8),
                 {"native": 3, "naive-evict": 3, "vtoken": 6}, gpu="l40s"),
)


def fig7(trace: Trace, base: Run, replayer: Replayer, progress: Progress | None = None, *,
         policies: Sequence[str] = FIG7_POLICIES, num_blocks: int | None = None) -> PaperFigure:
    """Memory utilization (live tokens / allocated slots) and retained blocks per request of
    naive-evict and vtoken under each policy, on `base`'s concurrency and budget (`base`: the
    experiment and the run spec every figure starts from; each replay's variant replaces its own)."""
    report = sweep(trace, base, SweepOptions((Vary("policy", tuple(policies)),), variants=EVICTING), replayer,
                   progress, num_blocks=num_blocks)
    rows = []
    for point in report.points:
        naive, vtoken = point.runs["naive-evict"], point.runs["vtoken"]
        rows.append({"policy": point.params["policy"],
                     "naive_utilization": naive.memory_utilization, "vtoken_utilization": vtoken.memory_utilization,
                     "utilization_gain_pts": 100 * (vtoken.memory_utilization - naive.memory_utilization),
                     "naive_blocks_per_request": naive.retained_blocks_per_request,
                     "vtoken_blocks_per_request": vtoken.retained_blocks_per_request,
                     "blocks_change_pct": _pct(vtoken.retained_blocks_per_request, naive.retained_blocks_per_request)})
    gains = [r["utilization_gain_pts"] for r in rows]
    relative = [_pct(r["vtoken_utilization"], r["naive_utilization"]) for r in rows]
    changes = [r["blocks_change_pct"] for r in rows]
    claims = (
        Claim("memory utilization, vtoken vs naive-evict", "+21.9%",
              f"{_range(gains, ' pts')} ({_range(relative, '%')} relative), mean {sum(gains) / len(gains):+.1f} pts",
              {"gain_pts": gains, "gain_pct": relative}),
        Claim("retained blocks per request, vtoken vs naive-evict", "-27.2% to -72.3%", _range(changes, "%"),
              {"change_pct": changes}),
    )
    settings = {**_settings(trace, report.points[0].run), "policies": list(policies)}
    return PaperFigure("fig7", "Fig. 7: memory utilization and retained blocks per request", settings,
                       tuple(rows), claims, trace.notes)


def memory_bound_budget(trace: Trace, run: Run, replayer: Replayer,
                        concurrency: int = FIG8_BUDGET_CONCURRENCY) -> int:
    """Native's peak block demand at `concurrency` closed-loop clients in a pool that never
    runs out: a budget in which every higher concurrency is memory-bound without reclamation."""
    block_size = run.experiment.block_size
    unbounded = sum(-(-(r.num_prompt_tokens + r.num_output_tokens) // block_size) for r in trace.requests) + 1
    probe = PARAMETERS["concurrency"].set(PARAMETERS["num_blocks"].set(run, unbounded), concurrency)
    return replayer.run(probe.with_variant("native"), trace.requests).peak_allocated_blocks


def fig8(trace: Trace, base: Run, replayer: Replayer, progress: Progress | None = None, *,
         models: Sequence[str] = FIG8_MODELS, concurrencies: Sequence[int] = FIG8_CONCURRENCIES,
         num_blocks: int | None = None, budget_concurrency: int = FIG8_BUDGET_CONCURRENCY) -> PaperFigure:
    """Throughput and p95 e2e latency at every concurrency, and the SLA-feasible throughput
    (at C_sel: SLA = 1.05 x naive-evict's p95 at C_ref = 8), per model."""
    rows, claims, budgets = [], [], {}
    for model in models:
        run = PARAMETERS["model"].set(base, resolve_model(model))
        blocks = num_blocks if num_blocks is not None else memory_bound_budget(trace, run, replayer,
                                                                              budget_concurrency)
        budgets[model] = blocks
        options = CompareOptions(tuple(concurrencies), with_frontier=False, concurrency=run.spec.concurrency)
        report = compare(trace, run.experiment, options, replayer, progress, num_blocks=blocks)
        rows += _fig8_rows(model, report)
        claims.append(_fig8_claim(model, report))
    how = ("--num-blocks" if num_blocks is not None else
           f"native's peak block demand at C = {budget_concurrency} in an unbounded pool (memory-bound above it)")
    settings = {**_settings(trace, base, resident=True), "models": list(models), "num_blocks": budgets, "budget_chosen_as": how,
                "sla": "1.05 x naive-evict p95 e2e latency at C_ref = 8", "concurrencies": list(concurrencies)}
    return PaperFigure("fig8", "Fig. 8: SLA-constrained throughput and p95 latency", settings, tuple(rows),
                       tuple(claims), trace.notes)


FIG8_PAPER = {"mistral-7b": "+9.9% to +37.3%", "llama-3.1-8b": "+18.9% on average"}


def _fig8_rows(model: str, report: CompareReport) -> list[dict[str, object]]:
    points = {(p.variant, p.concurrency): p for p in report.sweep}
    threshold = report.sla.threshold_s
    rows = []
    for concurrency in sorted({p.concurrency for p in report.sweep}):
        naive, vtoken = points[("naive-evict", concurrency)], points[("vtoken", concurrency)]
        rows.append({"model": model, "concurrency": concurrency,
                     "native_tok_s": points[("native", concurrency)].throughput_tok_s,
                     "naive_tok_s": naive.throughput_tok_s, "vtoken_tok_s": vtoken.throughput_tok_s,
                     "throughput_gain_pct": _pct(vtoken.throughput_tok_s, naive.throughput_tok_s),
                     "naive_p95_s": naive.p95_s, "vtoken_p95_s": vtoken.p95_s,
                     "p95_change_pct": _pct(vtoken.p95_s, naive.p95_s),
                     "within_sla": "".join("y" if p.p95_s <= threshold else "n" for p in (naive, vtoken)),
                     "preemptions": f"{naive.preemptions}/{vtoken.preemptions}"})
    return rows


def _fig8_claim(model: str, report: CompareReport) -> Claim:
    points = {(p.variant, p.concurrency): p for p in report.sweep}
    c_sel = report.sla.c_sel
    at_sel = {v: points[(v, c_sel[v])].throughput_tok_s if c_sel.get(v) else 0.0 for v in VARIANTS}
    gain = _pct(at_sel["vtoken"], at_sel["naive-evict"])
    per_c = [_pct(points[("vtoken", c)].throughput_tok_s, points[("naive-evict", c)].throughput_tok_s)
             for c in sorted({p.concurrency for p in report.sweep})]
    text = (f"{gain:+.1f}% at C_sel (naive-evict C = {c_sel['naive-evict']}, vtoken C = {c_sel['vtoken']}); "
            f"{_range(per_c, '%')} over C, mean {sum(per_c) / len(per_c):+.1f}%")
    return Claim(f"{model}: SLA-feasible throughput, vtoken vs naive-evict", FIG8_PAPER.get(model, "not stated"),
                 text, {"sla_threshold_s": report.sla.threshold_s, "c_sel": dict(c_sel),
                        "throughput_at_c_sel": at_sel, "gain_at_c_sel_pct": gain, "gain_per_c_pct": per_c})


def frontier(trace: Trace, base: Run, replayer: Replayer, cases: Sequence[FrontierCase],
             progress: Progress | None = None, *, experiment: str = "fig9",
             num_blocks: Sequence[int] | None = None, concurrencies: Sequence[int] | None = None) -> PaperFigure:
    """The largest concurrency each variant holds without preemption (vtoken.analysis.frontier)
    in each case's budget, against the paper's. `num_blocks` (one per case) and `concurrencies`
    replace the cases' own."""
    rows, claims, budgets = [], [], {}
    for idx, case in enumerate(cases):
        blocks, how = (num_blocks[idx], "--num-blocks") if num_blocks else case.budget()
        label = f"{case.label}, {blocks:,} blocks"
        budgets[label] = how
        run = PARAMETERS["model"].set(base, resolve_model(case.model))
        options = CompareOptions(tuple(concurrencies or case.concurrencies), with_sweep=False,
                                 concurrency=run.spec.concurrency)
        result = compare(trace, run.experiment, options, replayer, progress, num_blocks=blocks).frontier
        measured = {**result.max_feasible_concurrency, "ideal": result.ideal_max_concurrency}
        rows.append({"case": label, "source": "vtoken", **measured})
        rows.append({"case": label, "source": "paper", **{k: case.paper.get(k) for k in measured}})
        gaps = {k: measured[k] - case.paper[k] for k in case.paper}
        text = ", ".join(f"{k} {measured[k]}" + (f" ({gaps[k]:+d})" if gaps[k] else "") for k in case.paper)
        paper = ", ".join(f"{k} {v}" for k, v in case.paper.items())
        claims.append(Claim(f"{label}: max feasible C", paper, text, {"measured": measured, "gap": gaps}))
    title = {"fig9": "Fig. 9: capacity frontier, Llama-3.1-8B", "fig10": "Fig. 10: capacity frontier, Qwen2.5-14B"}
    settings = {**_settings(trace, base, resident=True), "budgets": budgets}
    return PaperFigure(experiment, title.get(experiment, "capacity frontier"), settings, tuple(rows), tuple(claims),
                       trace.notes)


def sensitivity(trace: Trace, base: Run, replayer: Replayer, progress: Progress | None = None, *,
                values: dict[str, Sequence[float]] | None = None, num_blocks: int | None = None) -> PaperFigure:
    """§4.5: naive-evict and vtoken with one of block size, eviction ratio and theta_F moved
    at a time, the others at `base`'s values."""
    values = {**SENSITIVITY, **(values or {})}
    varies = (Vary("block_size", tuple(values["block_size"])),
              Vary("budget", tuple(_keep(base, r) for r in values["eviction_ratio"])),
              Vary("theta_f", tuple(values["theta_f"])))
    report = sweep(trace, base, SweepOptions(varies, variants=EVICTING), replayer, progress, num_blocks=num_blocks)
    rows = []
    for vary in varies:
        order = -1 if vary.key == "budget" else 1  # eviction ratios ascending: kept shares descending
        for point in sorted(report.along(vary.key), key=lambda p: order * _sort_key(p.params[vary.key])):
            naive, vtoken = point.runs["naive-evict"], point.runs["vtoken"]
            value = point.params[vary.key]
            key, value = ("eviction_ratio", round(1 - float(str(value).rstrip("%")) / 100, 4)) \
                if vary.key == "budget" else (vary.key, value)
            rows.append({"parameter": key, "value": value, "naive_waste": naive.waste_ratio,
                         "vtoken_waste": vtoken.waste_ratio,
                         "naive_blocks_per_request": naive.retained_blocks_per_request,
                         "vtoken_blocks_per_request": vtoken.retained_blocks_per_request,
                         "blocks_change_pct": _pct(vtoken.retained_blocks_per_request,
                                                   naive.retained_blocks_per_request),
                         "throughput_gain_pct": _pct(vtoken.throughput_tok_s, naive.throughput_tok_s),
                         "tokens_moved": vtoken.tokens_moved})
    claims = tuple(
        Claim(f"retained blocks per request along {key}", "trend only (no figure restated here)",
              _range([r["blocks_change_pct"] for r in rows if r["parameter"] == key], "%"),
              {"change_pct": [r["blocks_change_pct"] for r in rows if r["parameter"] == key]})
        for key in dict.fromkeys(r["parameter"] for r in rows))
    settings = {**_settings(trace, report.points[0].run), "varied": {k: list(v) for k, v in values.items()}}
    return PaperFigure("sensitivity", "§4.5: block size, eviction ratio and theta_F", settings, tuple(rows), claims,
                       trace.notes)


def prefix_sharing(base: Run, replayer: Replayer, progress: Progress | None = None, *,
                   degrees: Sequence[int] = PREFIX_DEGREES, num_output_tokens: int | None = None,
                   num_blocks: int | None = None) -> PaperFigure:
    """§4.6: retained blocks per request of naive-evict (with prefix caching: a group's prefix
    blocks are shared) and vtoken at each sharing degree, every request resident at once."""
    rows = []
    largest = max(degrees)
    for degree in degrees:
        trace = shared_prefix_trace(degree, num_requests=largest, **_given(num_output_tokens=num_output_tokens))
        options = CompareOptions((largest,), with_sweep=False, with_frontier=False, variants=EVICTING, concurrency=largest)
        runs = compare(trace, base.experiment, options, replayer, progress, num_blocks=num_blocks).runs
        naive, vtoken = runs["naive-evict"], runs["vtoken"]
        rows.append({"degree": degree, "naive_blocks_per_request": naive.retained_blocks_per_request,
                     "vtoken_blocks_per_request": vtoken.retained_blocks_per_request,
                     "blocks_change_pct": _pct(vtoken.retained_blocks_per_request, naive.retained_blocks_per_request),
                     "naive_utilization": naive.memory_utilization, "vtoken_utilization": vtoken.memory_utilization,
                     "naive_peak_blocks": naive.peak_allocated_blocks, "vtoken_peak_blocks": vtoken.peak_allocated_blocks})
    changes = [r["blocks_change_pct"] for r in rows]
    claim = Claim("retained blocks per request, vtoken vs naive-evict with prefix caching", "-28.6% to -42.2%",
                  _range(changes, "%"), {"change_pct": changes})
    experiment = base.experiment
    settings = {"model": experiment.model.name, "gpu": experiment.gpu.name, "policy": experiment.eviction.policy,
                "budget": experiment.eviction.budget.describe(), "block_size": experiment.block_size,
                "num_blocks": num_blocks if num_blocks is not None else "the GPU's default",
                "concurrency": largest, "theta_f": experiment.reclaim.theta_f, "degrees": list(degrees)}
    num_tokens = trace.requests[0].num_output_tokens
    note = (f"{largest} requests at t = 0, each {PREFIX_TOKENS:,} shared + {SUFFIX_TOKENS:,} private prompt tokens and "
            f"{num_tokens} output tokens; at degree d, groups of d requests share one prefix (prefix caching: one copy "
            "of its blocks per group, pinned)")
    return PaperFigure("prefix-sharing", "§4.6: shared prefix, private suffixes", settings, tuple(rows), (claim,),
                       (note,))


def figure_to_json(figure: PaperFigure) -> dict:
    return make_json_safe(asdict(figure))


def _settings(trace: Trace, run: Run, *, resident: bool = False) -> dict[str, object]:
    """What every experiment states; `resident`: an experiment that sets the model, the block
    budget and the concurrency itself (those are left out here)."""
    e = run.experiment
    settings = {"trace": trace.source, "num_requests": len(trace.requests), "model": e.model.name,
                "gpu": e.gpu.name, "policy": e.eviction.policy, "budget": e.eviction.budget.describe(),
                "block_size": e.block_size, "num_blocks": e.num_blocks, "concurrency": run.spec.concurrency,
                "theta_f": e.reclaim.theta_f}
    if resident:
        for key in ("model", "num_blocks", "concurrency"):
            del settings[key]
    return settings


def _keep(base: Run, eviction_ratio: float) -> Budget:
    """The budget that evicts `eviction_ratio` of the tokens, with `base`'s protected tokens."""
    budget = base.experiment.eviction.budget
    return replace(budget, keep_ratio=round(1 - eviction_ratio, 6), num_tokens=None)


def _sort_key(value: object) -> float:
    """A varied value as a number: a budget '70%' by its percentage."""
    return float(str(value).rstrip("%")) if isinstance(value, str) else float(value)


def _given(**kwargs: object) -> dict[str, object]:
    return {k: v for k, v in kwargs.items() if v is not None}


def _pct(value: float, reference: float) -> float:
    return 100 * (value - reference) / reference if reference else float("nan")


def _range(values: Sequence[float], unit: str) -> str:
    low, high = min(values), max(values)
    return f"{low:+.1f}{unit}" if round(low, 1) == round(high, 1) else f"{low:+.1f}{unit} to {high:+.1f}{unit}"

