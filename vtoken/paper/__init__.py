"""The vToken paper's serving experiments (arXiv 2608.13263, §4), one library call each, with
the paper's own figure recorded next to vtoken's.

    fig7(trace, base, replayer)            memory utilization and retained blocks per request,
                                           vtoken against naive-evict under H2O, Scissorhands
                                           and Random (one `vtoken sweep` over the policy)
    fig8(trace, base, replayer)            SLA-constrained throughput and p95 on Llama-3.1-8B
                                           and Mistral-7B (`vtoken compare`'s closed-loop
                                           sweep and SLA rule) in a memory-bound block budget
    frontier(trace, base, replayer, cases) the capacity frontier: Fig. 9 (Llama-3.1-8B at 5,427
                                           and 11,519 blocks), Fig. 10 (Qwen2.5-14B)
    sensitivity(trace, base, replayer)     §4.5: block size, eviction ratio, theta_F (`vtoken
                                           sweep`, one factor at a time)
    prefix_sharing(base, replayer)         §4.6: an 8K shared prefix and 8K private suffixes
                                           at sharing degrees 1, 2, 4, 8

Each returns a `PaperFigure`: its settings (including how a block budget was chosen), one row
per configuration, and `Claim`s (the paper's figure, vtoken's measured one, and the numbers).
Every replay goes through the same entry points as the commands (vtoken.compare, vtoken.sweep,
the replayer's cache and runner).
"""

from vtoken.paper.experiments import (FIG7_POLICIES, FIG8_MODELS, FIG9_CASES, FIG10_CASES, PREFIX_BUDGET,
                                      PREFIX_DEGREES, SENSITIVITY, Claim, FrontierCase, PaperFigure, fig7, fig8,
                                      figure_to_json, frontier, memory_bound_budget, prefix_sharing, sensitivity)
from vtoken.paper.workloads import WORKLOADS, load_workload, shared_prefix_trace, workload_path

__all__ = [
    "FIG7_POLICIES", "FIG8_MODELS", "FIG9_CASES", "FIG10_CASES", "PREFIX_BUDGET", "PREFIX_DEGREES", "SENSITIVITY",
    "WORKLOADS", "Claim", "FrontierCase", "PaperFigure", "fig7", "fig8", "figure_to_json", "frontier",
    "load_workload", "memory_bound_budget", "prefix_sharing", "sensitivity", "shared_prefix_trace", "workload_path",
]
