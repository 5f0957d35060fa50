"""Read the GPUs' memory through NVML (nvidia-ml-py's `pynvml`), when a driver is present.

`probe_gpus()` never raises: on a machine without an NVIDIA driver, or with one that fails,
it returns no devices and a one-line reason, which `vtoken audit` shows instead of GPU numbers.
NVML's "used" memory includes vLLM's whole pre-allocated KV pool (`gpu_memory_utilization`),
so it tells how much memory the server holds, not how full its KV cache is.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GpuDevice:
    index: int  # NVML device index
    name: str  # e.g. "NVIDIA H100 80GB HBM3"
    memory_total_bytes: int
    memory_used_bytes: int


@dataclass(frozen=True)
class NvmlReport:
    devices: tuple[GpuDevice, ...]
    reason: str | None  # why no device (or not every device) was read; None when all were


def probe_gpus() -> NvmlReport:
    """List every GPU NVML sees with its memory. Never raises; always shuts NVML down.

    Without nvidia-ml-py, without libnvidia-ml.so.1, or when nvmlInit fails: no devices and the
    reason. With zero devices: no devices and a reason. When one device fails to answer: the
    devices read before it and the reason.
    """
    try:
        import pynvml
    except ImportError:
        return NvmlReport((), "NVML not available: nvidia-ml-py is not installed")
    try:
        pynvml.nvmlInit()
    except (pynvml.NVMLError, OSError) as err:
        return NvmlReport((), f"NVML not available: {_describe(pynvml, err)}")
    try:
        return _read_devices(pynvml)
    finally:
        try:
            pynvml.nvmlShutdown()
        except (pynvml.NVMLError, OSError):
            pass  # the report is already complete; a failed shutdown changes nothing in it


def _read_devices(pynvml) -> NvmlReport:  # noqa: ANN001 -- the module itself, imported lazily
    try:
        num_devices = pynvml.nvmlDeviceGetCount()
    except (pynvml.NVMLError, OSError) as err:
        return NvmlReport((), f"NVML could not count GPUs: {_describe(pynvml, err)}")
    if num_devices == 0:
        return NvmlReport((), "NVML found no GPU")
    devices: list[GpuDevice] = []
    for index in range(num_devices):
        try:
            devices.append(_read_device(pynvml, index))
        except (pynvml.NVMLError, OSError) as err:
            reason = f"NVML could not read GPU {index}: {_describe(pynvml, err)}"
            return NvmlReport(tuple(devices), reason)
    return NvmlReport(tuple(devices), None)


def _read_device(pynvml, index: int) -> GpuDevice:  # noqa: ANN001
    handle = pynvml.nvmlDeviceGetHandleByIndex(index)
    name = pynvml.nvmlDeviceGetName(handle)
    memory = pynvml.nvmlDeviceGetMemoryInfo(handle)  # .total / .used / .free, in bytes
    return GpuDevice(
        index=index,
        name=name.decode("utf-8", "replace") if isinstance(name, bytes) else str(name),
        memory_total_bytes=int(memory.total),
        memory_used_bytes=int(memory.used),
    )


def _describe(pynvml, err: Exception) -> str:  # noqa: ANN001
    not_found = getattr(pynvml, "NVMLError_LibraryNotFound", None)
    if not_found is not None and isinstance(err, not_found):
        return "libnvidia-ml.so.1 not found (no NVIDIA driver on this machine)"
    return " ".join(str(err).split()) or type(err).__name__
