"""The runtime side of the metrics feed: binds the engine's datagram socket and hands every decoded
message to the metrics state. The wire format is :mod:`carbonforge_runtime.core.feed_protocol`."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass

from carbonforge_runtime.core.feed_protocol import (
    KIND_COUNTERS,
    KIND_RECORDS,
    MAX_DATAGRAM_BYTES,
    VERSION,
    EngineState,
    RequestSample,
    dp_rank_of,
)

#: The receive buffer the runtime asks for (the kernel may cap it at net.core.rmem_max).
RECEIVE_BUFFER_BYTES = 4 * 1024 * 1024

@dataclass
class ReceiverStats:
    messages: int = 0
    lost: int = 0  # sequence numbers never received
    malformed: int = 0


class FeedReceiver:
    """Binds the socket and hands every message to the callbacks on its own thread."""

    def __init__(self, path: str, on_records: Callable[[list[RequestSample], int], None],
                 on_state: Callable[[EngineState, int], None], log: logging.Logger) -> None:
        """``on_records(samples, dp_rank)`` and ``on_state(state, dp_rank)`` get each message with
        the data-parallel rank of the engine core that sent it."""
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
            rank = dp_rank_of(message)
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
            if message.get("k") == KIND_RECORDS:
                self.on_records([RequestSample.from_compact(r) for r in message.get("r") or []], rank)
            elif message.get("k") == KIND_COUNTERS:
                self.on_state(EngineState.from_message(message.get("c") or {}, message.get("s") or {}), rank)
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
