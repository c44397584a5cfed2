"""Live GPU telemetry and control, as plain data and one small interface.

:class:`GpuSession` is what the metrics, the energy meter and the controller use. Two
implementations exist: :class:`carbonforge_runtime.gpu.nvml.NvmlSession` (the driver) and
:class:`carbonforge_runtime.gpu.fake.FakeGpuSession` (tests, and ``CF_FAKE_NVML``). Every method
raises only :class:`~carbonforge_runtime.gpu.GpuError` (already translated).

Units are in the names: watts, joules, MHz, bytes, degrees Celsius.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from carbonforge_runtime.gpu import GpuError


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


def select_visible(gpus: Sequence[GpuId], cuda_visible_devices: str | None) -> tuple[list[GpuId], str | None]:
    """The GPUs given to this deployment, and a warning when the selection is uncertain.

    The container runtime already hides GPUs that were not given (``--gpus``); within what NVML
    sees, ``CUDA_VISIBLE_DEVICES`` (indices or ``GPU-`` UUID prefixes) narrows it further, as it
    does for the engine. An entry that names nothing NVML lists (e.g. a MIG instance) selects
    nothing, so nothing is touched.
    """
    if cuda_visible_devices is None:
        return list(gpus), None
    text = cuda_visible_devices.strip()
    if not text:
        return [], None
    chosen: list[GpuId] = []
    for token in (t.strip() for t in text.split(",")):
        if not token:
            continue
        match: GpuId | None = None
        if token.isdigit():
            # CUDA numbers the devices it is given; NVML numbers them the same way when nothing else
            # reorders them (CUDA_DEVICE_ORDER=PCI_BUS_ID in containers).
            match = next((g for g in gpus if g.index == int(token)), None)
        elif token.startswith("GPU-"):
            found = [g for g in gpus if g.uuid.startswith(token)]
            match = found[0] if len(found) == 1 else None
        if match is None:
            return [], (f"CUDA_VISIBLE_DEVICES={cuda_visible_devices!r} names {token!r}, which is not a GPU this "
                        "process sees through NVML: no GPU is monitored or controlled")
        if match not in chosen:
            chosen.append(match)
    return chosen, None


def open_session(fake_script: str | None, log: logging.Logger) -> tuple[GpuSession, list[GpuId]] | None:
    """Open the driver (or the scripted fake named by ``fake_script``); ``None`` when there is no
    usable NVML, with the reason at debug level (a CPU host is a normal case)."""
    session: GpuSession
    if fake_script:
        from carbonforge_runtime.gpu.fake import FakeGpuSession

        session = FakeGpuSession.from_script(fake_script)
    else:
        from carbonforge_runtime.gpu.nvml import NvmlSession

        session = NvmlSession()
    try:
        gpus = session.open()
    except GpuError as exc:
        log.debug("no GPU telemetry: %s (%s)", exc, exc.kind)
        return None
    if not gpus:
        session.close()
        return None
    return session, gpus
