"""``carbonforge-runtime top`` through the real command line, against a real HTTP server (a thread here,
on a real socket) that serves metric pages recorded from a real serve."""

from __future__ import annotations

import http.server
import io
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from carbonforge_runtime.offline.top import draw
from tests.support import free_port

PAGES = Path(__file__).parents[1] / "offline" / "top_pages"


class Pages:
    """Serves ``/metrics`` (runtime-1.prom, then runtime-2.prom for every later scrape), ``/engine``
    (likewise engine-*.prom) and ``/other`` (a page with no carbonforge_ series)."""

    def __init__(self) -> None:
        self.hits: dict[str, int] = {}
        #: After this many scrapes of /metrics, answer 503 (the runtime went away).
        self.down_after: int | None = None
        pages = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                seen = pages.hits.get(self.path, 0)
                pages.hits[self.path] = seen + 1
                which = "1" if seen == 0 else "2"
                names = {"/metrics": f"runtime-{which}.prom", "/engine": f"engine-{which}.prom",
                         "/other": "engine-1.prom"}
                down = pages.down_after is not None and seen >= pages.down_after
                if self.path not in names or down:
                    self.send_error(503 if down else 404)
                    return
                body = (PAGES / names[self.path]).read_bytes()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)


@pytest.fixture
def pages() -> Iterator[Pages]:
    served = Pages()
    yield served
    served.close()


def top(args: list[str], log_dir: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "CF_LOG_DIR": str(log_dir)}
    env.pop("CF_CONTEXT_KEY", None)
    return subprocess.run([sys.executable, "-m", "carbonforge_runtime", "top", *args], env=env,
                          capture_output=True, text=True, timeout=60)


def test_once_prints_one_snapshot_from_two_scrapes(pages: Pages, tmp_path: Path) -> None:
    (tmp_path / "runtime.log").write_text("2026-12-04T03:00:00 carbonforge WARNING the KV cache is small\n")
    done = top(["--once", "--url", pages.url("/metrics"), "--engine-url", pages.url("/engine"),
                "--interval-s", "0.5"], tmp_path)
    assert done.returncode == 0, done.stderr
    assert pages.hits == {"/metrics": 2, "/engine": 2}  # two scrapes, for the rates
    out = done.stdout
    assert "\x1b" not in out  # plain lines: stdout is not a terminal
    assert "cf-tiny:bf16:chat:cpu" in out and "running 0/16" in out
    assert "Latency, since start" in out and "500ms" in out
    assert "03:00:00 WARNING the KV cache is small" in out
    row = next(line for line in out.splitlines() if line.startswith("0 "))
    cells = row.split()
    assert cells[1] == "0/16" and cells[4] == "0.0%"
    assert float(cells[3]) > 0  # scheduled tokens per second, from the two scrapes
    tokens = next(line for line in out.splitlines() if line.startswith("Tokens/s"))
    assert float(tokens.split()[2]) > 0
    assert all(len(line) <= 80 for line in out.splitlines())


def test_without_vllm_metrics_the_kv_column_is_na_and_says_why(pages: Pages, tmp_path: Path) -> None:
    dead = f"http://127.0.0.1:{free_port()}/metrics"
    done = top(["--once", "--url", pages.url("/metrics"), "--engine-url", dead, "--interval-s", "0.2"], tmp_path)
    assert done.returncode == 0, done.stderr
    assert "KV use and preemptions n/a: no answer from" in done.stdout
    row = next(line for line in done.stdout.splitlines() if line.startswith("0 "))
    assert row.split()[4] == "n/a"


@pytest.mark.parametrize(("path", "says"), [
    (None, "error: no answer from http://127.0.0.1:"),
    ("/other", "serves vLLM's own metrics (the API port), not the runtime's metrics"),
    ("/missing", "answered HTTP 404"),
])
def test_a_dead_or_wrong_url_is_one_line_and_a_fix_with_status_5(pages: Pages, tmp_path: Path, path: str | None,
                                                                  says: str) -> None:
    url = pages.url(path) if path else f"http://127.0.0.1:{free_port()}/metrics"
    done = top(["--once", "--url", url], tmp_path)
    assert done.returncode == 5
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 2 and says in lines[0], done.stderr
    assert lines[1].startswith("  fix: start the runtime with --metrics, or pass --url")
    assert "Traceback" not in done.stderr and done.stdout == ""


def test_live_mode_off_a_terminal_prints_plain_snapshots_and_outlives_a_dead_scrape(pages: Pages,
                                                                                     tmp_path: Path) -> None:
    pages.down_after = 2
    out = io.StringIO()
    target = draw.Target(pages.url("/metrics"), None, tmp_path / "runtime.log")
    draw.live(target, 0.2, out, ticks=3)
    snapshots = out.getvalue().split("\n\ncarbonforge top")
    assert len(snapshots) == 3 and pages.hits["/metrics"] == 3
    assert "Latency, since start" in snapshots[0] and "Latency, last 0 s" in snapshots[1]
    assert "finished n/a\n" in snapshots[0]  # one scrape: no rate yet
    finished = next(line for line in snapshots[1].splitlines() if line.startswith("Requests"))
    assert float(finished.split("finished ")[1].removesuffix("/s")) > 0  # six requests between two scrapes
    assert "no answer" not in snapshots[1]
    assert "no answer since" in snapshots[2] and "running 0/16" in snapshots[2]  # the last numbers stay up
