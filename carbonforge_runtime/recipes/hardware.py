"""Does the detected hardware match a key's hardware segment? A pure function."""

from __future__ import annotations

from carbonforge_runtime.gpu.types import GpuSnapshot
from carbonforge_runtime.recipes.keys import HardwareSpec

#: Relative tolerance when comparing declared GB with what NVML reports (80 GB cards report 79.6 GiB).
MEMORY_TOLERANCE = 0.10


def hardware_mismatches(spec: HardwareSpec, snapshot: GpuSnapshot) -> list[str]:
    """Each entry is one human-readable difference; an empty list means the host matches."""
    if spec.is_cpu:
        return []
    if not snapshot.available:
        return [f"the recipe is tuned for {spec} but no GPU can be inspected: {snapshot.reason}"]
    problems = []
    if snapshot.count < spec.count:
        problems.append(f"the recipe needs {spec.count} GPU(s), {snapshot.count} detected")
    elif snapshot.count > spec.count:
        problems.append(f"the recipe is tuned for {spec.count} GPU(s), {snapshot.count} detected (extra ones idle)")
    families = sorted({d.family for d in snapshot.devices})
    if families and families != [spec.family]:
        names = ", ".join(sorted({d.name for d in snapshot.devices}))
        problems.append(f"the recipe is tuned for {spec.family.upper()}, detected {names}")
    if spec.memory_gb:
        for dev in snapshot.devices:
            if abs(dev.memory_total_gib - spec.memory_gb) > spec.memory_gb * MEMORY_TOLERANCE:
                problems.append(
                    f"GPU {dev.index} has {dev.memory_total_gib:.0f} GiB, the recipe is tuned for {spec.memory_gb} GB"
                )
    return problems
