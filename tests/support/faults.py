"""SIGKILL checks on a runtime serving the real engine: the engine's process group and the API port
must be released by the runtime's own kill path."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import openai
import psutil

from tests.support import TINY_SERVED_NAME, RuntimeProcess, descendants, group_members, wait_until

#: Within this time of the runtime's SIGKILL, nothing of the engine may be left.
GONE_WITHIN_S = 10.0


def port_free(port: int) -> bool:
    """A new server could listen on ``port`` (as servers do, with SO_REUSEADDR: the client
    connections the kill cut off may linger in TIME_WAIT, but nothing listens there)."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
            sock.listen()
        except OSError:
            return False
    return True


def assert_gone_after_sigkill(runtime: RuntimeProcess, moment: str) -> None:
    """SIGKILL the runtime alone (not its group): the engine's whole group and the port must be
    released within GONE_WITHIN_S, by the runtime's own kill path."""
    assert runtime.proc is not None
    pgid = runtime.engine_pid()  # the engine runs in a session (and group) of its own
    members = group_members(pgid)
    assert len(members) >= 2, f"{moment}: expected vLLM's processes, found {runtime.describe(members)}"
    os.kill(runtime.proc.pid, signal.SIGKILL)
    runtime.proc.wait(timeout=10)
    wait_until(lambda: not group_members(pgid) and port_free(runtime.port), GONE_WITHIN_S)
    left = group_members(pgid)
    try:
        assert not left, f"{moment}: engine processes outlived the runtime:\n{runtime.describe(left)}"
        assert port_free(runtime.port), f"{moment}: port {runtime.port} still taken"
    finally:
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    print(f"SIGKILL {moment}: {len(members)} engine processes gone and port free")


def lower_engine_priority(runtime: RuntimeProcess) -> None:
    """Every thread of vLLM's engine processes (not its API server) at nice 19. On two cores the engine
    core's and the worker's busy loops can otherwise starve the API server for seconds, so that new
    requests reach the engine only much later (or, under a stop, never)."""
    for pid in descendants(runtime.engine_pid()):
        with contextlib.suppress(psutil.Error, OSError):
            for thread in psutil.Process(pid).threads():
                os.setpriority(os.PRIO_PROCESS, thread.id, 19)


def long_requests(runtime: RuntimeProcess, count: int, max_tokens: int
                  ) -> tuple[ThreadPoolExecutor, list[Future[int]], threading.Event]:
    """``count`` streamed requests of ``max_tokens`` each; the event is set once any answer has begun
    (a request is running in the engine)."""
    client = openai.OpenAI(base_url=runtime.base_url, api_key="unused", timeout=300, max_retries=0)
    streaming = threading.Event()

    def one(i: int) -> int:
        stream = client.chat.completions.create(
            model=TINY_SERVED_NAME, messages=[{"role": "user", "content": f"Count to a thousand, {i}"}],
            max_tokens=max_tokens, stream=True, extra_body={"ignore_eos": True})
        chunks = 0
        for _ in stream:
            chunks += 1
            streaming.set()
        return chunks

    pool = ThreadPoolExecutor(max_workers=count)
    return pool, [pool.submit(one, i) for i in range(count)], streaming


def sigkill_under_load(runtime: RuntimeProcess, moment: str) -> None:
    """A load of six long requests on a ready runtime; for "draining", SIGTERM first and the drain under
    way; then the runtime SIGKILLed alone: nothing of the engine may be left and its port is free."""
    pool = None
    try:
        lower_engine_priority(runtime)
        pool, futures, streaming = long_requests(runtime, 6, max_tokens=1500)
        # The kill lands once an answer has begun: a fixed wait could outlast a whole answer on a
        # fast engine (the ordering engines serve one request at a time, 1,500 tokens in about 2 s).
        wait_until(streaming.is_set, 60, every_s=0.05, what="the first answer to begin")
        ended = [f.exception() or f.result() for f in futures if f.done()]
        assert not ended, f"the load ended before the kill: {ended!r}"
        if moment == "draining":
            assert runtime.proc is not None
            runtime.proc.send_signal(signal.SIGTERM)
            wait_until(lambda: "received SIGTERM: stopping vLLM" in runtime.output(), 20, every_s=0.1,
                       what="the drain to start")
            time.sleep(1.0)
            assert runtime.proc.poll() is None, "the runtime finished its drain before the kill"
        assert_gone_after_sigkill(runtime, moment)
    finally:
        runtime.kill()
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
