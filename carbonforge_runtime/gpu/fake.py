"""A stand-in for NVML in tests: hosts described as plain data."""

from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from carbonforge_runtime.gpu.types import GpuDevice, GpuError, GpuId, GpuLimits, GpuProcess, GpuReading, GpuSnapshot

_MODELS = {
    # name, total MiB, compute capability
    "l4": ("NVIDIA L4", 23034, (8, 9)),
    "a100-80": ("NVIDIA A100-SXM4-80GB", 81920, (8, 0)),
    "a100-40": ("NVIDIA A100-SXM4-40GB", 40960, (8, 0)),
    "h100": ("NVIDIA H100 80GB HBM3", 81559, (9, 0)),
    "h200": ("NVIDIA H200", 143771, (9, 0)),
    "t4": ("Tesla T4", 15360, (7, 5)),
}


#: What a fresh GPU reports in use before anything runs (driver and context reservations).
RESERVED_MIB = 500


def device(kind: str, index: int = 0, free_mib: int | None = None,
           processes: tuple[GpuProcess, ...] = (), processes_visible: bool = True) -> GpuDevice:
    """One GPU; with ``processes`` and no ``free_mib``, their memory is taken from the free memory."""
    name, total, capability = _MODELS[kind]
    if free_mib is None:
        free_mib = total - RESERVED_MIB - sum(p.used_memory_mib or 0 for p in processes)
    return GpuDevice(
        index=index,
        name=name,
        uuid=f"GPU-fake-{kind}-{index}",
        memory_total_mib=total,
        memory_free_mib=free_mib,
        compute_capability=capability,
        processes=processes,
        processes_visible=processes_visible,
    )


def process(pid: int, name: str, used_mib: int | None) -> GpuProcess:
    return GpuProcess(pid, name, used_mib)


def host(kind: str | None, count: int = 1, driver: str = "595.84", **device_kwargs: object) -> GpuSnapshot:
    """``host(None)`` is a machine without a driver; ``host("h100", 2)`` two H100s."""
    if kind is None:
        return GpuSnapshot(False, "NVML could not be loaded: no NVIDIA driver is visible to this process",
                           failure="no-driver")
    devices = tuple(device(kind, i, **device_kwargs) for i in range(count))  # type: ignore[arg-type]
    return GpuSnapshot(True, "", driver, "13.0", devices)


def host_of(*devices: GpuDevice, driver: str = "595.84") -> GpuSnapshot:
    """A host with the given devices (mixed models, different free memory per GPU)."""
    return GpuSnapshot(True, "", driver, "13.0", tuple(devices))


def no_gpus(driver: str = "595.84") -> GpuSnapshot:
    """The driver loads but no GPU is visible (e.g. a container started without ``--gpus``)."""
    return GpuSnapshot(True, "", driver, "13.0", ())


def nvml_denied() -> GpuSnapshot:
    """NVML is present but the process may not open the GPU device files."""
    return GpuSnapshot(False, "NVML failed to initialise: Insufficient Permissions", failure="no-permission")


@dataclass
class FakeGpuBackend:
    """Returns a fixed snapshot; counts calls so tests can assert NVML was (not) consulted."""

    fixed: GpuSnapshot
    calls: int = 0

    def snapshot(self) -> GpuSnapshot:
        self.calls += 1
        return self.fixed


# ---- a scriptable stand-in for the NVML session (telemetry and control) ---------------------------

#: Per model: highest SM clock (MHz), memory clock (MHz), default/min/max power limit (W).
_CONTROL = {
    "l4": (2040, 6251, 72.0, 40.0, 72.0),
    "a100-80": (1410, 1593, 400.0, 100.0, 400.0),
    "a100-40": (1410, 1215, 400.0, 100.0, 400.0),
    "h100": (1980, 2619, 700.0, 200.0, 700.0),
    "h200": (1980, 3201, 700.0, 200.0, 700.0),
    "t4": (1590, 5001, 70.0, 60.0, 70.0),
}
SM_CLOCK_STEP_MHZ = 15
SM_CLOCK_LOWEST_MHZ = 210


@dataclass
class _FakeGpuState:
    locked: tuple[int, int] | None
    power_limit_w: float
    clocks_locked_before: bool


class FakeGpuSession:
    """A :class:`carbonforge_runtime.gpu.select.GpuSession` without a driver.

    Scriptable: the power draw over time (a constant, or ``[(seconds_from_origin, watts), ...]``
    steps) drives a cumulative energy counter that, like the real one, only moves every
    ``energy_update_s``; set calls change the reported clocks and limit and are recorded in
    :attr:`calls` (and appended to ``call_log`` as JSON lines, so another process can read them);
    ``deny_set`` makes every set call fail for lack of permission; ``unavailable`` makes
    :meth:`open` fail with that error kind.
    """

    def __init__(
        self,
        kind: str = "h100",
        count: int = 1,
        power_w: float | Sequence[tuple[float, float]] = 300.0,
        energy_start_j: float = 1_000_000.0,
        energy_update_s: float = 0.05,
        origin_s: float = 0.0,
        deny_set: bool = False,
        unavailable: str | None = None,
        power_limit_w: float | None = None,
        clocks_locked: bool = False,
        call_log: str | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.kind = kind
        self.count = count
        steps = [(0.0, float(power_w))] if isinstance(power_w, (int, float)) else sorted(
            (float(t), float(w)) for t, w in power_w)
        self.power_steps = steps
        self.energy_start_j = energy_start_j
        self.energy_update_s = energy_update_s
        self.origin_s = origin_s
        self.deny_set = deny_set
        self.unavailable = unavailable
        self.call_log = call_log
        self.clock = clock
        self.calls: list[dict[str, Any]] = []
        self.opened = 0
        self.closed = 0
        default_w = _CONTROL[kind][2]
        start_limit = default_w if power_limit_w is None else power_limit_w
        self._state = [_FakeGpuState(None, start_limit, clocks_locked) for _ in range(count)]
        self._lock = threading.Lock()

    @classmethod
    def from_script(cls, path: str) -> FakeGpuSession:
        """The session a JSON script describes (keys: the constructor's, except ``clock``)."""
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
        if isinstance(data.get("power_w"), list):
            data["power_w"] = [tuple(step) for step in data["power_w"]]
        return cls(**data)

    # -- the scripted energy counter --

    def power_at(self, t: float) -> float:
        offset = t - self.origin_s
        watts = self.power_steps[0][1]
        for start, value in self.power_steps:
            if offset >= start:
                watts = value
        return watts

    def energy_at(self, t: float) -> float:
        """Exact integral of the scripted power from the origin to ``t`` (not quantised)."""
        offset = max(t - self.origin_s, 0.0)
        total = 0.0
        for i, (start, watts) in enumerate(self.power_steps):
            end = self.power_steps[i + 1][0] if i + 1 < len(self.power_steps) else float("inf")
            lo, hi = max(start, 0.0), min(end, offset)
            if hi > lo:
                total += watts * (hi - lo)
        return self.energy_start_j + total

    def counter_at(self, t: float) -> float:
        """What the driver would report at ``t``: the counter as of its last update."""
        if self.energy_update_s <= 0:
            return self.energy_at(t)
        offset = t - self.origin_s
        return self.energy_at(self.origin_s + math.floor(offset / self.energy_update_s) * self.energy_update_s)

    # -- GpuSession --

    def _ids(self) -> list[GpuId]:
        name = _MODELS[self.kind][0]
        return [GpuId(i, f"GPU-fake-{self.kind}-{i}", name) for i in range(self.count)]

    def open(self) -> list[GpuId]:
        if self.unavailable:
            raise GpuError(self.unavailable, f"fake NVML: {self.unavailable}")
        self.opened += 1
        return self._ids()

    def close(self) -> None:
        self.closed += 1

    def _check(self, index: int) -> _FakeGpuState:
        if not 0 <= index < self.count:
            raise GpuError("other", f"GPU {index} is not open in this NVML session")
        return self._state[index]

    def energy_j(self, index: int) -> float:
        self._check(index)
        return self.counter_at(self.clock())

    def read(self, index: int) -> GpuReading:
        state = self._check(index)
        sm_max, mem_clock, _, _, _ = _CONTROL[self.kind]
        now = self.clock()
        total_mib = _MODELS[self.kind][1]
        return GpuReading(
            index=index,
            uuid=f"GPU-fake-{self.kind}-{index}",
            power_w=self.power_at(now),
            energy_j=self.counter_at(now),
            sm_clock_mhz=state.locked[1] if state.locked else sm_max,
            memory_clock_mhz=mem_clock,
            temperature_c=45.0,
            memory_used_bytes=(total_mib - 1024) * 1024 * 1024,
            power_limit_w=state.power_limit_w,
            clocks_locked=state.locked is not None or state.clocks_locked_before,
        )

    def limits(self, index: int) -> GpuLimits:
        state = self._check(index)
        sm_max, _, default_w, low_w, high_w = _CONTROL[self.kind]
        clocks = tuple(range(SM_CLOCK_LOWEST_MHZ, sm_max + 1, SM_CLOCK_STEP_MHZ))
        if clocks[-1] != sm_max:
            clocks = (*clocks, sm_max)
        return GpuLimits(
            index=index,
            uuid=f"GPU-fake-{self.kind}-{index}",
            power_limit_w=state.power_limit_w,
            power_limit_default_w=default_w,
            power_limit_min_w=low_w,
            power_limit_max_w=high_w,
            sm_clock_max_mhz=sm_max,
            sm_clocks_mhz=clocks,
            clocks_locked=state.locked is not None or state.clocks_locked_before,
        )

    def _record(self, call: str, index: int, **values: Any) -> None:
        entry = {"call": call, "index": index, "denied": self.deny_set, **values}
        with self._lock:
            self.calls.append(entry)
            if self.call_log:
                with open(self.call_log, "a", encoding="utf-8") as handle:
                    handle.write(json.dumps(entry) + "\n")
        if self.deny_set:
            raise GpuError("no-permission", "Insufficient Permissions")

    def set_locked_clocks(self, index: int, min_mhz: int, max_mhz: int) -> None:
        state = self._check(index)
        self._record("set_locked_clocks", index, min_mhz=int(min_mhz), max_mhz=int(max_mhz))
        state.locked = (int(min_mhz), int(max_mhz))

    def reset_locked_clocks(self, index: int) -> None:
        state = self._check(index)
        self._record("reset_locked_clocks", index)
        state.locked = None
        state.clocks_locked_before = False

    def set_power_limit_w(self, index: int, watts: float) -> None:
        state = self._check(index)
        _, _, _, low_w, high_w = _CONTROL[self.kind]
        if not low_w <= watts <= high_w:
            raise GpuError("other", f"power limit {watts} W outside [{low_w}, {high_w}] W")
        self._record("set_power_limit_w", index, watts=float(watts))
        state.power_limit_w = float(watts)

    # -- what a test inspects --

    def state(self, index: int = 0) -> tuple[tuple[int, int] | None, float]:
        """(locked clock range or None, power limit in W) of one GPU now."""
        state = self._check(index)
        return state.locked, state.power_limit_w
