"""The offline commands' ``-o`` files (``ltr fit``, ``trace sessions``, ``trace plot``, ``replay``) are
written through the one atomic writer: a link planted at ``X.tmp`` is not followed, a link at ``X``
is replaced (its target keeps its content), and a write that fails half-way (the file size limit,
as a full disk would) leaves the old ``X`` as it was and no temporary file, with one error line."""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from carbonforge_runtime.cli import main as cli
from tests.support import REPO

SECRET = "do not touch\n"
OLD = "the earlier output\n"


def trace_records(count: int = 60) -> list[dict[str, Any]]:
    """A full-level trace every one of these commands reads."""
    records = []
    for i in range(count):
        t = 1.7e9 + i
        records.append({"request_id": f"chatcmpl-{i}", "t_arrival": t, "t_completion": t + 2, "e2e_latency_s": 2.0,
                        "queue_wait_s": 0.5, "ttft_s": 0.1, "prompt_tokens": 12 + i % 5, "output_tokens": 5 + i % 7,
                        "scheduler_family": "fcfs", "prompt_text": f"<|im_start|>user\nhi {i % 4}<|im_end|>\n",
                        "output_text": "hello", "prefix_hash": i % 4, "finish_reason": "stop"})
    return records


class _Handler(BaseHTTPRequestHandler):
    """A stand-in OpenAI server: one model, every completion answered at once."""

    def log_message(self, *args: Any) -> None:
        return

    def _json(self, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        self._json({"object": "list", "data": [{"id": "stand-in", "object": "model", "created": 0, "owned_by": "t"}]})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self._json({"id": "cmpl-1", "object": "text_completion", "created": 0, "model": body["model"],
                    "choices": [{"index": 0, "text": "x", "finish_reason": "length", "logprobs": None}],
                    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})


@pytest.fixture(scope="module")
def stand_in() -> Iterator[str]:
    class Server(ThreadingHTTPServer):
        daemon_threads = True
        request_queue_size = 128

    server = Server(("127.0.0.1", 0), _Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def inputs(tmp_path: Path) -> Path:
    folder = tmp_path / "in"
    folder.mkdir()
    (folder / "t.jsonl").write_text("".join(json.dumps(r) + "\n" for r in trace_records()))
    return folder


Command = Callable[[Path, Path, str], list[str]]
COMMANDS: dict[str, tuple[str, Command]] = {
    "ltr fit": ("m.json", lambda trace, out, _url: ["ltr", "fit", str(trace), "-o", str(out)]),
    "trace sessions": ("s.jsonl", lambda trace, out, _url: ["trace", "sessions", str(trace), "-o", str(out)]),
    "trace plot": ("p.png", lambda trace, out, _url: ["trace", "plot", str(trace), "-o", str(out)]),
    "replay": ("r.json", lambda trace, out, url: ["replay", str(trace), "--base-url", url, "--rate", "100",
                                                  "--limit", "10", "-o", str(out), "--quiet"]),
}


def args_for(name: str, inputs: Path, out_dir: Path, url: str) -> tuple[Path, list[str]]:
    if name == "trace plot":
        pytest.importorskip("matplotlib")
    file_name, build = COMMANDS[name]
    out = out_dir / file_name
    return out, build(inputs / "t.jsonl", out, url)


@pytest.mark.parametrize("name", list(COMMANDS))
def test_a_link_planted_at_the_old_temporary_name_is_not_followed(name: str, inputs: Path, tmp_path: Path,
                                                                  stand_in: str) -> None:
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    out, args = args_for(name, inputs, out_dir, stand_in)
    victim = tmp_path / "victim"
    victim.write_text(SECRET)
    (out_dir / (out.name + ".tmp")).symlink_to(victim)
    result = CliRunner().invoke(cli.app, args)
    assert result.exit_code == 0, result.output
    assert victim.read_text() == SECRET
    assert out.is_file() and not out.is_symlink() and out.stat().st_size > 0


@pytest.mark.parametrize("name", list(COMMANDS))
def test_a_link_at_the_output_is_replaced_and_its_target_left_alone(name: str, inputs: Path, tmp_path: Path,
                                                                    stand_in: str) -> None:
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    out, args = args_for(name, inputs, out_dir, stand_in)
    victim = tmp_path / "victim"
    victim.write_text(SECRET)
    out.symlink_to(victim)
    result = CliRunner().invoke(cli.app, args)
    assert result.exit_code == 0, result.output
    assert victim.read_text() == SECRET
    assert not out.is_symlink() and out.read_bytes() != SECRET.encode()
    assert sorted(os.listdir(out_dir)) == [out.name]


#: The largest file the command may write: far less than any of these outputs.
FILE_SIZE_LIMIT = 256


def _limit_file_size() -> None:  # pragma: no cover - runs in the child between fork and exec
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
    resource.setrlimit(resource.RLIMIT_FSIZE, (FILE_SIZE_LIMIT, FILE_SIZE_LIMIT))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", list(COMMANDS))
def test_a_write_that_fails_half_way_leaves_the_old_output_and_no_temporary_file(
        name: str, inputs: Path, tmp_path: Path, stand_in: str) -> None:
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    out, args = args_for(name, inputs, out_dir, stand_in)
    out.write_text(OLD)
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    run = subprocess.run([sys.executable, "-m", "carbonforge_runtime", *args], capture_output=True, text=True,
                         cwd=REPO, env=env, timeout=100, preexec_fn=_limit_file_size)
    assert run.returncode != 0, run.stdout
    assert "Traceback" not in run.stderr, run.stderr
    assert "File too large" in run.stderr, run.stderr
    assert out.read_text() == OLD
    assert sorted(os.listdir(out_dir)) == [out.name], "a partial or temporary file was left behind"
