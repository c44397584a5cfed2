"""A stand-in for the vLLM process, for tests of what the runtime does around it (exit paths, GPU restore).

Run as ``python tests/support/engine_double.py [vLLM arguments]``: it answers ``/health`` on ``--port``, and,
like the scheduler shim, sends the runtime a few completed requests and then the engine's counters
every 0.2 s through the metrics feed named in the engine contract. It exits 0 a second after SIGTERM
(its drain), and 1
(a crash) once the file named by ``CF_DOUBLE_CRASH_FILE`` exists.
"""

from __future__ import annotations

import http.server
import os
import signal
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from carbonforge_runtime.core.contract import EngineContract
from carbonforge_runtime.core.feed_protocol import EngineCounters, encode_counters, encode_records
from carbonforge_runtime.engine.metrics_feed import FeedSender

REQUESTS = 3


class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def main() -> int:
    args = sys.argv[1:]
    port = int(args[args.index("--port") + 1])
    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    feed = EngineContract.from_environ(os.environ).metrics_feed
    sender = FeedSender(feed.socket) if feed else None
    if sender is not None:
        record = {"scheduler_family": "fcfs", "finish_reason": "stop", "queue_wait_s": 0.01, "ttft_s": 0.05,
                  "e2e_latency_s": 0.4, "prompt_tokens": 20, "output_tokens": 8, "energy_j": 12.5}
        sender.send(encode_records(sender.sid, sender.next_seq(), [record] * REQUESTS))
    crash_file = os.environ.get("CF_DOUBLE_CRASH_FILE")
    counters = EngineCounters(running=int(os.environ.get("CF_DOUBLE_RUNNING", "0")),
                              requests_arrived_total=REQUESTS, requests_completed_total=REQUESTS)
    while not stop.wait(0.2):
        if crash_file and os.path.exists(crash_file):
            return 1
        if sender is not None:
            sender.send(encode_counters(sender.sid, sender.next_seq(), counters, {"file": (REQUESTS, 0)}))
    time.sleep(1.0)  # draining in-flight requests
    server.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
