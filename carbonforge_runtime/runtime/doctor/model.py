"""The doctor's vocabulary: a check result, the sections, and the verdict over a list of results."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

OK, WARN, FAIL = "OK", "WARN", "FAIL"
STATUSES = (OK, WARN, FAIL)

HOST = "Host"
GPU = "GPU / NVML"
RECIPE = "Recipe"
LICENSE = "License"
TRACING = "Tracing"
STORAGE = "Storage"
ENGINE = "Engine"
GROUP = "Group"
#: Report order.
SECTIONS = (HOST, GPU, RECIPE, LICENSE, TRACING, STORAGE, ENGINE, GROUP)


@dataclass(frozen=True)
class Check:
    """One verdict. ``name`` is a stable identifier for scripts (``gpu.nvml``, ``storage.weights``);
    ``remedy`` names the fix and is set for every WARN and FAIL."""

    section: str
    name: str
    status: str
    detail: str
    remedy: str = ""

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"unknown check status {self.status!r}")
        if self.section not in SECTIONS:
            raise ValueError(f"unknown doctor section {self.section!r}")
        if self.status != OK and not self.remedy:
            raise ValueError(f"check {self.name} is {self.status} without a remedy")

    def as_dict(self) -> dict[str, str]:
        return {"section": self.section, "name": self.name, "status": self.status, "detail": self.detail,
                "remedy": self.remedy}


def verdict(checks: Iterable[Check]) -> str:
    statuses = {c.status for c in checks}
    return FAIL if FAIL in statuses else WARN if WARN in statuses else OK


def exit_code(checks: Iterable[Check]) -> int:
    """0 for OK and WARN, 1 for FAIL."""
    return 1 if verdict(checks) == FAIL else 0


def in_report_order(checks: Iterable[Check]) -> list[Check]:
    """Sections in :data:`SECTIONS` order; checks keep their order within a section."""
    rank = {name: i for i, name in enumerate(SECTIONS)}
    return sorted(checks, key=lambda c: rank[c.section])
