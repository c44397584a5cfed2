"""The address the API serves on, written for the image's healthcheck.

Once the plan is made, the runtime writes ``serve.json`` (host and port, nothing secret) into the
log directory, so ``docker/healthcheck.py`` probes where the plan serves rather than a fixed port.
The file is replaced atomically (:func:`carbonforge_runtime.files.write_atomic`) and is readable by everyone."""

from __future__ import annotations

import json
from pathlib import Path

from carbonforge_runtime import files

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
    files.write_text_atomic(target, json.dumps(record(host, port)) + "\n", mode=0o644)
    return target
