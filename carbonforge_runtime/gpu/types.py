"""GPU facts as plain data, and the two interfaces that produce them (a snapshot backend for the
doctor, a live session for telemetry and control). No driver code: see :mod:`.select`.

Only :mod:`carbonforge_runtime.gpu.nvml` talks to the driver; :mod:`.fake` stands in for it
in tests. "No GPU" is a normal answer (``available=False`` with a reason), never an exception.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Protocol


class GpuError(Exception):
    """An NVML failure, already translated: ``kind`` is one of
    ``no-driver``, ``no-permission``, ``not-supported``, ``gpu-lost``, ``other``."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True)
class GpuProcess:
    pid: int
    name: str
    used_memory_mib: int | None


@dataclass(frozen=True)
class GpuDevice:
    index: int
    name: str
    uuid: str
    memory_total_mib: int
    memory_free_mib: int
    compute_capability: tuple[int, int] | None
    processes: tuple[GpuProcess, ...] = ()
    #: False when NVML refused to list the processes using this GPU (``processes`` is then empty).
    processes_visible: bool = True

    @property
    def family(self) -> str:
        return gpu_family(self.name)

    @property
    def memory_total_gib(self) -> float:
        return self.memory_total_mib / 1024.0


@dataclass(frozen=True)
class GpuSnapshot:
    available: bool
    reason: str = ""
    driver_version: str = ""
    cuda_driver_version: str = ""
    devices: tuple[GpuDevice, ...] = field(default_factory=tuple)
    #: Why NVML is unavailable, as a :class:`GpuError` kind (or ``no-package``); empty when available.
    failure: str = ""

    @property
    def count(self) -> int:
        return len(self.devices)


class GpuBackend(Protocol):
    def snapshot(self) -> GpuSnapshot:
        """Describe the GPUs; never raises for a missing driver (``available=False``)."""
        ...


_VENDOR_WORDS = {"nvidia", "tesla", "geforce", "quadro"}


def gpu_family(name: str) -> str:
    """``'NVIDIA A100-SXM4-80GB'`` -> ``'a100'``; ``'NVIDIA GeForce RTX 4090'`` -> ``'rtx4090'``."""
    tokens = [t for t in re.split(r"[\s\-_]+", name.lower()) if t and t not in _VENDOR_WORDS]
    for i, token in enumerate(tokens):
        if re.fullmatch(r"[a-z]+\d+[a-z]*", token):
            return token
        if re.fullmatch(r"[a-z]+", token) and i + 1 < len(tokens) and re.fullmatch(r"\d+[a-z]*", tokens[i + 1]):
            return token + tokens[i + 1]
    return tokens[0] if tokens else "unknown"


@dataclass(frozen=True)
class GpuId:
    index: int  # NVML index
    uuid: str
    name: str


@dataclass(frozen=True)
class GpuReading:
    """One GPU at one moment; ``None`` where the driver does not report the value."""

    index: int
    uuid: str
    power_w: float | None
    energy_j: float | None  # cumulative since the driver loaded
    sm_clock_mhz: int | None
    memory_clock_mhz: int | None
    temperature_c: float | None
    memory_used_bytes: int | None
    power_limit_w: float | None
    #: The driver reports the clocks held by a user setting (locked or application clocks).
    clocks_locked: bool | None


@dataclass(frozen=True)
class GpuLimits:
    """What the controller may set on one GPU, and the settings found before it touched anything."""

    index: int
    uuid: str
    power_limit_w: float  # current (the original, read before any change)
    power_limit_default_w: float
    power_limit_min_w: float
    power_limit_max_w: float
    sm_clock_max_mhz: int
    #: Supported SM clocks at the highest memory clock, ascending.
    sm_clocks_mhz: tuple[int, ...]
    clocks_locked: bool


class GpuSession(Protocol):
    """An open connection to the GPU driver. Not started until :meth:`open`."""

    def open(self) -> list[GpuId]:
        """Initialise and list the GPUs this process can see."""
        ...

    def close(self) -> None: ...

    def energy_j(self, index: int) -> float:
        """The cumulative energy counter (fast: the energy meter calls it many times a second)."""
        ...

    def read(self, index: int) -> GpuReading: ...

    def limits(self, index: int) -> GpuLimits: ...

    def set_locked_clocks(self, index: int, min_mhz: int, max_mhz: int) -> None: ...

    def reset_locked_clocks(self, index: int) -> None: ...

    def set_power_limit_w(self, index: int, watts: float) -> None: ...
