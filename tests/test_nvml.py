"""vtoken.nvml: the real probe on this machine, and the device path through a fake pynvml."""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass, field

import pytest

from vtoken.nvml import GpuDevice, NvmlReport, probe_gpus

HAS_GPU = bool(probe_gpus().devices)
GIB = 1 << 30


class FakeNvmlError(Exception):
    pass


class FakeLibraryNotFound(FakeNvmlError):
    pass


@dataclass
class FakeMemory:
    total: int
    used: int
    free: int


@dataclass
class FakeNvml:
    """Devices as (name, total_bytes, used_bytes); `fail_idx` makes that device's reads fail."""

    devices: list[tuple[str | bytes, int, int]]
    init_error: Exception | None = None
    fail_idx: int | None = None
    shutdown_error: Exception | None = None
    calls: list[str] = field(default_factory=list)

    def module(self) -> types.ModuleType:
        module = types.ModuleType("pynvml")
        module.NVMLError = FakeNvmlError
        module.NVMLError_LibraryNotFound = FakeLibraryNotFound
        module.nvmlInit = self.init
        module.nvmlShutdown = self.shutdown
        module.nvmlDeviceGetCount = lambda: len(self.devices)
        module.nvmlDeviceGetHandleByIndex = self.handle
        module.nvmlDeviceGetName = lambda handle: self.devices[handle][0]
        module.nvmlDeviceGetMemoryInfo = self.memory
        return module

    def init(self) -> None:
        self.calls.append("init")
        if self.init_error is not None:
            raise self.init_error

    def shutdown(self) -> None:
        self.calls.append("shutdown")
        if self.shutdown_error is not None:
            raise self.shutdown_error

    def handle(self, index: int) -> int:
        if index == self.fail_idx:
            raise FakeNvmlError("GPU is lost")
        return index

    def memory(self, handle: int) -> FakeMemory:
        _, total, used = self.devices[handle]
        return FakeMemory(total=total, used=used, free=total - used)


@pytest.fixture
def install(monkeypatch: pytest.MonkeyPatch):
    def install_fake(fake: FakeNvml) -> FakeNvml:
        monkeypatch.setitem(sys.modules, "pynvml", fake.module())
        return fake

    return install_fake


# --- the real NVML on this machine ----------------------------------------------------------


@pytest.mark.skipif(HAS_GPU, reason="this machine has a GPU; the device test covers it")
def test_real_probe_without_gpu_gives_no_devices_and_a_reason() -> None:
    report = probe_gpus()

    assert report.devices == ()
    assert isinstance(report.reason, str) and report.reason.startswith("NVML")
    assert "\n" not in report.reason


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="no GPU visible to NVML")
def test_real_probe_reads_every_gpu() -> None:
    report = probe_gpus()

    assert report.reason is None
    assert [device.index for device in report.devices] == list(range(len(report.devices)))
    for device in report.devices:
        assert device.name and isinstance(device.name, str)
        assert 0 < device.memory_used_bytes <= device.memory_total_bytes


# --- the device path through a fake pynvml --------------------------------------------------


def test_devices_map_names_and_memory(install) -> None:
    fake = install(
        FakeNvml([(b"NVIDIA H100 80GB HBM3", 80 * GIB, 75 * GIB), ("NVIDIA L4", 24 * GIB, GIB)])
    )

    report = probe_gpus()

    assert report == NvmlReport(
        devices=(
            GpuDevice(0, "NVIDIA H100 80GB HBM3", 80 * GIB, 75 * GIB),
            GpuDevice(1, "NVIDIA L4", 24 * GIB, GIB),
        ),
        reason=None,
    )
    assert fake.calls == ["init", "shutdown"]


def test_missing_library_gives_a_reason_and_no_shutdown(install) -> None:
    fake = install(FakeNvml([], init_error=FakeLibraryNotFound("NVML Shared Library Not Found")))

    report = probe_gpus()

    assert report == NvmlReport(
        (), "NVML not available: libnvidia-ml.so.1 not found (no NVIDIA driver on this machine)"
    )
    assert fake.calls == ["init"]


def test_init_failure_gives_its_message(install) -> None:
    install(FakeNvml([], init_error=FakeNvmlError("Driver/library version\nmismatch")))

    assert probe_gpus() == NvmlReport((), "NVML not available: Driver/library version mismatch")


def test_zero_devices_gives_a_reason_and_shuts_down(install) -> None:
    fake = install(FakeNvml([]))

    assert probe_gpus() == NvmlReport((), "NVML found no GPU")
    assert fake.calls == ["init", "shutdown"]


def test_failing_device_keeps_the_ones_read_before_it(install) -> None:
    fake = install(
        FakeNvml([("A", 10 * GIB, GIB), ("B", 10 * GIB, GIB), ("C", 10 * GIB, GIB)], fail_idx=1)
    )

    report = probe_gpus()

    assert report == NvmlReport(
        (GpuDevice(0, "A", 10 * GIB, GIB),), "NVML could not read GPU 1: GPU is lost"
    )
    assert fake.calls == ["init", "shutdown"]


def test_failing_shutdown_does_not_raise(install) -> None:
    install(FakeNvml([("A", 2 * GIB, GIB)], shutdown_error=FakeNvmlError("Uninitialized")))

    assert probe_gpus() == NvmlReport((GpuDevice(0, "A", 2 * GIB, GIB),), None)


def test_without_nvidia_ml_py(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # makes `import pynvml` raise ImportError

    assert probe_gpus() == NvmlReport((), "NVML not available: nvidia-ml-py is not installed")
