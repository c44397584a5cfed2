"""Faults on the real CPU engine: the runtime SIGKILLed at three moments leaves no engine process
and a free port; a drain that runs out of time still ends every request in exactly one record; a
dead proxy in the environment does not stop readiness nor the image's healthcheck; an engine that
rejects its command line is reported within a minute, with vLLM's words and a hint.

The drain that runs out has a fresh override-mode engine of its own (on an engine that has served
already, the long requests can finish before the signal); override mode's plain serve and stop are
checked on the OTLP HTTP engine of tests/e2e/test_tracing.py. The SIGKILL while the engine initialises needs
an engine of its own; the SIGKILLs while serving under load and while draining end two of the
ordering engines (tests/e2e/test_ordering.py), whose checks are done by then. The helpers are
tests/support/faults.py."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import openai
import psutil
import pytest

from tests.support import REPO, TEST_RECIPES, TINY_KEY, RuntimeProcess, free_port, wait_until
from tests.support.faults import assert_gone_after_sigkill, group_members, lower_engine_priority


def spawned_child(pid: int) -> bool:
    """A process that vLLM started through multiprocessing's spawn (the engine core, its workers, the
    resource tracker), by its command line or the title vLLM gives it."""
    with contextlib.suppress(psutil.Error):
        words = " ".join(psutil.Process(pid).cmdline())
        return "multiprocessing" in words or words.startswith("VLLM::")
    return False


def test_sigkill_while_the_engine_initialises_leaves_nothing(tmp_path: Path) -> None:
    runtime = RuntimeProcess(["--context-key", TINY_KEY], tmp_path).start()
    try:
        # The engine core exists once vLLM's API server has spawned it: vLLM initialises there,
        # ignoring SIGTERM, long before it is ready. Only a spawned Python child counts: the API
        # server also runs short-lived helpers (ldconfig and the like) that come and go in its group.
        def initialising() -> bool:
            try:
                api_server = runtime.engine_pid()
                spawned = [pid for pid in group_members(api_server) if pid != api_server and spawned_child(pid)]
                return bool(spawned) and "ready: OpenAI API" not in runtime.output()
            except AssertionError:
                return False

        wait_until(initialising, 120, every_s=0.1, what="vLLM's engine core to start")
        assert_gone_after_sigkill(runtime, "while the engine initialises")
    finally:
        runtime.kill()


@contextlib.contextmanager
def dead_proxy() -> Iterator[dict[str, str]]:
    """A port that refuses every connection, as a proxy would that is down."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    yield {"http_proxy": url, "https_proxy": url, "HTTP_PROXY": url, "HTTPS_PROXY": url, "all_proxy": url,
           "no_proxy": "", "NO_PROXY": ""}


#: The drain of the drain check's engine: its leftovers are ended 2 s after the signal (half the drain).
DRAIN_S = 4
OVERRIDE_NAME = "tiny-override"
#: The drain check's long answers. The tiny model decodes a dozen sequences at about a millisecond a
#: step on a fast host, so 4,000 tokens could end before the drain does; 60,000 cannot. The stand-in's
#: context is stretched to hold them (its rotary positions extend past the 4,096 it was built with).
LONG_TOKENS = 60_000
OVERRIDE_CONTEXT = 65_536


@dataclass
class OverrideEngine:
    runtime: RuntimeProcess
    trace: Path
    proxy_env: dict[str, str]


@pytest.fixture
def override_engine(tmp_path: Path, tiny_model: str) -> Iterator[OverrideEngine]:
    """A fresh engine of its own for the drain that runs out, so that its trace holds only the drain's
    requests. Override mode, with a short drain, a context long enough for answers no drain can wait
    out, and a trace file, behind a dead proxy."""
    trace = tmp_path / "requests.jsonl"
    with dead_proxy() as proxy_env:
        runtime = RuntimeProcess(
            ["--request-trace", "standard", "--trace-file", str(trace), "--",
             tiny_model, "--served-model-name", OVERRIDE_NAME, "--dtype", "bfloat16",
             "--max-model-len", str(OVERRIDE_CONTEXT),
             "--hf-overrides", json.dumps({"max_position_embeddings": OVERRIDE_CONTEXT}),
             "--shutdown-timeout", str(DRAIN_S)],
            tmp_path / "logs", env=proxy_env,
        ).start()
        try:
            # Readiness is probed on loopback with the proxy variables set: it must not use them.
            runtime.wait_ready()
            lower_engine_priority(runtime)
            yield OverrideEngine(runtime, trace, proxy_env)
        finally:
            runtime.kill()


def test_a_drain_that_runs_out_ends_every_request_in_one_record_behind_a_dead_proxy(
    override_engine: OverrideEngine,
) -> None:
    """The SIGTERM under load."""
    runtime, trace, proxy_env = override_engine.runtime, override_engine.trace, override_engine.proxy_env
    drain_s = DRAIN_S
    assert runtime.known_children, "the engine's processes were not seen"
    earlier = 0  # a fresh engine: no request came before these
    pool = None
    try:
        health = subprocess.run(
            [sys.executable, str(REPO / "docker" / "healthcheck.py")], capture_output=True, text=True, timeout=30,
            env={**os.environ, **proxy_env, "CF_PORT": str(runtime.port), "CF_LOG_DIR": str(runtime.log_dir)},
        )
        assert health.returncode == 0, health.stdout + health.stderr

        client = openai.OpenAI(base_url=runtime.base_url, api_key="unused", timeout=300, max_retries=0)
        first_chunk = threading.Semaphore(0)
        all_sent = threading.Barrier(25, timeout=120)

        def one(i: int) -> tuple[str, str | None]:
            stream = client.chat.completions.create(
                model=OVERRIDE_NAME, messages=[{"role": "user", "content": f"Say something, {i}"}],
                max_tokens=24 if i % 2 else LONG_TOKENS, stream=True,
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
        left = runtime.leftover_children()
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
    assert left == set(), "engine processes survived the runtime:\n" + runtime.describe(left)
    assert "vLLM stopped" in out
    records = [json.loads(line) for line in trace.read_text().splitlines()][earlier:]
    by_id = {r["request_id"]: r["finish_reason"] for r in records}
    assert len(records) == 24 and len(by_id) == 24, records
    # Each client's answer says what its record says; the short ones completed, the long ones were cut off.
    assert by_id == dict(answers)
    assert [reason for _, reason in answers[1::2]] == ["length"] * 12
    assert [reason for _, reason in answers[0::2]] == ["abort"] * 12
    assert "ending 12 request(s) still in flight as aborted" in engine_log
    total = earlier + 24
    assert f"{total} requests reached the engine, {total} ended; 0 dropped before the sinks; " \
           f"records per sink: file {trace}: {total} written, 0 dropped" in engine_log, engine_log[-3000:]


def test_engine_that_cannot_start_is_reported_quickly(tmp_path: Path) -> None:
    """Here, not among the modules run beside another engine at the lowest CPU weight: its time bound
    includes vLLM's own start-up, which a starved core can stretch past a minute."""
    runtime = RuntimeProcess(["--context-key", "cf-tiny-broken:bf16:chat:cpu"], tmp_path,
                             env={"CF_RECIPES_DIR": str(TEST_RECIPES)})
    started = time.monotonic()
    runtime.start()
    try:
        code = runtime.wait(120)
        elapsed = time.monotonic() - started
        out = runtime.output()
        assert code != 0
        assert "vLLM exited (code 2) before becoming ready" in out
        assert "| " in out and "no-such-engine-flag" in out  # the log tail
        assert "hint: vLLM rejected a command-line flag" in out
        assert "Traceback" not in out
        assert elapsed < 60, f"took {elapsed:.1f} s"
    finally:
        runtime.kill()
