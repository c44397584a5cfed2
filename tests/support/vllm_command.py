"""Reading a planned vLLM command in tests, through the runtime's own argument reader."""

from __future__ import annotations

from collections.abc import Sequence

from carbonforge_runtime.runtime.planning.command import engine_args
from carbonforge_runtime.runtime.vllm_cli.args import normalise, read


def flags(argv: Sequence[str]) -> dict[str, str | None]:
    """``--flag`` (as written, in vLLM's spelling) -> the value vLLM keeps (the last; None for a
    switch), for a whole launch command or its vLLM arguments alone."""
    found: dict[str, str | None] = {}
    for occurrence in read(engine_args(argv)).occurrences:
        if occurrence.field is None:
            name = normalise(occurrence.written).split("=", 1)[0]
            found[name] = occurrence.values[0] if occurrence.values else None
    return found
