"""A stand-in for NVML in tests: hosts described as plain data."""

from __future__ import annotations

from dataclasses import dataclass

from carbonforge_runtime.gpu import GpuDevice, GpuProcess, GpuSnapshot

_MODELS = {
    # name, total MiB, compute capability
    "l4": ("NVIDIA L4", 23034, (8, 9)),
    "a100-80": ("NVIDIA A100-SXM4-80GB", 81920, (8, 0)),
    "a100-40": ("NVIDIA A100-SXM4-40GB", 40960, (8, 0)),
    "h100": ("NVIDIA H100 80GB HBM3", 81559, (9, 0)),
    "h200": ("NVIDIA H200", 143771, (9, 0)),
    "t4": ("Tesla T4", 15360, (7, 5)),
}


def device(kind: str, index: int = 0, free_mib: int | None = None,
           processes: tuple[GpuProcess, ...] = ()) -> GpuDevice:
    name, total, capability = _MODELS[kind]
    return GpuDevice(
        index=index,
        name=name,
        uuid=f"GPU-fake-{kind}-{index}",
        memory_total_mib=total,
        memory_free_mib=total - 500 if free_mib is None else free_mib,
        compute_capability=capability,
        processes=processes,
    )


def host(kind: str | None, count: int = 1, driver: str = "595.84", **device_kwargs: object) -> GpuSnapshot:
    """``host(None)`` is a machine without a driver; ``host("h100", 2)`` two H100s."""
    if kind is None:
        return GpuSnapshot(False, "NVML could not be loaded: no NVIDIA driver is visible to this process")
    devices = tuple(device(kind, i, **device_kwargs) for i in range(count))  # type: ignore[arg-type]
    return GpuSnapshot(True, "", driver, "13.0", devices)


@dataclass
class FakeGpuBackend:
    """Returns a fixed snapshot; counts calls so tests can assert NVML was (not) consulted."""

    fixed: GpuSnapshot
    calls: int = 0

    def snapshot(self) -> GpuSnapshot:
        self.calls += 1
        return self.fixed
