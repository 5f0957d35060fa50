"""matplotlib figures written to PNG (Agg backend, no display): those of `vtoken compare --output`
and `vtoken audit --output`. The commands import this module only when they draw, so that
matplotlib is not imported at start-up.

Every figure is titled with what it ran: trace, model, policy, budget and KV block budget.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from vtoken.audit import AuditReport, PolicyAudit, policy_title  # noqa: E402
from vtoken.compare import CompareReport  # noqa: E402
from vtoken_cli.render.common import BIN_LABELS  # noqa: E402

# one look per variant, so that lines that coincide stay visible (native under naive-evict)
STYLES = {"native": dict(color="tab:gray", marker="s", linestyle="-", markersize=7),
          "naive-evict": dict(color="tab:red", marker="o", linestyle="--", markersize=5),
          "vtoken": dict(color="tab:blue", marker="^", linestyle=":", markersize=6)}


def compare_title(report: CompareReport) -> str:
    cfg = report.experiment
    return (f"{Path(str(report.trace.source)).name} | {cfg.model.name} | {cfg.eviction.policy}, "
            f"{cfg.eviction.budget.describe()} | {cfg.num_blocks:,} blocks of {cfg.block_size} tokens")


def _save(fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_histograms(report: CompareReport, path: Path) -> None:
    fig, axes = plt.subplots(1, len(report.runs), figsize=(4.2 * len(report.runs), 3.6), sharey=True, squeeze=False)
    for ax, (name, result) in zip(axes[0], report.runs.items()):
        ax.bar(range(10), [100 * v for v in result.utilization_histogram], color=STYLES.get(name, {}).get("color"))
        ax.set_xticks(range(10), BIN_LABELS, rotation=60, fontsize=7)
        ax.set_title(f"{name}  F = {result.waste_ratio:.2f}", fontsize=10)
        ax.set_xlabel("block utilization u = live / S")
    axes[0][0].set_ylabel("share of allocated blocks (%)")
    fig.suptitle(compare_title(report), fontsize=9)
    _save(fig, path)


def plot_sweep(report: CompareReport, path: Path) -> None:
    sla = report.sla
    fig, (ax_tput, ax_lat, ax_pre) = plt.subplots(1, 3, figsize=(14, 4.2))
    for variant in dict.fromkeys(p.variant for p in report.sweep):
        points = sorted((p for p in report.sweep if p.variant == variant), key=lambda p: p.concurrency)
        cs = [p.concurrency for p in points]
        style = STYLES.get(variant, {})
        ax_tput.plot(cs, [p.throughput_tok_s for p in points], label=variant, **style)
        ax_lat.plot(cs, [p.p95_s for p in points], label=variant, **style)
        ax_pre.plot(cs, [p.preemptions for p in points], label=variant, **style)
        chosen = [p for p in points if p.concurrency == sla.c_sel.get(variant)]
        for p in chosen:
            ax_tput.plot([p.concurrency], [p.throughput_tok_s], marker="*", markersize=17, linestyle="none",
                         color=style.get("color"), markeredgecolor="k", label=f"C_sel {variant} = {p.concurrency}")
    ax_lat.axhline(sla.threshold_s, color="k", linestyle="-.", linewidth=1,
                   label=f"SLA {sla.threshold_s:.2f} s ({sla.factor:g} x naive-evict at C={sla.reference_concurrency})")
    concurrencies = sorted({p.concurrency for p in report.sweep})
    for ax in (ax_tput, ax_lat, ax_pre):
        ax.set_xticks(concurrencies)
        ax.set_xlabel("concurrency C (closed loop)")
        ax.legend(fontsize=7)
    ax_tput.set(ylabel="output tokens/s", title="throughput (* = C_sel: most tok/s within the SLA)")
    ax_lat.set(ylabel=f"p95 {sla.metric} latency (s)", title=f"p95 {sla.metric} latency")
    ax_pre.set(ylabel="preemptions", title="preemptions")
    fig.suptitle(compare_title(report), fontsize=9)
    _save(fig, path)


def plot_frontier(report: CompareReport, path: Path) -> None:
    fr = report.frontier
    fig, ax = plt.subplots(figsize=(7, 4.4))
    concurrencies = sorted({p.concurrency for p in fr.points})
    for variant in fr.max_feasible_concurrency:
        points = sorted((p for p in fr.points if p.variant == variant), key=lambda p: p.concurrency)
        ax.plot([p.concurrency for p in points], [p.peak_blocks for p in points],
                label=f"{variant} (max feasible C {fr.max_feasible_concurrency[variant]})", **STYLES.get(variant, {}))
    ax.axhline(fr.budget_blocks, color="k", linestyle="-.", linewidth=1, label=f"budget {fr.budget_blocks:,} blocks")
    ax.axvline(fr.ideal_max_concurrency, color="tab:green", linestyle=(0, (1, 3)),
               label=f"ideal packing: C = {fr.ideal_max_concurrency} fits")
    ax.set_xticks(concurrencies)
    ax.set(xlabel="concurrency C (markers: the C tried; all resident at t = 0)", ylabel="peak block demand",
           title="capacity frontier")
    ax.legend(fontsize=7)
    fig.suptitle(compare_title(report), fontsize=9)
    _save(fig, path)


def plot_policy_histogram(report: AuditReport, p: PolicyAudit, path: Path) -> None:
    """`vtoken audit`: one policy's block utilization, naive-evict next to vtoken."""
    d = report.deployment
    fig, ax = plt.subplots(figsize=(7, 3.8))
    width = 0.4
    for offset, variant in ((-width / 2, "naive-evict"), (width / 2, "vtoken")):
        run = p.runs[variant]
        ax.bar([i + offset for i in range(10)], [100 * v for v in run.utilization_histogram], width,
               color=STYLES[variant]["color"], label=f"{variant} (F = {run.waste_ratio:.2f})")
    ax.set_xticks(range(10), BIN_LABELS, rotation=45, fontsize=7)
    ax.set(xlabel="block utilization u = live / S", ylabel="share of allocated blocks (%)",
           title=f"{policy_title(p.policy)}: block utilization, time-weighted")
    ax.legend()
    fig.suptitle(f"{Path(str(report.trace.source)).name} | {d.model.name} | {p.policy}, {d.budget.describe()} | "
                 f"{d.num_blocks:,} blocks of {d.block_size} tokens", fontsize=9)
    _save(fig, path)


def plot_calibration(report, path: Path) -> None:
    """Measured against predicted step time, one colour per kind of step, on log axes."""
    from vtoken.calibration.fit import STEP_KINDS

    fig, ax = plt.subplots(figsize=(5.2, 4.6))
    colors = dict(zip(STEP_KINDS, ("tab:blue", "tab:orange", "tab:green", "tab:red")))
    for kind in STEP_KINDS:
        pairs = [(s.measured_s, p) for s, p in zip(report.steps, report.predicted_s) if s.kind == kind and p > 0]
        if pairs:
            measured, predicted = zip(*pairs)
            ax.scatter(measured, predicted, s=14, alpha=0.7, color=colors[kind], label=f"{kind} ({len(pairs)})")
    times = [t for s, p in zip(report.steps, report.predicted_s) for t in (s.measured_s, p) if t > 0]
    low, high = min(times) / 1.5, max(times) * 1.5
    ax.plot([low, high], [low, high], color="gray", linewidth=1, label="predicted = measured")
    ax.set(xscale="log", yscale="log", xlim=(low, high), ylim=(low, high), xlabel="measured step time (s)",
           ylabel="predicted step time (s)")
    ax.set_title(report.profile.sim.describe_step_times().removeprefix("calibrated against "), fontsize=7, wrap=True)
    ax.legend(fontsize=8)
    _save(fig, path)
