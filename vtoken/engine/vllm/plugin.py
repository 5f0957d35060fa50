"""vToken as a vLLM general plugin: a plain vLLM launch with `--additional-config '{"vtoken": ...}'`.

    python -m vllm.entrypoints.openai.api_server --model MODEL --block-size 32 \\
        --enforce-eager --additional-config '{"vtoken": {"policy": "streaming_llm"}}'

With vtoken installed, vLLM finds `register` in the entry-point group `vllm.general_plugins`
(pyproject.toml) and calls it once in every vLLM process (`vllm/plugins/__init__.py`
`load_general_plugins`; process 0 calls it from `EngineArgs.__post_init__`,
`engine/arg_utils.py:906`, before the config exists). vLLM 0.32 hands a general plugin no
config, and `scheduler_cls` / `worker_cls` are fixed in process 0 when `VllmConfig` is built,
then travel with the config to the engine core and the workers. So `register` wraps the one
per-process hook vLLM calls with the new config, the platform's `check_and_update_config`
(`config/vllm.py:1991`, in `VllmConfig.__post_init__`; the hook's contract is to check the
config and update it). The wrapper is set on the live `current_platform` object only; no
vLLM file or class changes. Around the stock hook, when `additional_config` has a "vtoken" key:

    before   scheduler_cls and worker_cls become vToken's (the platform fills in its worker
             only when worker_cls is still "auto": platforms/cpu.py:343, platforms/cuda.py:328)
    after    the settings are read and every setting vToken cannot run with is refused
             (support.config_problems): the process exits with one line naming each setting;
             without PROMETHEUS_MULTIPROC_DIR, vtoken_* metrics are routed to the server's
             /metrics through a file (metrics.py)

Without a "vtoken" key the wrapper calls the stock hook and changes nothing. The names relied
on are in contract.py and the behaviour is tested in tests/vllm_tier/test_plugin.py.
"""

from __future__ import annotations

import atexit
import importlib
import os
import shutil
import tempfile

from vtoken.engine.vllm.engine import SCHEDULER_CLS, WORKER_CLS
from vtoken.engine.vllm.metrics import METRICS_FILE_ENV, FileCollector
from vtoken.engine.vllm.settings import CONFIG_KEY
from vtoken.errors import ConfigError

_STOCK_WORKERS = ("auto", "vllm.v1.worker.cpu_worker.CPUWorker", "vllm.v1.worker.gpu_worker.Worker")
_WRAPPED = "_vtoken_wrapped"


class RefusedAtStart(SystemExit):
    """A configuration vToken cannot run with, found while vLLM builds its config.

    A SystemExit so that a vLLM launch stops with the one line (exit code 1, no traceback);
    in-process callers (engine.build_llm) raise the ConfigError it carries instead.
    """

    def __init__(self, error: ConfigError) -> None:
        super().__init__(f"vtoken: {error}")
        self.error = error


def register() -> None:
    """The entry point: wrap the platform's config hook in this process (once)."""
    from vllm.platforms import current_platform

    stock_hook = current_platform.check_and_update_config
    if getattr(stock_hook, _WRAPPED, False):
        return

    def check_and_update_config(vllm_config) -> None:
        enabled = is_enabled(vllm_config)
        if enabled:
            use_vtoken_classes(vllm_config)
        stock_hook(vllm_config)
        if enabled:
            refuse_unsupported(vllm_config)
            route_metrics_to_the_server()

    setattr(check_and_update_config, _WRAPPED, True)
    current_platform.check_and_update_config = check_and_update_config


def is_enabled(vllm_config) -> bool:
    """Whether this config asks for vToken (`additional_config` has a "vtoken" key)."""
    additional = vllm_config.additional_config
    return isinstance(additional, dict) and CONFIG_KEY in additional


def use_vtoken_classes(vllm_config) -> None:
    """Point the config at vToken's scheduler (or keep a subclass of it) and worker; refuse
    another custom class."""
    scheduler_config, parallel_config = vllm_config.scheduler_config, vllm_config.parallel_config
    if not _is_vtoken_scheduler(scheduler_config.scheduler_cls):
        raise RefusedAtStart(ConfigError(
            f"--scheduler-cls {scheduler_config.scheduler_cls} replaces vToken's scheduler; drop it"))
    if parallel_config.worker_cls not in (*_STOCK_WORKERS, WORKER_CLS):
        raise RefusedAtStart(ConfigError(f"--worker-cls {parallel_config.worker_cls} replaces vToken's worker; drop it"))
    if scheduler_config.scheduler_cls is None:
        scheduler_config.scheduler_cls = SCHEDULER_CLS
    parallel_config.worker_cls = WORKER_CLS


def _is_vtoken_scheduler(scheduler_cls) -> bool:
    """None (vLLM's default), vToken's scheduler, or a subclass of it (the calibration's recorder)."""
    if scheduler_cls in (None, SCHEDULER_CLS):
        return True
    if isinstance(scheduler_cls, str):
        module_name, _, name = scheduler_cls.rpartition(".")
        try:
            scheduler_cls = getattr(importlib.import_module(module_name), name)
        except (ImportError, AttributeError, ValueError):
            return False
    from vtoken.engine.vllm.scheduler import VTokenScheduler

    return isinstance(scheduler_cls, type) and issubclass(scheduler_cls, VTokenScheduler)


def refuse_unsupported(vllm_config) -> None:
    """RefusedAtStart for bad settings or a setting the variant cannot run with."""
    from vtoken.engine.vllm.support import check_config

    try:
        check_config(vllm_config)
    except ConfigError as error:
        raise RefusedAtStart(error) from None


def route_metrics_to_the_server() -> None:
    """vtoken_* metrics are written in the engine-core process; a server's `/metrics` (this
    process, which builds the config before it starts the engine core) collects them from
    prometheus_client's multiprocess directory when one is set, or else from a file this
    function names in the environment the engine core inherits (metrics.FileCollector). Once
    per process; nothing for an in-process engine."""
    multiprocess = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") != "0"
    if not multiprocess or "PROMETHEUS_MULTIPROC_DIR" in os.environ or METRICS_FILE_ENV in os.environ:
        return
    from prometheus_client import REGISTRY

    folder = tempfile.mkdtemp(prefix="vtoken-metrics-")
    atexit.register(shutil.rmtree, folder, True)
    path = os.path.join(folder, "vtoken.prom")
    os.environ[METRICS_FILE_ENV] = path
    REGISTRY.register(FileCollector(path))
