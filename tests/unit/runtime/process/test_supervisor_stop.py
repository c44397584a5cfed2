"""Stopping does what the operator asked: nothing starts after a signal during preparation, a stop
before ready is immediate, and a second signal during a drain stops at once."""

from __future__ import annotations

import logging
import os
import re
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

from carbonforge_runtime.errors import DrainOverrun, StopForced
from carbonforge_runtime.runtime.process import drain, supervisor
from tests.support import REPO, alive, free_port, group_members, wait_until

LOG = logging.getLogger("test-supervisor")
#: An engine that ignores SIGTERM (as vLLM does while it initialises) and never becomes ready.
DEAF = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"


def group_gone(pgid: int, within_s: float = 5.0) -> bool:
    """No process of the group runs any more. A zombie does not count: it has exited and only waits
    for its parent to collect it, which for an orphan is the machine's init, on its own schedule."""
    return wait_until(lambda: not group_members(pgid), within_s, every_s=0.05)


def signal_later(stop: supervisor.StopFlag, after_s: float, times: int = 1, between_s: float = 0.0) -> None:
    def fire() -> None:
        time.sleep(after_s)
        for _ in range(times):
            stop(signal.SIGTERM, None)
            time.sleep(between_s)

    threading.Thread(target=fire, daemon=True).start()


def test_a_signal_during_preparation_starts_nothing(tmp_path: Path) -> None:
    stop = supervisor.StopFlag()
    stop(signal.SIGTERM, None)
    engine = supervisor.EngineProcess([sys.executable, "-c", DEAF], dict(os.environ), tmp_path / "vllm.log")
    report = supervisor.supervise(engine, "http://127.0.0.1:1/health", 60, 30, LOG, lambda: None, stop)
    assert report.outcome == "stopped" and report.exit_code == 0
    assert engine.pid is None and not (tmp_path / "vllm.log").exists()


@pytest.mark.timeout(60)
def test_a_stop_before_ready_is_immediate_even_when_the_engine_ignores_sigterm(tmp_path: Path) -> None:
    stop = supervisor.StopFlag()
    engine = supervisor.EngineProcess([sys.executable, "-c", DEAF], dict(os.environ), tmp_path / "vllm.log")
    signal_later(stop, 1.0)
    started = time.monotonic()
    report = supervisor.supervise(engine, f"http://127.0.0.1:{free_port()}/health", 600, 30, LOG,
                                  lambda: None, stop)
    took = time.monotonic() - started
    assert report.outcome == "stopped" and report.exit_code == 0
    assert took < 1.0 + 5.0, took  # not the 30 s drain
    assert engine.pid is not None and group_gone(engine.pid)


def deaf_engine_double(port: int, log: Path) -> supervisor.EngineProcess:
    """The engine double, answering /health, but ignoring SIGTERM: only SIGKILL ends its drain."""
    code = (f"import runpy, signal, sys; sys.argv = ['engine_double', '--port', '{port}']; "
            "orig = signal.signal; signal.signal = lambda s, h: orig(s, signal.SIG_IGN) if s == signal.SIGTERM "
            "else orig(s, h); "
            f"runpy.run_path({str(REPO / 'tests' / 'support' / 'engine_double.py')!r}, run_name='__main__')")
    return supervisor.EngineProcess([sys.executable, "-c", code], dict(os.environ), log)


@pytest.mark.timeout(60)
def test_a_second_signal_during_the_drain_stops_at_once(tmp_path: Path) -> None:
    port = free_port()
    engine = deaf_engine_double(port, tmp_path / "vllm.log")
    stop = supervisor.StopFlag()
    ready = threading.Event()

    def on_ready() -> None:
        ready.set()
        signal_later(stop, 0.5, times=2, between_s=1.0)  # SIGTERM, then a second one a second later

    started = time.monotonic()
    report = supervisor.supervise(engine, f"http://127.0.0.1:{port}/health", 60, 30, LOG, on_ready, stop)
    took = time.monotonic() - started
    assert ready.is_set()
    assert report.outcome == "killed" and report.exit_code == StopForced.exit_code == 130
    assert took < 15.0, took  # far less than the 30 s drain plus grace
    assert engine.pid is not None and group_gone(engine.pid)


@pytest.mark.timeout(90)
def test_a_drain_overrun_ends_within_the_announced_bound(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """An engine that ignores SIGTERM, with a child that does too: the stop is over, the whole group
    gone, by the bound the runtime announces, and the exit code says the drain was cut short."""
    # A 1 s drain and a 4 s grace instead of 15: the SIGKILL still comes well after the drain (3 s
    # after the signal), so a grace skipped would fail the lower bound below, in a third of the time.
    monkeypatch.setattr(drain, "SHUTDOWN_GRACE_S", 4.0)
    port = free_port()
    engine = deaf_engine_double(port, tmp_path / "vllm.log")
    report, took = stop_after_ready(tmp_path, engine, port, caplog, delay_s=0.2, drain_s=1)
    announced = re.search(r"stopped within ([0-9.]+) s at the latest", caplog.text)
    assert announced, caplog.text
    bound = float(announced[1])
    assert bound == drain.stop_bound_s(1) == 1 + drain.SHUTDOWN_GRACE_S
    # the supervision loop sees the signal within one poll; from then on every wait is bounded
    assert took <= bound + supervisor.POLL_INTERVAL_S + 0.5, (took, bound)
    assert took >= bound - drain.KILL_WAIT_S - 1.0, (took, bound)  # the grace was given, not skipped
    assert report.outcome == "killed" and report.exit_code == DrainOverrun.exit_code == 124
    assert "vLLM did not stop within the drain time: killed" in caplog.text
    assert engine.pid is not None and group_gone(engine.pid, within_s=0.5)
    assert drain.stop_timeout_s(1) >= bound + drain.RUNTIME_EXIT_MARGIN_S


@pytest.mark.timeout(60)
def test_every_wait_of_a_stop_ends_by_its_deadline(tmp_path: Path) -> None:
    """EngineProcess.stop with a short deadline: SIGTERM ignored by the leader and its child, SIGKILL
    KILL_WAIT_S before the deadline, and the group gone by it."""
    child = ("import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
             f"subprocess.Popen([sys.executable, '-c', {DEAF!r}]); time.sleep(600)")
    engine = supervisor.EngineProcess([sys.executable, "-c", child], dict(os.environ), tmp_path / "vllm.log")
    engine.start()
    try:
        time.sleep(1.0)  # both processes are up and ignore SIGTERM
        started = time.monotonic()
        code, killed = engine.stop(started + 3.0)
        took = time.monotonic() - started
        assert killed and code == -signal.SIGKILL
        assert 3.0 - drain.KILL_WAIT_S - 0.2 <= took <= 3.0 + 0.2, took
        assert engine.pid is not None and group_gone(engine.pid, within_s=0.5)
    finally:
        engine.signal_group(signal.SIGKILL)
        engine.release_watchdog()


#: A stand-in runtime: starts an engine that ignores SIGTERM and has a child of its own, reports the
#: engine's process group and its watchdog, and waits to be killed.
RUNTIME = f"""
import json, os, sys, time
from pathlib import Path
sys.path.insert(0, {str(REPO)!r})
from carbonforge_runtime.runtime.process.supervisor import EngineProcess
child = "import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); " \\
        "subprocess.Popen([sys.executable, '-c', {DEAF!r}]); time.sleep(600)"
engine = EngineProcess([sys.executable, "-c", child], dict(os.environ), Path(sys.argv[1]))
engine.start()
print(json.dumps([engine.pid, getattr(engine, "watchdog_pid", None)]), flush=True)
time.sleep(600)
"""


@pytest.mark.timeout(60)
def test_sigkill_of_the_runtime_takes_the_whole_engine_group_with_it(tmp_path: Path) -> None:
    import json
    import subprocess

    runtime = subprocess.Popen([sys.executable, "-c", RUNTIME, str(tmp_path / "vllm.log")],
                               stdout=subprocess.PIPE, text=True)
    assert runtime.stdout is not None
    pgid, watchdog = json.loads(runtime.stdout.readline())
    wait_until(lambda: len(group_members(pgid)) >= 2, 10, every_s=0.05)  # the engine and its child
    assert len(group_members(pgid)) == 2
    runtime.kill()  # SIGKILL: no handler of ours runs
    runtime.wait(10)
    wait_until(lambda: not group_members(pgid), 10, every_s=0.1)
    assert group_members(pgid) == set(), "engine processes outlived the runtime"
    assert watchdog is not None
    wait_until(lambda: not alive(watchdog), 10, every_s=0.1)
    assert not alive(watchdog), "the watchdog stayed after doing its job"


#: A stand-in vLLM for the stop's log watch: an API server (argv: "leader", port, notes folder, the
#: scheduler's line, "idle" or "busy") with an engine core whose worker ignores SIGTERM. Each writes
#: the lines vLLM 0.32 writes during a stop and takes as long as vLLM does for the parts the watch
#: may skip: the executor waits 9 s for its worker, the core's and the API server's teardowns take
#: 30 s. A busy core drains for 1.5 s first and then exits by itself. The times of the steps go to
#: files in the notes folder (CLOCK_MONOTONIC, the same in every process).
FAKE_VLLM = r"""
import http.server, os, signal, subprocess, sys, threading, time
role, port, notes, marker, load = sys.argv[1:6]
me = "__doc__ = " + repr(__doc__) + "\n" + __doc__
def say(name, text):
    print(f"({name} pid={os.getpid()}) INFO 12-04 16:57:24 [fake.py:1] {text}", flush=True)
def note(name, value=None):
    with open(os.path.join(notes, name), "w") as handle:
        handle.write(repr(time.monotonic() if value is None else value))
if role == "worker":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    time.sleep(600)
stop = threading.Event()
signal.signal(signal.SIGTERM, lambda *_: stop.set())
if role == "core":
    worker = subprocess.Popen([sys.executable, "-c", me, "worker", *sys.argv[2:]])
    stop.wait()
    say("EngineCore", "[shutdown] EngineCore: start mode=drain timeout=15s")
    if load == "busy":
        say("EngineCore", "[shutdown] EngineCore: draining in-flight requests count=1 timeout=15s")
        time.sleep(1.5)
    note("drain-over")
    say("EngineCore", "[shutdown] EngineCore: request processing complete; starting resource teardown")
    say("EngineCore", "[shutdown] EngineCore: exiting busy loop")
    say("EngineCore", "[shutdown] Executor: waiting for worker exit count=1")
    note("workers-waited")
    until = time.monotonic() + 9.0
    while worker.poll() is None and time.monotonic() < until:
        time.sleep(0.02)
    note("worker-gone")
    worker.kill()
    say("EngineCore", f"{marker} {os.getpid()}")
    time.sleep(0.5 if load == "busy" else 30)
    sys.exit(0)
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
    def log_message(self, *args):
        pass
threading.Thread(target=http.server.HTTPServer(("127.0.0.1", int(port)), Health).serve_forever, daemon=True).start()
core = subprocess.Popen([sys.executable, "-c", me, "core", *sys.argv[2:]])
stop.wait()
say("APIServer", "[shutdown] API server: shutdown triggered")
core.terminate()
note("core-exit", core.wait(60))
say("APIServer", "[shutdown] API server: engine client stopped")
print("INFO:     Waiting for application shutdown.", flush=True)
print("INFO:     Application shutdown complete.", flush=True)
time.sleep(30)
"""


def fake_vllm(tmp_path: Path, load: str) -> tuple[supervisor.EngineProcess, int, Path]:
    from carbonforge_runtime.core.contract import CORE_DONE_MARKER

    port, notes = free_port(), tmp_path / "notes"
    notes.mkdir()
    code = f"__doc__ = {FAKE_VLLM!r}\n{FAKE_VLLM}"
    argv = [sys.executable, "-c", code, "leader", str(port), str(notes), CORE_DONE_MARKER, load]
    return supervisor.EngineProcess(argv, dict(os.environ), tmp_path / "vllm.log"), port, notes


def stop_after_ready(tmp_path: Path, engine: supervisor.EngineProcess, port: int,
                     caplog: pytest.LogCaptureFixture, delay_s: float = 0.5,
                     drain_s: float = 15) -> tuple[supervisor.ExitReport, float]:
    """Supervise ``engine``, send it a stop ``delay_s`` after ready; the report and the seconds from
    the signal to the end of the stop."""
    stop = supervisor.StopFlag()
    signalled: list[float] = []

    def on_ready() -> None:
        def fire() -> None:
            signalled.append(time.monotonic())
            stop(signal.SIGTERM, None)

        threading.Timer(delay_s, fire).start()

    with caplog.at_level(logging.INFO, logger=LOG.name):
        report = supervisor.supervise(engine, f"http://127.0.0.1:{port}/health", 60, drain_s, LOG, on_ready, stop)
    return report, time.monotonic() - signalled[0]


def noted(notes: Path, name: str) -> float:
    return float((notes / name).read_text())


@pytest.mark.timeout(60)
def test_a_stop_with_nothing_in_flight_ends_what_has_finished_and_is_over_within_3_s(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    engine, port, notes = fake_vllm(tmp_path, "idle")
    report, took = stop_after_ready(tmp_path, engine, port, caplog)
    assert report.outcome == "stopped" and report.exit_code == 0, caplog.text
    assert took < 3.0, (took, caplog.text)  # vLLM's own waits would take 9 s, then 30 s twice
    assert engine.pid is not None and group_gone(engine.pid, within_s=0.5)
    # the worker was ended once its core waited for it, not before, and not 9 s later
    assert noted(notes, "workers-waited") <= noted(notes, "worker-gone") < noted(notes, "workers-waited") + 2.0
    assert float((notes / "core-exit").read_text()) == -signal.SIGKILL  # its 30 s teardown skipped
    assert "ended 1 worker process(es) at once" in caplog.text
    assert "had nothing in flight: ended without waiting for its teardown" in caplog.text
    assert "vLLM stopped (its shutdown complete)" in caplog.text


@pytest.mark.timeout(60)
def test_a_stop_during_a_drain_ends_nothing_before_the_drain_is_over(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    engine, port, notes = fake_vllm(tmp_path, "busy")
    report, took = stop_after_ready(tmp_path, engine, port, caplog)
    assert report.outcome == "stopped" and report.exit_code == 0, caplog.text
    assert 1.5 <= took < 1.5 + 3.0, (took, caplog.text)
    assert engine.pid is not None and group_gone(engine.pid, within_s=0.5)
    assert noted(notes, "drain-over") <= noted(notes, "workers-waited") <= noted(notes, "worker-gone")
    assert float((notes / "core-exit").read_text()) == 0  # a core that drained exits by itself
    assert "had nothing in flight" not in caplog.text
