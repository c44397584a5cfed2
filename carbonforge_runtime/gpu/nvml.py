"""The one module that imports ``pynvml``. Every NVML error is translated here."""

from __future__ import annotations

from typing import Any

from carbonforge_runtime.gpu import GpuDevice, GpuError, GpuProcess, GpuSnapshot

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


class NvmlBackend:
    """Reads GPU facts through NVML. Construction is free; the driver is touched per call."""

    def _call(self, fn: Any, *args: Any) -> Any:
        import pynvml

        try:
            return fn(*args)
        except pynvml.NVMLError as exc:
            raise _translate(exc) from None

    def _optional(self, fn: Any, *args: Any) -> Any:
        try:
            return self._call(fn, *args)
        except GpuError:
            return None

    def snapshot(self) -> GpuSnapshot:
        try:
            import pynvml
        except ImportError:
            return GpuSnapshot(False, "the nvidia-ml-py package is not installed")
        try:
            self._call(pynvml.nvmlInit)
        except GpuError as exc:
            reason = NO_DRIVER_REASON if exc.kind == "no-driver" else f"NVML failed to initialise: {exc}"
            return GpuSnapshot(False, reason)
        try:
            driver = _text(self._call(pynvml.nvmlSystemGetDriverVersion))
            cuda = self._optional(pynvml.nvmlSystemGetCudaDriverVersion)
            cuda_text = f"{cuda // 1000}.{(cuda % 1000) // 10}" if isinstance(cuda, int) else ""
            devices = []
            for index in range(self._call(pynvml.nvmlDeviceGetCount)):
                handle = self._call(pynvml.nvmlDeviceGetHandleByIndex, index)
                memory = self._call(pynvml.nvmlDeviceGetMemoryInfo, handle)
                capability = self._optional(pynvml.nvmlDeviceGetCudaComputeCapability, handle)
                devices.append(
                    GpuDevice(
                        index=index,
                        name=_text(self._call(pynvml.nvmlDeviceGetName, handle)),
                        uuid=_text(self._optional(pynvml.nvmlDeviceGetUUID, handle) or ""),
                        memory_total_mib=int(memory.total) // (1024 * 1024),
                        memory_free_mib=int(memory.free) // (1024 * 1024),
                        compute_capability=tuple(capability) if capability else None,  # type: ignore[arg-type]
                        processes=self._processes(handle),
                    )
                )
            return GpuSnapshot(True, "", driver, cuda_text, tuple(devices))
        except GpuError as exc:
            return GpuSnapshot(False, f"NVML query failed ({exc.kind}): {exc}")
        finally:
            self._optional(pynvml.nvmlShutdown)

    def _processes(self, handle: Any) -> tuple[GpuProcess, ...]:
        import pynvml

        found: dict[int, GpuProcess] = {}
        for fn_name in ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses"):
            fn = getattr(pynvml, fn_name, None)
            entries = self._optional(fn, handle) if fn else None
            for entry in entries or []:
                pid = int(entry.pid)
                used = getattr(entry, "usedGpuMemory", None)
                used_mib = int(used) // (1024 * 1024) if isinstance(used, int) else None
                found[pid] = GpuProcess(pid, _process_name(pid), used_mib)
        return tuple(found.values())


def _process_name(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm", encoding="utf-8") as handle:
            return handle.read().strip()
    except OSError:
        return f"pid {pid} (not visible from this container)"
