"""Faults on the real CPU engine: the runtime SIGKILLed at three moments leaves no engine process
and a free port; a drain that runs out of time still ends every request in exactly one record; a
dead proxy in the environment does not stop readiness nor the image's healthcheck."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

from tests.support import REPO, TINY_KEY, TINY_SERVED_NAME, RuntimeProcess, free_port

#: Within this time of the runtime's SIGKILL, nothing of the engine may be left.
GONE_WITHIN_S = 10.0


def group_members(pgid: int) -> set[int]:
    """Live processes (zombies excluded) whose process group is ``pgid``, from /proc."""
    members = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:
            members.add(int(entry.name))
    return members


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
    deadline = time.monotonic() + GONE_WITHIN_S
    while time.monotonic() < deadline and (group_members(pgid) or not port_free(runtime.port)):
        time.sleep(0.2)
    left = group_members(pgid)
    try:
        assert not left, f"{moment}: engine processes outlived the runtime:\n{runtime.describe(left)}"
        assert port_free(runtime.port), f"{moment}: port {runtime.port} still taken"
    finally:
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    print(f"SIGKILL {moment}: {len(members)} engine processes gone and port free")


def long_requests(runtime: RuntimeProcess, count: int, max_tokens: int) -> tuple[ThreadPoolExecutor, list[Future[int]]]:
    client = openai.OpenAI(base_url=runtime.base_url, api_key="unused", timeout=300, max_retries=0)

    def one(i: int) -> int:
        stream = client.chat.completions.create(
            model=TINY_SERVED_NAME, messages=[{"role": "user", "content": f"Count to a thousand, {i}"}],
            max_tokens=max_tokens, stream=True, extra_body={"ignore_eos": True})
        return sum(1 for _ in stream)

    pool = ThreadPoolExecutor(max_workers=count)
    return pool, [pool.submit(one, i) for i in range(count)]


def wait_for(predicate: object, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def test_sigkill_while_the_engine_initialises_leaves_nothing(tmp_path: Path) -> None:
    runtime = RuntimeProcess(["--context-key", TINY_KEY], tmp_path).start()
    try:
        # The engine core exists once vLLM's API server has spawned it: vLLM initialises there,
        # ignoring SIGTERM, long before it is ready.
        def initialising() -> bool:
            try:
                return len(group_members(runtime.engine_pid())) >= 2 and "ready: OpenAI API" not in runtime.output()
            except AssertionError:
                return False

        wait_for(initialising, 120, "vLLM's engine core to start")
        assert_gone_after_sigkill(runtime, "while the engine initialises")
    finally:
        runtime.kill()


@pytest.mark.parametrize("moment", ["serving under load", "draining"])
def test_sigkill_while_serving_or_draining_leaves_nothing(tmp_path: Path, moment: str) -> None:
    runtime = RuntimeProcess(["--context-key", TINY_KEY], tmp_path).start()
    pool = None
    try:
        runtime.wait_ready()
        pool, futures = long_requests(runtime, 6, max_tokens=1500)
        time.sleep(2.0)  # the requests are running
        assert not any(f.done() for f in futures), "the load ended before the kill"
        if moment == "draining":
            assert runtime.proc is not None
            runtime.proc.send_signal(signal.SIGTERM)
            wait_for(lambda: "received SIGTERM: stopping vLLM" in runtime.output(), 20, "the drain to start")
            time.sleep(1.0)
            assert runtime.proc.poll() is None, "the runtime finished its drain before the kill"
        assert_gone_after_sigkill(runtime, moment)
    finally:
        runtime.kill()
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)


@contextlib.contextmanager
def dead_proxy() -> Iterator[dict[str, str]]:
    """A port that refuses every connection, as a proxy would that is down."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    yield {"http_proxy": url, "https_proxy": url, "HTTP_PROXY": url, "HTTPS_PROXY": url, "all_proxy": url,
           "no_proxy": "", "NO_PROXY": ""}


def test_a_drain_that_runs_out_ends_every_request_in_one_record_behind_a_dead_proxy(
    tmp_path: Path, tiny_model: str
) -> None:
    drain_s = 4  # the leftovers are ended 2 s after the signal (half the drain)
    trace = tmp_path / "requests.jsonl"
    with dead_proxy() as proxy_env:
        runtime = RuntimeProcess(
            ["--request-trace", "standard", "--trace-file", str(trace), "--",
             tiny_model, "--served-model-name", TINY_SERVED_NAME, "--dtype", "bfloat16", "--max-model-len", "4096",
             "--shutdown-timeout", str(drain_s)],
            tmp_path / "logs", env=proxy_env,
        ).start()
        pool = None
        try:
            # Readiness is probed on loopback with the proxy variables set: it must not use them.
            runtime.wait_ready()
            health = subprocess.run(
                [sys.executable, str(REPO / "docker" / "healthcheck.py")], capture_output=True, text=True, timeout=30,
                env={**os.environ, **proxy_env, "CF_PORT": str(runtime.port), "CF_LOG_DIR": str(tmp_path / "logs")},
            )
            assert health.returncode == 0, health.stdout + health.stderr

            # 12 short requests finish within the drain; 12 long ones (4,000 tokens, the model's whole context)
            # cannot: an idle machine's engine gives each of them well under 1,000 tokens a second, and the
            # leftovers are ended 2 s after the signal. The signal goes once every request has streamed its
            # first chunk (so it is in the engine). The long ones stream in chunks of 200 tokens: a chunk per
            # token from 12 streams keeps the API server (and this process) so busy that requests still
            # being prepared reach the engine only after the long ones have finished. All 24 are sent
            # before any stream is read.
            client = openai.OpenAI(base_url=runtime.base_url, api_key="unused", timeout=300, max_retries=0)
            first_chunk = threading.Semaphore(0)
            all_sent = threading.Barrier(25, timeout=120)

            def one(i: int) -> tuple[str, str | None]:
                stream = client.chat.completions.create(
                    model=TINY_SERVED_NAME, messages=[{"role": "user", "content": f"Say something, {i}"}],
                    max_tokens=24 if i % 2 else 4000, stream=True,
                    extra_body={"ignore_eos": True, **({} if i % 2 else {"stream_interval": 200})})
                all_sent.wait()
                answer_id, reason = "", None
                for chunk in stream:
                    if not answer_id:
                        answer_id = chunk.id
                        first_chunk.release()
                    if chunk.choices and chunk.choices[0].finish_reason:
                        reason = chunk.choices[0].finish_reason
                return answer_id, reason

            pool = ThreadPoolExecutor(max_workers=24)
            futures = [pool.submit(one, i) for i in range(24)]
            all_sent.wait()  # every request was answered with its stream's headers
            for _ in range(24):  # every request has reached the engine (it streamed a chunk)
                assert first_chunk.acquire(timeout=120), "a request never started"
            assert runtime.proc is not None
            started = time.monotonic()
            runtime.proc.send_signal(signal.SIGTERM)
            code = runtime.wait(drain_s + 60)
            took = time.monotonic() - started
            out = runtime.output()
            announced = float(re.search(r"stopped within ([0-9.]+) s at the latest", out)[1])  # type: ignore[index]
            # Every client got an answer: no connection is left hanging.
            answers = [f.result(timeout=30) for f in futures]
        finally:
            runtime.kill()
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)
    engine_log = runtime.engine_log()
    print(f"drain of {drain_s} s with 24 requests in flight: runtime exited {code} after {took:.1f} s "
          f"(announced {announced:g} s); finish reasons {sorted(r for _, r in answers if r)}")
    assert code == 0, out
    assert took <= announced, out
    assert took <= drain_s + 5, f"the engine did not end its leftovers before vLLM's deadline ({took:.1f} s)"
    records = [json.loads(line) for line in trace.read_text().splitlines()]
    by_id = {r["request_id"]: r["finish_reason"] for r in records}
    assert len(records) == 24 and len(by_id) == 24, records
    # Each client's answer says what its record says; the short ones completed, the long ones were cut off.
    assert by_id == dict(answers)
    assert [reason for _, reason in answers[1::2]] == ["length"] * 12
    assert [reason for _, reason in answers[0::2]] == ["abort"] * 12
    assert "ending 12 request(s) still in flight as aborted" in engine_log
    assert f"24 requests reached the engine, 24 ended; 0 dropped before the sinks; " \
           f"records per sink: file {trace}: 24 written, 0 dropped" in engine_log, engine_log[-3000:]
