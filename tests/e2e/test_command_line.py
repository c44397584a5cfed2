"""End to end: the command line means what it says with the real vLLM CPU engine, and `ready:` is
printed only when the server answering the API port is the runtime's own engine.

One engine takes the --context-key flag and vLLM flags after the double dash (port, served name, a
sequence limit); its checks only read, and the last one kills the engine: the runtime must end with
it. A foreign server on the API port gets an engine of its own (that engine never becomes ready)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import openai
import psutil
import pytest

from tests.support import TINY_KEY, RuntimeProcess, alive, descendants, free_port, wait_until
from tests.support.serving import chat_both_ways

#: Holds with a second engine beside it (scripts/test.sh runs these modules two at a time).
pytestmark = pytest.mark.parallel_safe

#: A foreign server: answers GET /health with 200 on the port given as argv[1].
FOREIGN_SERVER = """
import http.server, sys

class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass

server = http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health)
print("listening", flush=True)
server.serve_forever()
"""


def engines_on(port: int) -> set[int]:
    """Live vLLM API server processes started for ``port`` (from their command lines)."""
    found = set()
    for process in psutil.process_iter():
        try:
            words = process.cmdline()
        except psutil.Error:
            continue
        if "vllm.entrypoints.openai.api_server" in words and f"--port {port}" in " ".join(words):
            found.add(process.pid)
    return found


def test_a_foreign_server_on_the_api_port_is_not_taken_for_the_engine(tmp_path: Path) -> None:
    port = free_port()
    script = tmp_path / "foreign-health-server.py"
    script.write_text(FOREIGN_SERVER)
    foreign = subprocess.Popen([sys.executable, str(script), str(port)], stdout=subprocess.PIPE,
                               start_new_session=True)
    try:
        assert foreign.stdout is not None and foreign.stdout.readline().strip() == b"listening"
        # --skip-preflight: the pre-flight would refuse the taken port; this is the port taken after it.
        runtime = RuntimeProcess(["--context-key", TINY_KEY, "--skip-preflight"], tmp_path, port=port).start()
        assert runtime.proc is not None
        seen: set[int] = set()
        try:
            proc = runtime.proc

            def exited() -> bool:  # noting every process it starts on the way
                seen.update(descendants(proc.pid))
                return proc.poll() is not None

            wait_until(exited, 120, every_s=0.02)
            code = runtime.wait(30)
            out = runtime.output()
            assert code != 0, out
            assert "ready:" not in out
            assert f"port {port} is served by another process, not by this runtime's vLLM: pid {foreign.pid}" in out
            assert "foreign-health-server" in out  # the other process, named by its command line
            assert "stopping vLLM" in out and "Traceback" not in out
            assert "carbonforge-runtime starting vLLM" in runtime.engine_log()  # the engine was started
            def engines_left() -> set[int]:
                return {pid for pid in seen | engines_on(port) if alive(pid)}

            wait_until(lambda: not engines_left(), 20)
            left = engines_left()
            assert left == set(), "engine processes outlived the runtime:\n" + runtime.describe(left)
            # The runtime's own log file says the same.
            assert f"port {port} is served by another process" in (tmp_path / "runtime.log").read_text()
            assert foreign.poll() is None  # the other server is not ours to stop
        finally:
            runtime.known_children |= seen
            runtime.kill()
    finally:
        os.killpg(foreign.pid, signal.SIGKILL)
        foreign.wait(10)


@dataclass
class FlaggedEngine:
    runtime: RuntimeProcess
    real_port: int


@pytest.fixture(scope="module")
def flagged_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FlaggedEngine]:
    """The tiny recipe from the --context-key flag with vLLM flags after the double dash: a sequence
    limit, a port other than CF_PORT's and a served name of its own. The tests only read it until the
    last one kills its engine."""
    settings_port, real_port = free_port(), free_port()
    args = ["--context-key", TINY_KEY, "--", "--max-num-seqs", "3", "--port", str(real_port),
            "--served-model-name", "tiny-alias"]
    runtime = RuntimeProcess(args, tmp_path_factory.mktemp("flagged-engine"), port=real_port,
                             env={"CF_PORT": str(settings_port)}).start()
    try:
        runtime.wait_ready()
        yield FlaggedEngine(runtime, real_port)
    finally:
        runtime.kill()


def test_port_and_name_after_the_double_dash_are_the_ones_waited_on_and_announced(
    flagged_engine: FlaggedEngine,
) -> None:
    runtime, real_port = flagged_engine.runtime, flagged_engine.real_port
    out = runtime.output()
    assert f"ready: OpenAI API on http://127.0.0.1:{real_port}/v1 serving model 'tiny-alias'" in out
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{real_port}/v1", api_key="unused", timeout=120,
                           max_retries=0)
    response = client.chat.completions.create(model="tiny-alias", max_tokens=4,
                                              messages=[{"role": "user", "content": "Hello"}])
    assert response.model == "tiny-alias"
    # runtime.log beside vllm.log holds the runtime's own lines.
    log_text = (runtime.log_dir / "runtime.log").read_text()
    assert f"ready: OpenAI API on http://127.0.0.1:{real_port}/v1" in log_text
    assert (runtime.log_dir / "vllm.log").exists()


def test_context_key_flag_with_extra_vllm_flags(flagged_engine: FlaggedEngine) -> None:
    runtime = flagged_engine.runtime
    out = runtime.output()
    assert "extra vLLM flags depart from the benchmark: adds --max-num-seqs 3" in out
    log = runtime.engine_log()
    assert "'max_num_seqs': 3" in log  # vLLM's own "non-default args" line
    chat_both_ways(runtime.base_url, "tiny-alias")


def test_the_engine_dying_while_serving_ends_the_runtime(flagged_engine: FlaggedEngine) -> None:
    """Last: the engine dying while serving ends the runtime with the same summary and a non-zero code,
    and leaves no process of the engine behind. (A clean SIGTERM stop is checked on the default engine
    in test_serve.py.)"""
    runtime = flagged_engine.runtime
    os.kill(runtime.engine_pid(), signal.SIGKILL)
    code = runtime.wait(60)
    out = runtime.output()
    assert code != 0
    assert "vLLM exited (code 137, killed by SIGKILL) while serving" in out
    assert "last lines of" in out
    assert wait_until(lambda: not runtime.leftover_children(), 20, every_s=0.5)
    assert runtime.leftover_children() == set()
