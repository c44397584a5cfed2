"""The doctor's two report formats: text for people, one JSON document for scripts."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from carbonforge_runtime import __version__
from carbonforge_runtime.runtime.doctor.model import OK, Check, exit_code, in_report_order, verdict

#: Status column: the status padded to six characters ("OK    ", "WARN  ", "FAIL  ").
STATUS_WIDTH = 6
INDENT = "  "
REMEDY_PREFIX = " " * (len(INDENT) + STATUS_WIDTH) + "fix: "


def check_line(check: Check) -> str:
    """``OK    1 GPU(s), driver 595.84`` (without the indent)."""
    return f"{check.status.ljust(STATUS_WIDTH)}{check.detail}"


def check_lines(check: Check) -> list[str]:
    """The check's line and, for WARN and FAIL, its remedy on the next line (both indented)."""
    lines = [INDENT + check_line(check)]
    if check.status != OK and check.remedy:
        lines.append(REMEDY_PREFIX + check.remedy)
    return lines


def render_text(checks: Sequence[Check]) -> str:
    """Sections with one line per check, a blank line between sections, and ``doctor: <verdict>`` last."""
    lines: list[str] = []
    section = None
    for check in in_report_order(checks):
        if check.section != section:
            if section is not None:
                lines.append("")
            section = check.section
            lines.append(f"{section}:")
        lines.extend(check_lines(check))
    if lines:
        lines.append("")
    lines.append(f"doctor: {verdict(checks)}")
    return "\n".join(lines)


def report_document(checks: Sequence[Check], context_key: str | None = None) -> dict[str, Any]:
    ordered = in_report_order(checks)
    return {
        "verdict": verdict(ordered),
        "exit_code": exit_code(ordered),
        "runtime_version": __version__,
        "context_key": context_key,
        "checks": [check.as_dict() for check in ordered],
    }


def render_json(checks: Sequence[Check], context_key: str | None = None) -> str:
    return json.dumps(report_document(checks, context_key), indent=2)
