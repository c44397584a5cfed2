"""How every command line reports an operator's mistake: the message and its fix, no traceback."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import typer

from carbonforge_runtime.errors import CarbonForgeError

T = TypeVar("T")


def run_guarded(fn: Callable[[], T]) -> T:
    """Run ``fn``; a CarbonForgeError becomes its message on stderr and its exit code."""
    try:
        return fn()
    except CarbonForgeError as exc:
        typer.echo(exc.render(), err=True)
        raise typer.Exit(exc.exit_code) from None
