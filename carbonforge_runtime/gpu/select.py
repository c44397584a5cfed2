"""Which GPU implementation this process uses: the driver (NVML) or the scripted fake.

:class:`~carbonforge_runtime.gpu.types.GpuSession` is what the metrics, the energy meter and the controller use. Two
implementations exist: :class:`carbonforge_runtime.gpu.nvml.NvmlSession` (the driver) and
:class:`carbonforge_runtime.gpu.fake.FakeGpuSession` (tests, and ``CF_FAKE_NVML``). Every method
raises only :class:`~carbonforge_runtime.gpu.types.GpuError` (already translated).

Units are in the names: watts, joules, MHz, bytes, degrees Celsius.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from carbonforge_runtime.gpu.types import GpuBackend, GpuError, GpuId, GpuSession


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


def default_backend() -> GpuBackend:
    from carbonforge_runtime.gpu.nvml import NvmlBackend

    return NvmlBackend()
