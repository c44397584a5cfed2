"""The supervisor names the engine's start-up phase: in its progress lines, at ready, and when the engine
fails. The engine here is a small script that writes the lines of a real vLLM 0.32 CPU log."""

from __future__ import annotations

import logging
import os
import re
import signal
import sys
import threading
from pathlib import Path

import pytest

from carbonforge_runtime.runtime.process import supervisor
from tests.support import free_port

CPU_LOG = Path(__file__).parent / "vllm-0.32-cpu-start.log"

#: Writes the lines of a log file (argv[1]) up to the first one containing argv[2] (all of them when
#: argv[2] is empty), then runs what argv[3] says: "serve PORT" answers /health, "fail" exits 1,
#: "hang" sleeps.
FAKE_ENGINE = r"""
import http.server, os, sys, time
source, stop_at, action = sys.argv[1], sys.argv[2], sys.argv[3:]
for line in open(source, encoding="utf-8").read().splitlines(keepends=True):
    sys.stdout.write(line)
    sys.stdout.flush()
    if stop_at and stop_at in line:
        break
if os.environ.get("FAKE_DOWNLOAD_DIR"):
    blobs = os.path.join(os.environ["FAKE_DOWNLOAD_DIR"], "blobs")
    os.makedirs(blobs, exist_ok=True)
    part = os.path.join(blobs, "0a1b2c.deadbeef.incomplete")
    for _ in range(12):
        with open(part, "ab") as handle:
            handle.write(b"x" * (1 << 20))
        time.sleep(0.4)
    os.rename(part, os.path.join(blobs, "0a1b2c"))
    print("(Worker pid=9) INFO 12-02 05:22:00 [weight_utils.py:533] Time spent downloading weights for "
          "org/big: 4.800000 seconds", flush=True)
if action[0] == "hang":
    time.sleep(600)
if action[0] == "fail":
    print("(Worker pid=9) ERROR 12-02 05:22:01 [multiproc_executor.py:800] safetensors_rust.SafetensorError: "
          "Error while deserializing header: incomplete metadata, file not fully covered", flush=True)
    sys.exit(1)
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", int(action[1])), Health).serve_forever()
"""


def run(tmp_path: Path, stop_at: str, action: list[str], caplog: pytest.LogCaptureFixture,
        env: dict[str, str] | None = None, ready_timeout_s: float = 120,
        **kwargs: object) -> tuple[supervisor.ExitReport, list[str]]:
    log_path = tmp_path / "vllm.log"
    log_path.write_text("an earlier run: Starting to load model old... Capturing CUDA graphs\n")
    argv = [sys.executable, "-c", FAKE_ENGINE, str(CPU_LOG), stop_at, *action]
    engine = supervisor.EngineProcess(argv, {**os.environ, **(env or {})}, log_path)
    stop = supervisor.StopFlag()
    port = int(action[1]) if action[0] == "serve" else free_port()

    def on_ready() -> None:
        threading.Timer(0.2, stop, (signal.SIGTERM, None)).start()

    with caplog.at_level(logging.INFO, logger="test-phases"):
        report = supervisor.supervise(engine, f"http://127.0.0.1:{port}/health", ready_timeout_s, 5,
                                      logging.getLogger("test-phases"), on_ready, stop, **kwargs)  # type: ignore[arg-type]
    return report, [record.getMessage() for record in caplog.records]


@pytest.mark.timeout(120)
def test_at_ready_one_line_gives_each_phase_its_time_and_one_the_kv_capacity(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    port = free_port()
    report, messages = run(tmp_path, "", ["serve", str(port)], caplog)
    assert report.outcome == "stopped"
    ready = [m for m in messages if m.startswith("engine ready after ")]
    assert len(ready) == 1, messages
    names = ["launching processes", "loading weights", "compiling", "measuring memory for the KV cache",
             "starting the API server"]
    positions = [ready[0].find(f"{name} ") for name in names]
    assert -1 not in positions and positions == sorted(positions), ready[0]
    assert "capturing CUDA graphs" not in ready[0]  # the earlier run's lines in the same file are not read
    assert "KV cache: 2,097,152 tokens (CPU); maximum concurrency at 2,048 tokens per request: 1024.00x" in messages


@pytest.mark.timeout(120)
def test_an_engine_that_fails_while_loading_weights_is_reported_in_that_phase(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    report, messages = run(tmp_path, "Starting to load model", ["fail"], caplog)
    assert report.outcome == "early-exit" and report.exit_code == 1
    assert "vLLM exited (code 1) before becoming ready, while loading weights" in messages
    phases = [m for m in messages if m.startswith("start-up phases until then: ")]
    assert len(phases) == 1 and "launching processes" in phases[0] and "loading weights" in phases[0]
    assert "compiling" not in phases[0]


@pytest.mark.timeout(120)
def test_progress_lines_show_a_download_seen_in_the_cache_folder(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(supervisor, "PROGRESS_INTERVAL_S", 1.0)
    folder = tmp_path / "hub" / "models--org--big"
    report, messages = run(tmp_path, "Starting to load model", ["fail"], caplog,
                           env={"FAKE_DOWNLOAD_DIR": str(folder)}, download_folder=folder)
    assert report.outcome == "early-exit"
    progress = [m for m in messages if m.startswith("engine starting, ")]
    downloading = [m for m in progress if re.match(r"engine starting, [0-9]+ s so far: downloading weights: ", m)]
    assert downloading, messages
    assert any("MiB/s" in m for m in downloading), downloading
    # The download ended ("Time spent downloading weights"), so the failure is in the loading phase.
    assert "vLLM exited (code 1) before becoming ready, while loading weights" in messages
    assert any(m.startswith("start-up phases until then: ") and "downloading weights" in m for m in messages)


@pytest.mark.timeout(120)
def test_progress_lines_give_the_time_so_far_then_the_phase_without_repeating_either(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(supervisor, "PROGRESS_INTERVAL_S", 1.0)
    report, messages = run(tmp_path, "Warming up model for the compilation", ["hang"], caplog, ready_timeout_s=3.5)
    assert report.outcome == "timeout"
    progress = [m for m in messages if m.startswith("engine starting")]
    assert progress, messages
    for line in progress:
        assert re.fullmatch(r"engine starting, [0-9]+ s so far: (launching processes|[a-z ]+ for [0-9]+ s) "
                            r"\(details in .+vllm\.log\)", line), line
        assert "starting the engine" not in line and "elapsed" not in line
    assert any(": compiling for " in line for line in progress), progress


@pytest.mark.timeout(120)
def test_a_start_that_times_out_names_the_phase_it_was_stuck_in(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    report, messages = run(tmp_path, "Warming up model for the compilation", ["hang"], caplog, ready_timeout_s=3)
    assert report.outcome == "timeout"
    assert any(m.startswith("vLLM did not become ready within 3 s, still compiling ") for m in messages), messages
