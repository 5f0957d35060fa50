"""vToken through vLLM's plugin entry point: the config hook in-process, then a plain
`python -m vllm.entrypoints.openai.api_server --additional-config '{"vtoken": ...}'` on a loopback
port, and a refused combination that exits with one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from importlib.metadata import entry_points

import pytest

from tests.vllm_tier.conftest import VLLM_MISSING, VLLM_PROBE

pytest.importorskip(VLLM_PROBE, reason=VLLM_MISSING)

from tests.vllm_tier.test_serve import complete, free_port, launched  # noqa: E402
from vtoken.endpoint import scrape  # noqa: E402
from vtoken.engine.vllm.engine import SCHEDULER_CLS, WORKER_CLS, EngineSpec, build_llm, set_engine_env  # noqa: E402
from vtoken.engine.vllm.plugin import RefusedAtStart  # noqa: E402
from vtoken.engine.vllm.settings import VllmSettings  # noqa: E402
from vtoken.errors import ConfigError  # noqa: E402

SETTINGS = {"budget": 48, "num_recent_tokens": 16, "interval_tokens": 8, "theta_f": 0.01}
SERVER = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--host", "127.0.0.1", "--dtype", "float32",
          "--kv-cache-memory-bytes", str(8 << 20), "--max-model-len", "1024"]
EAGER_KWARGS = {"enforce_eager": True}
REFUSAL_TIMEOUT_S = 120


def server_env(**extra: str) -> dict[str, str]:
    """This process's environment as a user's shell has it: engines built in-process here set
    VLLM_ENABLE_V1_MULTIPROCESSING=0, which a server must not inherit."""
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_ENABLE_V1_MULTIPROCESSING", "PROMETHEUS_MULTIPROC_DIR")}
    return {**env, "VLLM_CPU_OMP_THREADS_BIND": "nobind", **extra}


def engine_config(model: str, **kwargs):
    from vllm.engine.arg_utils import EngineArgs

    set_engine_env()
    return EngineArgs(model=model, kv_cache_memory_bytes=8 << 20, **kwargs).create_engine_config()


def test_the_entry_point_is_registered():
    plugins = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    assert plugins.get("vtoken") == "vtoken.engine.vllm.plugin:register"


@pytest.mark.timeout(120)
def test_without_a_vtoken_key_the_config_is_stock(tiny_model_dir):
    config = engine_config(tiny_model_dir)
    assert config.scheduler_config.scheduler_cls is None
    assert config.parallel_config.worker_cls == "vllm.v1.worker.cpu_worker.CPUWorker"
    assert config.cache_config.enable_prefix_caching  # nothing refused, nothing turned off


@pytest.mark.timeout(120)
def test_a_vtoken_key_selects_the_vtoken_classes(tiny_model_dir):
    config = engine_config(tiny_model_dir, additional_config={"vtoken": {}}, **EAGER_KWARGS)
    assert config.scheduler_config.scheduler_cls == SCHEDULER_CLS
    assert config.parallel_config.worker_cls == WORKER_CLS


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kwargs, phrase", [
    ({}, "CUDA graphs / torch.compile are on (pass --enforce-eager"),
    ({**EAGER_KWARGS, "block_size": 48}, "--block-size 48 is not a multiple of 32"),
    ({**EAGER_KWARGS, "scheduler_cls": "my.Scheduler"}, "--scheduler-cls my.Scheduler replaces vToken's scheduler"),
])
def test_a_setting_vtoken_cannot_run_with_is_refused_in_one_line(tiny_model_dir, kwargs, phrase):
    with pytest.raises(RefusedAtStart) as refusal:
        engine_config(tiny_model_dir, additional_config={"vtoken": {}}, **kwargs)
    message = str(refusal.value)
    assert message.startswith("vtoken: ") and phrase in message and "\n" not in message


@pytest.mark.timeout(120)
def test_native_evicts_nothing_and_runs_with_prefix_caching(tiny_model_dir):
    config = engine_config(tiny_model_dir, additional_config={"vtoken": {"variant": "native"}})
    assert config.scheduler_config.scheduler_cls == SCHEDULER_CLS


@pytest.mark.timeout(120)
def test_an_evicting_variant_keeps_vllm_prefix_caching_on(tiny_model_dir):
    config = engine_config(tiny_model_dir, additional_config={"vtoken": {}}, **EAGER_KWARGS)
    assert config.cache_config.enable_prefix_caching


@pytest.mark.timeout(120)
def test_a_bad_vtoken_key_is_refused_and_build_llm_raises_the_config_error(tiny_model_dir):
    with pytest.raises(RefusedAtStart, match="unknown variant 'fast'"):
        engine_config(tiny_model_dir, additional_config={"vtoken": {"variant": "fast"}}, **EAGER_KWARGS)
    spec = EngineSpec(tiny_model_dir, kv_cache_memory_bytes=8 << 20, extra_llm_kwargs={"block_size": 48})
    with pytest.raises(ConfigError, match="--block-size 48 is not a multiple of 32"):
        build_llm(spec, VllmSettings())


# ---- a plain vLLM launch -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def plain_server(tiny_model_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("plain")
    port = free_port()
    argv = SERVER + ["--model", tiny_model_dir, "--port", str(port), "--enforce-eager", "--block-size", "32",
                     "--additional-config", json.dumps({"vtoken": SETTINGS})]
    env = server_env()  # no PROMETHEUS_MULTIPROC_DIR: the plugin routes vtoken_* metrics itself
    with launched(argv, port, folder / "server.log", env) as base_url:
        yield base_url


@pytest.mark.timeout(900)
def test_a_plain_vllm_launch_runs_vtoken(plain_server, tiny_model_dir):
    with ThreadPoolExecutor(3) as pool:
        answers = list(pool.map(lambda _: complete(plain_server, tiny_model_dir), range(3)))
    assert all(a["usage"]["completion_tokens"] == 60 for a in answers)
    metrics = scrape(plain_server).metrics.vtoken_metrics
    assert metrics["vtoken_tokens_evicted_total"] > 0
    assert metrics["vtoken_eviction_events_total"] >= 3
    assert metrics["vtoken_invariant_violations_total"] == 0
    assert any(key.startswith("vtoken_info{") and 'variant="vtoken"' in key for key in metrics)


@pytest.mark.timeout(REFUSAL_TIMEOUT_S + 30)
def test_a_plain_launch_without_enforce_eager_exits_with_one_line(tiny_model_dir):
    argv = SERVER + ["--model", tiny_model_dir, "--port", str(free_port()), "--block-size", "32",
                     "--additional-config", json.dumps({"vtoken": SETTINGS})]
    env = server_env(VLLM_LOGGING_LEVEL="ERROR")
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=REFUSAL_TIMEOUT_S)
    assert done.returncode != 0
    lines = [line for line in done.stderr.splitlines() if line.startswith("vtoken: ")]
    assert len(lines) == 1, done.stderr[-3000:]
    assert "pass --enforce-eager" in lines[0]
    assert "Traceback" not in done.stderr
