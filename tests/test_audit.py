"""vtoken.audit: deployment TOML parsing, the server path, the measurement and its JSON."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
from fakeserver import Route, serve

import vtoken.audit as audit_module
import vtoken.audit.deployment as deployment_module
from vtoken.analysis import frontier, run_steps
from vtoken.audit import (
    AuditReport, Overrides, _largest_feasible, audit, bundled_sample_path, load_settings, load_workload,
    measure, report_rows, report_to_json, resolve_deployment, experiment_of,
)
from vtoken.audit.report import room_for_more
from vtoken.endpoint import OLD_SERVER_HINT
from vtoken.engine import run_sim
from vtoken.errors import ConfigError, EndpointError, TraceError
from vtoken.hardware import MiB, num_blocks_for_gpu, resolve_gpu
from vtoken.model_spec import resolve_model
from vtoken.nvml import GpuDevice, NvmlReport, probe_gpus

DATA = Path(__file__).parent / "data"
SMALL = DATA / "audit_small.toml"
FIXTURE_TEXT = (DATA / "vllm-0.32-cpu-metrics.txt").read_text()
MODELS_JSON = json.dumps({"object": "list", "data": [{"id": "tiny-llama", "max_model_len": 2048}]})
HAS_GPU = bool(probe_gpus().devices)
# Few requests, one policy, a small capacity search: each audit takes well under a second.
TINY = Overrides(max_requests=6, policies=("h2o",), frontier_max_concurrency=8)
HF_CONFIG = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576,
             "intermediate_size": 1536, "vocab_size": 49152, "torch_dtype": "bfloat16"}


@pytest.fixture(autouse=True)
def no_proxy(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("http_proxy", "https_proxy", "all_proxy", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"):
        monkeypatch.delenv(name, raising=False)


def write_toml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "deployment.toml"
    path.write_text(text)
    return path


def vllm_routes(metrics: str = FIXTURE_TEXT) -> dict:
    return {"/metrics": Route(metrics), "/v1/models": Route(MODELS_JSON, 200, "application/json")}


def with_cache_dtype(text: str, dtype: str) -> str:
    assert 'cache_dtype="auto"' in text
    return text.replace('cache_dtype="auto"', f'cache_dtype="{dtype}"')


# ---- TOML variants ------------------------------------------------------------------------------


def test_catalog_model_and_explicit_block_budget() -> None:
    deployment, live = resolve_deployment(str(SMALL), Overrides())

    assert live is None
    assert deployment.model == resolve_model("llama-3.1-8b")
    assert (deployment.block_size, deployment.num_blocks) == (16, 400)
    assert deployment.policies == ("h2o", "streaming_llm")
    assert deployment.budget.keep_ratio == 0.5
    assert deployment.kv_bytes_per_block == 16 * 131072
    workload = deployment.workload
    assert workload.is_bundled_sample and workload.trace_path == bundled_sample_path()
    assert (workload.max_requests, workload.concurrency, deployment.frontier_max_concurrency) == (12, 4, 16)
    assert any("h100-80gb (default" in note for note in deployment.notes)


def test_gpu_and_memory_fraction_give_the_catalog_block_count() -> None:
    deployment, _ = resolve_deployment(str(DATA / "audit_l40s.toml"), Overrides())

    model, gpu = resolve_model("llama-3.1-8b"), resolve_gpu("l40s")
    assert deployment.num_blocks == num_blocks_for_gpu(model, gpu, 0.55, 16) == 3986
    assert deployment.gpu == gpu
    assert deployment.policies == ("h2o", "streaming_llm", "scissorhands", "random")


def test_explicit_geometry_and_a_trace_next_to_the_toml() -> None:
    deployment, _ = resolve_deployment(str(DATA / "audit_trace.toml"), Overrides())

    model = deployment.model
    assert (model.num_layers, model.num_kv_heads, model.head_dim, model.dtype_bytes) == (4, 2, 64, 2)
    assert model.kv_bytes_per_token == 2 * 4 * 2 * 64 * 2
    assert model.num_params == 50_000_000
    assert deployment.budget.num_tokens == 80 and deployment.interval_tokens == 4
    assert deployment.workload.trace_path == DATA / "native.jsonl"
    assert not deployment.workload.is_bundled_sample
    assert len(load_workload(deployment.workload).requests) == 4


def test_explicit_geometry_without_num_params_estimates_it(tmp_path: Path) -> None:
    path = write_toml(tmp_path, '[model]\nnum_layers = 2\nnum_kv_heads = 1\nhead_dim = 64\ndtype = "fp8"\n'
                                "[engine]\nnum_gpu_blocks = 100\n")
    deployment, _ = resolve_deployment(str(path), Overrides())

    assert deployment.model.kv_bytes_per_token == 2 * 2 * 1 * 64 * 1
    assert deployment.model.num_params == 12 * 2 * 64**2
    assert any("num_params estimated" in note for note in deployment.notes)


def test_hf_config_path_is_relative_to_the_toml(tmp_path: Path) -> None:
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "config.json").write_text(json.dumps(HF_CONFIG))
    path = write_toml(tmp_path, '[model]\nconfig = "models/config.json"\ndtype = "fp8"\n[engine]\nnum_gpu_blocks = 100\n')
    deployment, _ = resolve_deployment(str(path), Overrides())

    assert (deployment.model.num_layers, deployment.model.num_kv_heads, deployment.model.head_dim) == (30, 3, 64)
    assert deployment.model.dtype_bytes == 1


def test_catalog_dtype_override_halves_the_kv_bytes(tmp_path: Path) -> None:
    path = write_toml(tmp_path, '[model]\nname = "llama-3.1-8b"\ndtype = "fp8"\n[engine]\nnum_gpu_blocks = 100\n')
    deployment, _ = resolve_deployment(str(path), Overrides())

    assert deployment.model.kv_bytes_per_token == 131072 // 2


def test_flags_replace_toml_settings(tmp_path: Path) -> None:
    overrides = Overrides(model="qwen2.5-7b", block_size=32, num_gpu_blocks=123, policies=("tova",), budget="256",
                          trace=DATA / "native.jsonl", concurrency=3, seed=7)
    deployment, _ = resolve_deployment(str(DATA / "audit_l40s.toml"), overrides)

    assert deployment.model.name == "qwen2.5-7b"
    assert (deployment.block_size, deployment.num_blocks) == (32, 123)
    assert deployment.policies == ("tova",) and deployment.budget.num_tokens == 256
    assert deployment.workload.trace_path == DATA / "native.jsonl" and deployment.workload.concurrency == 3
    assert deployment.seed == 7


@pytest.mark.parametrize("text, message", [
    ("[engine]\nblock_sise = 16\n", "unknown key engine.block_sise; known keys of engine: block_size,"),
    ("[modle]\nname = 'llama-3.1-8b'\n", "unknown section 'modle'"),
    ("title = 'x'\n", "unknown section 'title'"),
    ("[model]\nname = 'gpt-17'\n[engine]\nnum_gpu_blocks = 10\n", "model.name: unknown model 'gpt-17'"),
    ("[model\nname = ", "not valid TOML"),
    ("[engine]\nblock_size = '16'\n", "engine.block_size must be a positive integer, got '16'"),
    ("[engine]\nblock_size = 0\n", "engine.block_size must be a positive integer, got 0"),
    ("[engine]\ngpu = 'h100'\ngpu_memory_utilization = 1.5\n", "engine.gpu_memory_utilization must be a number in (0, 1]"),
    ("[engine]\ngpu_memory_utilization = 0.9\n", "engine.gpu_memory_utilization needs engine.gpu"),
    ("[engine]\ngpu = 'tpu-v5'\n", "engine.gpu: unknown GPU 'tpu-v5'"),
    ("[model]\nname = 'llama-3.1-8b'\n", "no KV block budget; give engine.num_gpu_blocks, or engine.gpu"),
    ("[engine]\nnum_gpu_blocks = 10\n", "no model; give model.name, model.config or model.num_layers"),
    ("[model]\nname = 'llama-3.1-8b'\nnum_layers = 2\n", "the model section gives name and num_layers/..."),
    ("[model]\nname = 'llama-3.1-8b'\nconfig = 'c.json'\n", "the model section gives name and config"),
    ("[model]\nnum_layers = 2\nnum_kv_heads = 1\n", "the explicit model geometry needs model.head_dim"),
    ("[model]\nconfig = 'missing/config.json'\n", "model.config: no such file"),
    ("[model]\nnum_layers = 2\nnum_kv_heads = 1\nhead_dim = 8\ndtype = 'int3'\n[engine]\nnum_gpu_blocks = 9\n",
     "model.dtype must be one of"),
    ("[eviction]\npolicies = ['h2o', 'h3o']\n", "eviction.policies: unknown policy 'h3o'"),
    ("[eviction]\npolicies = []\n", "eviction.policies: give at least one policy"),
    ("[eviction]\nbudget = '150%'\n", "eviction.budget: budget must be"),
    ("[workload]\nformat = 'parquet'\n", "workload.format must be one of"),
    ("[workload]\nconcurrency = -4\n", "workload.concurrency must be a positive integer, got -4"),
    ("[endpoint]\ntimeout_s = 0\n", "endpoint.timeout_s must be a number of seconds > 0"),
])
def test_bad_toml_names_the_section_and_key(tmp_path: Path, text: str, message: str) -> None:
    path = write_toml(tmp_path, text)

    with pytest.raises(ConfigError) as err:
        resolve_deployment(str(path), Overrides())

    assert message in str(err.value)
    assert str(path) in str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("blocks, shown", [(100_000, "-"), (1_000, "54.")])
def test_num_gpu_blocks_that_disagree_with_the_gpu_share_are_refused(tmp_path: Path, blocks: int, shown: str) -> None:
    path = write_toml(tmp_path, f'[model]\nname = "llama-3.1-8b"\n[engine]\nnum_gpu_blocks = {blocks}\n'
                                'gpu = "h100"\ngpu_memory_utilization = 0.9\n')

    with pytest.raises(ConfigError, match=f"engine.num_gpu_blocks = {blocks} disagrees with engine.gpu = 'h100'") as err:
        resolve_deployment(str(path), Overrides())

    assert f"it leaves {shown}" in str(err.value)


def test_num_gpu_blocks_within_the_reserve_range_is_accepted(tmp_path: Path) -> None:
    model, gpu = resolve_model("llama-3.1-8b"), resolve_gpu("h100")
    estimate = num_blocks_for_gpu(model, gpu, 0.9, 16)  # with a 2 GiB reserve
    path = write_toml(tmp_path, f'[model]\nname = "llama-3.1-8b"\n[engine]\nnum_gpu_blocks = {estimate + 500}\n'
                                'gpu = "h100"\ngpu_memory_utilization = 0.9\n')

    deployment, _ = resolve_deployment(str(path), Overrides())

    assert deployment.num_blocks == estimate + 500


def test_unreadable_and_missing_files(tmp_path: Path) -> None:
    binary = tmp_path / "binary.toml"
    binary.write_bytes(b"\xff\xfe[model]")
    with pytest.raises(ConfigError, match="cannot read the deployment file"):
        load_settings(binary)
    with pytest.raises(ConfigError, match="no such file; DEPLOYMENT is a TOML file or the http"):
        resolve_deployment(str(tmp_path / "nope.toml"), Overrides())


def test_a_missing_trace_is_a_trace_error(tmp_path: Path) -> None:
    path = write_toml(tmp_path, '[model]\nname = "llama-3.1-8b"\n[engine]\nnum_gpu_blocks = 100\n'
                                '[workload]\ntrace = "gone.csv"\n')

    with pytest.raises(TraceError, match="gone.csv: trace file not found"):
        audit(str(path))


def test_a_missing_bundled_sample_is_a_clear_config_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(deployment_module, "bundled_sample_path", lambda: tmp_path / "azure_conv_sample.csv")

    with pytest.raises(ConfigError, match="bundled sample trace is missing"):
        audit(str(SMALL))


@pytest.mark.parametrize("overrides, message", [
    (dict(num_gpu_blocks=0), "--num-blocks must be > 0, got 0"),
    (dict(block_size=-16), "--block-size must be > 0"),
    (dict(timeout_s=0.0), "--timeout must be > 0 seconds"),
    (dict(policies=("nope",)), "--policy: unknown policy 'nope'"),
    (dict(budget="lots"), "--budget: budget must be"),
    (dict(gpu="tpu"), "unknown GPU 'tpu'"),
])
def test_bad_flag_values(overrides: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        Overrides(**overrides)


# ---- the measurement ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_report() -> AuditReport:
    return audit(str(SMALL), Overrides(max_requests=8, frontier_max_concurrency=10))


def test_each_policy_replays_the_same_runs_as_the_runtime(small_report: AuditReport) -> None:
    deployment = small_report.deployment
    requests = small_report.trace.requests
    assert [p.policy for p in small_report.policies] == ["h2o", "streaming_llm"]
    for p in small_report.policies:
        for variant in ("naive-evict", "vtoken"):
            expected = run_sim(experiment_of(deployment, p.policy).run(variant, deployment.workload.concurrency), requests)
            assert p.runs[variant].waste_ratio == expected.waste_ratio
            assert p.runs[variant].trapped_bytes == expected.trapped_bytes
            assert p.runs[variant].policy == p.policy
    native = small_report.policies[0].runs["native"]
    assert all(p.runs["native"] is native for p in small_report.policies)
    assert native.tokens_evicted == 0 and native.policy == "none"


def test_reclaimable_memory_is_the_trapped_difference(small_report: AuditReport) -> None:
    block_bytes = 16 * 131072
    h2o = small_report.policies[0]
    for p in small_report.policies:
        naive, vtoken = p.runs["naive-evict"], p.runs["vtoken"]
        assert p.reclaimable_bytes == max(0.0, naive.trapped_bytes - vtoken.trapped_bytes)
        assert p.reclaimable_blocks == p.reclaimable_bytes / block_bytes
        assert sum(naive.utilization_histogram) == pytest.approx(1.0)
    # H2O scatters its victims: vToken's compaction must give back memory and blocks per request.
    assert h2o.reclaimable_blocks > 10
    assert h2o.runs["vtoken"].retained_blocks_per_request < h2o.runs["naive-evict"].retained_blocks_per_request
    assert h2o.evicted.frac_blocks_le_half > 0.3


def test_capacity_search_equals_an_exhaustive_frontier_sweep(small_report: AuditReport) -> None:
    deployment = small_report.deployment
    requests = small_report.trace.requests
    cap = deployment.frontier_max_concurrency
    for p in small_report.policies:
        swept = frontier(experiment_of(deployment, p.policy), requests, range(1, cap + 1))
        assert {v: c.max_concurrency for v, c in p.capacity.items()} == swept.max_feasible_concurrency
        assert all(c.is_lower_bound == (c.max_concurrency == cap) for c in p.capacity.values())


@pytest.mark.parametrize("threshold", range(0, 12))
@pytest.mark.parametrize("guess", [0, 1, 3, 7, 11, 13])
def test_galloping_bisection_finds_the_threshold(threshold: int, guess: int) -> None:
    probed: list[int] = []

    def is_feasible(c: int):  # steps that need no replay
        probed.append(c)
        return c <= threshold
        yield

    assert run_steps(_largest_feasible(is_feasible, 0, 11, guess), run_many=None) == min(threshold, 10)
    assert all(1 <= c <= 10 for c in probed)
    assert len(probed) <= 2 * math.ceil(math.log2(11)) + 1


def test_verdict_names_the_worst_and_the_least_affected_policy(small_report: AuditReport) -> None:
    h2o = small_report.policies[0]
    verdict = small_report.verdict
    assert verdict.startswith(f"With H2O at 50%, {100 * h2o.evicted.frac_blocks_le_half:.0f}% of allocated blocks")
    assert f"vToken frees {h2o.reclaimable_bytes / 2**30:.2f} GiB ({h2o.reclaimable_blocks:.0f} blocks)" in verdict
    num_more, _ = room_for_more(h2o)
    assert num_more == h2o.capacity["vtoken"].max_concurrency - h2o.capacity["naive-evict"].max_concurrency
    assert f"room for {num_more} more concurrent request" in verdict
    assert "Least affected: StreamingLLM" in verdict


def test_progress_counts_every_request_and_search(tmp_path: Path) -> None:
    seen: list[tuple[str, int, int]] = []
    audit(str(SMALL), TINY, lambda stage, done, total: seen.append((stage, done, total)))

    dones = [done for _, done, _ in seen]
    assert dones == sorted(dones)
    requests = load_workload(resolve_deployment(str(SMALL), TINY)[0].workload).requests
    assert len(requests) == 6
    assert seen[-1][1] == seen[-1][2] == 3 * sum(r.num_output_tokens for r in requests) + 3
    assert {stage for stage, _, _ in seen} >= {"native", "h2o naive-evict", "h2o vtoken", "capacity h2o"}


def test_json_object_has_the_documented_keys(small_report: AuditReport) -> None:
    payload = report_to_json(small_report)
    text = json.dumps(payload, allow_nan=False)

    assert json.loads(text) == payload
    assert set(payload) >= {"deployment", "live", "gpus", "workload", "policies", "verdict", "definitions"}
    assert payload["live"] is None and payload["waste_source"] == "simulated"
    assert {k: payload["deployment"][k] for k in ("model", "kv_bytes_per_token", "block_size", "num_blocks")} == \
        {"model": "llama-3.1-8b", "kv_bytes_per_token": 131072, "block_size": 16, "num_blocks": 400}
    assert payload["workload"]["is_bundled_sample"] and "CC-BY 4.0" in payload["workload"]["attribution"]
    h2o = payload["policies"]["h2o"]
    assert set(h2o) >= {"waste_ratio", "frac_blocks_le_half", "utilization_histogram", "trapped_bytes",
                        "reclaimable_bytes", "reclaimable_blocks", "retained_blocks_per_request", "max_concurrency"}
    assert len(h2o["utilization_histogram"]) == 10
    assert set(h2o["retained_blocks_per_request"]) == set(h2o["max_concurrency"]) == {"native", "naive-evict", "vtoken"}
    rows = report_rows(small_report)
    assert [r["policy"] for r in rows] == ["h2o", "streaming_llm"]
    assert rows[0]["max_concurrency.vtoken"] == h2o["max_concurrency"]["vtoken"]
    assert rows[0]["utilization_histogram.9"] == h2o["utilization_histogram"][9]


def test_capacity_with_shared_prefixes_equals_the_sweep() -> None:
    deployment, _ = resolve_deployment(str(DATA / "audit_trace.toml"), Overrides())
    requests = load_workload(deployment.workload).requests
    (random,) = measure(deployment, requests)

    swept = frontier(experiment_of(deployment, "random"), requests, range(1, 9))
    assert {v: c.max_concurrency for v, c in random.capacity.items()} == swept.max_feasible_concurrency
    assert all(not r.skipped for r in random.runs.values())


# ---- NVML ---------------------------------------------------------------------------------------


def test_without_nvml_the_report_says_why_and_goes_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(audit_module, "probe_gpus", lambda: NvmlReport((), "NVML not available: no driver"))
    payload = report_to_json(audit(str(SMALL), TINY))

    assert payload["gpus"] == {"devices": [], "reason": "NVML not available: no driver"}
    assert payload["policies"]["h2o"]["waste_ratio"] > 0


def test_nvml_devices_are_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    device = GpuDevice(0, "NVIDIA H100 80GB HBM3", 81559 * MiB, 70000 * MiB)
    monkeypatch.setattr(audit_module, "probe_gpus", lambda: NvmlReport((device,), None))
    payload = report_to_json(audit(str(SMALL), TINY))

    assert payload["gpus"] == {"devices": [{"index": 0, "name": "NVIDIA H100 80GB HBM3",
                                            "memory_total_bytes": 81559 * MiB, "memory_used_bytes": 70000 * MiB}],
                               "reason": None}


@pytest.mark.skipif(HAS_GPU, reason="this machine has an NVIDIA GPU")
def test_real_probe_without_a_gpu_gives_a_reason() -> None:
    report = audit(str(SMALL), TINY)
    assert report.gpus.devices == () and report.gpus.reason


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs an NVIDIA GPU")
def test_real_probe_with_a_gpu_reads_its_memory() -> None:
    report = audit(str(SMALL), TINY)
    assert report.gpus.devices
    assert all(0 < g.memory_used_bytes <= g.memory_total_bytes for g in report.gpus.devices)


# ---- a running server ---------------------------------------------------------------------------


def test_deployment_from_a_server_reads_its_cache_config() -> None:
    with serve(vllm_routes()) as server:
        deployment, live = resolve_deployment(server.url, Overrides(model="llama-3.1-8b"))

    assert live is not None and live.model_name == "tiny-llama"
    assert (deployment.block_size, deployment.num_blocks) == (32, 8192)
    assert deployment.source == server.url
    # The fixture's 1 GiB pool of 8192 x 32 tokens is 4096 bytes/token, not Llama-8B's 131072.
    assert any("4096 bytes/token" in note and "--model" in note for note in deployment.notes)


def test_server_model_outside_the_catalog_asks_for_a_flag() -> None:
    with serve(vllm_routes()) as server, pytest.raises(ConfigError) as err:
        resolve_deployment(server.url, Overrides())

    assert "'tiny-llama' is not in the catalog; pass --model NAME or --model-config PATH" in str(err.value)


def test_server_with_a_model_config_and_flag_overrides(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(HF_CONFIG))
    with serve(vllm_routes()) as server:
        overrides = Overrides(model=str(tmp_path / "config.json"), block_size=16, num_gpu_blocks=500)
        deployment, _ = resolve_deployment(server.url, overrides)

    assert deployment.model.num_layers == 30
    assert (deployment.block_size, deployment.num_blocks) == (16, 500)


def test_server_fp8_cache_dtype_halves_the_kv_bytes() -> None:
    metrics = with_cache_dtype(FIXTURE_TEXT, "fp8")
    with serve(vllm_routes(metrics)) as server:
        deployment, _ = resolve_deployment(server.url, Overrides(model="llama-3.1-8b"))

    assert deployment.model.kv_bytes_per_token == 65536


def test_old_server_needs_the_flags_and_works_with_them() -> None:
    old = "\n".join(line for line in FIXTURE_TEXT.splitlines() if "vllm:cache_config_info" not in line)
    with serve(vllm_routes(old)) as server:
        with pytest.raises(EndpointError, match=OLD_SERVER_HINT):
            resolve_deployment(server.url, Overrides(model="llama-3.1-8b"))
        overrides = Overrides(model="llama-3.1-8b", block_size=16, num_gpu_blocks=300)
        deployment, live = resolve_deployment(server.url, overrides)

    assert live is None
    assert (deployment.block_size, deployment.num_blocks) == (16, 300)
    assert any("no vllm:cache_config_info" in note for note in deployment.notes)


def test_vtoken_metrics_mean_the_waste_is_measured() -> None:
    metrics = FIXTURE_TEXT + 'vtoken:waste_ratio{engine="0",model_name="tiny-llama"} 0.07\n'
    with serve(vllm_routes(metrics)) as server:
        report = audit(server.url, replace(TINY, model="llama-3.1-8b", num_gpu_blocks=400))

    assert report.is_waste_measured
    payload = report_to_json(report)
    assert payload["waste_source"] == "measured"
    assert payload["live"]["vtoken_metrics"] == {"vtoken:waste_ratio": 0.07}
    assert "measured there, not simulated" in report.verdict


def test_a_server_that_served_requests_is_audited_on_its_own_workload() -> None:
    # The fixture's server finished one request (4 prompt, 16 generated tokens): that is the
    # workload now, not the bundled sample.
    with serve(vllm_routes()) as server:
        report = audit(server.url, replace(TINY, model="llama-3.1-8b", num_gpu_blocks=400))

    workload = report.deployment.workload
    assert workload.source == "server" and not workload.is_bundled_sample
    assert [(r.num_prompt_tokens, r.num_output_tokens) for r in report.trace.requests] == [(4, 16)]
    payload = report_to_json(report)["workload"]
    assert (payload["source"], payload["num_requests_observed"], payload["attribution"]) == ("server", 1, None)
    assert (payload["prompt_tokens"]["mean"], payload["output_tokens"]["mean"]) == (4.0, 16.0)
    assert (payload["prompt_tokens"]["low"]["mean"], payload["prompt_tokens"]["high"]["mean"]) == (3.0, 5.0)
    assert any("no request in flight" in note for note in report.deployment.notes)


def test_toml_endpoint_fills_what_the_toml_leaves_out(tmp_path: Path) -> None:
    with serve(vllm_routes()) as server:
        url = server.url.replace("http://", "http://alice:hunter2@")
        path = write_toml(tmp_path, f'[model]\nname = "llama-3.1-8b"\n[engine]\nblock_size = 16\n'
                                    f'[endpoint]\nurl = "{url}"\ntimeout_s = 2\n')
        report = audit(str(path), TINY)
        seen = server.requests

    deployment = report.deployment
    assert report.live is not None and report.live.url == server.url
    assert (deployment.block_size, deployment.num_blocks) == (16, 8192)
    assert any("engine.block_size = 16" in note and "the server has 32" in note for note in deployment.notes)
    assert seen[0].headers["Authorization"].startswith("Basic ")
    assert "hunter2" not in repr(report) + json.dumps(report_to_json(report))


def test_credentials_never_appear_in_the_report() -> None:
    with serve(vllm_routes()) as server:
        url = server.url.replace("http://", "http://bob:s3cret@")
        report = audit(url, replace(TINY, model="llama-3.1-8b", num_gpu_blocks=400))

    assert "s3cret" not in json.dumps(report_to_json(report))
    assert report.deployment.source == server.url


def test_policy_names_in_a_deployment_file_are_read_loosely(tmp_path):
    from vtoken.audit.deployment import resolve_deployment
    from vtoken.audit.settings import Overrides

    toml = (Path(__file__).parent / "data" / "audit_small.toml").read_text()
    path = tmp_path / "deploy.toml"
    path.write_text(toml.replace('["h2o", "streaming_llm"]', '["H2O", "Streaming-LLM"]'))
    deployment, _ = resolve_deployment(str(path), Overrides())
    assert deployment.policies == ("h2o", "streaming_llm")


# ---- the model's context ------------------------------------------------------------------------


def test_a_trace_file_loses_the_requests_longer_than_the_models_context(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({**HF_CONFIG, "max_position_embeddings": 2048}))
    path = write_toml(tmp_path, f'[model]\nconfig = "config.json"\n[engine]\nnum_gpu_blocks = 700\n'
                                f'[workload]\ntrace = "{DATA / "native.jsonl"}"\nformat = "jsonl"\n')
    deployment, _ = resolve_deployment(str(path), Overrides())

    assert deployment.workload.max_model_len == 2048
    trace = load_workload(deployment.workload)
    assert [r.num_prompt_tokens + r.num_output_tokens for r in trace.requests] == [55, 120, 2032]
    assert any("1 request longer than the model's context of 2048" in note for note in trace.notes)


def test_the_servers_max_model_len_wins_over_the_models(tmp_path: Path) -> None:
    with serve(vllm_routes()) as server:
        path = write_toml(tmp_path, f'[model]\nname = "llama-3.1-8b"\n[workload]\ntrace = "{DATA / "native.jsonl"}"\n'
                                    f'format = "jsonl"\n[endpoint]\nurl = "{server.url}"\ntimeout_s = 2\n')
        deployment, live = resolve_deployment(str(path), Overrides())

    assert live.max_model_len == 2048 and deployment.model.max_model_len == 131072
    assert deployment.workload.max_model_len == 2048
    assert len(load_workload(deployment.workload).requests) == 3


def test_a_model_of_unknown_context_keeps_every_request() -> None:
    deployment, _ = resolve_deployment(str(DATA / "audit_trace.toml"), Overrides())

    assert deployment.workload.max_model_len is None
    assert len(load_workload(deployment.workload).requests) == 4
