"""The leader's watch port against peers that do not hold the group secret, over real loopback sockets:
arbitrary bytes, many connections, partial and huge lines, slow trickles, forged and replayed joins,
forged beats and byes change nothing of the group, and the leader's memory, threads and accept loop
hold. Also: the bind address, the hello's deadline, running out of descriptors, the close deadline,
and the group secret's own refusals."""

from __future__ import annotations

import contextlib
import errno
import os
import resource
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from carbonforge_runtime.errors import UsageError
from carbonforge_runtime.runtime.group import watch as group_watch
from carbonforge_runtime.runtime.group.placement import Group
from carbonforge_runtime.runtime.group.secret import read_group_secret
from carbonforge_runtime.runtime.group.watch import LeaderWatch, LineReader, WorkerWatch, listen_address
from carbonforge_runtime.settings import load_settings
from tests.support import free_port

SECRET = b"the group's secret, shared by every host"
WRONG = b"a guess at the group's secret, not it"


def until(condition: Callable[[], object], within_s: float = 5.0) -> float:
    started = time.monotonic()
    while not condition():
        assert time.monotonic() - started < within_s, "condition not met in time"
        time.sleep(0.01)
    return time.monotonic() - started


def connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=5)


def nonce_of(raw: socket.socket) -> bytes:
    words = raw.recv(128).decode().split()
    assert words[:2] == ["hello", group_watch.PROTOCOL], words
    return bytes.fromhex(words[2])


def join_line(leader_nonce: bytes, rank: int, nnodes: int, secret: bytes = SECRET,
              worker_nonce: bytes | None = None) -> bytes:
    mine = worker_nonce or os.urandom(16)
    proof = group_watch._proof(secret, b"join", leader_nonce, mine, rank, nnodes)
    return f"join {rank} {nnodes} {mine.hex()} {proof}\n".encode()


def closed_by_peer(raw: socket.socket, within_s: float) -> bool:
    """Whether the other end closes ``raw`` within ``within_s`` (what it sent first is skipped)."""
    raw.settimeout(within_s)
    deadline = time.monotonic() + within_s
    try:
        while time.monotonic() < deadline:
            if not raw.recv(65536):
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False
    return False


@pytest.fixture
def quick(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(group_watch, "BEAT_S", 0.1)
    monkeypatch.setattr(group_watch, "HELLO_S", 0.5)


@pytest.fixture
def leader(quick: None) -> Iterator[LeaderWatch]:
    said: list[str] = []
    watch = LeaderWatch(3, free_port(), join_timeout_s=600, secret=SECRET, host="127.0.0.1", log=said.append).start()
    watch.said = said  # type: ignore[attr-defined]
    yield watch
    watch.close()


# ---- bounded lines, linear time ------------------------------------------------------------------------

def test_the_line_reader_takes_32_mib_without_a_newline_in_linear_time() -> None:
    reader = LineReader(limit=64 * 1024 * 1024)  # a limit above the stream: only the cost is measured
    chunk = b"x" * 4096
    started = time.process_time()
    for _ in range(32 * 256):
        assert reader.feed(chunk) == []
    assert time.process_time() - started < 3.0  # the old buffer took 110 s of CPU on this
    assert reader.feed(b"tail\nnext") == [b"x" * (32 * 1024 * 1024) + b"tail"]
    assert len(reader) == 4


def test_the_line_reader_refuses_a_line_over_its_limit_with_or_without_a_newline() -> None:
    assert LineReader(limit=8).feed(b"12345678\n1234") == [b"12345678"]
    assert LineReader(limit=8).feed(b"123456789\n") is None
    reader = LineReader(limit=8)
    assert reader.feed(b"12345") == []
    assert reader.feed(b"6789") is None


def test_a_peer_that_sends_a_huge_line_is_dropped_at_once_with_one_log_line(leader: LeaderWatch) -> None:
    raw = connect(leader.port)
    nonce_of(raw)
    started = time.monotonic()
    with contextlib.suppress(OSError):  # the leader hangs up long before 32 MiB are through
        raw.sendall(b"y" * (32 * 1024 * 1024))
    assert closed_by_peer(raw, 2.0)
    assert time.monotonic() - started < 3.0
    assert leader.buffered() <= 2 * 4096
    said: list[str] = leader.said  # type: ignore[attr-defined]
    until(lambda: any("a line over 256 bytes" in line for line in said))
    assert sum("a line over" in line for line in said) == 1


# ---- the hello's deadline and the cap on greeters ------------------------------------------------------

def test_the_whole_hello_has_a_deadline_not_each_read(leader: LeaderWatch) -> None:
    raw = connect(leader.port)
    nonce_of(raw)
    started = time.monotonic()
    dropped = False
    for byte in b"join 1 3 " + b"0" * 64:  # one byte every 0.1 s: each read comes well within the deadline
        try:
            raw.send(bytes([byte]))
        except OSError:
            dropped = True
            break
        time.sleep(0.1)
        if closed_by_peer(raw, 0.001):
            dropped = True
            break
    took = time.monotonic() - started
    assert dropped and took < 0.5 + 0.5, took  # HELLO_S (0.5 s here) from the accept, not per read
    assert leader.connections() == 0


def test_greeters_beyond_the_cap_are_closed_and_a_worker_still_joins_after_them(leader: LeaderWatch) -> None:
    held = [connect(leader.port) for _ in range(group_watch.MAX_GREETERS)]
    until(lambda: leader.connections() == group_watch.MAX_GREETERS)
    extra = connect(leader.port)
    assert extra.recv(64) == b"busy\n" and closed_by_peer(extra, 2.0)
    assert leader.connections() == group_watch.MAX_GREETERS
    # a real worker meets a busy leader, tries again after the silent greeters' deadline, and joins
    worker = WorkerWatch(1, 3, "127.0.0.1", leader.port, join_timeout_s=10, secret=SECRET).start()
    until(lambda: worker.joined, within_s=5)
    assert leader.joined() == [1]
    worker.close()
    for raw in held:
        raw.close()


# ---- the accept loop ---------------------------------------------------------------------------------

@pytest.mark.timeout(60)
def test_the_accept_loop_survives_running_out_of_descriptors(leader: LeaderWatch) -> None:
    waiting = socket.socket()  # made before the descriptors run out
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    fillers: list[int] = []
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, 4096), hard))
        with contextlib.suppress(OSError):
            while True:
                fillers.append(os.open(os.devnull, os.O_RDONLY))
        waiting.connect(("127.0.0.1", leader.port))  # queued by the kernel; the leader cannot accept it
        said: list[str] = leader.said  # type: ignore[attr-defined]
        until(lambda: any("cannot accept" in line for line in said))
        assert any("Too many open files" in line for line in said), said
        time.sleep(0.5)  # several failed accepts, with the backoff
    finally:
        for fd in fillers:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert leader.alive()
    assert sum("cannot accept" in line for line in said) == 1  # logged once, not once per try
    waiting.settimeout(5)
    join_answer = join_line(nonce_of(waiting), 1, 3)  # the queued connection is taken after all
    waiting.sendall(join_answer)
    assert waiting.recv(128).startswith(b"welcome ")
    assert leader.joined() == [1]
    waiting.close()


# ---- the bind address ----------------------------------------------------------------------------------

def test_the_watch_port_listens_on_the_leaders_address_not_every_interface(tmp_path: Path) -> None:
    from carbonforge_runtime.log import get_logger
    from carbonforge_runtime.runtime.serve.launch import _watch_group

    settings = load_settings({"CF_GROUP_SECRET": SECRET.decode(), "CF_HOST": "0.0.0.0"})
    group = Group(2, 0, "127.0.0.1", free_port(), 30.0, watch_port=free_port())
    hooks = _watch_group(group, settings, tmp_path, {}, get_logger())
    try:
        assert isinstance(hooks, group_watch.LeaderHooks)
        assert hooks.watch.host == "127.0.0.1"
    finally:
        assert hooks is not None
        hooks.close()


def test_a_leader_address_of_another_host_falls_back_to_cf_host_saying_why() -> None:
    assert listen_address("127.0.0.1", "0.0.0.0") == ("127.0.0.1", None)
    assert listen_address("localhost", "0.0.0.0")[0] in {"127.0.0.1", "::1"}
    host, why = listen_address("192.0.2.7", "10.1.2.3")  # TEST-NET-1: never this host's
    assert (host, why) == ("10.1.2.3", "the leader's address 192.0.2.7 (192.0.2.7) is not an address of this host")
    host, why = listen_address("no-such-host.invalid", "0.0.0.0")
    assert host == "0.0.0.0" and why is not None and "does not resolve here" in why


# ---- the close deadline --------------------------------------------------------------------------------

@pytest.mark.timeout(60)
def test_close_with_farewell_is_bounded_when_peers_stop_reading(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(group_watch, "BEAT_S", 0.0)  # the leader beats as fast as it can: buffers fill
    monkeypatch.setattr(group_watch, "SILENCE_S", 30.0)
    watch = LeaderWatch(5, free_port(), join_timeout_s=600, secret=SECRET, host="127.0.0.1").start()
    peers = []
    for rank in range(1, 5):
        raw = socket.socket()
        raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        raw.connect(("127.0.0.1", watch.port))
        raw.sendall(join_line(nonce_of(raw), rank, 5))
        peers.append(raw)  # and never reads again
    until(lambda: watch.joined() == [1, 2, 3, 4])
    until(lambda: watch.buffered() >= 4 * (group_watch.MAX_UNSENT - 200), within_s=20)  # the kernel's are full
    started = time.monotonic()
    watch.close(farewell=True)
    took = time.monotonic() - started
    assert took < group_watch.CLOSE_S + 0.5, took
    for raw in peers:
        raw.close()


# ---- the property: nothing without the secret changes the group ----------------------------------------

CHUNK = st.binary(min_size=0, max_size=600)
ACTION = st.one_of(
    st.tuples(st.just("garbage"), CHUNK),
    st.tuples(st.just("partial"), st.binary(max_size=200).filter(lambda b: b"\n" not in b)),
    st.tuples(st.just("huge"), st.integers(min_value=300, max_value=256 * 1024)),
    st.tuples(st.just("trickle"), st.binary(min_size=1, max_size=8)),
    st.tuples(st.just("forged-join"), st.integers(min_value=0, max_value=4)),
    st.tuples(st.just("replayed-join"), st.integers(min_value=1, max_value=2)),
    st.tuples(st.just("forged-line"), st.sampled_from(["bye", "beat", "welcome", "join"])),
    st.tuples(st.just("many"), st.integers(min_value=1, max_value=3 * group_watch.MAX_GREETERS)),
    st.tuples(st.just("reset"), CHUNK),
)


def _act(port: int, action: tuple[str, object], captured: list[bytes]) -> list[socket.socket]:
    """Run one action from raw sockets; returns those it leaves open."""
    kind, arg = action
    raw = connect(port)
    raw.settimeout(1)
    try:
        if kind == "many":
            assert isinstance(arg, int)
            return [raw, *(connect(port) for _ in range(arg))]
        first = raw.recv(128)
        if first == b"busy\n":  # the greeters' places are taken (by "many"): closed at once, as it should
            raw.close()
            return []
        nonce = bytes.fromhex(first.decode().split()[2])
        if kind in ("garbage", "partial"):
            assert isinstance(arg, bytes)
            raw.sendall(arg)
        elif kind == "huge":
            assert isinstance(arg, int)
            raw.sendall(b"z" * arg)
        elif kind == "trickle":
            assert isinstance(arg, bytes)
            for byte in arg:
                raw.send(bytes([byte]))
                time.sleep(0.005)
        elif kind == "forged-join":
            assert isinstance(arg, int)
            raw.sendall(join_line(nonce, arg, 3, secret=WRONG))
        elif kind == "replayed-join":
            assert isinstance(arg, int)
            line = join_line(nonce, arg, 3)  # valid on the connection it was made for ...
            captured.append(line)
            raw.close()  # ... which is gone before it is sent
            raw = connect(port)
            raw.recv(128)  # another nonce (or busy)
            raw.sendall(captured[0])  # sent on another connection, to another nonce
        elif kind == "forged-line":
            assert isinstance(arg, str)
            key = os.urandom(32)
            raw.sendall(group_watch._sealed(key, b"worker", 0, arg) + group_watch._sealed(key, b"leader", 0, arg))
        elif kind == "reset":
            assert isinstance(arg, bytes)
            raw.sendall(arg)
            raw.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            raw.close()
            return []
    except OSError:  # the leader hung up on it: fine
        raw.close()
        return []
    return [raw]


@pytest.mark.timeout(120)
def test_no_peer_without_the_secret_changes_the_group_and_the_leader_stays_bounded(leader: LeaderWatch) -> None:
    worker = WorkerWatch(1, 3, "127.0.0.1", leader.port, join_timeout_s=10, secret=SECRET).start()
    until(lambda: worker.joined)
    threads_before = threading.active_count()
    captured: list[bytes] = []
    peak = {"connections": 0, "buffered": 0, "threads": 0}
    bound_connections = group_watch.MAX_GREETERS + 2
    bound_buffered = bound_connections * (group_watch.MAX_LINE + 4096 + group_watch.MAX_UNSENT)

    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    @given(st.lists(ACTION, min_size=1, max_size=6), st.booleans())
    def attack(actions: list[tuple[str, object]], hang_up: bool) -> None:
        opened: list[socket.socket] = []
        try:
            for action in actions:
                opened += _act(leader.port, action, captured)
                peak["connections"] = max(peak["connections"], leader.connections())
                peak["buffered"] = max(peak["buffered"], leader.buffered())
                peak["threads"] = max(peak["threads"], threading.active_count())
        finally:
            if hang_up:
                for raw in opened:
                    raw.close()
        # the group is as it was: rank 1 joined and healthy, rank 2 still awaited, nobody gone
        assert leader.joined() == [1]
        assert leader.problem() is None
        assert worker.problem() is None and not worker.farewell
        assert leader.alive()
        for raw in opened:
            raw.close()

    attack()
    assert peak["connections"] <= bound_connections, peak
    assert peak["buffered"] <= bound_buffered, peak
    assert peak["threads"] <= threads_before, peak  # no thread per connection
    until(lambda: leader.connections() == 1, within_s=3)  # every greeter is gone by its deadline
    # the accept loop still takes a real worker, and the group is whole
    second = WorkerWatch(2, 3, "127.0.0.1", leader.port, join_timeout_s=10, secret=SECRET).start()
    until(lambda: second.joined, within_s=5)
    assert leader.joined() == [1, 2] and leader.problem() is None
    worker.close()
    second.close()


def test_a_worker_with_another_secret_is_refused_and_says_why(leader: LeaderWatch) -> None:
    worker = WorkerWatch(1, 3, "127.0.0.1", leader.port, join_timeout_s=10, secret=WRONG).start()
    until(lambda: worker.problem() is not None)
    assert "the group secret differs" in str(worker.problem())
    assert leader.joined() == [] and leader.problem() is None


def test_a_worker_does_not_trust_a_leader_that_cannot_prove_the_secret(quick: None) -> None:
    impostor = LeaderWatch(2, free_port(), join_timeout_s=600, secret=WRONG, host="127.0.0.1").start()
    try:
        worker = WorkerWatch(1, 2, "127.0.0.1", impostor.port, join_timeout_s=10, secret=SECRET).start()
        until(lambda: worker.problem() is not None)
        assert not worker.joined
    finally:
        impostor.close()


# ---- the secret itself --------------------------------------------------------------------------------

def test_a_group_without_a_secret_is_refused_naming_the_file_variable() -> None:
    with pytest.raises(UsageError) as refused:
        read_group_secret(load_settings({}))
    assert "needs a group secret" in str(refused.value) and "CF_GROUP_SECRET_FILE" in refused.value.remedy


def test_the_secret_is_read_from_its_file_and_refused_when_short_or_unreadable(tmp_path: Path) -> None:
    path = tmp_path / "group.secret"
    path.write_text("0123456789abcdef0123\n")
    assert read_group_secret(load_settings({"CF_GROUP_SECRET_FILE": str(path)})) == b"0123456789abcdef0123"
    assert read_group_secret(load_settings({"CF_GROUP_SECRET_FILE": str(path),
                                            "CF_GROUP_SECRET": "x" * 20})) == b"x" * 20
    path.write_text("short\n")
    with pytest.raises(UsageError, match="shorter than 16 characters"):
        read_group_secret(load_settings({"CF_GROUP_SECRET_FILE": str(path)}))
    with pytest.raises(UsageError, match="cannot be read"):
        read_group_secret(load_settings({"CF_GROUP_SECRET_FILE": str(tmp_path / "missing")}))
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(UsageError, match="CF_GROUP_SECRET_FILE="):
        read_group_secret(load_settings({"CF_GROUP_SECRET_FILE": str(fifo)}))


def test_out_of_resources_errors_are_the_ones_that_pause_the_accepts() -> None:
    assert {errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS} == group_watch._OUT_OF_RESOURCES


def serve_one_worker(script: Callable[[socket.socket, bytes, bytes], None]) -> tuple[int, threading.Thread]:
    """A leader played by hand on a bare socket: greets one worker, checks its join, runs ``script``
    with the connection, the leader's nonce and the worker's."""
    server = socket.create_server(("127.0.0.1", 0))

    def run() -> None:
        conn, _ = server.accept()
        server.close()
        with conn:
            nonce = os.urandom(16)
            conn.sendall(f"hello {group_watch.PROTOCOL} {nonce.hex()}\n".encode())
            words = conn.makefile("rb").readline(512).decode().split()
            worker_nonce = bytes.fromhex(words[3])
            assert words[4] == group_watch._proof(SECRET, b"join", nonce, worker_nonce, int(words[1]), int(words[2]))
            script(conn, nonce, worker_nonce)
            time.sleep(1.0)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return int(server.getsockname()[1]), thread


def test_the_leaders_first_lines_in_the_same_packet_as_its_welcome_are_not_lost(quick: None) -> None:
    def welcome_beat_and_bye_at_once(conn: socket.socket, nonce: bytes, worker_nonce: bytes) -> None:
        key = group_watch._session_key(SECRET, nonce, worker_nonce)
        welcome = group_watch._proof(SECRET, b"welcome", nonce, worker_nonce, 1, 2)
        conn.sendall(f"welcome {welcome}\n".encode() + group_watch._sealed(key, b"leader", 0, "beat")
                     + group_watch._sealed(key, b"leader", 1, "bye"))

    port, leader = serve_one_worker(welcome_beat_and_bye_at_once)
    worker = WorkerWatch(1, 2, "127.0.0.1", port, join_timeout_s=10, secret=SECRET).start()
    until(lambda: worker.farewell)
    assert worker.joined
    worker.close()
    leader.join(5)


def test_a_worker_ignores_leader_lines_without_the_sessions_mac_or_out_of_order(quick: None) -> None:
    def forged_and_replayed_byes(conn: socket.socket, nonce: bytes, worker_nonce: bytes) -> None:
        key = group_watch._session_key(SECRET, nonce, worker_nonce)
        other = group_watch._session_key(SECRET, os.urandom(16), worker_nonce)  # another connection's key
        welcome = group_watch._proof(SECRET, b"welcome", nonce, worker_nonce, 1, 2)
        conn.sendall(f"welcome {welcome}\n".encode() + b"bye\n" + group_watch._sealed(other, b"leader", 0, "bye")
                     + group_watch._sealed(key, b"worker", 0, "bye")  # the worker's own direction
                     + group_watch._sealed(key, b"leader", 5, "bye")  # out of order
                     + group_watch._sealed(key, b"leader", 0, "beat") + group_watch._sealed(key, b"leader", 0, "bye"))

    port, leader = serve_one_worker(forged_and_replayed_byes)
    worker = WorkerWatch(1, 2, "127.0.0.1", port, join_timeout_s=10, secret=SECRET).start()
    until(lambda: worker.joined)
    time.sleep(0.5)
    assert not worker.farewell and worker.problem() is None  # a replayed beat's number was used already
    worker.close()
    leader.join(5)
