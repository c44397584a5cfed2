"""The runtimes of a multi-host group watch each other, so that the group fails as one.

vLLM alone does not: when a worker's engine dies the leader's ``/health`` stays 200 until a request
fails, and a headless worker outlives its leader for minutes. So the runtimes keep one TCP connection
from each worker to the leader, on ``CF_GROUP_PORT`` of the leader, for as long as each serves:

- a worker connects (retrying until the join timeout), says ``join <rank> <hosts>``, and then each
  side sends ``beat`` every second;
- a connection that closes (the peer runtime exited, or was killed: the kernel closes its sockets)
  or stays silent for :data:`SILENCE_S` (the peer's host is gone) means that peer is gone.

The leader reports a worker that never joined within the join timeout, or one that left; a worker
reports a leader it could not reach in time, or one that left. The supervisor polls :meth:`problem`
and stops its engine. Nothing here decides what to do about it.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

from carbonforge_runtime import files
from carbonforge_runtime.runtime.process.supervisor import GroupHooks, GroupLoss

#: Seconds between two heartbeats, each way.
BEAT_S = 1.0
#: A peer silent for this long is gone (a host that vanished sends no FIN).
SILENCE_S = 10.0
#: How long a join line may take to arrive on a new connection.
HELLO_S = 5.0


class _Peer:
    """One connection: sends a beat every BEAT_S, reads the peer's lines; ``gone`` says why it ended."""

    def __init__(self, sock: socket.socket, on_line: Callable[[str], None] | None = None) -> None:
        self.sock = sock
        self.on_line = on_line
        self.gone: str | None = None
        self._lock = threading.Lock()
        self._closing = False
        sock.settimeout(SILENCE_S)

    def send(self, line: str) -> None:
        with self._lock:
            self.sock.sendall(line.encode("ascii") + b"\n")

    def run(self) -> None:
        """Read until the peer is gone (own thread); a second thread beats."""
        threading.Thread(target=self._beat, name="cf-group-beat", daemon=True).start()
        buffer = b""
        reason = ""
        while not reason:
            try:
                data = self.sock.recv(4096)
            except TimeoutError:
                reason = f"silent for {SILENCE_S:g} s"
                break
            except OSError as exc:
                reason = f"connection lost ({exc.strerror or exc})"
                break
            if not data:
                reason = "connection closed"
                break
            buffer += data
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                if self.on_line is not None:
                    self.on_line(line.decode("ascii", "replace").strip())
        if not self._closing:  # a connection we closed ourselves is no loss
            self.gone = reason
        with contextlib.suppress(OSError):
            self.sock.close()

    def _beat(self) -> None:
        while self.gone is None and not self._closing:  # ends with the connection
            try:
                self.send("beat")
            except OSError:
                return
            time.sleep(BEAT_S)

    def close(self) -> None:
        self._closing = True
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self.sock.close()


class LeaderWatch:
    """The leader's side: listens on ``port`` and follows every worker rank 1..nnodes-1."""

    def __init__(self, nnodes: int, port: int, join_timeout_s: float, host: str = "",
                 on_join: Callable[[str], None] | None = None) -> None:
        self.nnodes = nnodes
        self.join_timeout_s = join_timeout_s
        #: Told a line for the log when a worker joins (or joins again).
        self.on_join = on_join
        self._server = socket.create_server((host, port), reuse_port=False)
        self._server.settimeout(0.5)
        self.port = int(self._server.getsockname()[1])
        self._peers: dict[int, _Peer] = {}
        self._lock = threading.Lock()
        self._started = time.monotonic()
        self._stopping = False
        self._thread = threading.Thread(target=self._accept, name="cf-group-leader", daemon=True)

    def start(self) -> LeaderWatch:
        self._thread.start()
        return self

    def joined(self) -> list[int]:
        with self._lock:
            return sorted(self._peers)

    def problem(self) -> str | None:
        """Why the group cannot serve, or None."""
        with self._lock:
            for rank, peer in sorted(self._peers.items()):
                if peer.gone is not None:
                    return f"worker rank {rank} of the group is gone ({peer.gone})"
            missing = [rank for rank in range(1, self.nnodes) if rank not in self._peers]
        if missing and time.monotonic() - self._started > self.join_timeout_s:
            names = ", ".join(str(rank) for rank in missing)
            return (f"worker rank {names} of the group did not join within {self.join_timeout_s:g} s "
                    "(CF_JOIN_TIMEOUT_S)")
        return None

    def _accept(self) -> None:
        while not self._stopping:
            try:
                conn, _ = self._server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=self._greet, args=(conn,), name="cf-group-join", daemon=True).start()

    def _greet(self, conn: socket.socket) -> None:
        """Read ``join <rank> <hosts>``; keep the connection of a rank that belongs to this group."""
        conn.settimeout(HELLO_S)
        try:
            hello = conn.makefile("rb").readline(64).decode("ascii", "replace").split()
        except OSError:
            conn.close()
            return
        valid = (len(hello) == 3 and hello[0] == "join" and hello[1].isdigit() and hello[2] == str(self.nnodes)
                 and 0 < int(hello[1]) < self.nnodes)
        if not valid:
            with contextlib.suppress(OSError):
                conn.sendall(b"refused\n")
            conn.close()
            return
        peer = _Peer(conn)
        with self._lock:
            old = self._peers.get(int(hello[1]))
            self._peers[int(hello[1])] = peer
        if old is not None:
            old.close()
        with contextlib.suppress(OSError):
            peer.send("welcome")
        if self.on_join is not None:
            again = " again" if old is not None else ""
            self.on_join(f"group: worker rank {hello[1]} joined{again} ({len(self.joined())} of "
                         f"{self.nnodes - 1} worker(s))")
        peer.run()

    def close(self, farewell: bool = False) -> None:
        """Stop watching and close every connection: the workers see their leader go (with
        ``farewell``, told first that this is an orderly stop)."""
        self._stopping = True
        with contextlib.suppress(OSError):
            self._server.close()
        with self._lock:
            peers = list(self._peers.values())
        for peer in peers:
            if farewell:
                with contextlib.suppress(OSError):
                    peer.send("bye")
            peer.close()


class WorkerWatch:
    """A worker's side: keeps a connection to the leader's watch port."""

    def __init__(self, rank: int, nnodes: int, leader: str, port: int, join_timeout_s: float,
                 on_join: Callable[[str], None] | None = None) -> None:
        self.rank, self.nnodes, self.leader, self.port = rank, nnodes, leader, port
        self.join_timeout_s = join_timeout_s
        #: Told a line for the log once the leader welcomed this worker.
        self.on_join = on_join
        self._peer: _Peer | None = None
        self._problem: str | None = None
        self._welcomed = threading.Event()
        self._stopping = False
        #: The leader said it stops the group (an orderly end, not a loss).
        self.farewell = False
        self._thread = threading.Thread(target=self._run, name="cf-group-worker", daemon=True)

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
        where = f"{self.leader}:{self.port}"
        while not self._stopping:
            try:
                sock = socket.create_connection((self.leader, self.port), timeout=min(5.0, self.join_timeout_s))
                break
            except OSError as exc:
                if time.monotonic() > deadline:
                    self._problem = (f"the group's leader {where} could not be reached within "
                                     f"{self.join_timeout_s:g} s (CF_JOIN_TIMEOUT_S): {exc.strerror or exc}")
                    return
                time.sleep(1.0)
        else:
            return

        def on_line(line: str) -> None:
            if line == "welcome":
                self._welcomed.set()
                if self.on_join is not None:
                    self.on_join(f"group: joined the leader {where} as rank {self.rank} of {self.nnodes} hosts")
            elif line == "bye":
                self.farewell = True
            elif line == "refused":
                self._problem = f"the group's leader {where} refused rank {self.rank} of {self.nnodes} hosts"

        peer = _Peer(sock, on_line)
        self._peer = peer
        try:
            peer.send(f"join {self.rank} {self.nnodes}")
        except OSError as exc:
            self._problem = f"the group's leader {where} is gone (connection lost: {exc.strerror or exc})"
            return
        peer.run()
        if peer.gone is not None and not self._stopping and self._problem is None:
            self._problem = f"the group's leader {where} is gone ({peer.gone})"

    def close(self) -> None:
        self._stopping = True
        if self._peer is not None:
            self._peer.close()


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

    def before_stop(self, deadline: float, hurry: Callable[[], bool]) -> None:
        while self.watch.joined and not self.watch.leader_gone() and time.monotonic() < deadline and not hurry():
            time.sleep(0.2)

    def close(self) -> None:
        self.watch.close()
