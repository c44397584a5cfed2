"""The engine-to-runtime feed: JSON datagrams on a Unix socket, never blocking the engine.

The runtime binds a ``SOCK_DGRAM`` Unix socket in a private temporary directory and passes its path
to the scheduler shim in ``TraceConfig.extra`` (:data:`FEED_KEY`). In the engine process,
:class:`FeedSink` is one more trace sink (so completed records reach it on the trace writer's own
thread, never on the engine loop) and also sends the engine's counters every
:data:`COUNTERS_INTERVAL_S` from a small thread of its own. Sends are non-blocking: when the
runtime is slow or gone the datagram is dropped. Every message carries a sequence number, so the
runtime counts what it never received.

Messages (one JSON object per datagram, ``v`` = :data:`VERSION`):

* ``{"k": "r", "sid", "seq", "r": [compact record, ...]}``: completed requests;
* ``{"k": "c", "sid", "seq", "c": {counters}, "s": {sink: [written, dropped]}}``: engine state.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

#: Key of the feed settings in ``TraceConfig.extra``: {"socket": path}.
FEED_KEY = "metrics_feed"
VERSION = 1
COUNTERS_INTERVAL_S = 0.5
#: Records per datagram (a compact record is about 150 bytes; datagrams stay far below the socket limit).
RECORDS_PER_DATAGRAM = 150
#: The receive buffer the runtime asks for (the kernel may cap it at net.core.rmem_max).
RECEIVE_BUFFER_BYTES = 4 * 1024 * 1024
MAX_DATAGRAM_BYTES = 256 * 1024


def compact(record: Mapping[str, Any]) -> dict[str, Any]:
    """The part of a trace record the metrics need (never any text)."""
    return {
        "f": record.get("scheduler_family"),
        "fr": record.get("finish_reason"),
        "qw": record.get("queue_wait_s"),
        "tt": record.get("ttft_s"),
        "e2e": record.get("e2e_latency_s"),
        "pt": record.get("prompt_tokens"),
        "ot": record.get("output_tokens"),
        "ej": record.get("energy_j"),
    }


@dataclass(frozen=True)
class RequestSample:
    """One completed request as the runtime receives it."""

    family: str
    finish_reason: str
    queue_wait_s: float
    ttft_s: float | None
    e2e_latency_s: float
    prompt_tokens: int
    output_tokens: int
    energy_j: float | None

    @classmethod
    def from_compact(cls, data: Mapping[str, Any]) -> RequestSample:
        def number(key: str) -> float | None:
            value = data.get(key)
            return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None

        return cls(
            family=str(data.get("f") or "unknown"),
            finish_reason=str(data.get("fr") or "unknown"),
            queue_wait_s=number("qw") or 0.0,
            ttft_s=number("tt"),
            e2e_latency_s=number("e2e") or 0.0,
            prompt_tokens=int(number("pt") or 0),
            output_tokens=int(number("ot") or 0),
            energy_j=number("ej"),
        )


@dataclass(frozen=True)
class EngineState:
    """The engine's counters at one moment, and its trace sinks' record counts."""

    steps: int = 0
    waiting: int = 0
    running: int = 0
    tokens_scheduled_total: int = 0
    requests_arrived_total: int = 0
    requests_completed_total: int = 0
    #: sink kind ("file", "otlp", "queue") -> (records written, records dropped)
    sinks: Mapping[str, tuple[int, int]] = field(default_factory=dict)

    @classmethod
    def from_message(cls, counters: Mapping[str, Any], sinks: Mapping[str, Any]) -> EngineState:
        values = {name: int(counters.get(name, 0) or 0) for name in
                  ("steps", "waiting", "running", "tokens_scheduled_total", "requests_arrived_total",
                   "requests_completed_total")}
        table = {str(k): (int(v[0]), int(v[1])) for k, v in sinks.items()
                 if isinstance(v, (list, tuple)) and len(v) == 2}
        return cls(sinks=table, **values)


def encode_records(sid: str, seq: int, records: Sequence[Mapping[str, Any]]) -> bytes:
    return json.dumps({"v": VERSION, "k": "r", "sid": sid, "seq": seq, "r": [compact(r) for r in records]},
                      separators=(",", ":")).encode()


def encode_counters(sid: str, seq: int, counters: Mapping[str, Any], sinks: Mapping[str, tuple[int, int]]) -> bytes:
    return json.dumps({"v": VERSION, "k": "c", "sid": sid, "seq": seq, "c": dict(counters),
                       "s": {k: list(v) for k, v in sinks.items()}}, separators=(",", ":")).encode()


def sink_kind(name: str) -> str:
    """``'file /var/log/t.jsonl'`` -> ``'file'``, ``'OTLP grpc http://...'`` -> ``'otlp'``."""
    return (name.split(" ", 1)[0] or "sink").lower()


# ---- engine side -------------------------------------------------------------------------------


class FeedSender:
    """A non-blocking datagram sender: a send either goes out at once or is counted as failed."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.sid = uuid.uuid4().hex[:12]
        self.sent = 0
        self.failed = 0
        self._seq = 0
        self._lock = threading.Lock()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.setblocking(False)

    def next_seq(self) -> int:
        with self._lock:
            self._seq += 1
            return self._seq

    def send(self, data: bytes) -> bool:
        try:
            self._sock.sendto(data, self.path)
        except OSError:  # receiver busy (EAGAIN), gone (ENOENT, ECONNREFUSED), or message too big
            self.failed += 1
            return False
        self.sent += 1
        return True

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.close()


class FeedSink:
    """A trace sink that forwards records to the runtime's metrics (see the module doc)."""

    def __init__(self, path: str, interval_s: float = COUNTERS_INTERVAL_S) -> None:
        self.name = f"metrics feed {path}"
        self.sender = FeedSender(path)
        self.interval_s = interval_s
        self._state: Callable[[], tuple[Mapping[str, Any], Mapping[str, tuple[int, int]]]] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def write(self, records: Sequence[Mapping[str, Any]]) -> None:
        """Never raises and never blocks: a datagram the runtime cannot take now is counted as lost."""
        sender = self.sender
        for i in range(0, len(records), RECORDS_PER_DATAGRAM):
            sender.send(encode_records(sender.sid, sender.next_seq(), records[i:i + RECORDS_PER_DATAGRAM]))

    def send_state(self) -> None:
        if self._state is None:
            return
        counters, sinks = self._state()
        self.sender.send(encode_counters(self.sender.sid, self.sender.next_seq(), counters, sinks))

    def follow(self, state: Callable[[], tuple[Mapping[str, Any], Mapping[str, tuple[int, int]]]]) -> None:
        """Send ``state()`` every ``interval_s`` from now on (and once more at close)."""
        self._state = state
        self._thread = threading.Thread(target=self._run, name="cf-metrics-feed", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            with contextlib.suppress(Exception):  # a torn read of the counters must not end the thread
                self.send_state()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(2.0)
        with contextlib.suppress(Exception):
            self.send_state()
        self.sender.close()


def attach(writer: Any) -> FeedSink | None:
    """Make the feed sink among ``writer``'s sinks (a ``TraceWriter``) send the engine's counters and the
    other sinks' record counts. Returns it, or ``None`` when the runtime asked for no feed."""
    feed = next((w.sink for w in writer.workers if isinstance(w.sink, FeedSink)), None)
    if feed is None:
        return None

    def state() -> tuple[Mapping[str, Any], Mapping[str, tuple[int, int]]]:
        sinks: dict[str, tuple[int, int]] = {}
        for worker in writer.workers:
            if worker.sink is feed:
                continue
            kind = sink_kind(worker.sink.name)
            written, dropped = sinks.get(kind, (0, 0))
            sinks[kind] = (written + worker.stats.written, dropped + worker.stats.dropped)
        if len(sinks):
            sinks["queue"] = (0, writer.intake_dropped + writer.build_failed)
        return asdict(writer.counters), sinks

    feed.follow(state)
    return feed


# ---- runtime side ------------------------------------------------------------------------------


@dataclass
class ReceiverStats:
    messages: int = 0
    lost: int = 0  # sequence numbers never received
    malformed: int = 0


class FeedReceiver:
    """Binds the socket and hands every message to the callbacks on its own thread."""

    def __init__(self, path: str, on_records: Callable[[list[RequestSample]], None],
                 on_state: Callable[[EngineState], None], log: logging.Logger) -> None:
        self.path = path
        self.on_records = on_records
        self.on_state = on_state
        self.log = log
        self.stats = ReceiverStats()
        self._last_seq: dict[str, int] = {}
        self._stop = threading.Event()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        with contextlib.suppress(OSError):
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RECEIVE_BUFFER_BYTES)
        self._sock.bind(path)
        os.chmod(path, 0o600)
        self._sock.settimeout(0.25)
        self._thread = threading.Thread(target=self._run, name="cf-metrics-receiver", daemon=True)

    def start(self) -> FeedReceiver:
        self._thread.start()
        return self

    def handle(self, data: bytes) -> None:
        """Decode and dispatch one datagram (public for tests)."""
        try:
            message = json.loads(data)
            if not isinstance(message, dict) or message.get("v") != VERSION:
                raise ValueError("unknown message")
            sid, seq = str(message["sid"]), int(message["seq"])
        except (ValueError, KeyError, TypeError):
            self.stats.malformed += 1
            return
        last = self._last_seq.get(sid)
        if last is not None and seq > last + 1:
            self.stats.lost += seq - last - 1
        if last is None or seq > last:
            self._last_seq[sid] = seq
        self.stats.messages += 1
        try:
            if message.get("k") == "r":
                self.on_records([RequestSample.from_compact(r) for r in message.get("r") or []])
            elif message.get("k") == "c":
                self.on_state(EngineState.from_message(message.get("c") or {}, message.get("s") or {}))
        except (ValueError, TypeError, AttributeError):
            self.stats.malformed += 1

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                data = self._sock.recv(MAX_DATAGRAM_BYTES)
            except TimeoutError:
                continue
            except OSError:
                if self._stop.is_set():
                    return
                continue
            try:
                self.handle(data)
            except Exception as exc:  # a bug in a callback must not stop the metrics
                self.log.warning("metrics feed: a message could not be applied: %s", exc)

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(2.0)
        with contextlib.suppress(OSError):
            self._sock.close()
        with contextlib.suppress(OSError):
            os.unlink(self.path)
