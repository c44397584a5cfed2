"""No engine outlives a start that failed: the watchdog (the engine's kill path) is started before the
engine, and any failure from the engine's spawn until the supervision loop kills its whole group.

The spawns are the real ones (``subprocess.Popen``); a test makes one of them fail as EAGAIN under a
pids limit would, through the spawn that :class:`EngineProcess` takes."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import secrets
import subprocess
import sys
from pathlib import Path
from typing import Any

import psutil
import pytest

from carbonforge_runtime.runtime.process import supervisor
from tests.support import free_port, group_members, wait_until

#: An engine that ignores SIGTERM (as vLLM does while it initialises) and starts a child that does
#: too; both carry the test's marker (argv[1]) on their command line.
DEAF = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"
ENGINE = ("import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
          f"subprocess.Popen([sys.executable, '-c', {DEAF!r}, sys.argv[1]]); time.sleep(600)")


def marked(marker: str) -> set[int]:
    """Live processes (zombies excluded) with ``marker`` on their command line."""
    found = set()
    for process in psutil.process_iter(["cmdline", "status"]):
        with contextlib.suppress(psutil.Error):
            if process.info["status"] != psutil.STATUS_ZOMBIE and marker in (process.info["cmdline"] or []):
                found.add(process.pid)
    return found


@pytest.fixture
def marker() -> Any:
    """A unique word on the engine's command line; whatever still carries it after the test is killed."""
    word = f"cf-engine-{secrets.token_hex(6)}"
    yield word
    for pid in marked(word):
        with contextlib.suppress(OSError):
            os.kill(pid, 9)


def engine_for(marker: str, log: Path, spawn: supervisor.Spawn) -> supervisor.EngineProcess:
    return supervisor.EngineProcess([sys.executable, "-c", ENGINE, marker], dict(os.environ), log, spawn=spawn)


class FailingSpawn:
    """``subprocess.Popen``, except that the call for which ``fails(argv, index)`` is true raises EAGAIN
    (the index counts the spawns from 1). Records the watchdog it started."""

    def __init__(self, fails: Any) -> None:
        self.fails = fails
        self.calls = 0
        self.watchdogs: list[subprocess.Popen[bytes]] = []

    def __call__(self, argv: list[str], **kwargs: Any) -> subprocess.Popen[bytes]:
        self.calls += 1
        if self.fails(argv, self.calls):
            raise BlockingIOError(errno.EAGAIN, "Resource temporarily unavailable")
        proc: subprocess.Popen[bytes] = subprocess.Popen(argv, **kwargs)
        if "killpg" in " ".join(argv):
            self.watchdogs.append(proc)
        return proc


def is_watchdog(argv: list[str], _index: int) -> bool:
    return "killpg" in " ".join(argv)


def is_second(_argv: list[str], index: int) -> bool:
    return index == 2


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fails", [is_watchdog, is_second], ids=["watchdog-spawn-fails", "second-spawn-fails"])
def test_a_spawn_that_fails_leaves_no_engine_process(tmp_path: Path, marker: str, fails: Any) -> None:
    spawn = FailingSpawn(fails)
    engine = engine_for(marker, tmp_path / "vllm.log", spawn)
    with pytest.raises(OSError) as raised:
        supervisor.supervise(engine, f"http://127.0.0.1:{free_port()}/health", 60, 30,
                             logging.getLogger("test-start"), lambda: None, supervisor.StopFlag())
    assert raised.value.errno == errno.EAGAIN
    if fails is is_second:
        assert spawn.calls == 2  # the failure was real: the first spawn ran
    wait_until(lambda: not marked(marker), 10, every_s=0.1)
    assert marked(marker) == set(), "an engine process outlived the failed start"
    for watchdog in spawn.watchdogs:  # a watchdog that was started is not left behind either
        assert watchdog.poll() is not None


@pytest.mark.timeout(60)
def test_the_watchdog_spawns_before_the_engine(tmp_path: Path, marker: str) -> None:
    order: list[str] = []

    def spawn(argv: list[str], **kwargs: Any) -> subprocess.Popen[bytes]:
        order.append("engine" if marker in argv else "watchdog")
        return subprocess.Popen(argv, **kwargs)

    engine = engine_for(marker, tmp_path / "vllm.log", spawn)
    engine.start()
    try:
        assert order == ["watchdog", "engine"]
    finally:
        engine.signal_group(9)
        engine.wait(5)
        engine.release_watchdog()


@pytest.mark.timeout(60)
def test_a_watchdog_gone_before_it_learns_the_group_kills_the_engine(tmp_path: Path, marker: str) -> None:
    """The watchdog dies between its spawn and the engine's (so it cannot be told the engine's group):
    the engine it would have guarded is killed, its child included, and the start fails."""
    started: list[int] = []

    def spawn(argv: list[str], **kwargs: Any) -> subprocess.Popen[bytes]:
        proc: subprocess.Popen[bytes] = subprocess.Popen(argv, **kwargs)
        if marker in argv:
            started.append(proc.pid)
            wait_until(lambda: len(group_members(proc.pid)) >= 2, 10, every_s=0.05)  # engine and child up
        else:
            proc.kill()
            proc.wait(5)
        return proc

    engine = engine_for(marker, tmp_path / "vllm.log", spawn)
    with pytest.raises(OSError):
        engine.start()
    assert started and engine.pid == started[0]
    wait_until(lambda: not marked(marker), 10, every_s=0.1)
    assert marked(marker) == set(), "an engine process outlived the failed start"


class FailOn(logging.Filter):
    """Raises once the runtime logs ``text``, after the engine's whole group is up: a failure between
    the engine's spawn and the supervision loop."""

    def __init__(self, text: str, engine: supervisor.EngineProcess) -> None:
        super().__init__()
        self.text = text
        self.engine = engine

    def filter(self, record: logging.LogRecord) -> bool:
        if self.text in record.getMessage():
            pid = self.engine.pid
            assert pid is not None
            wait_until(lambda: len(group_members(pid)) >= 2, 10, every_s=0.05)
            raise RuntimeError("failed before the supervision loop")
        return True


@pytest.mark.timeout(60)
def test_a_failure_after_the_spawn_kills_the_whole_engine_group(tmp_path: Path, marker: str) -> None:
    engine = engine_for(marker, tmp_path / "vllm.log", subprocess.Popen)
    log = logging.getLogger(f"test-start-{marker}")
    log.setLevel(logging.INFO)
    log.addFilter(FailOn("vLLM started headless", engine))
    with pytest.raises(RuntimeError, match="before the supervision loop"):
        supervisor.supervise(engine, None, 60, 30, log, lambda: None, supervisor.StopFlag())
    assert engine.pid is not None
    wait_until(lambda: not marked(marker), 10, every_s=0.1)
    assert marked(marker) == set(), "an engine process outlived the failed start"
    assert engine.watchdog_pid is None  # released once the group was gone
