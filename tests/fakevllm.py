"""A vLLM 0.32-shaped `/metrics` body for tests, from what each engine has served.

    metrics_text({"0": Served(prompts=[...], outputs=[...])})   -> Prometheus text
    routes(Route(text)) or routes(Computed(render))              -> fakeserver routes with /v1/models

`Served.vtoken` adds vtoken_* series (a vToken-enabled engine), named as the vLLM executor
exports them (vtoken/engine/vllm/metrics.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from fakeserver import Computed, Route

DATA = Path(__file__).parent / "data"
FIXTURE_TEXT = (DATA / "vllm-0.32-cpu-metrics.txt").read_text()
CACHE_INFO = next(line for line in FIXTURE_TEXT.splitlines() if line.startswith("vllm:cache_config_info"))
MAX_MODEL_LEN = 4096
BOUNDS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000)  # vLLM's 1-2-5 buckets below max_model_len
MODELS_JSON = json.dumps({"object": "list", "data": [{"id": "tiny-llama", "max_model_len": MAX_MODEL_LEN}]})
@dataclass
class Served:
    """What one engine has served: the lengths of its finished requests and its counters."""

    prompts: list[int]
    outputs: list[int]
    num_prefix_queries: int = 0
    num_prefix_hits: int = 0
    num_running: int = 0
    num_waiting: int = 0
    e2e_latency_s: float = 0.0
    by_reason: dict[str, int] = field(default_factory=dict)
    kv_cache_usage: float = 0.0
    num_preemptions: int = 0
    vtoken: dict[str, float] = field(default_factory=dict)  # vtoken_* series name -> value (labels: engine, model)

    @property
    def num_finished(self) -> int:
        return sum(self.by_reason.values()) if self.by_reason else len(self.prompts)


def metrics_text(engines: dict[str, Served], drop: tuple[str, ...] = ()) -> str:
    """A vLLM 0.32-shaped /metrics body: the fixture's cache config and each engine's series."""
    lines = [CACHE_INFO]

    def family(name: str, kind: str, sample: callable) -> None:
        if name in drop:
            return
        lines.append(f"# TYPE {name} {kind}")
        for engine, served in engines.items():
            lines.extend(sample(f'engine="{engine}",model_name="tiny-llama"', served))

    def histogram(name: str, lengths_of: callable) -> None:
        def sample(labels: str, served: Served) -> list[str]:
            lengths = lengths_of(served)
            out = [f'{name}_bucket{{{labels},le="{b}.0"}} {sum(x <= b for x in lengths)}.0' for b in BOUNDS]
            return out + [f'{name}_bucket{{{labels},le="+Inf"}} {len(lengths)}.0',
                          f"{name}_count{{{labels}}} {len(lengths)}.0", f"{name}_sum{{{labels}}} {sum(lengths)}.0"]
        family(name, "histogram", sample)

    def counter(name: str, value_of: callable) -> None:
        family(name, "counter", lambda labels, s: [f"{name}_total{{{labels}}} {value_of(s)}"])

    histogram("vllm:request_prompt_tokens", lambda s: s.prompts)
    histogram("vllm:request_generation_tokens", lambda s: s.outputs)
    family("vllm:request_success", "counter", lambda labels, s: [
        f'vllm:request_success_total{{{labels},finished_reason="{reason}"}} {n}'
        for reason, n in (s.by_reason or {"stop": len(s.prompts)}).items()])
    counter("vllm:prompt_tokens", lambda s: sum(s.prompts))
    counter("vllm:generation_tokens", lambda s: sum(s.outputs))
    counter("vllm:prefix_cache_queries", lambda s: s.num_prefix_queries)
    counter("vllm:prefix_cache_hits", lambda s: s.num_prefix_hits)
    family("vllm:num_requests_running", "gauge", lambda labels, s: [f"vllm:num_requests_running{{{labels}}} {s.num_running}"])
    family("vllm:num_requests_waiting", "gauge", lambda labels, s: [f"vllm:num_requests_waiting{{{labels}}} {s.num_waiting}"])
    family("vllm:e2e_request_latency_seconds", "histogram", lambda labels, s: [
        f'vllm:e2e_request_latency_seconds_bucket{{{labels},le="+Inf"}} {s.num_finished}',
        f"vllm:e2e_request_latency_seconds_count{{{labels}}} {s.num_finished}",
        f"vllm:e2e_request_latency_seconds_sum{{{labels}}} {s.e2e_latency_s}"])
    family("vllm:kv_cache_usage_perc", "gauge", lambda labels, s: [f"vllm:kv_cache_usage_perc{{{labels}}} {s.kv_cache_usage}"])
    family("vllm:num_preemptions", "counter", lambda labels, s: [f"vllm:num_preemptions_total{{{labels}}} {s.num_preemptions}"])
    for engine, served in engines.items():
        labels = f'engine="{engine}",model_name="tiny-llama"'
        for key, value in served.vtoken.items():
            name, _, more = key.partition("{")
            lines.append(f"{name}{{{labels}{',' + more.rstrip('}') if more else ''}}} {value}")
    return "\n".join(lines) + "\n"


def routes(metrics: Route | Computed) -> dict:
    return {"/metrics": metrics, "/v1/models": Route(MODELS_JSON, 200, "application/json")}


