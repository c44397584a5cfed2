"""The controller inside ``serve()``: it acts once the engine is ready and puts the GPUs back on every way out.

The runtime runs in this process with the scripted fake NVML (``CF_FAKE_NVML``; its set calls go to a
log file) and a stand-in engine (tests/support/engine_double.py) in place of vLLM, so that a stop signal, an
engine crash and an exception can each be produced on cue. The real engine's SIGTERM path is covered
with the fake NVML in tests/test_metrics_e2e.py.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from carbonforge_runtime import log as cflog
from carbonforge_runtime.gpu.fake import FakeGpuBackend, host
from carbonforge_runtime.runtime.process import supervisor
from carbonforge_runtime.runtime.serve.launch import ServeOptions, serve
from carbonforge_runtime.settings import load_settings
from tests.support import REPO, free_port, wait_until

KEY = "cf-energy-test:fp8:chat:h100x1"
RECIPE = f"""
key: {KEY}
plan: free
description: Test only. A GPU recipe with a controller, served by a stand-in engine.
model: {{repo: example/model, served_name: example/model}}
vllm: {{tensor_parallel_size: 1, max_num_seqs: 16}}
drain_timeout_s: 5
controller:
  policy: lock-sm-clock
  params: {{period_s: 0.5, down_periods: 1}}
"""
DOUBLE = REPO / "tests" / "support" / "engine_double.py"


@pytest.fixture
def signals_restored() -> Iterator[None]:
    """serve() installs SIGTERM/SIGINT handlers in this process: put pytest's back afterwards."""
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


class Run:
    def __init__(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, deny_set: bool = False,
                 dry_run: bool = False, metrics: bool = False) -> None:
        recipes = tmp_path / "recipes"
        recipes.mkdir()
        (recipes / "cf-energy-test--fp8--chat--h100x1.yaml").write_text(RECIPE)
        self.calls_path = tmp_path / "nvml-calls.jsonl"
        script = tmp_path / "nvml.json"
        script.write_text(json.dumps({"kind": "h100", "power_limit_w": 600, "deny_set": deny_set,
                                      "call_log": str(self.calls_path)}))
        self.crash_file = tmp_path / "crash"
        self.metrics_port = free_port()
        self.env = {
            "PATH": os.environ.get("PATH", ""),
            "CF_RECIPES_DIR": str(recipes), "CF_LOG_DIR": str(tmp_path / "logs"), "CF_PORT": str(free_port()),
            "CF_HOST": "127.0.0.1", "CF_FAKE_NVML": str(script), "CF_READY_TIMEOUT_S": "30",
            "CF_DOUBLE_CRASH_FILE": str(self.crash_file), "CF_METRICS_PORT": str(self.metrics_port),
            "CF_ENGINE_ENV_PASS": "CF_DOUBLE_*",  # the engine double's own settings reach it as an operator's would
        }
        if dry_run:
            self.env["CF_DRY_RUN"] = "1"
        self.options = ServeOptions(context_key=KEY, skip_preflight=True, metrics=metrics)
        self.engine: supervisor.EngineProcess | None = None
        real = supervisor.EngineProcess
        run = self

        class Double(real):  # type: ignore[valid-type, misc]
            """vLLM's command line, run by the stand-in instead."""

            raise_in_poll = False

            def __init__(self, argv: Sequence[str], env: Any, log_path: Path) -> None:
                super().__init__([sys.executable, str(DOUBLE), *argv[3:]], env, log_path)
                run.engine = self

            def poll(self) -> int | None:
                if Double.raise_in_poll:
                    raise RuntimeError("a bug in the supervision loop")
                return super().poll()

        self.double = Double
        monkeypatch.setattr(supervisor, "EngineProcess", Double)
        self.log = logging.getLogger(cflog.LOGGER_NAME)

    def calls(self) -> list[dict[str, Any]]:
        if not self.calls_path.exists():
            return []
        return [json.loads(line) for line in self.calls_path.read_text().splitlines()]

    def when(self, condition: Callable[[], bool], then: Callable[[], None], timeout_s: float = 20.0) -> None:
        """On a helper thread: once ``condition()`` holds, do ``then()`` (the main thread runs serve)."""

        def watch() -> None:
            wait_until(condition, timeout_s, every_s=0.05)
            then()

        threading.Thread(target=watch, daemon=True).start()

    def serve(self) -> int:
        settings = load_settings(self.env)
        return serve(self.options, settings, self.env, FakeGpuBackend(host("h100")))


def capture(log: logging.Logger, caplog: pytest.LogCaptureFixture) -> None:
    """See the runtime's log even when cflog.configure() stopped it propagating (it does in the CLI)."""
    caplog.set_level(logging.INFO, logger=log.name)
    if not log.propagate:
        log.addHandler(caplog.handler)


def restored(calls: list[dict[str, Any]]) -> bool:
    """The last clock call unlocks and the power limit is as found (600 W) or never touched."""
    clock = [c for c in calls if "clocks" in c["call"]]
    power = [c for c in calls if c["call"] == "set_power_limit_w"]
    return bool(clock) and clock[-1]["call"] == "reset_locked_clocks" and (not power or power[-1]["watts"] == 600)


def locked(run: Run) -> Callable[[], bool]:
    return lambda: any(c["call"] == "set_locked_clocks" for c in run.calls())


def test_restores_on_sigterm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, signals_restored: None,
                             caplog: pytest.LogCaptureFixture) -> None:
    run = Run(tmp_path, monkeypatch, metrics=True)
    capture(run.log, caplog)
    scraped: list[bytes] = []

    def scrape_then_stop() -> None:
        with urllib.request.urlopen(f"http://127.0.0.1:{run.metrics_port}/metrics", timeout=5) as response:
            scraped.append(response.read())
        os.kill(os.getpid(), signal.SIGTERM)

    run.when(locked(run), scrape_then_stop)
    try:
        code = run.serve()
    finally:
        run.log.removeHandler(caplog.handler)
    assert code == 0
    calls = run.calls()
    assert [c["call"] for c in calls] == ["set_locked_clocks", "reset_locked_clocks"]  # set once, restored once
    assert calls[0]["max_mhz"] < 1980 and restored(calls)
    # the GPU is put back as soon as the stop is asked for, before the engine's drain is over
    text = caplog.text
    assert "received SIGTERM" in text
    assert text.index("unlock the SM clock of GPU 0 (stopping)") < text.index("vLLM stopped")
    text = scraped[0].decode()
    assert 'carbonforge_requests_total{dp_rank="0",finish_reason="stop",scheduler_family="fcfs"} 3.0' in text
    assert 'carbonforge_controller_target_sm_clock_hertz{gpu="0",policy="lock-sm-clock"}' in text


def test_restores_when_the_engine_crashes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          signals_restored: None) -> None:
    run = Run(tmp_path, monkeypatch)
    run.when(locked(run), run.crash_file.touch)
    assert run.serve() == 1
    assert restored(run.calls())


def test_restores_on_an_exception(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, signals_restored: None) -> None:
    run = Run(tmp_path, monkeypatch)

    def break_the_loop() -> None:
        run.double.raise_in_poll = True

    run.when(locked(run), break_the_loop)
    with pytest.raises(RuntimeError, match="supervision loop"):
        run.serve()
    assert restored(run.calls())
    assert run.engine is not None and run.engine._proc is not None
    assert run.engine._proc.poll() is not None  # the stand-in engine was stopped on the way out


def test_dry_run_sets_nothing_and_says_what_it_would_do(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        signals_restored: None,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    run = Run(tmp_path, monkeypatch, dry_run=True)
    capture(run.log, caplog)

    def periods() -> int:
        return caplog.text.count("energy controller (dry run): would")

    run.when(lambda: periods() >= 4, lambda: os.kill(os.getpid(), signal.SIGTERM))
    try:
        assert run.serve() == 0
    finally:
        run.log.removeHandler(caplog.handler)
    assert run.calls() == [] and periods() >= 4
    assert "would lock the SM clock of GPU 0" in caplog.text and "why: load 0.00" in caplog.text


def test_permission_denied_warns_once_and_only_observes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        signals_restored: None,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    run = Run(tmp_path, monkeypatch, deny_set=True)
    capture(run.log, caplog)
    run.when(lambda: bool(run.calls()), lambda: (time.sleep(1.5), os.kill(os.getpid(), signal.SIGTERM)))
    try:
        assert run.serve() == 0
    finally:
        run.log.removeHandler(caplog.handler)
    calls = run.calls()
    assert len(calls) == 1 and calls[0]["denied"]  # refused once, never tried again, nothing to restore
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "energy controller" in r.getMessage()]
    assert len(warnings) == 1 and "--cap-add SYS_ADMIN" in warnings[0].getMessage()
