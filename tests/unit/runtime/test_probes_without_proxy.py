"""The readiness probe and the image's healthcheck reach the local API directly, whatever proxy the
environment names."""

from __future__ import annotations

import http.server
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest

from carbonforge_runtime.runtime.process.supervisor import http_ok
from tests.support import REPO, free_port
from tests.support.engine_double import Health


@pytest.fixture
def api_port() -> Iterator[int]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


@pytest.fixture
def dead_proxy(monkeypatch: pytest.MonkeyPatch) -> str:
    proxy = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    for name in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY"):
        monkeypatch.setenv(name, proxy)
    for name in ("no_proxy", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)
    return proxy


def test_the_readiness_probe_ignores_a_dead_proxy(api_port: int, dead_proxy: str) -> None:
    url = f"http://127.0.0.1:{api_port}/health"
    with pytest.raises(urllib.error.URLError):  # what a proxy-following client built now gets here
        urllib.request.build_opener().open(url, timeout=2)
    assert http_ok(url)


def test_the_image_healthcheck_ignores_a_dead_proxy(api_port: int, dead_proxy: str) -> None:
    env = {"PATH": "/usr/bin:/bin", "CF_LOG_DIR": "/nonexistent", "CF_PORT": str(api_port),
           "http_proxy": dead_proxy, "HTTP_PROXY": dead_proxy}
    done = subprocess.run([sys.executable, str(REPO / "docker" / "healthcheck.py")], env=env, timeout=30)
    assert done.returncode == 0
    env["CF_PORT"] = str(free_port())  # and it still fails when nothing answers
    refused = subprocess.run([sys.executable, str(REPO / "docker" / "healthcheck.py")], env=env, timeout=30)
    assert refused.returncode == 1
