"""A real `vtoken serve` on a loopback port: requests, vtoken_* metrics, `vtoken audit URL`."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tests.vllm_tier.conftest import VLLM_MISSING, VLLM_PROBE

pytest.importorskip(VLLM_PROBE, reason=VLLM_MISSING)

from vtoken.endpoint import scrape  # noqa: E402
from vtoken_cli.app import app  # noqa: E402

START_TIMEOUT_S = 600  # minutes on a loaded 2-core machine
PROMPT = ("the quick brown fox jumps over the lazy dog while the cat sleeps on the warm mat. "
          "a paged kv cache stores keys and values in blocks")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def get(url: str, timeout_s: float = 5.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        return response.read()


def complete(base_url: str, model: str) -> dict:
    body = json.dumps({"model": model, "prompt": PROMPT, "max_tokens": 60, "temperature": 0, "ignore_eos": True})
    request = urllib.request.Request(f"{base_url}/v1/completions", body.encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    port = free_port()
    log_path = tmp_path_factory.mktemp("serve") / "server.log"
    argv = [sys.executable, "-c", "from vtoken_cli.app import main; main()", "serve", tiny_model_dir,
            "--port", str(port), "--budget", "48", "--recent-tokens", "16", "--eviction-interval", "8",
            "--theta-f", "0.01", "--dtype", "float32", "--kv-cache-bytes", str(8 << 20), "--max-model-len", "1024"]
    with launched(argv, port, log_path) as base_url:
        yield base_url


@contextlib.contextmanager
def launched(argv: list[str], port: int, log_path: Path, env: dict[str, str] | None = None):
    """A server started from `argv` on loopback `port`, logging to `log_path`: its base URL once
    healthy; stopped (its whole process group) however the block ends."""
    with open(log_path, "wb") as log:
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        wait_until_healthy(f"http://127.0.0.1:{port}", process, log_path)
        yield f"http://127.0.0.1:{port}"
    finally:
        stop(process)


def wait_until_healthy(base_url: str, process: subprocess.Popen, log_path: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"vtoken serve exited with {process.returncode}:\n{log_path.read_text()[-3000:]}")
        try:
            get(f"{base_url}/health", timeout_s=2)
            return
        except OSError:
            time.sleep(1)
    pytest.fail(f"vtoken serve not healthy after {START_TIMEOUT_S} s:\n{log_path.read_text()[-3000:]}")


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGINT)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def test_served_requests_show_up_in_vtoken_metrics_and_the_audit(server, tiny_model_dir):
    with ThreadPoolExecutor(3) as pool:
        answers = list(pool.map(lambda _: complete(server, tiny_model_dir), range(3)))
    assert all(a["usage"]["completion_tokens"] == 60 for a in answers)

    live = scrape(server)
    metrics = live.metrics.vtoken_metrics
    assert metrics["vtoken_tokens_evicted_total"] > 0
    assert metrics["vtoken_eviction_events_total"] >= 3  # every request after its prefill at least
    assert metrics["vtoken_invariant_violations_total"] == 0
    assert metrics["vtoken_allocated_token_seconds_total"] > 0
    assert 0.0 <= metrics["vtoken_waste_ratio_mean"] < 1.0
    assert any(key.startswith("vtoken_info{") and 'variant="vtoken"' in key for key in metrics)
    assert live.cache_config.block_size == 32

    result = CliRunner().invoke(app, ["audit", server, "--model-config", str(Path(tiny_model_dir) / "config.json"),
                                      "--policy", "streaming_llm", "--max-requests", "16", "--frontier-max", "8", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["live"]["vtoken_metrics"]["vtoken_tokens_evicted_total"] > 0
    # the server runs vToken: the audit puts its measured waste beside the sim's for the same workload
    assert "The server runs vToken (vtoken, " in report["verdict"] and "measures its waste" in report["verdict"]
    assert report["closing_the_loop"] is not None
