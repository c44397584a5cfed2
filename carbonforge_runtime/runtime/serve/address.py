"""The address the API serves on, written for the image's healthcheck.

Once the plan is made, the runtime writes ``serve.json`` (host and port, nothing secret) into the
log directory, so ``docker/healthcheck.py`` probes where the plan serves rather than a fixed port.
The file is replaced atomically (written beside it, then renamed) and is readable by everyone."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path

#: The file's name inside the log directory; ``docker/healthcheck.py`` reads the same name.
FILE_NAME = "serve.json"
#: Hosts that bind every address: the probe reaches them on loopback.
ANY_ADDRESS = ("0.0.0.0", "::", "")


def probe_host(host: str) -> str:
    """The address a local client uses to reach an API bound to ``host``."""
    return "127.0.0.1" if host in ANY_ADDRESS else host


def record(host: str, port: int) -> dict[str, object]:
    """The file's content: where the API binds and where a local probe reaches it."""
    return {"host": host, "port": int(port), "probe_host": probe_host(host)}


def write(log_dir: Path, host: str, port: int) -> Path:
    """Replace ``log_dir/serve.json`` with ``host`` and ``port`` (mode 0644). Raises OSError."""
    target = log_dir / FILE_NAME
    fd, temp = tempfile.mkstemp(prefix=".serve-", suffix=".json", dir=log_dir)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            os.fchmod(handle.fileno(), 0o644)
            json.dump(record(host, port), handle)
            handle.write("\n")
        os.replace(temp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise
    return target
