"""Context keys: ``<model>:<quant>:<workload>:<hardware>``."""

from __future__ import annotations

import re
from dataclasses import dataclass

from carbonforge_runtime.errors import ContextKeyError

WORKLOADS = ("chat", "coding", "agentic")

#: ``[<hosts>x]<gpu>[-<memory GB>]x<count>``: a leading host count (a GPU name never starts with a digit,
#: so ``2xrtx4090x1`` reads one way only).
_HARDWARE_RE = re.compile(
    r"^(?:(?P<hosts>\d+)x)?(?P<family>[a-z][a-z0-9]*?)(?:-(?P<memory>\d+))?x(?P<count>\d+)$"
)
_SEGMENT_RE = re.compile(r"^[a-z0-9][a-z0-9._-]*$")


@dataclass(frozen=True)
class HardwareSpec:
    """The GPUs a recipe is tuned for. ``family == "cpu"`` means the CPU build of vLLM.

    ``count`` is the number of GPUs on each host and ``hosts`` the number of hosts the recipe spans
    (``2xh100x8``: two hosts of eight H100 each; a single-host segment has no leading host count)."""

    family: str
    memory_gb: int | None
    count: int
    hosts: int = 1

    @property
    def is_cpu(self) -> bool:
        return self.family == "cpu"

    def __str__(self) -> str:
        if self.is_cpu:
            return "cpu"
        memory = f"-{self.memory_gb}" if self.memory_gb else ""
        hosts = f"{self.hosts}x" if self.hosts > 1 else ""
        return f"{hosts}{self.family}{memory}x{self.count}"

    @property
    def multi_host(self) -> bool:
        return self.hosts > 1


@dataclass(frozen=True)
class ContextKey:
    model: str
    quant: str
    workload: str
    hardware: HardwareSpec

    def __str__(self) -> str:
        return f"{self.model}:{self.quant}:{self.workload}:{self.hardware}"


def parse_hardware(text: str) -> HardwareSpec:
    segment = text.strip().lower()
    if segment == "cpu":
        return HardwareSpec("cpu", None, 1)
    match = _HARDWARE_RE.match(segment)
    if not match:
        raise ContextKeyError(
            f"hardware segment {text!r} is not [<hosts>x]<gpu>[-<memory GB>]x<count>",
            "write it like a100-80x1, l4x1, h100x8, or 2xh100x8 for two hosts of eight (or cpu for the CPU "
            "validation recipes)",
        )
    count = int(match["count"])
    if count < 1:
        raise ContextKeyError(f"hardware segment {text!r} declares {count} GPUs", "declare at least one GPU")
    hosts = int(match["hosts"]) if match["hosts"] else 1
    if hosts < 1:
        raise ContextKeyError(f"hardware segment {text!r} declares {hosts} hosts", "declare at least one host")
    memory = int(match["memory"]) if match["memory"] else None
    return HardwareSpec(match["family"], memory, count, hosts)


def parse_context_key(text: str) -> ContextKey:
    """Parse a key; every problem is a one-line :class:`ContextKeyError` naming the fix."""
    raw = text.strip()
    parts = raw.split(":")
    if len(parts) != 4:
        raise ContextKeyError(
            f"context key {text!r} has {len(parts)} segment(s), expected 4",
            "use <model>:<quant>:<workload>:<hardware>, e.g. qwen3-32b:fp8:chat:a100-80x1 "
            "(`carbonforge-runtime recipes list` shows every key)",
        )
    model, quant, workload, hardware = (part.strip().lower() for part in parts)
    for name, value in (("model", model), ("quant", quant)):
        if not value or not _SEGMENT_RE.match(value):
            raise ContextKeyError(
                f"the {name} segment of {text!r} is empty or has characters other than a-z 0-9 . _ -",
                "use <model>:<quant>:<workload>:<hardware>, e.g. qwen3-32b:fp8:chat:a100-80x1",
            )
    if workload not in WORKLOADS:
        raise ContextKeyError(
            f"unknown workload {workload!r} in {text!r}",
            f"the workload segment is one of {', '.join(WORKLOADS)}",
        )
    return ContextKey(model, quant, workload, parse_hardware(hardware))
