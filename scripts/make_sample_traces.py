"""Write the sample traces in sample_traces/ and examples/validation_trace.jsonl, and print their
statistics for the READMEs.

    python scripts/make_sample_traces.py [--out-dir sample_traces] [--examples-dir examples]
                                         [--azure-source PATH]

Reproducible: the synthetic traces come from fixed seeds and the Azure slice is chosen by a
deterministic rule, so re-running rewrites identical bytes.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from vtoken.trace import Trace, load_trace  # noqa: E402

DEFAULT_AZURE_SOURCE = REPO_ROOT.parent / "shared" / "traces" / "azure_llm_2023_conv.csv"
AZURE_NUM_ROWS = 240
AZURE_WINDOW_STRIDE = 40
LONGBENCH_SEED = 20240611
SHARED_PREFIX_SEED = 20240612
VALIDATION_SEED = 20261201
# every prompt length a calibration grid replays (vtoken/calibration/grid.py, the default and --quick)
GRID_PROMPT_TOKENS = frozenset({32, 64, 128, 256, 512, 1024})


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=REPO_ROOT / "sample_traces")
    parser.add_argument("--examples-dir", type=Path, default=REPO_ROOT / "examples")
    parser.add_argument("--azure-source", type=Path, default=DEFAULT_AZURE_SOURCE)
    args = parser.parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    outputs = {
        "azure_conv_sample.csv": azure_slice_bytes(args.azure_source),
        "longbench_like.jsonl": jsonl_bytes(longbench_like_records()),
        "shared_prefix.jsonl": jsonl_bytes(shared_prefix_records()),
    }
    paths = {args.out_dir / name: content for name, content in outputs.items()}
    paths[args.examples_dir / "validation_trace.jsonl"] = jsonl_bytes(validation_records())
    for path, content in paths.items():
        path.write_bytes(content)
        print(describe(load_trace(path)))


def azure_slice_bytes(source: Path) -> bytes:
    """AZURE_NUM_ROWS contiguous rows of the Azure conversation trace, bytes unchanged.

    The window (starts every AZURE_WINDOW_STRIDE rows) is the one whose median and p95 prompt
    and output lengths are closest, in summed |log ratio|, to the whole trace's.
    """
    header, *rows = source.read_bytes().splitlines(keepends=True)
    lengths = np.array([[int(cell) for cell in row.split(b",")[1:3]] for row in rows])  # [num_rows, 2]
    target = _length_profile(lengths)
    starts = range(0, len(rows) - AZURE_NUM_ROWS + 1, AZURE_WINDOW_STRIDE)
    scores = [np.abs(np.log(_length_profile(lengths[start:start + AZURE_NUM_ROWS]) / target)).sum()
              for start in starts]
    best_start = starts[int(np.argmin(scores))]
    return header + b"".join(rows[best_start:best_start + AZURE_NUM_ROWS])


def _length_profile(lengths: np.ndarray) -> np.ndarray:
    return np.percentile(lengths, [50, 95], axis=0).ravel()


def longbench_like_records() -> list[dict]:
    """24 long-context requests shaped like LongBench: prompts 4K-16K tokens (log-uniform),
    outputs 128-512 tokens, Poisson arrivals at 0.25 requests/s."""
    rng = np.random.default_rng(LONGBENCH_SEED)
    num_requests = 24
    arrivals_s = np.cumsum(rng.exponential(1 / 0.25, num_requests))
    prompt_tokens = np.exp(rng.uniform(np.log(4096), np.log(16384), num_requests)).round().astype(int)
    output_tokens = rng.integers(128, 513, num_requests)
    return [
        {"request_id": f"longbench-{idx:02d}", "timestamp": round(float(arrivals_s[idx] - arrivals_s[0]), 3),
         "input_length": int(prompt_tokens[idx]), "output_length": int(output_tokens[idx])}
        for idx in range(num_requests)
    ]


def shared_prefix_records() -> list[dict]:
    """64 requests, most in 8 groups that share a 1024-2048-token system prompt or document;
    each adds a 64-1024-token question and gets a 64-512-token answer; Poisson at 2 req/s."""
    rng = np.random.default_rng(SHARED_PREFIX_SEED)
    num_requests, num_groups = 64, 8
    prefix_tokens = rng.integers(1024, 2049, num_groups)
    arrivals_s = np.cumsum(rng.exponential(1 / 2.0, num_requests))
    group_idx = rng.integers(0, num_groups + 1, num_requests)  # num_groups: no shared prefix
    suffix_tokens = rng.integers(64, 1025, num_requests)
    output_tokens = rng.integers(64, 513, num_requests)
    records = []
    for idx in range(num_requests):
        timestamp_s = round(float(arrivals_s[idx] - arrivals_s[0]), 3)
        record = {"request_id": f"shared-{idx:02d}", "timestamp": timestamp_s,
                  "input_length": int(suffix_tokens[idx]), "output_length": int(output_tokens[idx])}
        if group_idx[idx] < num_groups:
            num_prefix_tokens = int(prefix_tokens[group_idx[idx]])
            record["input_length"] += num_prefix_tokens
            record |= {"prefix_id": f"doc-{group_idx[idx]}", "prefix_length": num_prefix_tokens}
        records.append(record)
    return records


def validation_records() -> list[dict]:
    """32 requests for `vtoken validate`: prompts of 40-300 tokens and outputs of 8-40 (uniform),
    no prompt of a length any calibration grid replays, arrivals every 0.5 s (validate replays
    closed loop). The longest request is 301 tokens: at C = 4 validate's default budget is 41
    blocks of 32."""
    rng = np.random.default_rng(VALIDATION_SEED)
    num_requests = 32
    prompt_tokens = rng.integers(40, 301, num_requests)
    prompt_tokens = [int(p) + 8 if int(p) in GRID_PROMPT_TOKENS else int(p) for p in prompt_tokens]
    output_tokens = rng.integers(8, 41, num_requests)
    return [{"request_id": f"v{idx:02d}", "timestamp": 0.5 * idx, "input_length": prompt_tokens[idx],
             "output_length": int(output_tokens[idx])} for idx in range(num_requests)]


def jsonl_bytes(records: list[dict]) -> bytes:
    return "".join(json.dumps(record) + "\n" for record in records).encode()


def describe(trace: Trace) -> str:
    """Markdown lines with the statistics the README quotes."""
    prompt_tokens = np.array([req.num_prompt_tokens for req in trace.requests])
    output_tokens = np.array([req.num_output_tokens for req in trace.requests])
    duration_s = trace.requests[-1].arrival_s
    prefix_ids = {req.prefix_id for req in trace.requests if req.prefix_id is not None}
    num_prefixed = sum(req.prefix_id is not None for req in trace.requests)
    lines = [
        f"{Path(trace.source).name}: {len(trace.requests)} requests over {duration_s:.1f} s "
        f"({len(trace.requests) / duration_s:.2f} req/s)",
        f"- prompt tokens: {_quantiles(prompt_tokens)}",
        f"- output tokens: {_quantiles(output_tokens)}",
    ]
    if prefix_ids:
        lines.append(f"- {num_prefixed} requests share one of {len(prefix_ids)} prefixes")
    return "\n".join(lines) + "\n"


def _quantiles(values: np.ndarray) -> str:
    p50, p95 = np.percentile(values, [50, 95])
    return f"min {values.min()}, p50 {p50:.0f}, p95 {p95:.0f}, max {values.max()}, mean {values.mean():.0f}"


if __name__ == "__main__":
    main()
