"""Which model a vLLM argument list would serve (used by the override mode and its licence gate)."""

from __future__ import annotations

from collections.abc import Sequence

from carbonforge_runtime.errors import LicenseError

CANNOT_GATE = "could not determine which model to gate"


def model_from_args(args: Sequence[str]) -> str:
    """The model named by the first positional argument or by ``--model`` / ``--model=``."""
    candidates: list[str] = []
    if args and not args[0].startswith("-"):
        candidates.append(args[0])
    for i, arg in enumerate(args):
        if arg == "--model" and i + 1 < len(args):
            candidates.append(args[i + 1])
        elif arg.startswith("--model="):
            candidates.append(arg.split("=", 1)[1])
    if not candidates or not candidates[-1].strip():
        raise LicenseError(
            CANNOT_GATE,
            "put the model first after -- (carbonforge-runtime -- MODEL ...) or pass it as --model MODEL",
        )
    return candidates[-1]
