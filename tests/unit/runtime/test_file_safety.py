"""Files the runtime writes in the log directory are never opened through a symbolic link: the
write probe, the trace file, vllm.log and runtime.log. A planted link is refused with a message and
the fix, and what it points at keeps its content and its mode."""

from __future__ import annotations

import logging
import os
import stat
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from carbonforge_runtime import files
from carbonforge_runtime import log as cflog
from carbonforge_runtime.core.contract import TraceConfig
from carbonforge_runtime.errors import CarbonForgeError
from carbonforge_runtime.gpu.fake import FakeGpuBackend, host
from carbonforge_runtime.runtime.fetch import _prepare_cache
from carbonforge_runtime.runtime.planning.plan import ServeOptions
from carbonforge_runtime.runtime.process import supervisor
from carbonforge_runtime.runtime.serve.launch import _create_trace_file, _log_dir, create_trace_file, serve
from carbonforge_runtime.settings import load_settings
from tests.support import TINY_KEY

SECRET = "root:x:0:0:do not touch\n"


@pytest.fixture
def target(tmp_path: Path) -> Iterator[Path]:
    """A file outside the log directory that a planted link points at; it must stay as it is."""
    outside = tmp_path / "outside"
    outside.mkdir()
    path = outside / "precious"
    path.write_text(SECRET)
    path.chmod(0o640)
    yield path
    assert_untouched(path)


def assert_untouched(path: Path) -> None:
    assert path.read_text() == SECRET
    assert stat.S_IMODE(path.stat().st_mode) == 0o640


def plant(link: Path, target: Path) -> Path:
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(target)
    return link


# ---- the write probe -------------------------------------------------------------------------------

def test_the_log_directory_probe_never_opens_a_planted_link(tmp_path: Path, target: Path) -> None:
    logs = tmp_path / "logs"
    plant(logs / ".write-test", target)  # the name the probe once used
    assert _log_dir(load_settings({"CF_LOG_DIR": str(logs)})) == logs
    assert sorted(p.name for p in logs.iterdir()) == [".write-test"]  # the probe left nothing behind
    assert (logs / ".write-test").is_symlink()


def test_the_cache_probe_never_opens_a_planted_link(tmp_path: Path, target: Path) -> None:
    cache = tmp_path / "hub"
    plant(cache / ".cf-fetch-write-test", target)
    _prepare_cache(cache)
    assert sorted(p.name for p in cache.iterdir()) == [".cf-fetch-write-test"]


def test_the_probe_name_is_new_each_time_and_a_link_with_that_name_is_skipped(
        tmp_path: Path, target: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    names = iter(["taken", "free"])
    monkeypatch.setattr(files.secrets, "token_hex", lambda n: next(names))
    plant(tmp_path / ".cf-write-probe-taken", target)  # a link with the very name drawn first
    created: list[tuple[str, int]] = []
    real_open = os.open

    def spy(path: Any, flags: int, mode: int = 0o777) -> int:
        created.append((os.fspath(path), flags))
        return real_open(path, flags, mode)

    monkeypatch.setattr(os, "open", spy)
    files.probe_writable(tmp_path)
    assert [os.path.basename(p) for p, _ in created] == [".cf-write-probe-taken", ".cf-write-probe-free"]
    assert all(flags & os.O_EXCL and flags & os.O_CREAT and flags & os.O_NOFOLLOW for _, flags in created)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".cf-write-probe-taken", "outside"]


def test_an_unwritable_log_directory_still_names_the_fix(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(CarbonForgeError) as refused:
        _log_dir(load_settings({"CF_LOG_DIR": str(blocker / "logs")}))
    assert "is not writable" in refused.value.message and "CF_LOG_DIR" in refused.value.remedy


# ---- the trace file --------------------------------------------------------------------------------

@pytest.mark.parametrize("level", ["standard", "full"])
def test_a_link_as_trace_file_is_refused_and_its_target_neither_chmod_ed_nor_written(
        tmp_path: Path, target: Path, level: str) -> None:
    link = plant(tmp_path / "logs" / "trace.jsonl", target)
    with pytest.raises(CarbonForgeError) as refused:
        _create_trace_file(TraceConfig(level=level, file=str(link)))
    assert str(link) in refused.value.message and "symbolic link" in refused.value.message
    assert "remove the symbolic link" in refused.value.remedy
    assert link.is_symlink()


def test_a_dangling_link_as_trace_file_creates_nothing_where_it_points(tmp_path: Path) -> None:
    nowhere = tmp_path / "elsewhere.jsonl"
    link = plant(tmp_path / "trace.jsonl", nowhere)
    with pytest.raises(files.SymlinkRefused):
        create_trace_file(str(link), private=True)
    assert not nowhere.exists()


# ---- vllm.log --------------------------------------------------------------------------------------

def test_a_link_as_vllm_log_is_refused_before_the_engine_starts(tmp_path: Path, target: Path) -> None:
    link = plant(tmp_path / "vllm.log", target)
    engine = supervisor.EngineProcess([sys.executable, "-c", "pass"], {}, link)
    with pytest.raises(CarbonForgeError) as refused:
        engine.start()
    assert str(link) in refused.value.message and "remove the symbolic link" in refused.value.remedy
    assert engine.pid is None and engine.watchdog_pid is None


def test_vllm_log_is_still_appended_to(tmp_path: Path) -> None:
    log_path = tmp_path / "vllm.log"
    log_path.write_text("earlier run\n")
    engine = supervisor.EngineProcess([sys.executable, "-c", "print('engine says hi')"], {}, log_path)
    engine.start()
    try:
        assert engine._proc is not None and engine._proc.wait(30) == 0
    finally:
        engine.release_watchdog()
    text = log_path.read_text()
    assert text.startswith("earlier run\n") and "carbonforge-runtime starting vLLM" in text
    assert text.endswith("engine says hi\n")


# ---- runtime.log -----------------------------------------------------------------------------------

def test_a_link_as_runtime_log_is_refused(tmp_path: Path, target: Path) -> None:
    plant(tmp_path / cflog.RUNTIME_LOG_NAME, target)
    log_file = cflog.RuntimeLogFile()
    try:
        with pytest.raises(files.SymlinkRefused):
            log_file.open(tmp_path)
    finally:
        log_file.close()


def test_serving_stops_with_the_fix_when_runtime_log_is_a_link(
        tmp_path: Path, target: Path, tiny_model: str, monkeypatch: pytest.MonkeyPatch) -> None:
    link = plant(tmp_path / cflog.RUNTIME_LOG_NAME, target)
    monkeypatch.setattr(supervisor, "supervise", lambda *a, **k: pytest.fail("the engine must not start"))
    env = {"CF_LOG_DIR": str(tmp_path), "CF_TINY_MODEL_DIR": tiny_model}
    with pytest.raises(CarbonForgeError) as refused:
        serve(ServeOptions(context_key=TINY_KEY, skip_preflight=True), load_settings(env), env,
              FakeGpuBackend(host(None)))
    assert str(link) in refused.value.message and "remove the symbolic link" in refused.value.remedy


def test_rotation_moves_planted_links_without_touching_their_targets(
        tmp_path: Path, target: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(cflog, "RUNTIME_LOG_MAX_BYTES", 2000)
    for n in (1, 2, 3):
        plant(tmp_path / f"runtime.log.{n}", target)
    logger = cflog.get_logger()
    old = logger.level
    logger.setLevel(logging.INFO)
    log_file = cflog.RuntimeLogFile()
    try:
        log_file.open(tmp_path)
        for i in range(200):
            logger.info("line %d %s", i, "x" * 40)
        # A link put in place of runtime.log while it is closed (as between two rotations) is refused
        # at the reopen: one line on stderr, no traceback, and the target stays as it was.
        assert log_file.handler is not None
        log_file.handler.close()
        (tmp_path / "runtime.log").unlink()
        plant(tmp_path / "runtime.log", target)
        logger.info("not written through the link")
        logger.info("nor this one")
    finally:
        log_file.close()
        logger.setLevel(old)
    rotated = [tmp_path / f"runtime.log.{n}" for n in (1, 2, 3)]
    assert not any(path.is_symlink() for path in rotated)
    assert all("line " in path.read_text() for path in rotated)
    err = capsys.readouterr().err
    assert err.count("runtime.log is not written") == 1 and "Traceback" not in err
