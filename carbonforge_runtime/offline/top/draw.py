"""The one place ``top`` draws: rich's live display on a terminal, plain lines anywhere else.

Each tick scrapes the runtime's page (and vLLM's), keeps the last minute of scrapes, builds the view
(:mod:`carbonforge_runtime.offline.top.view`) and shows its lines. Once the first scrape succeeded, a
failed one does not end the view: the last numbers stay up under a line that says since when the
runtime has not answered.
"""

from __future__ import annotations

import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from carbonforge_runtime.offline.top import fetch
from carbonforge_runtime.offline.top.view import (
    HEIGHT,
    WIDTH,
    Line,
    Scrape,
    build_view,
    keep_window,
    last_finite_bound,
    layout,
)

_STYLES = {"title": "bold reverse", "head": "bold", "warn": "yellow", "note": "dim", "": ""}


@dataclass(frozen=True)
class Target:
    """Where ``top`` reads: the runtime's metrics, vLLM's (None: not read) and runtime.log."""

    url: str
    engine_url: str | None
    log_file: Path


def read(target: Target) -> tuple[Scrape, str]:
    """One scrape of both pages, and a note when vLLM's did not answer. Raises TopError."""
    runtime = fetch.scrape_runtime(target.url)
    engine, note = fetch.scrape_engine(target.engine_url)
    return Scrape(time.monotonic(), runtime, engine), note


def screen(target: Target, scrapes: list[Scrape], windowed: bool, notes: list[str],
           width: int = WIDTH, height: int = HEIGHT) -> list[Line]:
    """The lines for the latest of ``scrapes``."""
    source = target.url + (f"  +  {target.engine_url}" if target.engine_url else "")
    view = build_view(scrapes, windowed=windowed, warnings=fetch.recent_warnings(target.log_file),
                      notes=[note for note in notes if note])
    return layout(view, source, time.strftime("%H:%M:%S"), width, height, last_finite_bound(scrapes[-1]))


def plain(lines: list[Line]) -> str:
    """The lines as plain text, trailing spaces removed."""
    return "\n".join(text.rstrip() for text, _ in lines)


def rich_text(lines: list[Line]) -> object:
    """The lines as one rich Text, styled, never wrapped."""
    from rich.text import Text

    text = Text(no_wrap=True, overflow="crop")
    for index, (line, style) in enumerate(lines):
        if index:
            text.append("\n")
        text.append(line, style=_STYLES.get(style, ""))
    return text


def once(target: Target, interval_s: float, out: TextIO) -> None:
    """Two scrapes ``interval_s`` apart (for the rates), one snapshot printed as plain lines; the latency
    percentiles cover every request since the runtime started. Raises TopError."""
    first, _ = read(target)
    time.sleep(interval_s)
    second, note = read(target)
    print(plain(screen(target, [first, second], windowed=False, notes=[note], height=10_000)), file=out)


def live(target: Target, interval_s: float, out: TextIO, ticks: int | None = None) -> None:
    """Refresh every ``interval_s`` until interrupted (or ``ticks`` refreshes): rich's live display on a
    terminal, a snapshot of plain lines after a blank line otherwise. Raises TopError when the first
    scrape fails."""
    first, note = read(target)
    scrapes = [first]
    notes = [note]
    down_since: str | None = None
    tty = out.isatty()

    def lines() -> list[Line]:
        width, height = shutil.get_terminal_size((WIDTH, HEIGHT)) if tty else (WIDTH, 10_000)
        down = [f"no answer since {down_since}: the numbers above are from then"] if down_since else []
        return screen(target, scrapes, True, notes + down, width, height)

    count = 0
    if not tty:
        print(plain(lines()), file=out, flush=True)
        while ticks is None or (count := count + 1) < ticks:
            time.sleep(interval_s)
            down_since = _tick(target, scrapes, notes, down_since)
            print("\n" + plain(lines()), file=out, flush=True)
        return

    from rich.console import Console
    from rich.live import Live

    console = Console(file=out)
    with Live(rich_text(lines()), console=console, screen=True, auto_refresh=False) as display:  # type: ignore[arg-type]
        while ticks is None or (count := count + 1) < ticks:
            time.sleep(interval_s)
            down_since = _tick(target, scrapes, notes, down_since)
            display.update(rich_text(lines()), refresh=True)  # type: ignore[arg-type]


def _tick(target: Target, scrapes: list[Scrape], notes: list[str], down_since: str | None) -> str | None:
    """Scrape once more into ``scrapes`` (kept to the window) and ``notes``; the new down-since."""
    try:
        scrape, note = read(target)
    except fetch.TopError:
        return down_since or time.strftime("%H:%M:%S")
    scrapes.append(scrape)
    scrapes[:] = keep_window(scrapes)
    notes[:] = [note]
    return None


def main(target: Target, interval_s: float, run_once: bool, out: TextIO | None = None) -> int:
    """Run top; Ctrl-C ends it quietly (status 0)."""
    stream = out if out is not None else sys.stdout
    try:
        if run_once:
            once(target, interval_s, stream)
        else:
            live(target, interval_s, stream)
    except KeyboardInterrupt:
        pass
    return 0
