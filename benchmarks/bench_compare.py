"""Speed of the sim runtime: the paper's capacity-frontier experiment and the whole Azure
conversation trace through all three variants at C=32. Host seconds, not a test. Then what
packing under memory pressure costs on the paper's capacity setup (H2O keeping 8,192 tokens,
the largest C each budget holds, all resident from t = 0): tokens copied per freed block and
per generated token, and the critical-path copy time per step from the sim's copy cost.

    python benchmarks/bench_compare.py [--azure ../shared/traces/azure_llm_2023_conv.csv] [--only-pressure]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from dataclasses import replace

from vtoken.analysis import frontier, run_variants
from vtoken.engine import Experiment, Runtime, SimExecutor
from vtoken.engine.experiment import EvictionConfig
from vtoken.policies.base import Budget
from vtoken.hardware import resolve_gpu
from vtoken.model_spec import resolve_model
from vtoken.trace import load_trace

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--azure", default=str(ROOT.parent / "shared" / "traces" / "azure_llm_2023_conv.csv"))
    parser.add_argument("--only-pressure", action="store_true", help="only the pressure packing's cost")
    args = parser.parse_args()
    if args.only_pressure:
        return pressure_cost()
    base = Experiment(resolve_model("llama-3.1-8b"), resolve_gpu("h100"), num_blocks=5427)
    paper = load_trace(ROOT / "sample_traces" / "paper_frontier.jsonl").requests
    for budget, concurrencies in ((5427, range(1, 13)), (11519, range(1, 25))):
        started = time.perf_counter()
        result = frontier(replace(base, num_blocks=budget), paper, list(concurrencies))
        print(f"frontier budget={budget}: max feasible {result.max_feasible_concurrency}, ideal {result.ideal_max_concurrency}, "
              f"{time.perf_counter() - started:.1f} s host")
    trace = load_trace(args.azure)
    started = time.perf_counter()
    results = run_variants(replace(base, num_blocks=28019), trace.requests, 32)
    elapsed = time.perf_counter() - started
    steps = sum(r.num_iterations for r in results.values())
    print(f"azure conv ({len(trace.requests)} requests) x 3 variants at C=32: {elapsed:.1f} s host, "
          f"{steps} simulated engine steps, {1e6 * elapsed / steps:.1f} us host per step")
    for name, r in results.items():
        print(f"  {name:12s} F={r.waste_ratio:.3f} le_half={r.frac_blocks_le_half:.3f} tok/s={r.throughput_tok_s:.0f} "
              f"p95={r.latency.p95_s:.2f}s moved={r.tokens_moved} host={r.host_time_s:.1f}s")

    pressure_cost()


class CopyTimingSim(SimExecutor):
    """The sim executor, adding up the copy time it charges (the part past the post-forward
    overlap window)."""

    copy_s = 0.0

    def execute(self, batch, load):
        self.copy_s += self.copy_time_s(load.num_copied_tokens)
        return super().execute(batch, load)


def pressure_cost() -> None:
    paper = load_trace(ROOT / "sample_traces" / "paper_frontier.jsonl").requests
    eviction = EvictionConfig("h2o", Budget.parse("8192"))
    for budget, concurrency in ((5427, 10), (11519, 22)):
        batch = [replace(paper[0], request_id=f"r{i}") for i in range(concurrency)]
        experiment = Experiment(resolve_model("llama-3.1-8b"), resolve_gpu("h100"), num_blocks=budget, eviction=eviction)
        executor = CopyTimingSim(experiment.model, experiment.gpu, experiment.sim, experiment.seed)
        result = Runtime(experiment.run("vtoken", None, admit_all_at_start=True), batch, executor).run()
        num_generated = sum(r.num_output_tokens for r in batch)
        print(f"pressure packing, budget {budget} blocks, C={concurrency}: {result.num_completed} completed, "
              f"{result.preemptions} preempted, peak {result.peak_allocated_blocks} blocks")
        for trigger, work in (("lazy", result.lazy_reclaim), ("pressure", result.pressure_reclaim),
                              ("layout", result.layout_reclaim)):
            cost = work.cost(num_generated, result.num_iterations)
            print(f"  {trigger:8s} {work.num_rounds} rounds, {work.num_plans} plans, {work.num_blocks_freed} blocks freed, "
                  f"{work.num_tokens_moved} tokens copied: {cost['tokens_per_freed_block'] or 0:.1f} per freed block, "
                  f"{cost['tokens_per_generated_token'] or 0:.3f} per generated token, "
                  f"{1e6 * (cost['copy_s_per_step'] or 0):.2f} us of copy per step")
        print(f"  on the critical path {1e6 * executor.copy_s / result.num_iterations:.2f} us per step "
              f"({result.num_iterations} steps, makespan {result.makespan_s:.1f} s)")


if __name__ == "__main__":
    main()
