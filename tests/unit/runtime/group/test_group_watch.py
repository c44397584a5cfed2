"""The runtimes of a group watch each other over real loopback sockets: joining, a worker or a leader
that goes away (closed, killed or silent), an orderly stop, a rank that never joins; and the
supervisor stopping a headless engine when its group is lost, or waiting for the leader on SIGTERM."""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from carbonforge_runtime.runtime.group import watch as group_watch
from carbonforge_runtime.runtime.group.watch import LeaderHooks, LeaderWatch, WorkerHooks, WorkerWatch
from carbonforge_runtime.runtime.process import supervisor
from tests.support import free_port

LOG = logging.getLogger("test-group-watch")
SECRET = b"a test group secret of some length"
SLEEPER = "import time; time.sleep(600)"


@pytest.fixture(autouse=True)
def quick(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(group_watch, "BEAT_S", 0.1)
    monkeypatch.setattr(group_watch, "SILENCE_S", 1.0)
    monkeypatch.setattr(group_watch, "UNHEALTHY_HOLD_S", 0.2)


def until(condition: Callable[[], object], within_s: float = 5.0) -> float:
    """Seconds until ``condition()`` is true; fails after ``within_s``."""
    started = time.monotonic()
    while not condition():
        assert time.monotonic() - started < within_s, "condition not met in time"
        time.sleep(0.02)
    return time.monotonic() - started


@pytest.fixture
def leader() -> Iterator[LeaderWatch]:
    watch = LeaderWatch(3, free_port(), join_timeout_s=30, secret=SECRET, host="127.0.0.1").start()
    yield watch
    watch.close()


def join(leader: LeaderWatch, rank: int, nnodes: int = 3) -> WorkerWatch:
    worker = WorkerWatch(rank, nnodes, "127.0.0.1", leader.port, join_timeout_s=10, secret=SECRET).start()
    until(lambda: worker.joined)
    return worker


def test_workers_join_and_a_healthy_group_has_no_problem(leader: LeaderWatch) -> None:
    workers = [join(leader, 1), join(leader, 2)]
    until(lambda: leader.joined() == [1, 2])
    time.sleep(1.5)  # longer than the silence limit: the beats keep both sides alive
    assert leader.problem() is None and all(w.problem() is None for w in workers)
    for worker in workers:
        worker.close()


def test_each_join_is_told_to_the_log_on_both_sides() -> None:
    said: list[str] = []
    leader = LeaderWatch(2, free_port(), join_timeout_s=30, secret=SECRET, host="127.0.0.1",
                         on_join=said.append).start()
    worker = WorkerWatch(1, 2, "127.0.0.1", leader.port, join_timeout_s=10, secret=SECRET,
                         on_join=said.append).start()
    try:
        until(lambda: len(said) == 2)
        assert sorted(said) == [f"group: joined the leader 127.0.0.1:{leader.port} as rank 1 of 2 hosts",
                                "group: worker rank 1 joined (1 of 1 worker(s))"]
    finally:
        worker.close()
        leader.close()


def test_a_worker_that_leaves_is_named_by_the_leader(leader: LeaderWatch) -> None:
    join(leader, 1)
    second = join(leader, 2)
    second.close()  # its runtime exited (a SIGKILL closes its sockets the same way)
    took = until(lambda: leader.problem() is not None)
    assert "worker rank 2 of the group is gone (connection closed)" in str(leader.problem())
    assert took < 1.0


def test_a_silent_worker_is_gone_after_the_silence_limit(leader: LeaderWatch) -> None:
    raw = socket.create_connection(("127.0.0.1", leader.port))
    raw_join(raw, 1, 3)  # joins, then never beats (its host vanished)
    until(lambda: leader.joined() == [1])
    until(lambda: leader.problem() is not None, within_s=3)
    assert "worker rank 1 of the group is gone (silent for 1 s)" in str(leader.problem())
    raw.close()


def test_a_rank_that_never_joins_is_named_after_the_join_timeout() -> None:
    watch = LeaderWatch(3, free_port(), join_timeout_s=0.5, secret=SECRET, host="127.0.0.1").start()
    try:
        join(watch, 1)
        until(lambda: watch.problem() is not None, within_s=3)
        assert watch.problem() == "worker rank 2 of the group did not join within 0.5 s (CF_JOIN_TIMEOUT_S)"
    finally:
        watch.close()


@pytest.mark.parametrize(("rank", "nnodes"), [(3, 3), (1, 4), (0, 3)])
def test_a_connection_that_is_not_a_worker_of_this_group_is_refused(leader: LeaderWatch, rank: int,
                                                                    nnodes: int) -> None:
    with socket.create_connection(("127.0.0.1", leader.port), timeout=5) as raw:
        assert raw_join(raw, rank, nnodes) == "refused rank"
    assert leader.joined() == [] and leader.problem() is None


@pytest.mark.parametrize("hello", [b"join 1 3\n", b"hello\n", b"join 1 3 00 00\n"])
def test_a_connection_that_does_not_speak_the_protocol_is_refused(leader: LeaderWatch, hello: bytes) -> None:
    with socket.create_connection(("127.0.0.1", leader.port), timeout=5) as raw:
        raw.recv(128)  # the leader's hello
        raw.sendall(hello)
        assert raw.recv(64) == b"refused protocol\n"
    assert leader.joined() == [] and leader.problem() is None


def raw_join(raw: socket.socket, rank: int, nnodes: int, secret: bytes = SECRET) -> str:
    """What a worker says, from a bare socket: the join with its proof; returns the leader's answer."""
    hello = raw.recv(128).decode().split()
    assert hello[:2] == ["hello", group_watch.PROTOCOL]
    nonce = os.urandom(16)
    proof = group_watch._proof(secret, b"join", bytes.fromhex(hello[2]), nonce, rank, nnodes)
    raw.sendall(f"join {rank} {nnodes} {nonce.hex()} {proof}\n".encode())
    return raw.recv(128).decode().strip()


def test_a_leader_that_goes_away_is_a_loss_and_an_orderly_stop_is_not(leader: LeaderWatch) -> None:
    killed = join(leader, 1)
    leader.close()  # no farewell: the leader's runtime died
    until(lambda: killed.problem() is not None)
    assert f"the group's leader 127.0.0.1:{leader.port} is gone" in str(killed.problem())
    loss = WorkerHooks(killed).loss()
    assert loss is not None and not loss.orderly

    again = LeaderWatch(3, free_port(), join_timeout_s=30, secret=SECRET, host="127.0.0.1").start()
    stopped = join(again, 1)
    again.close(farewell=True)
    until(lambda: stopped.leader_gone())
    loss = WorkerHooks(stopped).loss()
    assert loss is not None and loss.orderly and "stopped the group" in loss.message


def test_a_worker_that_cannot_reach_its_leader_says_so_after_the_join_timeout() -> None:
    worker = WorkerWatch(1, 2, "127.0.0.1", free_port(), join_timeout_s=0.5, secret=SECRET).start()
    until(lambda: worker.problem() is not None, within_s=5)
    assert "could not be reached within 0.5 s (CF_JOIN_TIMEOUT_S)" in str(worker.problem())


# ---- the supervisor with a group --------------------------------------------------------------------

def headless(tmp_path: Path) -> supervisor.EngineProcess:
    return supervisor.EngineProcess([sys.executable, "-c", SLEEPER], dict(os.environ), tmp_path / "vllm.log")


def gone(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.mark.timeout(60)
def test_the_leader_turns_unhealthy_and_stops_when_a_worker_leaves(tmp_path: Path, leader: LeaderWatch) -> None:
    down = tmp_path / "group-down"
    hooks = LeaderHooks(leader, down)
    worker = join(leader, 1)
    join(leader, 2)
    engine = headless(tmp_path)
    threading.Timer(1.0, worker.close).start()
    report = supervisor.supervise(engine, None, 60, 30, LOG, lambda: None, supervisor.StopFlag(), group=hooks)
    assert report.outcome == "group-lost" and report.exit_code == 1
    assert down.exists()  # the API server's /health answered 503 from then on
    assert engine.pid is not None and until(lambda: gone(engine.pid))  # type: ignore[arg-type]
    hooks.close()
    assert not down.exists()


@pytest.mark.timeout(60)
def test_a_worker_stops_at_once_when_its_leader_stops_the_group(tmp_path: Path, leader: LeaderWatch) -> None:
    hooks = WorkerHooks(join(leader, 1, nnodes=3))
    engine = headless(tmp_path)
    threading.Timer(1.0, lambda: leader.close(farewell=True)).start()
    started = time.monotonic()
    report = supervisor.supervise(engine, None, 60, 30, LOG, lambda: None, supervisor.StopFlag(), group=hooks)
    assert report.outcome == "stopped" and report.exit_code == 0
    assert time.monotonic() - started < 10


@pytest.mark.timeout(60)
def test_a_worker_signalled_to_stop_waits_for_its_leader_to_finish(tmp_path: Path, leader: LeaderWatch) -> None:
    hooks = WorkerHooks(join(leader, 1, nnodes=3))
    engine = headless(tmp_path)
    stop = supervisor.StopFlag()
    threading.Timer(0.5, lambda: stop(signal.SIGTERM, None)).start()  # the whole group is being deleted
    threading.Timer(2.5, lambda: leader.close(farewell=True)).start()  # the leader drains for 2 s more
    started = time.monotonic()
    report = supervisor.supervise(engine, None, 60, 30, LOG, lambda: None, stop, group=hooks)
    waited = time.monotonic() - started
    assert report.exit_code == 0 and 2.3 < waited < 15, waited


@pytest.mark.timeout(60)
@pytest.mark.parametrize("farewell", [True, False])
def test_a_workers_engine_that_ends_first_is_an_orderly_stop_only_if_the_leader_says_so(
        tmp_path: Path, leader: LeaderWatch, farewell: bool) -> None:
    hooks = WorkerHooks(join(leader, 1, nnodes=3))
    # vLLM on the worker notices the leader's shutdown and exits a moment before the word arrives
    engine = supervisor.EngineProcess([sys.executable, "-c", "import time; time.sleep(1)"], dict(os.environ),
                                      tmp_path / "vllm.log")
    if farewell:
        threading.Timer(1.5, lambda: leader.close(farewell=True)).start()
    report = supervisor.supervise(engine, None, 60, 30, LOG, lambda: None, supervisor.StopFlag(), group=hooks)
    assert (report.outcome, report.exit_code) == (("stopped", 0) if farewell else ("died", 1))


def test_the_group_down_marker_is_never_written_through_a_planted_link(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from carbonforge_runtime.runtime.group import watch as group_watch

    monkeypatch.setattr(group_watch, "UNHEALTHY_HOLD_S", 0.0)
    target = tmp_path / "elsewhere.txt"
    target.write_text("keep me\n")
    target.chmod(0o640)
    before = target.stat()
    down = tmp_path / "group-down"
    down.symlink_to(target)
    LeaderHooks(None, down).on_loss(supervisor.GroupLoss("worker 1 left"))  # type: ignore[arg-type]
    after = target.stat()
    assert target.read_text() == "keep me\n" and after.st_mode & 0o777 == 0o640
    assert (after.st_mtime_ns, after.st_size) == (before.st_mtime_ns, before.st_size)  # touch() would move it
    assert down.is_symlink()
    dangling = tmp_path / "dangling-down"
    dangling.symlink_to(tmp_path / "created-through-the-link")
    LeaderHooks(None, dangling).on_loss(supervisor.GroupLoss("worker 1 left"))  # type: ignore[arg-type]
    assert not (tmp_path / "created-through-the-link").exists()
    plain = tmp_path / "plain-down"
    LeaderHooks(None, plain).on_loss(supervisor.GroupLoss("worker 1 left"))  # type: ignore[arg-type]
    assert plain.is_file()


def test_lines_without_the_sessions_mac_do_not_keep_a_worker_alive(leader: LeaderWatch) -> None:
    raw = socket.create_connection(("127.0.0.1", leader.port))
    assert raw_join(raw, 1, 3).startswith("welcome ")
    started = time.monotonic()
    forged = [b"beat\n", b"beat 0 " + b"0" * 32 + b"\n", group_watch._sealed(os.urandom(32), b"worker", 0, "beat")]
    while leader.problem() is None and time.monotonic() - started < 5:
        raw.sendall(forged[int(time.monotonic() * 10) % len(forged)])  # beats a stranger could make
        time.sleep(0.05)
    assert "worker rank 1 of the group is gone (silent for 1 s)" in str(leader.problem())
    raw.close()
