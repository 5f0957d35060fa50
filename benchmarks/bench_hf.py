"""Speed of the hf executor on SmolLM2-135M (CPU, fp32): per-token time of vtoken against
native at batch 4 with an eviction every 32 tokens, and the cost of collecting attention scores.

    python benchmarks/bench_hf.py [--rounds 3] [--threads 1] [--prompt-tokens 256] [--output-tokens 128]

Runs, interleaved over rounds so that machine noise hits every run alike; medians printed:

    native                      full retention, fused attention (no scores)
    naive-evict h2o             H2O at 50%, scores collected, no reclamation
    vtoken h2o                  the same, plus the reclaimer and real KV copies
    vtoken streaming_llm        positional eviction: no scores
    vtoken streaming_llm+scores the same decisions with scores collected anyway

The cost of score collection is the last two rows' difference (same evictions, same copies).
ms/token is the mean TPOT of the measured forwards (every step decodes the 4 requests);
engine ms/step is the engine's work outside the forward (policy, reclaimer, copies,
scheduling) per iteration.
--threads 1 by default: on a small shared machine two OpenMP threads wait on each other.

Then quality against native over a set of instruction prompts (the chat template applied),
every policy at 50% (4 sinks, 16 recent), an eviction every 16 tokens: ROUGE-L F1 of the text
and the output-length ratio, up to the first EOS.
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import replace

import torch

from vtoken.engine.experiment import EvictionConfig, Experiment
from vtoken.engine.hf import HFRun, run_hf
from vtoken.engine.hf_oracle import agreement, quality_vs_native
from vtoken.hardware import resolve_gpu
from vtoken.kv.reclaim import ReclaimConfig
from vtoken.models import load_model
from vtoken.policies import POLICIES
from vtoken.policies.base import Budget
from vtoken.trace import Request

CASES = (
    ("native", "native", "h2o", None),
    ("naive-evict h2o", "naive-evict", "h2o", None),
    ("vtoken h2o", "vtoken", "h2o", None),
    ("vtoken streaming_llm", "vtoken", "streaming_llm", False),
    ("vtoken streaming_llm+scores", "vtoken", "streaming_llm", True),
)
PROMPTS = (
    "Explain why the sky is blue.",
    "Write a short story about a robot who learns to paint.",
    "What are the main differences between Python and C?",
    "Give me three tips for sleeping better.",
    "Describe how a bicycle works.",
    "Why is exercise good for your health?",
    "Summarize the plot of a typical detective novel.",
    "How do plants make their food?",
)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--output-tokens", type=int, default=128)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = load_model("smollm2-135m", on_status=print)
    requests = [Request(str(i), 0.0, args.prompt_tokens, args.output_tokens) for i in range(args.batch)]
    blocks_per_request = -(-(args.prompt_tokens + args.output_tokens) // 16)
    base = Experiment(model.spec, resolve_gpu("h100"), num_blocks=args.batch * blocks_per_request + 1,
                      block_size=16, eviction=EvictionConfig("h2o", Budget(keep_ratio=0.5), 32),
                      reclaim=ReclaimConfig(mode="hole-fill"))
    print(f"SmolLM2-135M fp32 on CPU, {args.threads} torch thread(s); batch {args.batch}, prompts of "
          f"{args.prompt_tokens} random token ids, {args.output_tokens} generated tokens each, H2O/StreamingLLM keep 50% "
          f"(4 sinks, 64 recent), eviction every 32 tokens, hole-fill reclamation, {args.rounds} rounds (medians)")
    runs: dict[str, list[HFRun]] = {name: [] for name, *_ in CASES}
    for _ in range(args.rounds):
        for name, variant, policy, collect_scores in CASES:
            run = replace(base, eviction=replace(base.eviction, policy=policy)).run(variant, args.batch)
            runs[name].append(run_hf(run, requests, model, collect_scores=collect_scores))
    report(runs)
    quality(model, base)


def quality(model, base: Experiment) -> None:
    requests = [Request(str(i), 0.0, 1, 96, prompt=p) for i, p in enumerate(PROMPTS)]
    budget = Budget(keep_ratio=0.5, num_sink_tokens=4, num_recent_tokens=16)
    experiment = replace(base, num_blocks=len(requests) * 12, eviction=EvictionConfig("h2o", budget, 16))
    native = run_hf(experiment.run("native", 4), requests, model)
    print(f"\nquality vs native: {len(PROMPTS)} instruction prompts, 96 generated tokens, {budget.describe()}, "
          "eviction every 16 tokens")
    print(f"{'policy':<15}{'ROUGE-L F1':>11}{'length ratio':>13}{'evicted':>9}{'moved':>7}{'naive=vtoken':>14}")
    for policy in POLICIES:
        policy_experiment = replace(experiment, eviction=replace(experiment.eviction, policy=policy))
        naive = run_hf(policy_experiment.run("naive-evict", 4), requests, model)
        vtoken = run_hf(policy_experiment.run("vtoken", 4), requests, model)
        q, same = quality_vs_native(native.outputs, vtoken.outputs, model), agreement(naive.outputs, vtoken.outputs)
        print(f"{policy:<15}{q.rouge_l_f1:>11.3f}{q.length_ratio:>13.2f}{vtoken.result.tokens_evicted:>9}"
              f"{vtoken.result.tokens_moved:>7}{f'{same.num_identical}/{same.num_requests}':>14}")


def report(runs: dict[str, list[HFRun]]) -> None:
    ms_per_token = {name: statistics.median(1000 * r.result.tpot.mean_s for r in rs) for name, rs in runs.items()}
    native = ms_per_token["native"]
    print(f"{'case':<29}{'ms/token':>9}{'x native':>9}{'tok/s':>8}{'engine ms/step':>15}{'evicted':>9}{'moved':>7}"
          f"{'reclaimed':>10}")
    for name, rs in runs.items():
        last = rs[-1].result
        tok_s = statistics.median(sum(o.logprobs.size for o in r.outputs) / r.forward_s for r in rs)
        engine_ms = statistics.median(1000 * (r.result.host_time_s - r.forward_s) / r.result.num_iterations for r in rs)
        print(f"{name:<29}{ms_per_token[name]:>9.1f}{ms_per_token[name] / native:>9.3f}{tok_s:>8.1f}{engine_ms:>15.1f}"
              f"{last.tokens_evicted:>9}{last.tokens_moved:>7}{last.blocks_reclaimed:>10}")
    cost = ms_per_token["vtoken streaming_llm+scores"] - ms_per_token["vtoken streaming_llm"]
    print(f"score collection: {cost:+.1f} ms/token ({100 * cost / native:+.1f}% of native) "
          "= streaming_llm with scores - without (same evictions and copies)")
    print(f"vtoken h2o / native per-token time: {ms_per_token['vtoken h2o'] / native:.3f} (target <= 1.15)")


if __name__ == "__main__":
    main()
