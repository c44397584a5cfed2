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


# A stop that loses nothing exits 0 (a signal while the launch is prepared, before vLLM is ready, or
# a drain that completes). The two stops that cut requests short have codes of their own, which
# ``serve`` exits with (they are not raised).


class DrainOverrun(CarbonForgeError):
    """serve: vLLM did not stop within the drain time and its grace, and was killed (like timeout(1))."""

    exit_code = 124


class StopForced(CarbonForgeError):
    """serve: a second SIGTERM or SIGINT during the drain killed vLLM at once (like a shell's interrupt)."""

    exit_code = 130
