"""The doctor: host checks that give a verdict and name the fix."""

from __future__ import annotations

from dataclasses import dataclass

from carbonforge_runtime.gpu import GpuBackend

OK, WARN, FAIL = "OK", "WARN", "FAIL"
NVML_REMEDY = (
    "run the container with --gpus all on a host with the NVIDIA driver and the NVIDIA Container Toolkit "
    "configured for Docker (sudo nvidia-ctk runtime configure --runtime=docker, restart Docker); "
    "verify with: docker run --rm --gpus all ubuntu nvidia-smi"
)


@dataclass(frozen=True)
class Check:
    section: str
    name: str
    status: str
    detail: str
    remedy: str = ""


def gpu_checks(gpu: GpuBackend) -> list[Check]:
    snapshot = gpu.snapshot()
    if not snapshot.available:
        return [Check("GPU / NVML", "nvml", FAIL, snapshot.reason, NVML_REMEDY)]
    checks = [Check("GPU / NVML", "nvml", OK, f"{snapshot.count} GPU(s), driver {snapshot.driver_version}")]
    for dev in snapshot.devices:
        cc = f", compute {dev.compute_capability[0]}.{dev.compute_capability[1]}" if dev.compute_capability else ""
        checks.append(Check("GPU / NVML", f"gpu{dev.index}", OK,
                            f"GPU {dev.index}: {dev.name}{cc}, {dev.memory_free_mib} of "
                            f"{dev.memory_total_mib} MiB free"))
    return checks


def verdict(checks: list[Check]) -> str:
    statuses = {c.status for c in checks}
    return FAIL if FAIL in statuses else WARN if WARN in statuses else OK


def render_text(checks: list[Check]) -> str:
    lines: list[str] = []
    section = None
    for check in checks:
        if check.section != section:
            if section is not None:
                lines.append("")
            section = check.section
            lines.append(f"{section}:")
        lines.append(f"  {check.status.ljust(5)} {check.detail}")
        if check.remedy and check.status != OK:
            lines.append(f"        fix: {check.remedy}")
    lines.append("")
    lines.append(f"doctor: {verdict(checks)}")
    return "\n".join(lines)


def run_doctor(gpu: GpuBackend) -> tuple[str, int]:
    checks = gpu_checks(gpu)
    return render_text(checks), 1 if verdict(checks) == FAIL else 0
