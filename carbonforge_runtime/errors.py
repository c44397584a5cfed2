"""The exception tree. Every error carries what the operator should do about it.

The CLI maps a :class:`CarbonForgeError` to one short message and an exit code; it never
shows a traceback for one of these.
"""

from __future__ import annotations


class CarbonForgeError(Exception):
    """A problem the operator can fix. ``remedy`` says how."""

    exit_code = 1

    def __init__(self, message: str, remedy: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.remedy = remedy

    def render(self) -> str:
        if self.remedy:
            return f"error: {self.message}\n  fix: {self.remedy}"
        return f"error: {self.message}"


class UsageError(CarbonForgeError):
    """Bad command line, context key or variable: exit code 2 like other usage errors."""

    exit_code = 2


class ContextKeyError(UsageError):
    """A context key is malformed, names an unknown workload, or matches no recipe."""


class RecipeError(CarbonForgeError):
    """A recipe file is malformed; the message names the file and the field."""

    exit_code = 2


class OverrideError(UsageError):
    """A CF_* override has an invalid value."""


class HardwareMismatchError(CarbonForgeError):
    """--strict-hardware and the detected GPUs do not match the key's hardware segment."""

    exit_code = 3


class LicenseError(CarbonForgeError):
    """The licence is missing, invalid, or does not entitle what is being served."""

    exit_code = 4


class EngineError(CarbonForgeError):
    """vLLM failed to start or died while serving."""

    exit_code = 1
