"""`vtoken audit` through typer's CliRunner: the --json contract, rendering, --output, and every
fault of a TOML file or a server as one line with exit code 2."""

from __future__ import annotations

import json
import re
import socket
from pathlib import Path

import pandas as pd
import pytest
from fakeserver import HANG, Hang, Route, serve
from typer.testing import CliRunner

import vtoken.audit as audit_module
import vtoken_cli.plots as plots
from vtoken.audit import Overrides, audit, audit_deployment, deployment_to_json, report_to_json
from vtoken.nvml import NvmlReport
from vtoken_cli.app import app

DATA = Path(__file__).parent / "data"
SMALL = DATA / "audit_small.toml"
FIXTURE_TEXT = (DATA / "vllm-0.32-cpu-metrics.txt").read_text()
MODELS_JSON = json.dumps({"object": "list", "data": [{"id": "tiny-llama", "max_model_len": 2048}]})
NO_GPU = NvmlReport((), "NVML not available: test")
# Few requests, one policy, a small capacity search.
TINY_FLAGS = ["--max-requests", "6", "--policy", "h2o", "--frontier-max", "8"]
TINY = Overrides(max_requests=6, policies=("h2o",), frontier_max_concurrency=8)

runner = CliRunner()


@pytest.fixture(autouse=True)
def fixed_gpus_and_no_proxy(monkeypatch: pytest.MonkeyPatch) -> None:
    """Same NVML answer for the CLI and the library call it is compared with; loopback unproxied."""
    monkeypatch.setattr(audit_module, "probe_gpus", lambda: NO_GPU)
    for name in ("http_proxy", "https_proxy", "all_proxy", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"):
        monkeypatch.delenv(name, raising=False)


def invoke(*args: str):
    return runner.invoke(app, ["audit", *args])


def vllm_routes(metrics: str | Route | Hang = FIXTURE_TEXT) -> dict:
    route = Route(metrics) if isinstance(metrics, str) else metrics
    return {"/metrics": route, "/v1/models": Route(MODELS_JSON, 200, "application/json")}


def refused_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def assert_one_line_error(result, *fragments: str) -> None:
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    for fragment in fragments:
        assert fragment in lines[0]


# ---- the --json contract ------------------------------------------------------------------------


def test_json_of_a_toml_equals_the_library_result() -> None:
    result = invoke(str(SMALL), *TINY_FLAGS, "--json")

    assert result.exit_code == 0, result.output
    printed = json.loads(result.stdout)
    expected = json.loads(json.dumps(report_to_json(audit(str(SMALL), TINY))))
    assert printed == expected
    assert printed["deployment"]["num_blocks"] == 400 and printed["live"] is None
    assert list(printed["policies"]) == ["h2o"]


def test_json_of_a_server_equals_the_library_result() -> None:
    with serve(vllm_routes()) as server:
        result = invoke(server.url, "--model", "llama-3.1-8b", *TINY_FLAGS, "--json")
        expected = json.loads(json.dumps(report_to_json(audit(server.url, Overrides(
            model="llama-3.1-8b", max_requests=6, policies=("h2o",), frontier_max_concurrency=8)))))

    assert result.exit_code == 0, result.output
    printed = json.loads(result.stdout)
    assert printed == expected
    assert printed["live"]["cache_config"]["num_gpu_blocks"] == 8192
    assert printed["live"]["model_name"] == "tiny-llama"
    assert printed["deployment"]["block_size"] == 32


def test_model_config_flag(tmp_path: Path) -> None:
    config = {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 64,
              "intermediate_size": 128, "vocab_size": 1000}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with serve(vllm_routes()) as server:
        result = invoke(server.url, "--model-config", str(tmp_path / "config.json"), *TINY_FLAGS, "--json")

    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["deployment"]["kv_bytes_per_token"] == 2 * 2 * 2 * 16 * 2


# ---- rendering ----------------------------------------------------------------------------------


def test_tables_histograms_and_verdict() -> None:
    result = invoke(str(SMALL), *TINY_FLAGS)

    assert result.exit_code == 0, result.output
    out = result.stdout
    for fragment in ("Deployment", "Workload", "Waste per policy", "Per variant", "naive-evict", "vtoken",
                     "█", "Definitions", "reclaim", "Verdict", "With H2O at 50%", "NVML not available: test",
                     "bundled sample", "CC-BY 4.0"):
        assert fragment in out, fragment


def test_live_server_panel_and_measured_waste() -> None:
    metrics = FIXTURE_TEXT + 'vtoken:waste_ratio{engine="0",model_name="tiny-llama"} 0.07\n'
    with serve(vllm_routes(metrics)) as server:
        result = invoke(server.url, "--model", "llama-3.1-8b", "--num-blocks", "400", *TINY_FLAGS)

    assert result.exit_code == 0, result.output
    for fragment in ("Live server", "KV usage 0.0%", "0 running", "0 preemptions", "prefix caching True",
                     "vtoken:waste_ratio", "measured, not simulated"):
        assert fragment in result.stdout, fragment


def flat(text: str) -> str:
    """The words of rendered output, panel borders dropped: a value wrapped inside its panel reads as one line."""
    return " ".join(text.replace("│", " ").split())


def test_a_server_workload_is_shown_with_its_bucket_ranges() -> None:
    # The fixture's server finished one request of 4 prompt and 16 generated tokens.
    with serve(vllm_routes()) as server:
        result = invoke(server.url, "--model", "llama-3.1-8b", *TINY_FLAGS)

    assert result.exit_code == 0, result.output
    out = flat(result.stdout)
    for fragment in ("source server:", "observed 1 finished requests (length 1)",
                     "prompt tokens mean 4.0 (3-5), p50 4.0 (3-5), p90 4.8 (3-5)",
                     "output tokens mean 16.0 (11-20), p50 15.5 (11-20), p90 19.1 (11-20)",
                     "rate not sampled (--window SECONDS", "(lo-hi): over replays",
                     "histogram buckets"):
        assert fragment in out, fragment
    assert re.search(r"F \(waste ratio\) \d\.\d{3} \(\d\.\d{3}-\d\.\d{3}\)", out), "F has no (lo-hi) range"
    assert "bundled sample" not in out


def test_window_samples_the_request_rate() -> None:
    with serve(vllm_routes()) as server:
        result = invoke(server.url, "--model", "llama-3.1-8b", *TINY_FLAGS, "--window", "0.2", "--json")
        plain = invoke(server.url, "--model", "llama-3.1-8b", *TINY_FLAGS, "--window", "0.2")

    assert result.exit_code == 0, result.output
    workload = json.loads(result.stdout)["workload"]
    assert workload["request_rate_per_s"] == 0.0  # the fixture's counters do not move
    assert workload["window_s"] >= 0.2  # at least the window; more when the machine is busy
    assert re.search(r"rate 0\.00 requests/s over \d+\.\d s", flat(plain.stdout))


def test_several_urls_and_one_that_does_not_answer() -> None:
    dead = refused_url()
    with serve(vllm_routes()) as first, serve(vllm_routes()) as second:
        urls = [first.url, dead, second.url]
        result = invoke(*urls, "--model", "llama-3.1-8b", *TINY_FLAGS, "--json")
        rendered = invoke(*urls, "--model", "llama-3.1-8b", *TINY_FLAGS)
        expected = json.loads(json.dumps(deployment_to_json(audit_deployment(urls, Overrides(
            model="llama-3.1-8b", max_requests=6, policies=("h2o",), frontier_max_concurrency=8)))))

    assert result.exit_code == 0, result.output
    printed = json.loads(result.stdout)
    assert printed == expected
    assert [r["deployment"]["source"] for r in printed["replicas"]] == [first.url, second.url]
    assert printed["failures"][0]["target"] == dead and "connection refused" in printed["failures"][0]["reason"]
    one = printed["replicas"][0]["policies"]["h2o"]["max_concurrency"]["vtoken"]
    assert printed["total"]["policies"]["h2o"]["max_concurrency"]["vtoken"] == 2 * one
    for fragment in (f"Replica {first.url}", f"Replica {second.url}", "2 replicas audited, 1 did not answer",
                     f"failed      {dead}", "Deployment total"):
        assert fragment in rendered.stdout, fragment


def test_no_url_answering_is_one_line_and_exit_2() -> None:
    first, second = refused_url(), refused_url()

    assert_one_line_error(invoke(first, second, "--model", "llama-3.1-8b"), "no replica answered", first, second)


# ---- --output -----------------------------------------------------------------------------------


def test_output_dir_has_json_csv_and_pngs(tmp_path: Path) -> None:
    out = tmp_path / "audit"
    result = invoke(str(SMALL), "--max-requests", "6", "--frontier-max", "8", "--output", str(out), "--json")

    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in out.iterdir()) == [
        ".vtoken-output.json", "histogram_h2o.png", "histogram_streaming_llm.png", "policies.csv", "report.json"]
    written = json.loads((out / "report.json").read_text())
    assert set(written.pop("provenance")) == {"vtoken_version", "command_line", "written_at"}
    assert written == json.loads(result.stdout)
    table = pd.read_csv(out / "policies.csv")
    assert list(table["policy"]) == ["h2o", "streaming_llm"]
    assert table["reclaimable_bytes"][0] == pytest.approx(json.loads(result.stdout)["policies"]["h2o"]["reclaimable_bytes"])
    assert (out / "histogram_h2o.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [p.name for p in tmp_path.iterdir()] == ["audit"]


def test_output_refuses_a_non_empty_dir_it_did_not_write_even_forced(tmp_path: Path) -> None:
    out = tmp_path / "audit"
    out.mkdir()
    (out / "keep.txt").write_text("mine")

    for force in ((), ("--force",)):
        refused = invoke(str(SMALL), *TINY_FLAGS, "--output", str(out), *force)
        assert_one_line_error(refused, "not empty", "vtoken did not write it")
        assert [p.name for p in out.iterdir()] == ["keep.txt"]


def test_output_replaces_its_own_dir_only_when_forced(tmp_path: Path) -> None:
    out = tmp_path / "audit"
    assert invoke(str(SMALL), *TINY_FLAGS, "--output", str(out)).exit_code == 0

    refused = invoke(str(SMALL), *TINY_FLAGS, "--output", str(out))
    assert_one_line_error(refused, "not empty", "--force")

    forced = invoke(str(SMALL), *TINY_FLAGS, "--output", str(out), "--force")
    assert forced.exit_code == 0, forced.output
    assert sorted(p.name for p in out.iterdir()) == [".vtoken-output.json", "histogram_h2o.png", "policies.csv",
                                                     "report.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["audit"]


def test_output_into_an_empty_existing_dir(tmp_path: Path) -> None:
    out = tmp_path / "audit"
    out.mkdir()
    result = invoke(str(SMALL), *TINY_FLAGS, "--output", str(out))

    assert result.exit_code == 0, result.output
    assert (out / "report.json").is_file()


def test_a_failed_write_leaves_nothing_half_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken_plot(report, policy_audit, path: Path) -> None:
        path.write_bytes(b"half a png")
        raise RuntimeError("disk full")

    monkeypatch.setattr(plots, "plot_policy_histogram", broken_plot)
    result = invoke(str(SMALL), *TINY_FLAGS, "--output", str(tmp_path / "audit"))

    assert result.exit_code != 0 and isinstance(result.exception, RuntimeError)
    assert list(tmp_path.iterdir()) == []


# ---- bad input: TOML and flags ------------------------------------------------------------------


@pytest.mark.parametrize("text, fragments", [
    ("[engine]\nnum_blocks = 16\n", ("unknown key engine.num_blocks", "known keys of engine: block_size, num_gpu_blocks")),
    ('[model]\nname = "llama-3.1-8b"\n[engine]\nnum_gpu_blocks = 90000\ngpu = "h100"\ngpu_memory_utilization = 0.9\n',
     ("engine.num_gpu_blocks = 90000 disagrees with engine.gpu = 'h100'", "give one or the other")),
    ('[model]\nname = "gpt-17"\n[engine]\nnum_gpu_blocks = 90\n', ("model.name: unknown model 'gpt-17'",)),
    ("[model]]\n", ("not valid TOML",)),
    ("[engine]\nblock_size = 16.5\n", ("engine.block_size must be a positive integer, got 16.5",)),
])
def test_bad_toml_is_one_line_and_exit_2(tmp_path: Path, text: str, fragments: tuple[str, ...]) -> None:
    path = tmp_path / "deployment.toml"
    path.write_text(text)

    assert_one_line_error(invoke(str(path), "--json"), str(path), *fragments)


@pytest.mark.parametrize("args, fragment", [
    (["no/such/deployment.toml"], "no such file; DEPLOYMENT is a TOML file or the http"),
    ([str(SMALL), "--num-blocks", "0"], "--num-blocks must be > 0"),
    ([str(SMALL), "--policy", "h3o"], "--policy: unknown policy 'h3o'"),
    ([str(SMALL), "--model", "llama-3.1-8b", "--model-config", "x.json"], "--model or --model-config, not both"),
    ([str(SMALL), "--trace", "missing.jsonl"], "missing.jsonl: trace file not found"),
    ([str(SMALL), "--window", "0"], "--window must be > 0 seconds, got 0.0"),
])
def test_bad_flags_are_one_line_and_exit_2(args: list[str], fragment: str) -> None:
    assert_one_line_error(invoke(*args), fragment)


# ---- bad input: servers -------------------------------------------------------------------------


@pytest.mark.parametrize("route, fragments", [
    (Route("oops", 500, "text/plain"), ("/metrics: HTTP 500",)),
    (Route("<html><body>login</body></html>", 200, "text/html"), ("body is not Prometheus text",)),
    (Route("\n".join(l for l in FIXTURE_TEXT.splitlines() if "vllm:cache_config_info" not in l)),
     ("no vllm:cache_config_info", "pass --block-size, --num-blocks and --model")),
    (Route("# nothing\nnode_load1 0.5\n"), ("no vllm: metrics",)),
])
def test_server_faults_are_one_line_and_exit_2(route: Route, fragments: tuple[str, ...]) -> None:
    with serve(vllm_routes(route)) as server:
        result = invoke(server.url, "--model", "llama-3.1-8b", *TINY_FLAGS)

    assert_one_line_error(result, server.url, *fragments)


def test_a_hanging_server_times_out() -> None:
    with serve(vllm_routes(HANG)) as server:
        result = invoke(server.url, "--model", "llama-3.1-8b", "--timeout", "0.5", *TINY_FLAGS)

    assert_one_line_error(result, "no answer within 0.5 s")


def test_refused_connection_never_shows_the_credentials() -> None:
    url = refused_url().replace("http://", "http://bob:s3cret@")
    result = invoke(url, "--model", "llama-3.1-8b")

    assert_one_line_error(result, "connection refused")
    assert "s3cret" not in result.output and "bob" not in result.output


@pytest.mark.parametrize("url, fragment", [
    ("ftp://bob:s3cret@127.0.0.1/metrics", "unsupported scheme 'ftp'"),
    ("http://", "no host in the URL"),
])
def test_unusable_urls(url: str, fragment: str) -> None:
    result = invoke(url)

    assert_one_line_error(result, fragment)
    assert "s3cret" not in result.output


def test_server_model_outside_the_catalog_names_the_flags() -> None:
    with serve(vllm_routes()) as server:
        result = invoke(server.url, *TINY_FLAGS)

    assert_one_line_error(result, "'tiny-llama' is not in the catalog", "--model NAME", "--model-config PATH")


def test_old_server_works_with_the_flags() -> None:
    old = "\n".join(line for line in FIXTURE_TEXT.splitlines() if "vllm:cache_config_info" not in line)
    with serve(vllm_routes(old)) as server:
        result = invoke(server.url, "--model", "llama-3.1-8b", "--block-size", "16", "--num-blocks", "300",
                        *TINY_FLAGS, "--json")

    assert result.exit_code == 0, result.output
    printed = json.loads(result.stdout)
    assert printed["live"] is None
    assert (printed["deployment"]["block_size"], printed["deployment"]["num_blocks"]) == (16, 300)
