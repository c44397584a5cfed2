"""The runtimes of a multi-host group watch each other, so that the group fails as one.

vLLM alone does not: when a worker's engine dies the leader's ``/health`` stays 200 until a request
fails, and a headless worker outlives its leader for minutes. So the runtimes keep one TCP connection
from each worker to the leader, on ``CF_GROUP_PORT`` of the leader, for as long as each serves:

- the leader greets a new connection with a fresh random nonce (``hello cf-group-2 <nonce>``);
- the worker answers ``join <rank> <hosts> <its nonce> <mac>``, the MAC being HMAC-SHA256 of the
  group secret over both nonces and its identity; the leader checks it with ``hmac.compare_digest``
  and answers ``welcome <mac>`` (its own proof of the secret), or ``refused <why>``;
- from then on every line (``beat`` each second each way, the leader's ``bye`` on an orderly stop) is
  ``<word> <seq> <mac>``: MACed with a key derived from the secret and both nonces, numbered per
  direction, so that a line is neither forged, nor replayed, nor carried to another connection;
- a connection that closes (the peer runtime exited, or was killed: the kernel closes its sockets)
  or brings no valid line for :data:`SILENCE_S` (the peer's host is gone) means that peer is gone.

Nothing a peer without the secret sends changes the group: it cannot join, take a rank's place, say
``bye``, keep a dead connection alive or flood the log. The leader runs one thread with a selector
over non-blocking sockets: lines are bounded (:data:`MAX_LINE`), a greeting has a real deadline
(:data:`HELLO_S` from the accept), unauthenticated connections are capped (:data:`MAX_GREETERS`),
and running out of descriptors or memory pauses the accepts (logged, with a backoff) instead of
ending them.

The leader reports a worker that never joined within the join timeout, or one that left; a worker
reports a leader it could not reach in time, or one that left. The supervisor polls :meth:`problem`
and stops its engine. Nothing here decides what to do about it.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import hmac
import os
import secrets
import selectors
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

from carbonforge_runtime import files
from carbonforge_runtime.runtime.process.supervisor import GroupHooks, GroupLoss

#: Seconds between two heartbeats, each way.
BEAT_S = 1.0
#: A peer without a valid line for this long is gone (a host that vanished sends no FIN).
SILENCE_S = 10.0
#: How long a new connection has, from its accept, to prove it is a worker of the group.
HELLO_S = 5.0
#: The longest line either side accepts (a join is about 120 bytes); a peer over it is dropped.
MAX_LINE = 256
#: Connections at most that have not proved the secret yet; extra ones are closed at once.
MAX_GREETERS = 8
#: What the leader keeps unsent for a peer that does not read; more beats are not queued.
MAX_UNSENT = 4096
#: The longest pause of the accepts after running out of descriptors or memory (it doubles up to this).
ACCEPT_BACKOFF_MAX_S = 1.0
#: How long :meth:`LeaderWatch.close` may take, whatever the number of peers.
CLOSE_S = 1.0
#: A repeated warning (refused peers, failed accepts) is logged once, then summed up at most this often.
NOTE_EVERY_S = 30.0

PROTOCOL = "cf-group-2"
_NONCE_BYTES = 16
_MAC_HEX = 32  # the lines' MACs: HMAC-SHA256 cut to 128 bits
_OUT_OF_RESOURCES = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS})


# --- the protocol's words, as plain functions -----------------------------------------------------------

def _proof(secret: bytes, what: bytes, leader_nonce: bytes, worker_nonce: bytes, rank: int, nnodes: int) -> str:
    """HMAC-SHA256 of the group secret over both nonces and the worker's identity (``what`` tells the
    worker's join from the leader's welcome, so one cannot stand for the other)."""
    message = b"|".join((what, leader_nonce, worker_nonce, str(rank).encode(), str(nnodes).encode()))
    return hmac.new(secret, message, hashlib.sha256).hexdigest()


def _session_key(secret: bytes, leader_nonce: bytes, worker_nonce: bytes) -> bytes:
    return hmac.new(secret, b"|".join((b"session", leader_nonce, worker_nonce)), hashlib.sha256).digest()


def _sealed(key: bytes, direction: bytes, seq: int, word: str) -> bytes:
    """One line after the join: ``word seq mac``."""
    mac = hmac.new(key, b"|".join((direction, str(seq).encode(), word.encode())), hashlib.sha256).hexdigest()
    return f"{word} {seq} {mac[:_MAC_HEX]}\n".encode("ascii")


def _opened(key: bytes, direction: bytes, seq: int, line: bytes) -> str | None:
    """The word of a sealed line that is the next one (``seq``) of that direction, or None."""
    parts = line.split()
    if len(parts) != 3 or parts[1] != str(seq).encode():
        return None
    word = parts[0].decode("ascii", "replace")
    expected = _sealed(key, direction, seq, word).split()[2]
    return word if hmac.compare_digest(expected, parts[2]) else None


#: The directions, each with its own sequence of numbers.
_FROM_LEADER = b"leader"
_FROM_WORKER = b"worker"


class LineReader:
    """Complete lines out of a byte stream, in linear time: each byte is looked at a bounded number of
    times, and the unfinished rest is never longer than ``limit``."""

    def __init__(self, limit: int = MAX_LINE) -> None:
        self.limit = limit
        self._buffer = bytearray()

    def __len__(self) -> int:
        """Bytes held of an unfinished line."""
        return len(self._buffer)

    def feed(self, data: bytes) -> list[bytes] | None:
        """The lines ``data`` completes (without their newline), or None once a line is over the limit."""
        scan = len(self._buffer)  # what came before holds no newline: only the new bytes are searched
        self._buffer += data
        lines: list[bytes] = []
        start = 0
        while (end := self._buffer.find(b"\n", scan)) >= 0:
            if end - start > self.limit:
                return None
            lines.append(bytes(self._buffer[start:end]).rstrip(b"\r"))
            start = scan = end + 1
        del self._buffer[:start]
        return None if len(self._buffer) > self.limit else lines


class _Notes:
    """Warnings that may repeat (a peer that keeps knocking): the first of each kind is logged, the
    next ones are counted and summed up at most every NOTE_EVERY_S."""

    def __init__(self, log: Callable[[str], None] | None) -> None:
        self.log = log
        self._last: dict[str, float] = {}
        self._held: dict[str, int] = {}

    def note(self, kind: str, text: str, now: float) -> list[str]:
        """The lines to log now (emitted by the caller, outside its locks)."""
        if self.log is None:
            return []
        last = self._last.get(kind)
        if last is not None and now - last < NOTE_EVERY_S:
            self._held[kind] = self._held.get(kind, 0) + 1
            return []
        self._last[kind] = now
        held = self._held.pop(kind, 0)
        return [text + (f" (and {held} more like it in the last {NOTE_EVERY_S:g} s)" if held else "")]


class _Conn:
    """One connection on the leader: a greeter until it proves the secret, then a worker's."""

    def __init__(self, sock: socket.socket, peer: str, now: float) -> None:
        self.sock = sock
        self.peer = peer
        self.lines = LineReader()
        self.nonce = secrets.token_bytes(_NONCE_BYTES)
        self.deadline = now + HELLO_S
        self.rank: int | None = None
        self.key = b""
        self.seq_in = 0
        self.seq_out = 0
        self.heard = now
        self.next_beat = now
        self.unsent = bytearray()


class LeaderWatch:
    """The leader's side: listens on ``host:port`` and follows every worker rank 1..nnodes-1 that
    proves ``secret``. One thread, whatever the number of connections."""

    def __init__(self, nnodes: int, port: int, join_timeout_s: float, *, secret: bytes, host: str = "",
                 on_join: Callable[[str], None] | None = None, log: Callable[[str], None] | None = None) -> None:
        if not secret:
            raise ValueError("a group watch needs the group secret")
        self.nnodes = nnodes
        self.join_timeout_s = join_timeout_s
        self._secret = secret
        #: Told a line for the log when a worker joins (or joins again).
        self.on_join = on_join
        #: Told the warnings: refused peers, failed accepts (each kind at most every NOTE_EVERY_S).
        self._notes = _Notes(log)
        self._server = socket.create_server((host, port), reuse_port=False)
        self._server.setblocking(False)
        self.host = str(self._server.getsockname()[0])
        self.port = int(self._server.getsockname()[1])
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._server, selectors.EVENT_READ)
        self._accepting = True
        self._resume_at = 0.0
        self._backoff = 0.0
        self._greeters: set[_Conn] = set()
        self._members: dict[int, _Conn] = {}
        self._gone: dict[int, str] = {}
        self._lock = threading.Lock()
        self._said: list[tuple[Callable[[str], None] | None, str]] = []
        self._started = time.monotonic()
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="cf-group-leader", daemon=True)

    def start(self) -> LeaderWatch:
        self._thread.start()
        return self

    def joined(self) -> list[int]:
        with self._lock:
            return sorted({*self._members, *self._gone})

    def connections(self) -> int:
        """Open connections, greeters included (bounded by MAX_GREETERS + nnodes - 1)."""
        with self._lock:
            return len(self._greeters) + len(self._members)

    def buffered(self) -> int:
        """Bytes held for all connections, read and unsent (bounded by the connections' count times
        MAX_LINE + 4096 + MAX_UNSENT)."""
        with self._lock:
            return sum(len(c.lines) + len(c.unsent) for c in [*self._greeters, *self._members.values()])

    def alive(self) -> bool:
        """Whether the watch's thread still runs (it ends only with :meth:`close`)."""
        return self._thread.is_alive()

    def problem(self) -> str | None:
        """Why the group cannot serve, or None."""
        with self._lock:
            if self._gone:
                rank = min(self._gone)
                return f"worker rank {rank} of the group is gone ({self._gone[rank]})"
            missing = [rank for rank in range(1, self.nnodes) if rank not in self._members]
        if missing and time.monotonic() - self._started > self.join_timeout_s:
            names = ", ".join(str(rank) for rank in missing)
            return (f"worker rank {names} of the group did not join within {self.join_timeout_s:g} s "
                    "(CF_JOIN_TIMEOUT_S)")
        return None

    def lost(self) -> list[int]:
        """The worker ranks the group has lost, as :meth:`problem` decides: gone, or not joined within
        the join timeout (the metric ``carbonforge_group_hosts_lost`` counts them)."""
        with self._lock:
            gone = set(self._gone)
            missing = {rank for rank in range(1, self.nnodes) if rank not in self._members}
        late = time.monotonic() - self._started > self.join_timeout_s
        return sorted(gone | missing if late else gone)

    # --- the loop -------------------------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._stopping:
            try:
                ready = self._selector.select(timeout=min(0.1, BEAT_S))
                with self._lock:
                    if self._stopping:
                        break
                    self._turn(ready, time.monotonic())
            except Exception as exc:  # the watch must outlive anything one peer causes
                with self._lock:
                    self._warn("loop", f"group: the watch on port {self.port} hit an error, going on: {exc!r}")
                time.sleep(0.1)
            self._speak()

    def _turn(self, ready: list[tuple[selectors.SelectorKey, int]], now: float) -> None:
        for key, _ in ready:
            if key.fileobj is self._server:
                self._accept(now)
            elif isinstance(key.data, _Conn):
                self._read(key.data, now)
        if not self._accepting and now >= self._resume_at and not self._stopping:
            self._selector.register(self._server, selectors.EVENT_READ)
            self._accepting = True
        for conn in list(self._greeters):
            if now > conn.deadline:
                self._drop(conn, now, f"gave no valid join within {HELLO_S:g} s")
        for rank, conn in list(self._members.items()):
            if now - conn.heard > SILENCE_S:
                self._lose(rank, conn, f"silent for {SILENCE_S:g} s")
            elif now >= conn.next_beat:
                conn.next_beat = now + BEAT_S
                self._send(conn, "beat")
        for conn in [*self._greeters, *self._members.values()]:
            self._flush(conn)

    def _accept(self, now: float) -> None:
        for _ in range(MAX_GREETERS + self.nnodes):  # a burst is taken in turns with the peers' lines
            try:
                sock, address = self._server.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno not in _OUT_OF_RESOURCES:  # e.g. a connection reset before its accept
                    continue
                self._backoff = min(ACCEPT_BACKOFF_MAX_S, max(0.05, self._backoff * 2))
                self._warn("accept", f"group: cannot accept on port {self.port} ({exc.strerror or exc}); "
                           f"accepting again in {self._backoff:g} s")
                self._selector.unregister(self._server)
                self._accepting = False
                self._resume_at = now + self._backoff
                return
            sock.setblocking(False)  # nothing on this thread waits on a peer
            self._backoff = 0.0
            peer = _address(address)
            if len(self._greeters) >= MAX_GREETERS:
                self._warn("busy", f"group: closed a connection from {peer}: {MAX_GREETERS} others are still "
                           "to prove the group secret")
                with contextlib.suppress(OSError):
                    sock.send(b"busy\n")  # a worker tries again
                _close(sock)
                continue
            conn = _Conn(sock, peer, now)
            self._greeters.add(conn)
            self._selector.register(sock, selectors.EVENT_READ, conn)
            conn.unsent += f"hello {PROTOCOL} {conn.nonce.hex()}\n".encode("ascii")

    def _read(self, conn: _Conn, now: float) -> None:
        try:
            data = conn.sock.recv(4096)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._end(conn, now, f"connection lost ({exc.strerror or exc})")
            return
        if not data:
            self._end(conn, now, "connection closed")
            return
        lines = conn.lines.feed(data)
        if lines is None:
            self._end(conn, now, f"sent a line over {MAX_LINE} bytes")
            return
        for line in lines:
            if conn.rank is None:
                self._hello(conn, line, now)
                if conn.rank is None:  # refused: nothing more from it is read
                    return
            elif _opened(conn.key, _FROM_WORKER, conn.seq_in, line) is not None:
                conn.seq_in += 1
                conn.heard = now
            else:
                self._warn("forged", f"group: ignored a line from {conn.peer} (worker rank {conn.rank}'s "
                           "connection) that does not carry the group's MAC")

    def _hello(self, conn: _Conn, line: bytes, now: float) -> None:
        """``join <rank> <nnodes> <worker nonce> <mac>``: a rank of this group that proves the secret."""
        words = line.decode("ascii", "replace").split()
        shaped = (len(words) == 5 and words[0] == "join" and words[1].isdigit() and words[2].isdigit()
                  and len(words[3]) == 2 * _NONCE_BYTES and all(c in "0123456789abcdef" for c in words[3]))
        if not shaped:
            self._refuse(conn, now, "protocol", "did not send a join")
            return
        rank, nnodes, worker_nonce = int(words[1]), int(words[2]), bytes.fromhex(words[3])
        expected = _proof(self._secret, b"join", conn.nonce, worker_nonce, rank, nnodes)
        if not hmac.compare_digest(expected.encode(), words[4].encode("ascii", "replace")):
            self._refuse(conn, now, "secret", "did not prove the group secret")
            return
        if nnodes != self.nnodes or not 0 < rank < self.nnodes:
            self._refuse(conn, now, "rank", f"is rank {rank} of {nnodes} hosts, not a worker of this group")
            return
        self._greeters.discard(conn)
        conn.rank, conn.heard, conn.next_beat = rank, now, now + BEAT_S
        conn.key = _session_key(self._secret, conn.nonce, worker_nonce)
        old = self._members.get(rank)
        self._members[rank] = conn
        self._gone.pop(rank, None)
        if old is not None:
            self._forget(old)
        welcome = _proof(self._secret, b"welcome", conn.nonce, worker_nonce, rank, nnodes)
        conn.unsent += f"welcome {welcome}\n".encode("ascii")
        again = " again" if old is not None else ""
        self._said.append((self.on_join, f"group: worker rank {rank} joined{again} ({len(self._members)} of "
                                         f"{self.nnodes - 1} worker(s))"))

    def _refuse(self, conn: _Conn, now: float, why: str, what: str) -> None:
        conn.unsent += f"refused {why}\n".encode("ascii")
        self._flush(conn)
        self._drop(conn, now, what)

    # --- sending and ending -----------------------------------------------------------------------------

    def _send(self, conn: _Conn, word: str) -> None:
        if len(conn.unsent) < MAX_UNSENT:  # a peer that does not read gets no pile of beats
            conn.unsent += _sealed(conn.key, _FROM_LEADER, conn.seq_out, word)
            conn.seq_out += 1

    def _flush(self, conn: _Conn) -> None:
        while conn.unsent:
            try:
                sent = conn.sock.send(conn.unsent)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return  # the reader sees the connection end
            del conn.unsent[:sent]

    def _end(self, conn: _Conn, now: float, reason: str) -> None:
        if conn.rank is not None and self._members.get(conn.rank) is conn:
            self._lose(conn.rank, conn, reason)
        else:
            self._drop(conn, now, reason)

    def _lose(self, rank: int, conn: _Conn, reason: str) -> None:
        """A worker's connection ended: that rank is gone."""
        self._gone[rank] = reason
        del self._members[rank]
        self._forget(conn)

    def _drop(self, conn: _Conn, now: float, reason: str) -> None:
        """A connection that never proved the secret ends; the group does not change."""
        if conn in self._greeters:
            self._warn("refused", f"group: refused a connection from {conn.peer}: it {reason}")
        self._greeters.discard(conn)
        self._forget(conn)

    def _forget(self, conn: _Conn) -> None:
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(conn.sock)
        _close(conn.sock)

    def _warn(self, kind: str, text: str) -> None:
        for line in self._notes.note(kind, text, time.monotonic()):
            self._said.append((self._notes.log, line))

    def _speak(self) -> None:
        """Log what the last turn said, outside the lock."""
        with self._lock:
            said, self._said = self._said, []
        for to, line in said:
            if to is not None:
                to(line)

    def close(self, farewell: bool = False) -> None:
        """Stop watching and close every connection: the workers see their leader go (with
        ``farewell``, told first that this is an orderly stop). Takes at most about CLOSE_S: nothing
        here waits on a peer."""
        self._stopping = True
        if self._thread.is_alive():
            self._thread.join(CLOSE_S)
        with self._lock:
            conns = [*self._greeters, *self._members.values()]
            self._greeters.clear()
            for conn in conns:
                if farewell and conn.rank is not None:
                    self._send(conn, "bye")
                self._flush(conn)  # non-blocking: what does not fit now is not waited for
                with contextlib.suppress(OSError):
                    conn.sock.shutdown(socket.SHUT_WR)  # the bye, then the end, go out before the close
                _drain(conn.sock)
                self._forget(conn)
            _close(self._server)
            with contextlib.suppress(Exception):
                self._selector.close()
        self._speak()


def _address(address: object) -> str:
    if isinstance(address, tuple) and len(address) >= 2:
        return f"{address[0]}:{address[1]}"
    return str(address)


def _close(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.close()


def _drain(sock: socket.socket) -> None:
    """Read what the peer sent and nobody will read, without waiting: closing a socket with unread data
    resets the connection, which may discard the farewell on its way."""
    with contextlib.suppress(OSError):
        for _ in range(16):
            if not sock.recv(4096):
                return


def listen_address(leader: str, fallback: str) -> tuple[str, str | None]:
    """Where the leader's watch port listens: the leader's address, the one its workers are told to
    connect to, when it is an address of this host; else ``fallback`` (CF_HOST), with the line that
    says why. A name is resolved once (no wait beyond the system resolver's own)."""
    try:
        infos = socket.getaddrinfo(leader, None, type=socket.SOCK_STREAM)
    except OSError as exc:
        return fallback, f"the leader's address {leader} does not resolve here ({exc.strerror or exc})"
    for family, kind, proto, _, address in infos:
        try:
            with socket.socket(family, kind, proto) as probe:
                probe.bind((address[0], 0))
        except OSError:
            continue
        return str(address[0]), None
    found = ", ".join(dict.fromkeys(str(info[4][0]) for info in infos))
    return fallback, f"the leader's address {leader} ({found}) is not an address of this host"


class WorkerWatch:
    """A worker's side: keeps a connection to the leader's watch port, proving ``secret`` and asking
    the leader to prove it back."""

    def __init__(self, rank: int, nnodes: int, leader: str, port: int, join_timeout_s: float, *, secret: bytes,
                 on_join: Callable[[str], None] | None = None) -> None:
        if not secret:
            raise ValueError("a group watch needs the group secret")
        self.rank, self.nnodes, self.leader, self.port = rank, nnodes, leader, port
        self.join_timeout_s = join_timeout_s
        self._secret = secret
        #: Told a line for the log once the leader welcomed this worker.
        self.on_join = on_join
        self._sock: socket.socket | None = None
        self._key = b""
        self._reader = LineReader()
        #: Lines read with the greeting that came in the same packets (the leader's first beats).
        self._early: list[bytes] = []
        self._problem: str | None = None
        self._welcomed = threading.Event()
        self._stopping = False
        #: The leader said it stops the group (an orderly end, not a loss).
        self.farewell = False
        self._thread = threading.Thread(target=self._run, name="cf-group-worker", daemon=True)

    @property
    def where(self) -> str:
        return f"{self.leader}:{self.port}"

    def start(self) -> WorkerWatch:
        self._thread.start()
        return self

    @property
    def joined(self) -> bool:
        return self._welcomed.is_set()

    def problem(self) -> str | None:
        return self._problem

    def leader_gone(self) -> bool:
        return self._problem is not None

    def _run(self) -> None:
        deadline = time.monotonic() + self.join_timeout_s
        last = ""
        while not self._stopping:
            sock = self._connect(deadline)
            if sock is None:
                return
            try:
                outcome = self._join(sock)
            except OSError as exc:
                outcome = f"connection lost ({exc.strerror or exc})"
            if outcome is None:
                self._follow(sock)
                return
            _close(sock)
            if self._problem is not None:
                return
            last = outcome  # the leader was busy, or the connection broke before the join: try again
            if time.monotonic() > deadline:
                self._problem = (f"the group's leader {self.where} could not be joined within "
                                 f"{self.join_timeout_s:g} s (CF_JOIN_TIMEOUT_S): {last}")
                return
            time.sleep(1.0)

    def _connect(self, deadline: float) -> socket.socket | None:
        while not self._stopping:
            try:
                sock = socket.create_connection((self.leader, self.port), timeout=min(5.0, self.join_timeout_s))
            except OSError as exc:
                if time.monotonic() > deadline:
                    self._problem = (f"the group's leader {self.where} could not be reached within "
                                     f"{self.join_timeout_s:g} s (CF_JOIN_TIMEOUT_S): {exc.strerror or exc}")
                    return None
                time.sleep(1.0)
                continue
            self._sock = sock
            if self._stopping:
                _close(sock)
                return None
            return sock
        return None

    def _join(self, sock: socket.socket) -> str | None:
        """The greeting: None once welcomed (the problem is set when the leader refused this worker for
        good), else what went wrong, for another try."""
        reader, early = LineReader(), list[bytes]()
        hello_by = time.monotonic() + HELLO_S
        words = _next_line(sock, reader, hello_by, early)
        if words is None:
            return f"no greeting within {HELLO_S:g} s"
        if words == ["busy"]:
            return "the leader was busy with other connections"
        if len(words) != 3 or words[:2] != ["hello", PROTOCOL] or len(words[2]) != 2 * _NONCE_BYTES:
            self._problem = (f"the group's leader {self.where} does not speak this runtime's group protocol "
                             f"({PROTOCOL}): run the same runtime version on every host of the group")
            return "refused"
        try:
            leader_nonce = bytes.fromhex(words[2])
        except ValueError:
            return "a greeting that is not hexadecimal"
        nonce = secrets.token_bytes(_NONCE_BYTES)
        proof = _proof(self._secret, b"join", leader_nonce, nonce, self.rank, self.nnodes)
        sock.settimeout(max(0.1, hello_by - time.monotonic()))
        sock.sendall(f"join {self.rank} {self.nnodes} {nonce.hex()} {proof}\n".encode("ascii"))
        words = _next_line(sock, reader, hello_by, early)
        if words is None:
            return f"no answer to the join within {HELLO_S:g} s"
        if words[:1] == ["refused"]:
            self._problem = (f"the group's leader {self.where} refused rank {self.rank} of {self.nnodes} hosts"
                             f"{_REFUSALS.get(' '.join(words[1:2]), '')}")
            return "refused"
        expected = _proof(self._secret, b"welcome", leader_nonce, nonce, self.rank, self.nnodes)
        if len(words) != 2 or words[0] != "welcome" or not hmac.compare_digest(expected.encode(),
                                                                                 words[1].encode("ascii", "replace")):
            self._problem = (f"the group's leader {self.where} did not prove the group secret: check that every "
                             "host of the group has the same one (CF_GROUP_SECRET_FILE)")
            return "refused"
        self._key = _session_key(self._secret, leader_nonce, nonce)
        self._reader, self._early = reader, early
        self._welcomed.set()
        if self.on_join is not None:
            self.on_join(f"group: joined the leader {self.where} as rank {self.rank} of {self.nnodes} hosts")
        return None

    def _follow(self, sock: socket.socket) -> None:
        """Beat every BEAT_S and read the leader's lines until it is gone, says bye, or this side stops."""
        key, reader = self._key, self._reader
        seq_in = seq_out = 0
        heard = next_beat = time.monotonic()
        reason = ""
        pending: list[bytes] | None = self._early
        while not self._stopping:
            for line in pending or []:
                word = _opened(key, _FROM_LEADER, seq_in, line)
                if word is None:
                    continue  # not the leader's: changes nothing
                seq_in += 1
                heard = time.monotonic()
                if word == "bye":
                    self.farewell = True
            pending = []
            now = time.monotonic()
            if now - heard > SILENCE_S:
                reason = f"silent for {SILENCE_S:g} s"
                break
            if now >= next_beat:
                try:
                    sock.settimeout(SILENCE_S)  # a leader that reads nothing for that long is gone too
                    sock.sendall(_sealed(key, _FROM_WORKER, seq_out, "beat"))
                except OSError as exc:
                    reason = f"connection lost ({exc.strerror or exc})"
                    break
                seq_out += 1
                next_beat = now + BEAT_S
            try:
                sock.settimeout(max(0.01, min(next_beat, heard + SILENCE_S) - time.monotonic()))
                data = sock.recv(4096)
            except TimeoutError:
                continue
            except OSError as exc:
                reason = f"connection lost ({exc.strerror or exc})"
                break
            if not data:
                reason = "connection closed"
                break
            pending = reader.feed(data)
            if pending is None:
                reason = f"sent a line over {MAX_LINE} bytes"
                break
        _close(sock)
        if reason and not self._stopping and self._problem is None:
            self._problem = f"the group's leader {self.where} is gone ({reason})"

    def close(self) -> None:
        self._stopping = True
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)
            _close(self._sock)


#: What a worker says about the leader's reason for a refusal.
_REFUSALS = {
    "secret": ": the group secret differs; give every host of the group the same one (CF_GROUP_SECRET_FILE)",
    "rank": ": not a worker rank of its group; check CF_NNODES and CF_NODE_RANK on every host",
    "protocol": ": the join was not understood; run the same runtime version on every host of the group",
}


def _next_line(sock: socket.socket, reader: LineReader, deadline: float, pending: list[bytes]) -> list[str] | None:
    """The words of the next line, by ``deadline`` (a monotonic time), or None. Lines that came with it
    stay in ``pending``, first in line for the next call."""
    while not pending:
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        sock.settimeout(left)
        try:
            data = sock.recv(4096)
        except TimeoutError:
            return None
        if not data:
            return None
        lines = reader.feed(data)
        if lines is None:
            return None
        pending += lines
    return pending.pop(0).decode("ascii", "replace").split()


# --- what the supervisor asks of a host of a group ---------------------------------------------------

#: How long the leader answers /health with 503 before it stops its engine, so that probes and load
#: balancers see the group go down rather than only a refused connection.
UNHEALTHY_HOLD_S = 3.0


class LeaderHooks(GroupHooks):
    """The leader: the group is lost when a worker leaves or never joins; /health then answers 503."""

    def __init__(self, watch: LeaderWatch, down_file: Path) -> None:
        self.watch = watch
        self.down_file = down_file

    def loss(self) -> GroupLoss | None:
        problem = self.watch.problem()
        return GroupLoss(problem) if problem else None

    def hosts_lost(self) -> int:
        return len(self.watch.lost())

    def on_loss(self, loss: GroupLoss) -> None:
        with contextlib.suppress(OSError):  # a link planted in its place is refused, its target untouched
            os.close(files.open_append(self.down_file, 0o644))
        time.sleep(UNHEALTHY_HOLD_S)

    def close(self) -> None:
        """The leader is done: tell every worker to stop, then close."""
        self.watch.close(farewell=True)
        with contextlib.suppress(OSError):
            self.down_file.unlink()


class WorkerHooks(GroupHooks):
    """A worker: the group is lost when its leader leaves (or is never reached); a stop signal waits
    for the leader to finish its drain first, since the leader's requests run on this host too."""

    hears_orderly_stop = True

    def __init__(self, watch: WorkerWatch) -> None:
        self.watch = watch

    def loss(self) -> GroupLoss | None:
        if self.watch.farewell:
            return GroupLoss(f"the group's leader {self.watch.leader} stopped the group", orderly=True)
        problem = self.watch.problem()
        return GroupLoss(problem) if problem else None

    def hosts_lost(self) -> int:
        """1 once the leader is gone or was never reached; 0 when it stopped the group in order."""
        return 0 if self.watch.farewell or self.watch.problem() is None else 1

    def before_stop(self, deadline: float, hurry: Callable[[], bool]) -> None:
        while self.watch.joined and not self.watch.leader_gone() and time.monotonic() < deadline and not hurry():
            time.sleep(0.2)

    def close(self) -> None:
        self.watch.close()
