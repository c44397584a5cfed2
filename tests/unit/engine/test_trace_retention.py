"""CF_TRACE_RETENTION: the trace file rotates at UTC boundaries into stamped segments, between
batches, and expired segments are deleted (each with a log line) by the sink's own thread. Time
comes from an injected clock; only a file left by an earlier run is dated by its modification time."""

from __future__ import annotations

import calendar
import json
import logging
import os
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from carbonforge_runtime.cli import main as cli
from carbonforge_runtime.core.contract import TraceConfig
from carbonforge_runtime.core.trace_retention import (
    DAY_S,
    HOUR_S,
    MINUTE_S,
    SegmentNames,
    format_duration,
    rotation_period,
    segment_path,
)
from carbonforge_runtime.engine import trace_sinks
from carbonforge_runtime.engine.trace_sinks import JsonlSink, build_sinks
from carbonforge_runtime.engine.trace_writer import TraceWriter
from carbonforge_runtime.errors import OverrideError
from carbonforge_runtime.settings import load_settings
from tests.support import wait_until

#: 2030-01-01 10:00 UTC.
T10 = float(calendar.timegm((2030, 1, 1, 10, 0, 0, 0, 0, 0)))
RETENTION_12H = 12 * HOUR_S  # hourly segments
SECRET_PROMPT = "my password is hunter2"


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def sink_at(path: Path, clock: Clock, retention_s: float = RETENTION_12H, **kwargs: Any) -> JsonlSink:
    return JsonlSink(str(path), private=True, retention_s=retention_s, clock=clock, **kwargs)


def lines(path: Path) -> list[dict[str, Any]]:
    text = path.read_text()
    assert text == "" or text.endswith("\n"), f"{path.name} ends in a partial line"
    return [json.loads(line) for line in text.splitlines()]


def names(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def deletions(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "deleted expired trace segment" in r.getMessage()]


# --- the policy ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("retention", "period"), [
    (30 * DAY_S, DAY_S), (12 * DAY_S, DAY_S), (7 * DAY_S, HOUR_S), (12 * HOUR_S, HOUR_S),
    (11 * HOUR_S, MINUTE_S), (30 * MINUTE_S, MINUTE_S), (MINUTE_S, MINUTE_S),
])
def test_the_period_is_the_longest_that_fits_twelve_times_into_the_retention(retention: int, period: int) -> None:
    assert rotation_period(retention) == period


@pytest.mark.parametrize(("text", "seconds"), [("7d", 7 * DAY_S), ("12h", 12 * HOUR_S), ("30m", 30 * MINUTE_S),
                                                (" 2D ", 2 * DAY_S), ("1m", 60)])
def test_retention_values(text: str, seconds: int) -> None:
    settings = load_settings({"CF_TRACE_RETENTION": text})
    assert settings.trace_retention_s == seconds
    assert format_duration(seconds) == text.strip().lower()


def test_unset_retention_keeps_files_forever() -> None:
    assert load_settings({}).trace_retention_s is None
    assert load_settings({"CF_TRACE_RETENTION": " "}).trace_retention_s is None
    sink = build_sinks(TraceConfig(level="full", file="/tmp/x/requests.jsonl"))[0]
    assert isinstance(sink, JsonlSink) and sink.rotation is None


@pytest.mark.parametrize("text", ["7", "7w", "0d", "-1h", "1.5h", "d", "7 d", "7dd", "seven days", "１h", "²h"])
def test_a_bad_retention_is_refused_naming_the_accepted_forms(text: str) -> None:
    with pytest.raises(OverrideError) as caught:
        load_settings({"CF_TRACE_RETENTION": text})
    assert f"CF_TRACE_RETENTION={text!r} is not a retention" in caught.value.message
    assert "7d, 12h, 30m" in caught.value.remedy and "unset it to keep trace files forever" in caught.value.remedy


def test_a_bad_retention_stops_serve_before_anything_starts() -> None:
    result = CliRunner().invoke(cli.app, ["serve", "--dry-run", "--request-trace", "full", "--trace-file",
                                          "/tmp/t.jsonl", "--", "m"], env={"CF_TRACE_RETENTION": "1 week"})
    assert result.exit_code != 0
    assert "CF_TRACE_RETENTION='1 week' is not a retention" in result.output
    assert "Traceback" not in result.output


def test_segment_names_are_exact() -> None:
    ours = SegmentNames("/logs/requests.jsonl")
    boundary = T10
    assert Path(segment_path("/logs/requests.jsonl", boundary)).name == "requests.20300101T1000Z.jsonl"
    assert Path(segment_path("/logs/requests.dp3.jsonl", boundary, 2)).name == "requests.dp3.20300101T1000Z-2.jsonl"
    for name in ("requests.20300101T1000Z.jsonl", "requests.dp3.20300101T1000Z-2.jsonl"):
        segment = ours.match(name)
        assert segment is not None and segment.closed_at == T10
    for name in ("requests.jsonl", "requests.dp0.jsonl", "requests.20300101T1000Z.jsonl.gz",
                 "requests.20300101T1000Z.jsonl.bak", "other.20300101T1000Z.jsonl", "xrequests.20300101T1000Z.jsonl",
                 "requests.2030-01-01.jsonl", "requests.20301399T9999Z.jsonl", "requests.20300101T1000.jsonl",
                 "requests.dpx.20300101T1000Z.jsonl", "requests.20300101T1000Z-.jsonl"):
        assert ours.match(name) is None, name
    # a file without a suffix: its ranks' segments too
    bare = SegmentNames("/logs/traces")
    assert Path(segment_path("/logs/traces.dp1", boundary)).name == "traces.dp1.20300101T1000Z"
    assert bare.match("traces.dp1.20300101T1000Z") is not None
    assert bare.match("traces.20300101T1000Z") is not None


# --- rotation -----------------------------------------------------------------------------------


def test_the_file_rotates_at_the_boundary_between_batches(tmp_path: Path) -> None:
    path = tmp_path / "requests.jsonl"
    clock = Clock(T10 + 30 * MINUTE_S)
    sink = sink_at(path, clock)
    sink.write([{"n": 1}])
    clock.now = T10 + HOUR_S - 0.001  # still 10:xx
    sink.write([{"n": 2}, {"n": 3}])
    assert names(tmp_path) == ["requests.jsonl"]
    clock.now = T10 + HOUR_S  # 11:00:00 exactly
    sink.write([{"n": 4}])
    segment = tmp_path / "requests.20300101T1100Z.jsonl"
    assert names(tmp_path) == [segment.name, "requests.jsonl"]
    assert [r["n"] for r in lines(segment)] == [1, 2, 3]
    assert [r["n"] for r in lines(path)] == [4]
    assert oct(segment.stat().st_mode & 0o777) == "0o600" and oct(path.stat().st_mode & 0o777) == "0o600"
    sink.close()


def test_a_batch_is_never_split_and_every_line_is_whole(tmp_path: Path) -> None:
    path = tmp_path / "requests.jsonl"
    clock = Clock(T10)
    sink = sink_at(path, clock, retention_s=30 * MINUTE_S)  # a segment a minute
    written = 0
    batches: list[list[int]] = []
    for minute in range(5):
        for part in range(3):
            clock.now = T10 + minute * MINUTE_S + part * 20
            batch = [{"n": written + i, "prompt_text": "x\n" * 1000 + SECRET_PROMPT} for i in range(50)]
            batches.append([r["n"] for r in batch])
            sink.write(batch)
            written += len(batch)
    sink.close()
    segments = sorted(tmp_path.glob("requests.*Z.jsonl"))
    assert len(segments) == 4  # minutes 0..3 closed, minute 4 still being written
    seen: list[int] = []
    for file in [*segments, path]:  # name order is time order, the file being written last
        numbers = [r["n"] for r in lines(file)]
        assert len(numbers) == 150
        seen += numbers
    assert seen == list(range(written))
    # each batch lies in one file
    by_file = {file.name: {r["n"] for r in lines(file)} for file in [*segments, path]}
    for batch in batches:
        assert sum(1 for numbers in by_file.values() if set(batch) & numbers) == 1


def test_an_idle_file_is_closed_at_its_boundary_and_the_next_record_starts_a_new_one(tmp_path: Path) -> None:
    path = tmp_path / "requests.jsonl"
    clock = Clock(T10 + 5 * MINUTE_S)
    sink = sink_at(path, clock)
    sink.write([{"n": 1}])
    sink.maintain()  # within the hour: nothing to do
    assert names(tmp_path) == ["requests.jsonl"]
    clock.now = T10 + HOUR_S + 1
    sink.maintain()
    assert names(tmp_path) == ["requests.20300101T1100Z.jsonl"]  # no empty file left behind
    sink.maintain()
    assert names(tmp_path) == ["requests.20300101T1100Z.jsonl"]
    clock.now = T10 + 3 * HOUR_S
    sink.write([{"n": 2}])
    assert names(tmp_path) == ["requests.20300101T1100Z.jsonl", "requests.jsonl"]
    assert lines(path) == [{"n": 2}]


def test_an_empty_file_is_never_rotated(tmp_path: Path) -> None:
    path = tmp_path / "requests.jsonl"
    path.touch()  # as the runtime creates it before the engine starts
    os.utime(path, (T10 - DAY_S, T10 - DAY_S))
    sink = sink_at(path, Clock(T10))
    sink.maintain()
    assert names(tmp_path) == ["requests.jsonl"]
    sink.write([{"n": 1}])
    assert names(tmp_path) == ["requests.jsonl"]


def test_a_file_left_by_an_earlier_run_is_dated_by_its_last_write(tmp_path: Path) -> None:
    path = tmp_path / "requests.jsonl"
    path.write_text('{"n": 0}\n')
    os.utime(path, (T10 + 10 * MINUTE_S, T10 + 10 * MINUTE_S))  # last written 10:10
    clock = Clock(T10 + 2 * HOUR_S)
    sink = sink_at(path, clock)
    sink.maintain()
    assert names(tmp_path) == ["requests.20300101T1100Z.jsonl"]
    # one written in the current period is appended to
    clock.now = T10 + 2 * HOUR_S + 30 * MINUTE_S
    path.write_text('{"n": 1}\n')
    os.utime(path, (clock.now - 60, clock.now - 60))
    other = sink_at(path, clock)
    other.write([{"n": 2}])
    assert [r["n"] for r in lines(path)] == [1, 2]


def test_a_taken_segment_name_is_never_overwritten(tmp_path: Path) -> None:
    path = tmp_path / "requests.jsonl"
    taken = tmp_path / "requests.20300101T1100Z.jsonl"
    taken.write_text('{"n": "earlier"}\n')
    clock = Clock(T10 + 1)
    sink = sink_at(path, clock)
    sink.write([{"n": 1}])
    clock.now = T10 + HOUR_S
    sink.write([{"n": 2}])
    assert lines(taken) == [{"n": "earlier"}]
    assert lines(tmp_path / "requests.20300101T1100Z-2.jsonl") == [{"n": 1}]
    assert lines(path) == [{"n": 2}]


def test_a_failed_rotation_loses_nothing_and_is_tried_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "requests.jsonl"
    clock = Clock(T10 + 1)
    sink = sink_at(path, clock)
    sink.write([{"n": 1}])
    real_rename = os.rename

    def refuse(src: Any, dst: Any) -> None:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(trace_sinks.os, "rename", refuse)
    clock.now = T10 + HOUR_S + 1
    with caplog.at_level(logging.WARNING, logger="vllm.carbonforge"):
        sink.write([{"n": 2}])
        sink.write([{"n": 3}])
    assert [r["n"] for r in lines(path)] == [1, 2, 3]
    warnings = [r.getMessage() for r in caplog.records if "cannot rotate" in r.getMessage()]
    assert len(warnings) == 1 and "Permission denied" in warnings[0] and "fix:" in warnings[0]
    monkeypatch.setattr(trace_sinks.os, "rename", real_rename)
    # the records written since are newer than 11:00, so the file closes at the next boundary, 12:00
    clock.now = T10 + 2 * HOUR_S
    sink.write([{"n": 4}])
    assert [r["n"] for r in lines(tmp_path / "requests.20300101T1200Z.jsonl")] == [1, 2, 3]
    assert lines(path) == [{"n": 4}]


# --- deletion -----------------------------------------------------------------------------------


def segment(directory: Path, name: str, text: str = '{"prompt_text": "' + SECRET_PROMPT + '"}\n') -> Path:
    path = directory / name
    path.write_text(text)
    return path


def test_an_expired_segment_is_deleted_and_logged(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "requests.jsonl"
    old = segment(tmp_path, "requests.20300101T0900Z.jsonl")  # closed 09:00
    kept = segment(tmp_path, "requests.20300101T1000Z.jsonl")  # closed 10:00
    clock = Clock(T10 + 11 * HOUR_S + 30 * MINUTE_S)  # 21:30: 09:00 is 12h30m ago, 10:00 is 11h30m ago
    sink = sink_at(path, clock)
    with caplog.at_level(logging.INFO, logger="vllm.carbonforge"):
        sink.maintain()
    assert not old.exists() and kept.exists()
    [line] = deletions(caplog)
    assert line == (f"request trace: deleted expired trace segment {old} (age 12h30m: its newest record is older "
                    "than 12h; CF_TRACE_RETENTION=12h, rotated hourly)")
    assert SECRET_PROMPT not in caplog.text
    clock.now += 31 * MINUTE_S  # the next sweep is a minute later at most
    with caplog.at_level(logging.INFO, logger="vllm.carbonforge"):
        sink.maintain()
    assert not kept.exists()
    assert len(deletions(caplog)) == 2


def test_the_file_being_written_is_never_deleted(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "requests.jsonl"
    clock = Clock(T10)
    sink = sink_at(path, clock)
    sink.write([{"n": 1}])
    os.utime(path, (T10 - 365 * DAY_S, T10 - 365 * DAY_S))  # however old it looks
    assert sink.rotation is not None
    sink.rotation.sweep_if_due(T10 + 59 * MINUTE_S)
    assert lines(path) == [{"n": 1}]
    # far in the future: the old records rotate out and expire, the new record stays in the file
    clock.now = T10 + 30 * DAY_S
    with caplog.at_level(logging.INFO, logger="vllm.carbonforge"):
        sink.write([{"n": 2}])
    assert names(tmp_path) == ["requests.jsonl"]
    assert lines(path) == [{"n": 2}]
    assert len(deletions(caplog)) == 1


def test_files_that_are_not_our_segments_are_left_alone(tmp_path: Path) -> None:
    foreign = [
        segment(tmp_path, "requests.jsonl.bak"), segment(tmp_path, "requests.20200101T0000Z.jsonl.gz"),
        segment(tmp_path, "other.20200101T0000Z.jsonl"), segment(tmp_path, "requests.20201399T0000Z.jsonl"),
        segment(tmp_path, "requests.2020-01-01.jsonl"), segment(tmp_path, "notes.txt"),
        segment(tmp_path, "requests.dp0.jsonl"), segment(tmp_path, "requests.1.jsonl"),
    ]
    directory = tmp_path / "requests.20200101T0100Z.jsonl"
    directory.mkdir()
    target = segment(tmp_path, "target.txt")
    link = tmp_path / "requests.20200101T0200Z.jsonl"
    link.symlink_to(target)
    sink = sink_at(tmp_path / "requests.jsonl", Clock(T10))
    sink.maintain()
    assert all(path.read_text() for path in foreign)
    assert directory.is_dir() and link.is_symlink() and target.exists()


def test_each_rank_rotates_its_own_file_and_expired_segments_of_every_rank_go(tmp_path: Path) -> None:
    config = TraceConfig(level="full", file=str(tmp_path / "requests.jsonl"), data_parallel_size=2,
                         retention_s=RETENTION_12H)
    clock = Clock(T10 + 1)
    ranks = []
    for rank in (0, 1):
        [sink] = build_sinks(config, dp_rank=rank)
        assert isinstance(sink, JsonlSink) and sink.rotation is not None
        sink.rotation.clock = clock
        ranks.append(sink)
    stale = segment(tmp_path, "requests.dp2.20290101T0000Z.jsonl")  # a rank that no longer runs
    for rank, sink in enumerate(ranks):
        sink.write([{"rank": rank, "n": 1}])
    clock.now = T10 + HOUR_S + 1
    for rank, sink in enumerate(ranks):
        sink.write([{"rank": rank, "n": 2}])
    assert names(tmp_path) == ["requests.dp0.20300101T1100Z.jsonl", "requests.dp0.jsonl",
                               "requests.dp1.20300101T1100Z.jsonl", "requests.dp1.jsonl"]
    assert not stale.exists()
    assert lines(tmp_path / "requests.dp1.20300101T1100Z.jsonl") == [{"rank": 1, "n": 1}]
    clock.now = T10 + 13 * HOUR_S + 1
    for sink in ranks:
        sink.maintain()
    # the 11:00 segments expired; the files written until 11:00:01 closed at 12:00 and are kept
    assert names(tmp_path) == ["requests.dp0.20300101T1200Z.jsonl", "requests.dp1.20300101T1200Z.jsonl"]


def test_the_writer_thread_does_the_upkeep_while_idle(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "requests.jsonl"
    expired = segment(tmp_path, "requests.20200101T0000Z.jsonl")
    sink = JsonlSink(str(path), retention_s=RETENTION_12H)  # the real clock

    class Broken:
        name = "broken"
        calls = 0

        def write(self, records: Any) -> None:
            pass

        def maintain(self) -> None:
            Broken.calls += 1
            raise OSError("upkeep broke")

        def close(self) -> None:
            pass

    config = TraceConfig(level="standard")
    with caplog.at_level(logging.INFO):
        writer = TraceWriter([sink, Broken()], lambda item: {"n": item}, config, logging.getLogger("t")).start()
        wait_until(lambda: not expired.exists() and Broken.calls >= 3, 10, what="the idle upkeep")
        writer.submit(1)
        writer.close()
    assert lines(path) == [{"n": 1}]
    assert len([r for r in caplog.records if "upkeep of sink broken failed: upkeep broke" in r.getMessage()]) == 1


# --- reading the segments -----------------------------------------------------------------------


def test_trace_summarize_reads_the_segments_as_one_trace(tmp_path: Path) -> None:
    traces = tmp_path / "traces"
    traces.mkdir()
    clock = Clock(T10)
    sinks = [sink_at(traces / f"requests.dp{rank}.jsonl", clock, family=str(traces / "requests.jsonl"))
             for rank in (0, 1)]
    count = 0
    for step in range(12):  # 3 hours, a batch every 15 minutes per rank
        clock.now = T10 + step * 15 * MINUTE_S
        for sink in sinks:
            t = clock.now - 2.0
            sink.write([{"request_id": f"chatcmpl-{count:016x}", "t_arrival": t, "t_completion": t + 1.5,
                         "prompt_tokens": 10, "output_tokens": 5, "e2e_latency_s": 1.5, "ttft_s": 0.2,
                         "queue_wait_s": 0.1, "scheduler_family": "fcfs", "priority_score": None}])
            count += 1
    assert len(list(traces.glob("*Z.jsonl"))) == 4  # two closed hours per rank
    result = CliRunner().invoke(cli.app, ["trace", "summarize", str(traces), "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["records"] == count == 24
    files = [Path(f["path"]).name for f in summary["files"]]
    assert files == sorted(files) and files[:3] == [
        "requests.dp0.20300101T1100Z.jsonl", "requests.dp0.20300101T1200Z.jsonl", "requests.dp0.jsonl"]


def test_segment_stamps_sort_in_time_order() -> None:
    stamps = [Path(segment_path("/l/requests.jsonl", T10 + i * 7919)).name for i in range(0, 400, 37)]
    assert stamps == sorted(stamps)
