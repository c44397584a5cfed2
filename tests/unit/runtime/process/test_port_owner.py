"""Ready means ours: the socket listening on the API port must belong to the engine's process group."""

from __future__ import annotations

import http.server
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from carbonforge_runtime.runtime.process import supervisor
from carbonforge_runtime.runtime.process.port_owner import describe_process, foreign_listener_problem, listeners
from tests.support import free_port, wait_until

LOG = logging.getLogger("test-port-owner")
#: Listens on the port given as argv[1] with SO_REUSEPORT, in a session of its own, until killed.
REUSE_LISTENER = """
import socket, sys, time
sock = socket.socket()
sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
sock.bind(("127.0.0.1", int(sys.argv[1])))
sock.listen()
print("listening", flush=True)
time.sleep(600)
"""


@pytest.fixture
def listening() -> Iterator[socket.socket]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    yield sock
    sock.close()


def test_a_listener_of_the_engine_group_is_ours(listening: socket.socket) -> None:
    port = listening.getsockname()[1]
    assert [listener.address for listener in listeners(port)] == ["127.0.0.1"]
    assert foreign_listener_problem(port, "127.0.0.1", os.getpgrp()) is None


def test_a_listener_of_another_process_is_named(listening: socket.socket) -> None:
    port = listening.getsockname()[1]
    problem = foreign_listener_problem(port, "127.0.0.1", engine_pgid=1)
    assert problem is not None
    assert f"port {port} is served by another process, not by this runtime's vLLM: pid {os.getpid()}" in problem


def test_nothing_listening_is_not_taken_for_ready() -> None:
    problem = foreign_listener_problem(free_port(), "127.0.0.1", os.getpgrp())
    assert problem is not None and "no socket listening" in problem


def test_a_port_shared_through_so_reuseport_is_reported() -> None:
    port = free_port()
    child = subprocess.Popen([sys.executable, "-c", REUSE_LISTENER, str(port)], stdout=subprocess.PIPE,
                             start_new_session=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == b"listening"
        mine = socket.socket()
        mine.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        mine.bind(("127.0.0.1", port))
        mine.listen()
        try:
            # The child plays the engine: its group holds one listener, this test process the other.
            problem = foreign_listener_problem(port, "127.0.0.1", engine_pgid=child.pid)
        finally:
            mine.close()
        assert problem is not None
        assert f"vLLM shares port {port} with another process (pid {os.getpid()}" in problem
        assert "SO_REUSEPORT" in problem
    finally:
        os.killpg(child.pid, signal.SIGKILL)
        child.wait(10)


class _Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.mark.timeout(60)
def test_supervise_does_not_declare_ready_on_a_foreign_health_answer(tmp_path: Path) -> None:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    port = server.server_address[1]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    engine = supervisor.EngineProcess([sys.executable, "-c", "import time; time.sleep(600)"], dict(os.environ),
                                      tmp_path / "vllm.log")
    ready: list[bool] = []
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    keep = Keep()
    LOG.addHandler(keep)
    try:
        report = supervisor.supervise(engine, f"http://127.0.0.1:{port}/health", 60, 30, LOG,
                                      lambda: ready.append(True), supervisor.StopFlag(), api_port=port)
    finally:
        LOG.removeHandler(keep)
        server.shutdown()
        server.server_close()
    assert ready == []
    assert report.outcome == "not-ours" and report.exit_code == 1
    assert any(f"port {port} is served by another process" in line and f"pid {os.getpid()}" in line
               for line in records), records
    assert engine.pid is not None
    wait_until(lambda: not engine.group_alive(), 5, every_s=0.05)
    assert not engine.group_alive()


def test_a_long_command_line_keeps_its_program_and_its_script(tmp_path: Path) -> None:
    """A deep virtual environment and a deep script path: the script's name must still show."""
    (tmp_path / "4242").mkdir()
    argv = ["/tmp/" + "d" * 90 + "/.venv/bin/python", "/tmp/pytest-of-root/" + "p" * 90 + "/foreign-health-server.py",
            "57421"]
    (tmp_path / "4242" / "cmdline").write_bytes(b"\0".join(a.encode() for a in argv) + b"\0")
    shown = describe_process(4242, proc=tmp_path)
    assert shown.startswith("pid 4242 (/tmp/ddd") and shown.endswith("foreign-health-server.py 57421)")
    assert len(shown) < 200
