"""Speed of the sim runtime: the paper's capacity-frontier experiment and the whole Azure
conversation trace through all three variants at C=32. Host seconds, not a test.

    python benchmarks/bench_compare.py [--azure ../shared/traces/azure_llm_2023_conv.csv]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from vtoken.analysis import frontier, run_variants
from vtoken.engine import RunConfig
from vtoken.hardware import resolve_gpu
from vtoken.model_spec import resolve_model
from vtoken.trace import load_trace

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--azure", default=str(ROOT.parent / "shared" / "traces" / "azure_llm_2023_conv.csv"))
    args = parser.parse_args()
    base = RunConfig("vtoken", resolve_model("llama-3.1-8b"), resolve_gpu("h100"), num_blocks=5427)
    paper = load_trace(ROOT / "sample_traces" / "paper_frontier.jsonl").requests
    for budget, concurrencies in ((5427, range(1, 13)), (11519, range(1, 25))):
        started = time.perf_counter()
        result = frontier(RunConfig(**{**base.__dict__, "num_blocks": budget}), paper, list(concurrencies))
        print(f"frontier budget={budget}: max feasible {result.max_feasible_concurrency}, ideal {result.ideal_max_concurrency}, "
              f"{time.perf_counter() - started:.1f} s host")
    trace = load_trace(args.azure)
    config = RunConfig(**{**base.__dict__, "num_blocks": 28019, "concurrency": 32})
    started = time.perf_counter()
    results = run_variants(config, trace.requests)
    elapsed = time.perf_counter() - started
    steps = sum(r.num_decode_steps for r in results.values())
    print(f"azure conv ({len(trace.requests)} requests) x 3 variants at C=32: {elapsed:.1f} s host, "
          f"{steps} simulated decode steps, {1e6 * elapsed / steps:.1f} us host per decode step")
    for name, r in results.items():
        print(f"  {name:12s} F={r.waste_ratio:.3f} le_half={r.frac_blocks_le_half:.3f} tok/s={r.throughput_tok_s:.0f} "
              f"p95={r.latency.p95_s:.2f}s moved={r.tokens_moved} host={r.host_time_s:.1f}s")


if __name__ == "__main__":
    main()
