"""The engine side of the metrics feed: completed records and the engine's counters, sent to the
runtime as datagrams that never block the engine.

The runtime binds the socket and names it in the engine contract's ``metrics_feed`` part.
:class:`FeedSink` is one more sink of the trace writer (records reach it on the writer's own thread,
never on the engine loop) and also sends the engine's counters every :data:`COUNTERS_INTERVAL_S`
from a small thread of its own. A send that cannot go out at once (the runtime slow or gone) is
dropped; the sequence numbers let the runtime count it. The wire format is
:mod:`carbonforge_runtime.core.feed_protocol`.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from carbonforge_runtime.core.feed_protocol import (
    RECORDS_PER_DATAGRAM,
    EngineCounters,
    encode_counters,
    encode_records,
    sink_kind,
)

COUNTERS_INTERVAL_S = 0.5

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

    def __init__(self, path: str, interval_s: float = COUNTERS_INTERVAL_S, dp_rank: int = 0) -> None:
        self.name = f"metrics feed {path}"
        self.sender = FeedSender(path)
        self.dp_rank = dp_rank
        self.interval_s = interval_s
        self._state: Callable[[], tuple[EngineCounters, Mapping[str, tuple[int, int]]]] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def write(self, records: Sequence[Mapping[str, Any]]) -> None:
        """Never raises and never blocks: a datagram the runtime cannot take now is counted as lost."""
        sender = self.sender
        for i in range(0, len(records), RECORDS_PER_DATAGRAM):
            sender.send(encode_records(sender.sid, sender.next_seq(), records[i:i + RECORDS_PER_DATAGRAM],
                                       self.dp_rank))

    def send_state(self) -> None:
        if self._state is None:
            return
        counters, sinks = self._state()
        self.sender.send(encode_counters(self.sender.sid, self.sender.next_seq(), counters, sinks, self.dp_rank))

    def follow(self, state: Callable[[], tuple[EngineCounters, Mapping[str, tuple[int, int]]]]) -> None:
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

    def state() -> tuple[EngineCounters, Mapping[str, tuple[int, int]]]:
        sinks: dict[str, tuple[int, int]] = {}
        for worker in writer.workers:
            if worker.sink is feed:
                continue
            kind = sink_kind(worker.sink.name)
            written, dropped = sinks.get(kind, (0, 0))
            sinks[kind] = (written + worker.stats.written, dropped + worker.stats.dropped)
        if len(sinks):
            sinks["queue"] = (0, writer.intake_dropped + writer.build_failed)
        return writer.counters, sinks

    feed.follow(state)
    return feed
