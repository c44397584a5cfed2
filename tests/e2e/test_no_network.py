"""End to end: the embedded default serves a whole run without one connection off this machine.

The runtime, vLLM's API server, its engine core and every other process they start run under
``strace -f -e trace=connect``; each connect() they make must reach loopback or a local socket, and
none may be a name lookup (port 53, which a local resolver would forward off the machine). The
environment asks vLLM to report usage (``VLLM_NO_USAGE_STATS=0``, ``DO_NOT_TRACK=0``) and says nothing
about the hub, so the run also proves that the runtime turns reporting off and serves offline itself.
The reader of strace's lines is tests/support/connects.py, checked in tests/unit/runtime/test_no_network_connects.py.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import openai
import pytest

from tests.support import TINY_KEY, TINY_SERVED_NAME, RuntimeProcess, descendants
from tests.support.connects import connect_lines, is_local

#: Holds with a second engine beside it (scripts/test.sh runs these modules two at a time).
pytestmark = pytest.mark.parallel_safe

#: Only connect() is stopped on (``--seccomp-bpf``), so the engine runs at nearly its own speed.
STRACE = ["strace", "-f", "--seccomp-bpf", "-qq", "-e", "trace=connect", "-e", "signal=none"]
#: strace slows the start-up; the plain e2e tests wait 400 s.
READY_TIMEOUT_S = 900.0
ENGINE_MODULE = "vllm.entrypoints.openai.api_server"
#: What the engine's environment must hold, whatever the runtime's environment said.
ENGINE_SWITCHES = {"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "VLLM_DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1",
                   "TRANSFORMERS_OFFLINE": "1", "VLLM_HOST_IP": "127.0.0.1"}

def strace_usable() -> str | None:
    """Why strace cannot trace here (not installed, ptrace refused), or None when it can."""
    if shutil.which("strace") is None:
        return "strace is not installed (scripts/test.sh installs Debian's strace)"
    try:
        probe = subprocess.run([*STRACE, "-o", "/dev/null", "true"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"strace cannot run: {exc}"
    if probe.returncode != 0:
        return f"ptrace is not permitted in this container: {probe.stderr.strip()[:300]}"
    return None


@dataclass
class TracedRun:
    runtime: RuntimeProcess
    trace_path: Path
    exit_code: int | None = None
    #: Output tokens of each chat request.
    replies: list[int] = field(default_factory=list)
    #: pid -> (command line, the variables of ENGINE_SWITCHES as its environment holds them)
    engine_env: dict[int, tuple[str, dict[str, str | None]]] = field(default_factory=dict)
    #: Engine processes whose /proc/<pid>/environ no longer shows their environment: vLLM renames its
    #: engine core and workers (setproctitle), which reuses that memory for the new title.
    retitled: list[str] = field(default_factory=list)


def _proc_environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    pairs = (item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)
    return {key.decode(errors="replace"): value.decode(errors="replace") for key, value in pairs}


def _cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")


def _stat(pid: int) -> list[str]:
    """State, parent, ... of a process (the fields after its name in /proc/<pid>/stat)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def _engine_processes(runtime_pid: int) -> list[int]:
    """vLLM's API server (a child of the runtime) and every live process below it (the engine core);
    a zombie has no environment left to read."""
    servers = [pid for pid in descendants(runtime_pid) if ENGINE_MODULE in _cmdline(pid)
               and int(_stat(pid)[1]) == runtime_pid]
    assert len(servers) == 1, f"expected one vLLM API server under the runtime, found {servers}"
    below = [pid for pid in sorted(descendants(servers[0])) if _stat(pid)[0] != "Z"]
    assert below, "the API server has no engine-core process"
    return [servers[0], *below]


def _chat(base_url: str) -> list[int]:
    """Three chat completions and one streamed; the output tokens of each (the text of the random
    model may all land in the reasoning part, so the counts are what is checked)."""
    client = openai.OpenAI(base_url=base_url, api_key="unused", timeout=300, max_retries=0)
    tokens = []
    for question in ("Hello there", "What is two plus two?", "Name a colour"):
        response = client.chat.completions.create(model=TINY_SERVED_NAME, max_tokens=8,
                                                  messages=[{"role": "user", "content": question}],
                                                  extra_body={"ignore_eos": True})
        assert response.model == TINY_SERVED_NAME and response.usage is not None
        tokens.append(response.usage.completion_tokens)
    stream = client.chat.completions.create(model=TINY_SERVED_NAME, max_tokens=6, stream=True,
                                            stream_options={"include_usage": True},
                                            messages=[{"role": "user", "content": "Count to three"}],
                                            extra_body={"ignore_eos": True})
    usage = [chunk.usage.completion_tokens for chunk in stream if chunk.usage is not None]
    tokens.append(usage[-1] if usage else 0)
    return tokens


@pytest.fixture(scope="module")
def traced_run(tmp_path_factory: pytest.TempPathFactory) -> TracedRun:
    why_not = strace_usable()
    if why_not is not None:
        pytest.skip(why_not)
    log_dir = tmp_path_factory.mktemp("no-network")
    trace_path = log_dir / "connect.strace"
    runtime = RuntimeProcess(["--context-key", TINY_KEY], log_dir,
                             env={"VLLM_NO_USAGE_STATS": "0", "DO_NOT_TRACK": "0"},
                             python=[*STRACE, "-o", str(trace_path), sys.executable, "-m", "carbonforge_runtime"])
    # The runtime decides the hub switches itself: none reaches it from the test's environment.
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "VLLM_DO_NOT_TRACK", "VLLM_USE_MODELSCOPE"):
        runtime.env.pop(name, None)
    run = TracedRun(runtime, trace_path)
    runtime.start()
    try:
        runtime.wait_ready(timeout_s=READY_TIMEOUT_S)
        runtime_pid = runtime.engine_pid()  # strace's child: the runtime itself
        assert "carbonforge_runtime" in _cmdline(runtime_pid)
        for pid in _engine_processes(runtime_pid):
            environ = _proc_environ(pid)
            if "PATH" not in environ and _cmdline(pid).startswith("VLLM::"):
                run.retitled.append(f"pid {pid} {_cmdline(pid).strip()}")
                continue
            run.engine_env[pid] = (_cmdline(pid)[:160], {name: environ.get(name) for name in ENGINE_SWITCHES})
        run.replies = _chat(runtime.base_url)
        # strace itself ignores SIGTERM while it runs a command: the stop goes to the runtime, and
        # strace exits with the runtime's status once every traced process has exited.
        os.kill(runtime_pid, signal.SIGTERM)
        run.exit_code = runtime.wait(timeout_s=120)
    finally:
        runtime.kill()
    return run


def test_the_run_serves_and_stops_cleanly(traced_run: TracedRun) -> None:
    assert traced_run.replies == [8, 8, 8, 6]
    out = traced_run.runtime.output()
    assert traced_run.exit_code == 0, out
    assert "vLLM stopped" in out and "Traceback" not in out
    assert "DO_NOT_TRACK=0" in out and "would let vLLM report usage statistics" in out  # the override is logged


def test_the_engine_runs_with_reporting_off_and_offline(traced_run: TracedRun) -> None:
    """The API server's environment, which its engine core and workers inherit when they start."""
    servers = [cmd for cmd, _ in traced_run.engine_env.values() if ENGINE_MODULE in cmd]
    assert len(servers) == 1, (traced_run.engine_env, traced_run.retitled)
    wrong = {pid: seen for pid, seen in traced_run.engine_env.items()
             if seen[1] != ENGINE_SWITCHES}
    assert not wrong, "engine processes without the switches:\n" + "\n".join(
        f"pid {pid} {cmd}: {values}" for pid, (cmd, values) in wrong.items())


def test_every_connect_stays_on_this_machine(traced_run: TracedRun) -> None:
    trace = traced_run.trace_path.read_text(errors="replace")
    calls = connect_lines(trace)
    # The runtime's readiness probe reached the API on loopback: the trace did see the run.
    assert any(f"htons({traced_run.runtime.port})" in line for line in calls), trace[-3000:]
    offending = [line for line in calls if not is_local(line)]
    assert not offending, f"{len(offending)} connect() call(s) off this machine:\n" + "\n".join(offending[:50])
