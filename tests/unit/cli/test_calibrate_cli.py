"""``carbonforge-runtime calibrate``: bad input refused with the fix before anything starts (exit 2), a
failing phase stopped with its name and no traceback (exit 1), and the model file calibrate writes taken
by ``sim --cost-model`` and ``tune --cost-model``. No vLLM engine is started here (tests/e2e/test_calibrate.py
calibrates the CPU engine end to end)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import psutil
import pytest
from typer.testing import CliRunner

from carbonforge_runtime.cli import calibrate as calibrate_cli
from carbonforge_runtime.cli import main as cli
from carbonforge_runtime.offline.calibrate import design
from carbonforge_runtime.offline.calibrate.served import ServedEngine
from carbonforge_runtime.runtime.process.supervisor import EngineProcess
from tests.unit.offline.test_calibrate_run import KEY, Clock, FakeEngine, calibrate_with

runner = CliRunner()


@pytest.mark.parametrize(("args", "message", "fix"), [
    (["--context-key", "nope:bf16:chat:cpu"], "nope", "recipes list"),
    (["--context-key", KEY, "--budget", "fast"], "is not a duration", "--budget like 90s"),
    (["--context-key", KEY, "--budget", "20s"], "is too small", "at least 60s"),
])
def test_bad_input_is_refused_before_anything_starts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     args: list[str], message: str, fix: str) -> None:
    monkeypatch.setattr(calibrate_cli, "served_engine", lambda *a: pytest.fail("an engine was started"))
    result = runner.invoke(cli.app, ["calibrate", *args, "-o", str(tmp_path / "out")])
    assert result.exit_code == 2, result.output
    assert message in result.output and fix in result.output and "Traceback" not in result.output


def test_an_output_directory_that_cannot_be_written_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(calibrate_cli, "served_engine", lambda *a: pytest.fail("an engine was started"))
    (tmp_path / "file").write_text("x")
    for target in (tmp_path / "file", tmp_path / "file" / "below"):
        result = runner.invoke(cli.app, ["calibrate", "--context-key", KEY, "-o", str(target)])
        assert result.exit_code == 2, result.output
        assert "--output-dir" in result.output and "fix: pass --output-dir" in result.output


def test_an_engine_that_never_becomes_ready_stops_the_start_phase_and_is_killed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The supervisor's process, running a stand-in that never says it is ready (and ignores SIGTERM),
    with the start phase's share of a 60 s budget cut to about two seconds."""
    def never_ready(context_key: str, output_dir: Path) -> ServedEngine:
        code = ("import os, signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                "open(sys.argv[1], 'w').write(str(os.getpid())); time.sleep(120)")
        return ServedEngine(context_key, output_dir, dict(os.environ), EngineProcess,
                            argv_prefix=[sys.executable, "-c", code, str(tmp_path / "pid")])

    monkeypatch.setattr(calibrate_cli, "served_engine", never_ready)
    monkeypatch.setitem(design.PHASE_WEIGHTS, design.START, 0.025)
    result = runner.invoke(cli.app, ["calibrate", "--context-key", KEY, "--budget", "60s", "-o", str(tmp_path / "o")])
    assert result.exit_code == 1, result.output
    assert "calibrate stopped in the engine start phase: the engine was not ready" in result.output
    assert "done: nothing" in result.output and "written: nothing" in result.output
    assert "Traceback" not in result.output
    pid = int((tmp_path / "pid").read_text())  # the stand-in ignored SIGTERM: its process group was killed
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_the_model_calibrate_writes_is_taken_by_sim_and_tune(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    clock = Clock()
    outcome, _ = calibrate_with(tmp_path, FakeEngine(tmp_path, clock), clock)
    pytest.importorskip("vllm")
    from concurrent.futures import ThreadPoolExecutor

    from carbonforge_runtime.cli import tune as tune_cli

    trace = tmp_path / "check-load.jsonl"  # the check load calibrate wrote
    out = tmp_path / "sim.json"
    sim = runner.invoke(cli.app, ["sim", str(trace), "--context-key", KEY, "--cost-model", str(outcome.model),
                                  "--limit", "20", "-o", str(out), "-q"])
    assert sim.exit_code == 0, sim.output
    document = json.loads(out.read_text())
    assert document["sim"]["cost_model"]["name"].endswith("-calibrated") and document["summary"]["ok"] == 20
    assert "PROXY" not in sim.output
    monkeypatch.setattr(tune_cli, "_pool", lambda jobs: ThreadPoolExecutor(max_workers=1))
    tuned = runner.invoke(cli.app, ["tune", str(trace), "--context-key", KEY, "--goal", "mean_e2e", "--limit", "20",
                                    "--cost-model", str(outcome.model), "--budget", "2", "-o",
                                    str(tmp_path / "tune.json"), "-q"])
    assert tuned.exit_code == 0, tuned.output
    assert json.loads((tmp_path / "tune.json").read_text())["tune"]["cost_model"]["name"].endswith("-calibrated")
