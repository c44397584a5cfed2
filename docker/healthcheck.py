"""Container health: the OpenAI API answers /health. Exit 0 when healthy, 1 otherwise."""

from __future__ import annotations

import os
import sys
import urllib.request


def main() -> int:
    port = os.environ.get("CF_PORT", "8000").strip() or "8000"
    # Never through a proxy: the API is on this host.
    direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with direct.open(f"http://127.0.0.1:{port}/health", timeout=4) as response:
            return 0 if response.status == 200 else 1
    except OSError:
        return 1


if __name__ == "__main__":
    sys.exit(main())
