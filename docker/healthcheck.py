"""Container health: the OpenAI API answers /health. Exit 0 when healthy, 1 otherwise.

It probes the address the runtime recorded in ``$CF_LOG_DIR/serve.json`` once the plan was made
(so a port set by ``--port`` in the vLLM arguments or by CF_PORT is followed); without that file it
probes CF_PORT (default 8000) on loopback. A host that binds every address is probed on loopback."""

from __future__ import annotations

import json
import os
import sys
import urllib.request

ANY_ADDRESS = ("0.0.0.0", "::", "")


def target(environ: dict[str, str]) -> tuple[str, str]:
    """(host, port) to probe."""
    log_dir = environ.get("CF_LOG_DIR", "").strip() or "/var/log/carbonforge"
    try:
        with open(os.path.join(log_dir, "serve.json"), encoding="utf-8") as handle:
            served = json.load(handle)
        host, port = str(served["host"]), int(served["port"])
        if 0 < port < 65536:
            return ("127.0.0.1" if host in ANY_ADDRESS else host), str(port)
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return "127.0.0.1", environ.get("CF_PORT", "8000").strip() or "8000"


def main() -> int:
    host, port = target(dict(os.environ))
    netloc = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    # Never through a proxy: the API is on this host.
    direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with direct.open(f"http://{netloc}/health", timeout=4) as response:
            return 0 if response.status == 200 else 1
    except OSError:
        return 1


if __name__ == "__main__":
    sys.exit(main())
