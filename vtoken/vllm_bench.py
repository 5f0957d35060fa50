"""A `vllm bench serve --save-result --save-detailed` result file: as a trace, and as what the
server measured, request by request.

    load_bench_result(path)   -> BenchResult: per-request lengths, start, TTFT, ITLs, end-to-end
    BenchResult.figures()     throughput, TTFT / TPOT / end-to-end p50 and p95, as vtoken names them
    read_bench_trace          the trace reader (format "vllm-bench"; `auto` detects it)

The file is one JSON object (vLLM 0.32, vllm/benchmarks/serve.py: `result_json`, written with
`json.dump`). The per-request lists, kept only with `--save-detailed`, are aligned with the
benchmark's requests in the order they were issued:

    input_lens[i]    prompt tokens as the server counted them (`RequestFuncOutput.prompt_len`)
    output_lens[i]   output tokens; 0 for a failed request (serve.py `calculate_metrics`)
    start_times[i]   time.perf_counter() on the client when the request was sent (after waiting
                     for a `--max-concurrency` slot); seconds, arbitrary origin
    ttfts[i]         seconds from sending to the first streamed token
    itls[i]          seconds between successive streamed chunks after the first (one per token
                     when every chunk holds one token)
    latencies[i]     seconds from sending to the last chunk (end-to-end)
    errors[i]        "" for a request that succeeded

TPOT is vLLM's and vtoken's definition: (end-to-end - TTFT) / (output tokens - 1). Failed
requests are left out (and counted in the notes). No file here holds the prompt texts: a
replay draws prompt token ids at random, of the measured lengths.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from vtoken.errors import TraceError
from vtoken.trace import Request

FORMAT = "vllm-bench"
PER_REQUEST_KEYS = ("input_lens", "output_lens", "ttfts", "itls", "latencies")
# Keys of every `vllm bench serve` result, detailed or not: how `auto` recognises one.
SUMMARY_KEYS = frozenset({"backend", "duration", "completed"})


@dataclass(frozen=True)
class BenchRequest:
    """One request the benchmark sent, as the client measured it (seconds)."""

    request_idx: int  # its index in the file's lists
    start_s: float  # sent, from the first request sent
    num_prompt_tokens: int
    num_output_tokens: int
    ttft_s: float
    itls_s: tuple[float, ...]
    e2e_s: float

    @property
    def tpot_s(self) -> float:
        """(end-to-end - TTFT) / (output tokens - 1); NaN for a single output token."""
        if self.num_output_tokens <= 1:
            return float("nan")
        return (self.e2e_s - self.ttft_s) / (self.num_output_tokens - 1)

    @property
    def finish_s(self) -> float:
        return self.start_s + self.e2e_s


@dataclass(frozen=True)
class BenchResult:
    """What a `vllm bench serve` run measured: its settings and its successful requests."""

    source: str
    model_id: str
    backend: str
    date: str
    request_rate: float | str | None  # requests/s, or "inf"
    max_concurrency: int | None
    duration_s: float  # the benchmark's own wall time
    requests: tuple[BenchRequest, ...]  # successful requests, in the order they were issued
    num_failed: int
    notes: tuple[str, ...] = ()

    @property
    def makespan_s(self) -> float:
        """First request sent to last one finished, as vtoken's throughput counts time."""
        return max(r.finish_s for r in self.requests) - min(r.start_s for r in self.requests)

    def figures(self) -> dict[str, float]:
        """The measured figures, named as vtoken's (throughput over the makespan; numpy 'linear'
        percentiles over the successful requests; TPOT over those with at least 2 tokens)."""
        ttfts = [r.ttft_s for r in self.requests]
        tpots = [r.tpot_s for r in self.requests if r.num_output_tokens > 1]
        e2es = [r.e2e_s for r in self.requests]
        return {
            "throughput_tok_s": sum(r.num_output_tokens for r in self.requests) / self.makespan_s,
            "ttft_p50_s": _percentile(ttfts, 50), "ttft_p95_s": _percentile(ttfts, 95),
            "tpot_p50_s": _percentile(tpots, 50), "tpot_p95_s": _percentile(tpots, 95),
            "latency_p50_s": _percentile(e2es, 50), "latency_p95_s": _percentile(e2es, 95),
        }

    def trace_requests(self) -> list[Request]:
        """The requests as a trace replays them: sent at `start_s`, of the measured lengths,
        sorted by arrival (ties keep file order)."""
        ordered = sorted(self.requests, key=lambda r: (r.start_s, r.request_idx))
        return [Request(str(r.request_idx), r.start_s, r.num_prompt_tokens, r.num_output_tokens) for r in ordered]


def load_bench_result(path: str) -> BenchResult:
    """Read a `vllm bench serve --save-result --save-detailed` JSON file. Raises TraceError,
    naming the file and the field, for anything else."""
    from vtoken.trace_parse import read_text

    source = str(path)
    return parse_bench_result(read_text(source), source)


def parse_bench_result(text: str, source: str) -> BenchResult:
    obj = _one_object(text, source)
    missing = [key for key in PER_REQUEST_KEYS if key not in obj]
    if missing:
        if SUMMARY_KEYS <= obj.keys():
            raise TraceError(f"{source}: a vllm bench serve result without its per-request fields ({', '.join(missing)}): "
                             "rerun it with --save-result --save-detailed")
        raise TraceError(f"{source}: not a vllm bench serve result: no {', '.join(missing)}")
    lists = {key: _list(obj, key, source) for key in PER_REQUEST_KEYS}
    has_starts = isinstance(obj.get("start_times"), list)
    if has_starts:
        lists["start_times"] = _list(obj, "start_times", source)
    errors = obj.get("errors") if isinstance(obj.get("errors"), list) else [""] * len(lists["input_lens"])
    lists["errors"] = errors
    num_requests = len(lists["input_lens"])
    uneven = [f"{key} {len(values)}" for key, values in lists.items() if len(values) != num_requests]
    if uneven:
        raise TraceError(f"{source}: per-request lists of different lengths: input_lens {num_requests}, {', '.join(uneven)}")
    requests, num_failed = [], 0
    for idx in range(num_requests):
        num_output = _int_at(lists, "output_lens", idx, source, minimum=0)
        if num_output == 0 or errors[idx]:
            num_failed += 1
            continue
        requests.append(BenchRequest(
            idx, _number_at(lists, "start_times", idx, source) if has_starts else 0.0,
            _int_at(lists, "input_lens", idx, source, minimum=1), num_output, _number_at(lists, "ttfts", idx, source),
            tuple(_itls_at(lists, idx, source)), _number_at(lists, "latencies", idx, source)))
    if not requests:
        raise TraceError(f"{source}: no request of the benchmark succeeded ({num_failed} failed)")
    first_s = min(r.start_s for r in requests)
    requests = [BenchRequest(r.request_idx, r.start_s - first_s, r.num_prompt_tokens, r.num_output_tokens, r.ttft_s,
                             r.itls_s, r.e2e_s) for r in requests]
    notes = [f"vllm bench serve result ({obj.get('backend', '?')} backend, model {obj.get('model_id', '?')}, "
             f"request rate {obj.get('request_rate', '?')}, max concurrency {obj.get('max_concurrency')}): arrivals are "
             "when the client sent each request; prompts are random token ids of the measured lengths"]
    if not has_starts:
        notes.append("no start_times in the file: every request arrives at 0 s")
    if num_failed:
        notes.append(f"{num_failed} failed benchmark request{'s' if num_failed > 1 else ''} left out")
    return BenchResult(source, str(obj.get("model_id", "")), str(obj.get("backend", "")), str(obj.get("date", "")),
                       obj.get("request_rate"), obj.get("max_concurrency"), _duration(obj, source), tuple(requests),
                       num_failed, tuple(notes))


def read_bench_trace(text: str, options: Any):
    """The trace reader of format "vllm-bench" (vtoken.trace_readers.READERS)."""
    from vtoken.trace_parse import Parsed

    result = parse_bench_result(text, options.source)
    return Parsed(result.trace_requests(), list(result.notes))


def is_bench_result(text: str) -> bool:
    """Whether `text` is one JSON object with a vllm bench serve result's keys."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        return False
    return isinstance(obj, dict) and ("input_lens" in obj or SUMMARY_KEYS <= obj.keys())


def _one_object(text: str, source: str) -> dict:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        if exc.msg == "Extra data":
            raise TraceError(f"{source} line {exc.lineno}: more than one JSON object (results appended with "
                             "--append-result?); give one vllm bench serve result per file") from None
        raise TraceError(f"{source} line {exc.lineno}: malformed JSON ({exc.msg})") from None
    if not isinstance(obj, dict):
        raise TraceError(f"{source}: a vllm bench serve result is one JSON object, got {type(obj).__name__}")
    return obj


def _list(obj: dict, key: str, source: str) -> list:
    if not isinstance(obj[key], list):
        raise TraceError(f"{source}: {key} must be a list, got {type(obj[key]).__name__}")
    return obj[key]


def _int_at(lists: dict, key: str, idx: int, source: str, minimum: int) -> int:
    value = lists[key][idx]
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise TraceError(f"{source}: {key}[{idx}] must be an integer >= {minimum}, got {value!r}")
    return value


def _number_at(lists: dict, key: str, idx: int, source: str) -> float:
    value = lists[key][idx]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or (
            key != "start_times" and value < 0):
        raise TraceError(f"{source}: {key}[{idx}] must be a finite number{'' if key == 'start_times' else ' >= 0'}, "
                         f"got {value!r}")
    return float(value)


def _itls_at(lists: dict, idx: int, source: str) -> list[float]:
    value = lists["itls"][idx]
    if not isinstance(value, list) or not all(
            not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v) and v >= 0 for v in value):
        raise TraceError(f"{source}: itls[{idx}] must be a list of seconds >= 0, got {_clip(value)}")
    return [float(v) for v in value]


def _duration(obj: dict, source: str) -> float:
    value = obj.get("duration", float("nan"))
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TraceError(f"{source}: duration must be a number of seconds, got {value!r}")
    return float(value)


def _clip(value: Any, max_chars: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= max_chars else text[:max_chars] + "..."


def _percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")
