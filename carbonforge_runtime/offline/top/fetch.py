"""The outside world of ``top``: the HTTP scrapes (every one with a deadline) and runtime.log's warnings."""

from __future__ import annotations

import os
import re
from pathlib import Path

from carbonforge_runtime import files
from carbonforge_runtime.errors import CarbonForgeError
from carbonforge_runtime.offline.top.page import Samples, parse_page

#: Each scrape's deadline, connect and read together.
SCRAPE_TIMEOUT_S = 2.0
#: How much of runtime.log's end is read for its warnings.
LOG_TAIL_BYTES = 64 * 1024
_WARNING = re.compile(r"^(\S+) carbonforge (WARNING|ERROR|CRITICAL) (.*)$")
_RUNTIME_PREFIX = "carbonforge_"


class TopError(CarbonForgeError):
    """top: the metrics URL does not answer, or what answers is not a runtime's metrics page."""

    exit_code = 5


def scrape(url: str, timeout_s: float = SCRAPE_TIMEOUT_S) -> Samples:
    """Every sample ``url`` serves. Raises OSError (no answer, an HTTP error) or ValueError (not
    Prometheus text), each with one line that says what happened."""
    import httpx

    try:
        response = httpx.get(url, timeout=timeout_s, follow_redirects=True)
    except httpx.HTTPError as exc:
        raise OSError(f"no answer from {url} ({type(exc).__name__}: {exc})") from None
    if response.status_code != 200:
        raise OSError(f"{url} answered HTTP {response.status_code}")
    try:
        return parse_page(response.text)
    except (ValueError, IndexError, TypeError) as exc:
        raise ValueError(f"{url} is not a Prometheus page ({exc})") from None


def scrape_runtime(url: str, timeout_s: float = SCRAPE_TIMEOUT_S) -> Samples:
    """The runtime's own metrics page at ``url``; a :class:`TopError` naming the fix when it cannot be read."""
    fix = ("start the runtime with --metrics, or pass --url http://HOST:PORT/metrics of its metrics endpoint "
           "(CF_METRICS_HOST, CF_METRICS_PORT: 9105 by default)")
    try:
        samples = scrape(url, timeout_s)
    except (OSError, ValueError) as exc:
        raise TopError(str(exc), fix) from None
    if not any(name.startswith(_RUNTIME_PREFIX) for name in samples):
        vllm = any(name.startswith("vllm:") for name in samples)
        what = "vLLM's own metrics (the API port)" if vllm else "no carbonforge_ series"
        raise TopError(f"{url} serves {what}, not the runtime's metrics", fix)
    return samples


def scrape_engine(url: str | None, timeout_s: float = SCRAPE_TIMEOUT_S) -> tuple[Samples | None, str]:
    """vLLM's own page (KV use, preemptions), or None and why not: top shows those as n/a then."""
    if not url:
        return None, ""
    try:
        samples = scrape(url, timeout_s)
    except (OSError, ValueError) as exc:
        return None, f"KV use and preemptions n/a: {exc}"
    if not any(name.startswith("vllm:") for name in samples):
        return None, f"KV use and preemptions n/a: {url} has no vllm: series"
    return samples, ""


def recent_warnings(log_file: Path, limit: int = 3) -> list[str]:
    """The last ``limit`` WARNING or ERROR lines of runtime.log, as ``HH:MM:SS LEVEL message``; none when
    the file cannot be read (a FIFO or a device is refused at once, without blocking)."""
    try:
        with files.open_regular(log_file) as handle:
            size = os.fstat(handle.fileno()).st_size
            handle.seek(max(size - LOG_TAIL_BYTES, 0))
            text = handle.read(LOG_TAIL_BYTES).decode("utf-8", "replace")
    except (OSError, CarbonForgeError):
        return []
    found = []
    for line in text.splitlines():
        match = _WARNING.match(line)
        if match:
            stamp, level, message = match.groups()
            clock = stamp.partition("T")[2] or stamp
            found.append(f"{clock} {level} {message}")
    return found[-limit:] if limit > 0 else []
