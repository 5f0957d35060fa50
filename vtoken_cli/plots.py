"""matplotlib figures written to PNG (Agg backend, no display): those of `vtoken compare --output`
and `vtoken audit --output`. The commands import this module only when they draw, so that
matplotlib is not imported at start-up."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from vtoken.audit import PolicyAudit, policy_title  # noqa: E402
from vtoken.compare import CompareReport  # noqa: E402
from vtoken_cli.render.common import BIN_LABELS  # noqa: E402

BIN_CENTERS = [f"{10 * i}-{10 * (i + 1)}" for i in range(10)]


def plot_histograms(report: CompareReport, path: Path) -> None:
    fig, axes = plt.subplots(1, len(report.runs), figsize=(4 * len(report.runs), 3.2), sharey=True)
    for ax, (name, result) in zip(axes, report.runs.items()):
        ax.bar(range(10), [100 * v for v in result.utilization_histogram], color="tab:blue")
        ax.set_xticks(range(10), BIN_CENTERS, rotation=60, fontsize=7)
        ax.set_title(f"{name}  F={result.waste_ratio:.2f}")
        ax.set_xlabel("block utilization (%)")
    axes[0].set_ylabel("share of allocated blocks (%)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_sweep(report: CompareReport, path: Path) -> None:
    fig, (ax_tput, ax_lat) = plt.subplots(1, 2, figsize=(10, 3.8))
    for variant in dict.fromkeys(p.variant for p in report.sweep):
        points = sorted((p for p in report.sweep if p.variant == variant), key=lambda p: p.concurrency)
        cs = [p.concurrency for p in points]
        ax_tput.plot(cs, [p.throughput_tok_s for p in points], marker="o", label=variant)
        ax_lat.plot(cs, [p.p95_s for p in points], marker="o", label=variant)
        c_sel = report.sla.c_sel.get(variant)
        for p in points:
            if p.concurrency == c_sel:
                ax_tput.plot([p.concurrency], [p.throughput_tok_s], marker="*", markersize=16, color="gold", markeredgecolor="k")
    ax_lat.axhline(report.sla.threshold_s, color="red", linestyle="--", label="SLA")
    ax_tput.set(xlabel="concurrency", ylabel="output tokens/s", title="throughput (* = C_sel)")
    ax_lat.set(xlabel="concurrency", ylabel=f"p95 {report.sla.metric} latency (s)", title="p95 latency")
    ax_lat.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_frontier(report: CompareReport, path: Path) -> None:
    fr = report.frontier
    fig, ax = plt.subplots(figsize=(6, 3.8))
    for variant in fr.max_feasible_concurrency:
        points = sorted((p for p in fr.points if p.variant == variant), key=lambda p: p.concurrency)
        ax.plot([p.concurrency for p in points], [p.peak_blocks for p in points], marker="o", label=variant)
    ax.axhline(fr.budget_blocks, color="red", linestyle="--", label="budget")
    ax.set(xlabel="concurrency (all resident at t=0)", ylabel="peak block demand", title="capacity frontier")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_policy_histogram(p: PolicyAudit, path: Path) -> None:
    """`vtoken audit`: one policy's block utilization, naive-evict next to vtoken."""
    fig, ax = plt.subplots(figsize=(6, 3.4))
    width = 0.4
    for offset, variant in ((-width / 2, "naive-evict"), (width / 2, "vtoken")):
        run = p.runs[variant]
        ax.bar([i + offset for i in range(10)], [100 * v for v in run.utilization_histogram], width,
               label=f"{variant} (F = {run.waste_ratio:.2f})")
    ax.set_xticks(range(10), [label.strip() for label in BIN_LABELS], rotation=45, fontsize=7)
    ax.set(xlabel="block utilization (live tokens / S)", ylabel="share of allocated blocks (%)",
           title=f"{policy_title(p.policy)}: block utilization, time-weighted")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
