"""The NVML module's translation of driver answers into the facts the doctor reads.

A stand-in ``pynvml`` module plays the driver (this machine has none), so the code paths that only
run on GPU hosts (permission errors, process listings) are exercised here too.
"""

from __future__ import annotations

import sys
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

from carbonforge_runtime.gpu.nvml import NO_DRIVER_REASON, NvmlBackend

LIBRARY_NOT_FOUND, NO_PERMISSION, NOT_SUPPORTED = 12, 4, 3


class NVMLError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(f"NVML error {value}")
        self.value = value


def fake_pynvml(init_error: int | None = None, compute: Any = (), graphics: Any = ()) -> ModuleType:
    module = ModuleType("pynvml")

    def answer(value: Any) -> Any:
        if isinstance(value, int) and not isinstance(value, bool) and value in (NO_PERMISSION, NOT_SUPPORTED):
            raise NVMLError(value)
        return value

    def init() -> None:
        if init_error is not None:
            raise NVMLError(init_error)

    gib = 1024**3
    module.__dict__.update(
        NVMLError=NVMLError,
        NVML_ERROR_LIBRARY_NOT_FOUND=LIBRARY_NOT_FOUND,
        NVML_ERROR_DRIVER_NOT_LOADED=9,
        NVML_ERROR_NO_PERMISSION=NO_PERMISSION,
        NVML_ERROR_NOT_SUPPORTED=NOT_SUPPORTED,
        NVML_ERROR_GPU_IS_LOST=15,
        nvmlInit=init,
        nvmlShutdown=lambda: None,
        nvmlSystemGetDriverVersion=lambda: b"595.84",
        nvmlSystemGetCudaDriverVersion=lambda: 13000,
        nvmlDeviceGetCount=lambda: 1,
        nvmlDeviceGetHandleByIndex=lambda index: f"handle{index}",
        nvmlDeviceGetMemoryInfo=lambda handle: SimpleNamespace(total=80 * gib, free=50 * gib, used=30 * gib),
        nvmlDeviceGetCudaComputeCapability=lambda handle: (9, 0),
        nvmlDeviceGetName=lambda handle: "NVIDIA H100 80GB HBM3",
        nvmlDeviceGetUUID=lambda handle: "GPU-1234",
        nvmlDeviceGetComputeRunningProcesses=lambda handle: answer(compute),
        nvmlDeviceGetGraphicsRunningProcesses=lambda handle: answer(graphics),
    )
    return module


def snapshot_with(monkeypatch: pytest.MonkeyPatch, module: ModuleType) -> Any:
    monkeypatch.setitem(sys.modules, "pynvml", module)
    return NvmlBackend().snapshot()


def test_missing_library_is_the_no_driver_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    snapshot = snapshot_with(monkeypatch, fake_pynvml(init_error=LIBRARY_NOT_FOUND))
    assert not snapshot.available and snapshot.failure == "no-driver" and snapshot.reason == NO_DRIVER_REASON


def test_permission_denied_at_init_is_its_own_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    snapshot = snapshot_with(monkeypatch, fake_pynvml(init_error=NO_PERMISSION))
    assert not snapshot.available and snapshot.failure == "no-permission"


def test_processes_are_listed_with_their_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    proc = SimpleNamespace(pid=999_999_999, usedGpuMemory=30 * 1024**3)
    snapshot = snapshot_with(monkeypatch, fake_pynvml(compute=[proc]))
    assert snapshot.available and snapshot.failure == ""
    (dev,) = snapshot.devices
    assert (dev.name, dev.memory_total_mib, dev.memory_free_mib, dev.compute_capability) == (
        "NVIDIA H100 80GB HBM3", 81920, 51200, (9, 0))
    assert dev.processes_visible
    (process,) = dev.processes
    assert process.used_memory_mib == 30 * 1024
    assert process.name == "pid 999999999 (not visible from this container)"


def test_process_listing_refused_marks_the_processes_unknown(monkeypatch: pytest.MonkeyPatch) -> None:
    snapshot = snapshot_with(monkeypatch, fake_pynvml(compute=NO_PERMISSION, graphics=NO_PERMISSION))
    (dev,) = snapshot.devices
    assert dev.processes == () and not dev.processes_visible
    unsupported = snapshot_with(monkeypatch, fake_pynvml(compute=NOT_SUPPORTED, graphics=()))
    assert unsupported.devices[0].processes_visible
