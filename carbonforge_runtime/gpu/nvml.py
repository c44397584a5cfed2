"""The one module that imports ``pynvml``. Every NVML error is translated here."""

from __future__ import annotations

from typing import Any

from carbonforge_runtime.gpu.types import GpuDevice, GpuError, GpuId, GpuLimits, GpuProcess, GpuReading, GpuSnapshot

NO_DRIVER_REASON = "NVML could not be loaded: no NVIDIA driver is visible to this process"


def _translate(exc: Exception) -> GpuError:
    import pynvml

    code = getattr(exc, "value", None)
    mapping = {
        getattr(pynvml, "NVML_ERROR_LIBRARY_NOT_FOUND", -1): "no-driver",
        getattr(pynvml, "NVML_ERROR_DRIVER_NOT_LOADED", -1): "no-driver",
        getattr(pynvml, "NVML_ERROR_NO_PERMISSION", -1): "no-permission",
        getattr(pynvml, "NVML_ERROR_NOT_SUPPORTED", -1): "not-supported",
        getattr(pynvml, "NVML_ERROR_GPU_IS_LOST", -1): "gpu-lost",
    }
    return GpuError(mapping.get(code, "other"), str(exc))


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _call(fn: Any, *args: Any) -> Any:
    """Call an NVML function; its errors come out translated."""
    import pynvml

    try:
        return fn(*args)
    except pynvml.NVMLError as exc:
        raise _translate(exc) from None


def _optional(fn: Any, *args: Any) -> Any:
    """Like :func:`_call`, but a failure (not supported, no permission...) reads as None."""
    try:
        return _call(fn, *args)
    except GpuError:
        return None


class NvmlBackend:
    """Reads GPU facts through NVML. Construction is free; the driver is touched per call."""

    _call = staticmethod(_call)
    _optional = staticmethod(_optional)

    def snapshot(self) -> GpuSnapshot:
        try:
            import pynvml
        except ImportError:
            return GpuSnapshot(False, "the nvidia-ml-py package is not installed", failure="no-package")
        try:
            self._call(pynvml.nvmlInit)
        except GpuError as exc:
            reason = NO_DRIVER_REASON if exc.kind == "no-driver" else f"NVML failed to initialise: {exc}"
            return GpuSnapshot(False, reason, failure=exc.kind)
        try:
            driver = _text(self._call(pynvml.nvmlSystemGetDriverVersion))
            cuda = self._optional(pynvml.nvmlSystemGetCudaDriverVersion)
            cuda_text = f"{cuda // 1000}.{(cuda % 1000) // 10}" if isinstance(cuda, int) else ""
            devices = []
            for index in range(self._call(pynvml.nvmlDeviceGetCount)):
                handle = self._call(pynvml.nvmlDeviceGetHandleByIndex, index)
                memory = self._call(pynvml.nvmlDeviceGetMemoryInfo, handle)
                capability = self._optional(pynvml.nvmlDeviceGetCudaComputeCapability, handle)
                processes, processes_visible = self._processes(handle)
                devices.append(
                    GpuDevice(
                        index=index,
                        name=_text(self._call(pynvml.nvmlDeviceGetName, handle)),
                        uuid=_text(self._optional(pynvml.nvmlDeviceGetUUID, handle) or ""),
                        memory_total_mib=int(memory.total) // (1024 * 1024),
                        memory_free_mib=int(memory.free) // (1024 * 1024),
                        compute_capability=tuple(capability) if capability else None,  # type: ignore[arg-type]
                        processes=processes,
                        processes_visible=processes_visible,
                    )
                )
            return GpuSnapshot(True, "", driver, cuda_text, tuple(devices))
        except GpuError as exc:
            return GpuSnapshot(False, f"NVML query failed ({exc.kind}): {exc}", failure=exc.kind)
        finally:
            self._optional(pynvml.nvmlShutdown)

    def _processes(self, handle: Any) -> tuple[tuple[GpuProcess, ...], bool]:
        """The processes holding memory on the GPU, and whether NVML let us list them."""
        import pynvml

        found: dict[int, GpuProcess] = {}
        visible = True
        for fn_name in ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses"):
            fn = getattr(pynvml, fn_name, None)
            if fn is None:
                continue
            try:
                entries = self._call(fn, handle)
            except GpuError as exc:
                if exc.kind == "no-permission":
                    visible = False
                entries = None
            for entry in entries or []:
                pid = int(entry.pid)
                used = getattr(entry, "usedGpuMemory", None)
                used_mib = int(used) // (1024 * 1024) if isinstance(used, int) else None
                found[pid] = GpuProcess(pid, _process_name(pid), used_mib)
        return tuple(found.values()), visible


def _process_name(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm", encoding="utf-8") as handle:
            return handle.read().strip()
    except OSError:
        return f"pid {pid} (not visible from this container)"


def _mw_to_w(value: Any) -> float:
    return float(value) / 1000.0


class NvmlSession:
    """Telemetry and control of the GPUs (see :class:`carbonforge_runtime.gpu.select.GpuSession`).

    Reads need no privilege; the three set calls need root or CAP_SYS_ADMIN and raise
    ``GpuError("no-permission")`` otherwise. NVML is thread-safe, so one session may serve the
    metrics poller and the controller at once.
    """

    def __init__(self) -> None:
        self._handles: dict[int, Any] = {}
        self._open = False

    _call = staticmethod(_call)
    _optional = staticmethod(_optional)

    def open(self) -> list[GpuId]:
        try:
            import pynvml
        except ImportError:
            raise GpuError("no-driver", "the nvidia-ml-py package is not installed") from None
        self._call(pynvml.nvmlInit)
        self._open = True
        gpus = []
        try:
            for index in range(self._call(pynvml.nvmlDeviceGetCount)):
                handle = self._call(pynvml.nvmlDeviceGetHandleByIndex, index)
                self._handles[index] = handle
                uuid = _text(self._optional(pynvml.nvmlDeviceGetUUID, handle) or f"index-{index}")
                gpus.append(GpuId(index, uuid, _text(self._call(pynvml.nvmlDeviceGetName, handle))))
        except GpuError:
            self.close()
            raise
        return gpus

    def close(self) -> None:
        if self._open:
            import pynvml

            self._open = False
            self._handles.clear()
            self._optional(pynvml.nvmlShutdown)

    def _handle(self, index: int) -> Any:
        handle = self._handles.get(index)
        if handle is None:
            raise GpuError("other", f"GPU {index} is not open in this NVML session")
        return handle

    def energy_j(self, index: int) -> float:
        import pynvml

        return float(self._call(pynvml.nvmlDeviceGetTotalEnergyConsumption, self._handle(index))) / 1000.0

    def _clocks_locked(self, handle: Any) -> bool | None:
        import pynvml

        fn = getattr(pynvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or getattr(
            pynvml, "nvmlDeviceGetCurrentClocksThrottleReasons", None)
        reasons = self._optional(fn, handle) if fn is not None else None
        if reasons is None:
            return None
        return bool(int(reasons) & 0x2)  # nvmlClocksEventReasonApplicationsClocksSetting

    def read(self, index: int) -> GpuReading:
        import pynvml

        handle = self._handle(index)
        power = self._optional(pynvml.nvmlDeviceGetPowerUsage, handle)
        energy = self._optional(pynvml.nvmlDeviceGetTotalEnergyConsumption, handle)
        memory = self._optional(pynvml.nvmlDeviceGetMemoryInfo, handle)
        limit = self._optional(pynvml.nvmlDeviceGetPowerManagementLimit, handle)
        temperature = self._optional(pynvml.nvmlDeviceGetTemperature, handle, pynvml.NVML_TEMPERATURE_GPU)
        sm = self._optional(pynvml.nvmlDeviceGetClockInfo, handle, pynvml.NVML_CLOCK_SM)
        mem = self._optional(pynvml.nvmlDeviceGetClockInfo, handle, pynvml.NVML_CLOCK_MEM)
        uuid = _text(self._optional(pynvml.nvmlDeviceGetUUID, handle) or f"index-{index}")
        return GpuReading(
            index=index,
            uuid=uuid,
            power_w=_mw_to_w(power) if power is not None else None,
            energy_j=float(energy) / 1000.0 if energy is not None else None,
            sm_clock_mhz=int(sm) if sm is not None else None,
            memory_clock_mhz=int(mem) if mem is not None else None,
            temperature_c=float(temperature) if temperature is not None else None,
            memory_used_bytes=int(memory.used) if memory is not None else None,
            power_limit_w=_mw_to_w(limit) if limit is not None else None,
            clocks_locked=self._clocks_locked(handle),
        )

    def limits(self, index: int) -> GpuLimits:
        import pynvml

        handle = self._handle(index)
        limit = self._call(pynvml.nvmlDeviceGetPowerManagementLimit, handle)
        default = self._optional(pynvml.nvmlDeviceGetPowerManagementDefaultLimit, handle) or limit
        low, high = self._optional(pynvml.nvmlDeviceGetPowerManagementLimitConstraints, handle) or (limit, limit)
        sm_max = int(self._call(pynvml.nvmlDeviceGetMaxClockInfo, handle, pynvml.NVML_CLOCK_SM))
        clocks: tuple[int, ...] = ()
        memory_clocks = self._optional(pynvml.nvmlDeviceGetSupportedMemoryClocks, handle)
        if memory_clocks:
            graphics = self._optional(pynvml.nvmlDeviceGetSupportedGraphicsClocks, handle, max(memory_clocks))
            clocks = tuple(sorted({int(c) for c in graphics or [] if int(c) <= sm_max}))
        uuid = _text(self._optional(pynvml.nvmlDeviceGetUUID, handle) or f"index-{index}")
        return GpuLimits(
            index=index,
            uuid=uuid,
            power_limit_w=_mw_to_w(limit),
            power_limit_default_w=_mw_to_w(default),
            power_limit_min_w=_mw_to_w(low),
            power_limit_max_w=_mw_to_w(high),
            sm_clock_max_mhz=sm_max,
            sm_clocks_mhz=clocks or (sm_max,),
            clocks_locked=bool(self._clocks_locked(handle)),
        )

    def set_locked_clocks(self, index: int, min_mhz: int, max_mhz: int) -> None:
        import pynvml

        self._call(pynvml.nvmlDeviceSetGpuLockedClocks, self._handle(index), int(min_mhz), int(max_mhz))

    def reset_locked_clocks(self, index: int) -> None:
        import pynvml

        self._call(pynvml.nvmlDeviceResetGpuLockedClocks, self._handle(index))

    def set_power_limit_w(self, index: int, watts: float) -> None:
        import pynvml

        self._call(pynvml.nvmlDeviceSetPowerManagementLimit, self._handle(index), round(watts * 1000))
