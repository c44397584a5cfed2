"""The trace file sink, as it runs inside the engine: never through a symbolic link, owner-only at
the full level on every (re)open, and a failed append never removes what another engine core
appended to the same file."""

from __future__ import annotations

import errno
import json
import logging
import os
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from carbonforge_runtime.core.contract import TraceConfig
from carbonforge_runtime.engine import trace_sinks
from carbonforge_runtime.engine.trace_sinks import JsonlSink, PermanentSinkError, SinkError
from carbonforge_runtime.engine.trace_writer import TraceWriter
from tests.support import wait_until

SECRET = "keep me\n"


def precious(tmp_path: Path) -> Path:
    outside = tmp_path / "outside"
    outside.mkdir()
    path = outside / "precious"
    path.write_text(SECRET)
    path.chmod(0o644)
    return path


def assert_untouched(path: Path) -> None:
    assert path.read_text() == SECRET
    assert stat.S_IMODE(path.stat().st_mode) == 0o644


def lines(path: Path) -> list[dict[str, Any]]:
    text = path.read_text()
    assert text == "" or text.endswith("\n"), "a partial line was left at the end"
    return [json.loads(line) for line in text.splitlines()]


# ---- symbolic links --------------------------------------------------------------------------------

@pytest.mark.parametrize("private", [False, True])
def test_a_link_as_trace_file_is_refused_and_the_drop_is_permanent(tmp_path: Path, private: bool) -> None:
    target = precious(tmp_path)
    path = tmp_path / "trace.jsonl"
    path.symlink_to(target)
    sink = JsonlSink(str(path), private=private)
    with pytest.raises(PermanentSinkError) as refused:
        sink.write([{"prompt_text": "secret prompt"}])
    assert str(path) in str(refused.value) and "symbolic link" in str(refused.value)
    assert "remove the symbolic link" in str(refused.value)
    assert_untouched(target)
    path.unlink()  # once the operator removes the link, the next batch is written
    sink.write([{"n": 1}])
    sink.close()
    assert lines(path) == [{"n": 1}]
    assert_untouched(target)


def test_a_link_put_in_place_of_the_open_file_is_not_followed(tmp_path: Path) -> None:
    target = precious(tmp_path)
    path = tmp_path / "trace.jsonl"
    sink = JsonlSink(str(path), private=True)
    sink.write([{"n": 1}])
    path.rename(tmp_path / "trace.jsonl.1")  # rotated away ...
    path.symlink_to(target)  # ... and a link planted under the old name
    with pytest.raises(PermanentSinkError):
        sink.write([{"n": 2}])
    sink.close()
    assert_untouched(target)
    assert lines(tmp_path / "trace.jsonl.1") == [{"n": 1}]


def test_a_refused_link_is_counted_as_dropped_records(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    target = precious(tmp_path)
    path = tmp_path / "trace.jsonl"
    path.symlink_to(target)
    config = TraceConfig(level="standard", file=str(path), report_interval_s=60.0, flush_timeout_s=5.0)
    log = logging.getLogger("test.trace.safety")
    caplog.set_level(logging.INFO, logger="test.trace.safety")
    writer = TraceWriter([JsonlSink(str(path))], lambda item: {"n": item}, config, log).start()
    for i in range(5):
        writer.submit(i)
    assert writer.close() == {f"file {path}": 5, "queue": 0}
    assert "symbolic link" in caplog.text
    assert_untouched(target)


# ---- owner-only at the full level ------------------------------------------------------------------

def test_a_full_level_file_replaced_by_a_wider_one_is_owner_only_before_the_next_record(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "trace.jsonl"
    sink = JsonlSink(str(path), private=True)
    sink.write([{"n": 1}])
    path.rename(tmp_path / "trace.jsonl.1")  # a logrotate-style replacement with a 0644 file
    path.write_text("")
    path.chmod(0o644)
    modes: list[int] = []
    real_write = os.write

    def watch(fd: int, data: Any) -> int:
        modes.append(stat.S_IMODE(os.fstat(fd).st_mode))  # the mode at the moment the record goes in
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", watch)
    sink.write([{"prompt_text": "secret prompt"}])
    path.chmod(0o644)  # widened in place, same file: tightened again before the next record
    sink.write([{"prompt_text": "another"}])
    monkeypatch.undo()
    sink.close()
    assert modes == [0o600, 0o600]
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert lines(path) == [{"prompt_text": "secret prompt"}, {"prompt_text": "another"}]


def test_a_standard_level_file_keeps_its_mode(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    path.write_text("")
    path.chmod(0o644)
    JsonlSink(str(path)).write([{"n": 1}])
    assert stat.S_IMODE(path.stat().st_mode) == 0o644


def test_a_full_level_file_that_cannot_be_made_owner_only_gets_no_record(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "trace.jsonl"
    path.write_text("")
    path.chmod(0o644)

    def refuse(fd: int, mode: int) -> None:
        raise PermissionError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "fchmod", refuse)
    with pytest.raises(PermanentSinkError, match="cannot be made owner-only"):
        JsonlSink(str(path), private=True).write([{"prompt_text": "secret prompt"}])
    assert path.read_text() == ""


# ---- several writers on one file -------------------------------------------------------------------

def test_a_failed_append_never_removes_what_another_writer_appended(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Engine core A's append fails half-way; meanwhile core B appends to the same file. B's lines
    all stay, A leaves no partial line, and A's retry lands once."""
    path = tmp_path / "trace.jsonl"
    core_a, core_b = JsonlSink(str(path)), JsonlSink(str(path))
    core_a.write([{"core": "a", "n": 0}])
    core_b.write([{"core": "b", "n": 0}])
    real_write = os.write
    a_fd = core_a._fd
    other: list[threading.Thread] = []
    failures = {"a": 0}

    def disk_trouble(fd: int, data: Any) -> int:
        if fd != a_fd or failures["a"] >= 2:
            return real_write(fd, data)
        failures["a"] += 1
        if failures["a"] == 2:
            raise OSError(errno.ENOSPC, "No space left on device")  # ... then the disk is full
        # While A is in the middle of its append, B appends its own batch ...
        thread = threading.Thread(target=core_b.write, args=([{"core": "b", "n": i} for i in (1, 2, 3)],))
        thread.start()
        thread.join(0.5)  # (B waits for A's lock; without one it would be done by now)
        other.append(thread)
        return real_write(fd, bytes(data[:7]))  # ... A's write is cut short ...

    monkeypatch.setattr(os, "write", disk_trouble)
    batch = [{"core": "a", "n": 1}, {"core": "a", "n": 2}]
    with pytest.raises(SinkError, match="No space left"):
        core_a.write(batch)
    other[0].join(10)
    assert not other[0].is_alive()
    core_a.write(batch)  # the writer's retry of the same batch
    monkeypatch.undo()
    core_a.close()
    core_b.close()
    records = lines(path)
    assert [r for r in records if r["core"] == "b"] == [{"core": "b", "n": n} for n in range(4)]
    assert [r for r in records if r["core"] == "a"] == [{"core": "a", "n": n} for n in range(3)]


def test_a_short_write_is_not_cut_back_over_bytes_it_did_not_write(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A writer that takes no lock appended while ours failed: the cut would remove its bytes,
    so the file is left as it is."""
    path = tmp_path / "trace.jsonl"
    sink = JsonlSink(str(path))
    sink.write([{"n": 0}])
    real_write = os.write
    calls = {"n": 0}

    def foreign_then_fail(fd: int, data: Any) -> int:
        calls["n"] += 1
        if calls["n"] > 1:
            raise OSError(errno.EIO, "Input/output error")
        written = real_write(fd, bytes(data[:3]))
        with open(path, "a") as other:
            other.write('{"foreign": true}\n')
        return written

    monkeypatch.setattr(os, "write", foreign_then_fail)
    with pytest.raises(SinkError):
        sink.write([{"n": 1}])
    monkeypatch.undo()
    assert '{"foreign": true}\n' in path.read_text()


def test_a_file_without_locks_is_refused_rather_than_risked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_locks(fd: int, operation: int) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(trace_sinks.fcntl, "flock", no_locks)
    path = tmp_path / "trace.jsonl"
    with pytest.raises(PermanentSinkError, match="filesystem with file locks"):
        JsonlSink(str(path)).write([{"n": 1}])
    assert path.read_text() == ""


_CORE = """
import json, os, resource, signal, sys, time
from carbonforge_runtime.engine.trace_sinks import JsonlSink, SinkError
path, name, limit, go = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # past the limit a write fails (EFBIG) or is cut short
if limit:
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
open(go + "." + name, "w").close()
# The limited core appends its first batch while the file is still small; then all append at once.
first = go if limit else go + ".first"
while not os.path.exists(first):
    time.sleep(0.005)
sink, written = JsonlSink(path, private=True), []
for batch in range(150):
    records = [{"core": name, "n": batch * 4 + i, "pad": "x" * 57} for i in range(4)]
    try:
        sink.write(records)
        written += [r["n"] for r in records]
    except SinkError:
        pass
    if limit and batch == 0:
        open(go + ".first", "w").close()
sink.close()
print(json.dumps(written))
"""


def test_engine_cores_appending_at_once_keep_every_line_whole_when_one_hits_a_size_limit(tmp_path: Path) -> None:
    """Three processes append to one file; one of them is held to a file size limit, so its appends
    start failing part-way through a line. Every line in the file is whole, and each core's lines
    are exactly the records it reported written."""
    path = tmp_path / "trace.jsonl"
    limit = 30_000  # below what the limited core alone appends (some 57 kB)
    repo = str(Path(__file__).resolve().parents[3])
    env = {**os.environ, "PYTHONPATH": repo}
    go = tmp_path / "go"
    cores = {name: subprocess.Popen([sys.executable, "-c", _CORE, str(path), name, str(cap), str(go)], env=env,
                                    stdout=subprocess.PIPE, text=True)
             for name, cap in (("a", 0), ("b", 0), ("limited", limit))}
    deadline = time.monotonic() + 60
    wait_until(lambda: all(Path(f"{go}.{name}").exists() for name in cores), 60, every_s=0.01)
    go.write_text("")
    reported = {}
    for name, proc in cores.items():
        out, _ = proc.communicate(timeout=max(deadline - time.monotonic(), 1))
        assert proc.returncode == 0
        reported[name] = json.loads(out)
    records = lines(path)
    for name in cores:
        assert [r["n"] for r in records if r["core"] == name] == reported[name]
    assert len(reported["a"]) == len(reported["b"]) == 600
    assert 0 < len(reported["limited"]) < 600  # its first batch went in, and it did hit the limit
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
