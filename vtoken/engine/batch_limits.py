"""The scheduler limits a vLLM server starts with when it is given none, for a catalog GPU.

vLLM V1 sizes `max_num_batched_tokens` (the token budget of one step) and `max_num_seqs` (the
most running requests) by the device's memory and the entry point
(vllm/engine/arg_utils.py, `EngineArgs.get_batch_defaults` and
`_set_default_max_num_seqs_and_batched_tokens_args`); chunked prefill is on
(vllm/config/scheduler.py, `SchedulerConfig.enable_chunked_prefill = True`). A trace replay
models a server, so the entry point is `vllm serve` (`UsageContext.OPENAI_API_SERVER`).

Where vLLM is already loaded in this process (the vllm executor, vLLM's environment once it has
imported it), the figures are read from it, with the simulated GPU in place of the local
device; otherwise they come from `vtoken.defaults`, which copies vLLM 0.32's table (a vLLM-tier
test checks the copy against the installed vLLM for every catalog GPU). Importing vLLM only to
read two numbers would cost about 13 s of CPU, so it is not done for that alone.
"""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass

from vtoken import defaults
from vtoken.hardware import GpuSpec

GiB = 1 << 30


@dataclass(frozen=True)
class BatchDefaults:
    max_num_batched_tokens: int
    max_num_seqs: int
    source: str  # where the figures were read


def vllm_batch_defaults(gpu: GpuSpec) -> BatchDefaults:
    """What `vllm serve` on `gpu` takes when given neither limit."""
    if "vllm.engine.arg_utils" in sys.modules:
        return _read_installed(gpu)
    return documented_batch_defaults(gpu)


def engine_batch_defaults() -> BatchDefaults:
    """What the installed vLLM takes on this machine's own device for `vllm.LLM` (the vllm
    executor's entry point: `UsageContext.LLM_CLASS`) when given neither limit: on CPU, 4,096
    tokens and 256 sequences in vLLM 0.32. Imports vLLM."""
    from vllm import __version__
    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms import current_platform
    from vllm.usage.usage_lib import UsageContext

    tokens, seqs = EngineArgs.get_batch_defaults(1)
    device = "cpu" if current_platform.is_cpu() else current_platform.get_device_name()
    return BatchDefaults(int(tokens[UsageContext.LLM_CLASS]), int(seqs[UsageContext.LLM_CLASS]),
                         f"vLLM {__version__} vllm/engine/arg_utils.py get_batch_defaults, vllm.LLM on this machine's {device}")


def documented_batch_defaults(gpu: GpuSpec) -> BatchDefaults:
    """vLLM 0.32's table as `vtoken.defaults.VLLM_BATCH_DEFAULTS` copies it."""
    memory_gib = gpu.memory_bytes / GiB
    name = gpu.name.lower()
    for min_gib, num_tokens, num_seqs in defaults.VLLM_BATCH_DEFAULTS:
        if memory_gib < min_gib:
            continue
        if min_gib == 70 and any(tag in name for tag in defaults.VLLM_BATCH_DEFAULTS_NOT_70GIB):
            continue
        return BatchDefaults(num_tokens, num_seqs, "vLLM 0.32 vllm/engine/arg_utils.py get_batch_defaults "
                                                   "(as copied in vtoken/defaults.py)")
    raise AssertionError("the last row of VLLM_BATCH_DEFAULTS has no memory floor")


class _CatalogDevice:
    """The parts of vLLM's `current_platform` that `get_batch_defaults` asks, for a catalog GPU."""

    def __init__(self, gpu: GpuSpec) -> None:
        self._gpu = gpu

    def get_device_total_memory(self, device_id: int = 0) -> int:
        return self._gpu.memory_bytes

    def get_device_name(self, device_id: int = 0) -> str:
        return self._gpu.name

    def is_tpu(self) -> bool:
        return False

    def is_cpu(self) -> bool:
        return False


def _read_installed(gpu: GpuSpec) -> BatchDefaults:
    """`EngineArgs.get_batch_defaults` of the loaded vLLM, run with the catalog GPU as its device
    (a copy of the function with its own globals: vLLM's module is not touched); the documented
    table, saying why, where that function is not what vLLM 0.32 has."""
    arg_utils = sys.modules["vllm.engine.arg_utils"]
    try:
        from vllm import __version__
        from vllm.usage.usage_lib import UsageContext

        func = arg_utils.EngineArgs.get_batch_defaults.__func__
        scope = dict(func.__globals__, current_platform=_CatalogDevice(gpu))
        tokens, seqs = types.FunctionType(func.__code__, scope, func.__name__)(arg_utils.EngineArgs, 1)
        context = UsageContext.OPENAI_API_SERVER
        return BatchDefaults(int(tokens[context]), int(seqs[context]),
                             f"vLLM {__version__} (loaded) vllm/engine/arg_utils.py get_batch_defaults")
    except (AttributeError, ImportError, KeyError, TypeError) as exc:  # a vLLM whose function changed
        documented = documented_batch_defaults(gpu)
        return BatchDefaults(documented.max_num_batched_tokens, documented.max_num_seqs,
                             f"{documented.source}; the loaded vLLM's could not be read: {exc!r}")
