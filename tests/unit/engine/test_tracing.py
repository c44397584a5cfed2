"""Trace records, configuration, sinks and the writer, without vLLM (real files, real OTLP)."""

from __future__ import annotations

import ast
import errno
import json
import logging
import os
import stat
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from carbonforge_runtime.core.contract import CONTRACT_ENV, EngineContract, Ordering, TraceConfig
from carbonforge_runtime.core.trace_record import (
    EXTRA_FIELDS,
    FULL_FIELDS,
    STANDARD_FIELDS,
    Completion,
    build_record,
    client_request_id,
)
from carbonforge_runtime.engine.trace_sinks import (
    JsonlSink,
    OtlpSink,
    PermanentSinkError,
    SinkError,
    build_sinks,
    span_attributes,
    span_ids,
)
from carbonforge_runtime.engine.trace_writer import TraceWriter
from carbonforge_runtime.errors import UsageError
from carbonforge_runtime.runtime.planning import trace_options as trace_config
from carbonforge_runtime.runtime.planning.trace_options import otlp_target, resolve_trace_options
from carbonforge_runtime.runtime.serve.launch import create_trace_file
from tests.support import wait_until
from tests.support.otlp_receiver import OtlpReceiver

REPO = Path(__file__).resolve().parents[3]


def completion(**overrides: Any) -> Completion:
    values: dict[str, Any] = dict(
        engine_request_id="chatcmpl-abc123-0123abcd", t_arrival=1000.0, t_scheduled=1000.25,
        t_first_token=1000.5, t_completion=1002.0, prompt_tokens=30, output_tokens=8, finish_reason="length",
    )
    values.update(overrides)
    return Completion(**values)


# ---- request ids -----------------------------------------------------------------------------------


@pytest.mark.parametrize(("engine_id", "client_id"), [
    ("chatcmpl-9f2c41d0aa-1a2b3c4d", "chatcmpl-9f2c41d0aa"),
    ("2_chatcmpl-9f2c41d0aa-1a2b3c4d", "chatcmpl-9f2c41d0aa"),  # n > 1: sample 2
    ("cmpl-5e0b-0-89731b8d", "cmpl-5e0b"),  # /v1/completions, prompt 0
    ("1_cmpl-5e0b-3-89731b8d", "cmpl-5e0b"),  # n > 1 and prompt 3
    ("chatcmpl-my-trace-id-7-deadbeef", "chatcmpl-my-trace-id-7"),  # X-Request-Id with dashes
    ("chatcmpl-0123abcd-0123abcd", "chatcmpl-0123abcd"),  # a client id that itself ends in hex
    ("12_other-request", "12_other-request"),  # not the API's shape: left alone
    ("no-suffix", "no-suffix"),
])
def test_client_request_id_strips_what_the_engine_added(engine_id: str, client_id: str) -> None:
    assert client_request_id(engine_id) == client_id


# ---- record ----------------------------------------------------------------------------------------


def test_standard_record_has_exactly_the_documented_fields_in_order() -> None:
    record = build_record(completion(priority_score=3.5, cached_prompt_tokens=16, preemptions=1), "trace",
                          "standard")
    assert tuple(record) == STANDARD_FIELDS + EXTRA_FIELDS
    assert record["request_id"] == "chatcmpl-abc123"
    assert record["engine_request_id"] == "chatcmpl-abc123-0123abcd"
    assert record["t_arrival"] == 1000.0 and record["t_completion"] == 1002.0
    assert record["e2e_latency_s"] == 2.0
    assert record["queue_wait_s"] == 0.25
    assert record["ttft_s"] == 0.5
    assert record["scheduler_family"] == "trace"
    assert record["priority_score"] == 3.5
    assert record["finish_reason"] == "length"
    assert (record["cached_prompt_tokens"], record["preemptions"]) == (16, 1)
    assert json.loads(json.dumps(record)) == record


def test_e2e_equals_completion_minus_arrival_and_waits_are_ordered() -> None:
    done = completion(t_arrival=1788962815.331234, t_scheduled=1788962815.338, t_first_token=1788962815.4,
                      t_completion=1788962816.58)
    record = build_record(done, "fcfs", "standard")
    assert abs(record["e2e_latency_s"] - (record["t_completion"] - record["t_arrival"])) < 1e-6
    assert 0 <= record["queue_wait_s"] <= record["ttft_s"] <= record["e2e_latency_s"]


def test_request_never_admitted_waited_its_whole_life_and_has_no_ttft() -> None:
    record = build_record(completion(t_scheduled=None, t_first_token=None, output_tokens=0,
                                     finish_reason="abort"), "fcfs", "standard")
    assert record["queue_wait_s"] == record["e2e_latency_s"] == 2.0
    assert record["ttft_s"] is None
    assert record["finish_reason"] == "abort"


def test_clock_skew_between_processes_never_gives_negative_durations() -> None:
    # the API server stamped arrival slightly *after* the engine's first admission (clock step)
    record = build_record(completion(t_arrival=1000.3, t_scheduled=1000.25, t_first_token=1000.2,
                                     t_completion=1000.1), "fcfs", "standard")
    assert record["e2e_latency_s"] == 0.0 and record["queue_wait_s"] == 0.0 and record["ttft_s"] == 0.0
    assert record["t_completion"] >= record["t_arrival"]


def test_full_record_decodes_prompt_with_specials_and_output_like_the_api() -> None:
    calls: list[tuple[list[int], bool]] = []

    def decode(ids: Sequence[int], skip_special_tokens: bool) -> str:
        calls.append((list(ids), skip_special_tokens))
        return "<|im_start|>user\nhi<|im_end|>" if not skip_special_tokens else "ok\ufffd\ufffd"

    done = completion(prompt_token_ids=[1, 2, 3], output_token_ids=[4, 5])
    record = build_record(done, "fcfs", "full", decode)
    assert tuple(record) == STANDARD_FIELDS + EXTRA_FIELDS + FULL_FIELDS
    assert calls == [([1, 2, 3], False), ([4, 5], True)]
    assert record["prompt_text"] == "<|im_start|>user\nhi<|im_end|>"
    assert record["output_text"] == "ok"  # an incomplete trailing character is held back, as by the API
    standard = build_record(done, "fcfs", "standard", decode)
    assert "prompt_text" not in standard and len(calls) == 2  # standard never decodes


# ---- configuration ---------------------------------------------------------------------------------


def test_sink_without_level_is_an_error() -> None:
    for kwargs in ({"trace_file": "t.jsonl"}, {"endpoint": "http://c:4317", "trace_format": "otlp"}):
        with pytest.raises(UsageError) as info:
            resolve_trace_options("off", kwargs.get("trace_file"), kwargs.get("endpoint"),
                                  kwargs.get("trace_format"), {})
        assert "--request-trace is off" in info.value.message
        assert "--request-trace standard" in info.value.remedy


def test_level_without_sink_warns_once_and_stays_off() -> None:
    decision = resolve_trace_options("standard", None, None, None, {})
    assert decision.config is None
    assert len(decision.warnings) == 1 and "no sink" in decision.warnings[0]
    assert resolve_trace_options("off", None, None, None, {}).warnings == []


@pytest.mark.parametrize(("args", "fragment"), [
    (("verbose", None, None, None), "not a trace level"),
    (("standard", None, "http://c:4317", "zipkin"), "--trace-format"),
    (("standard", "t.jsonl", None, "otlp"), "--trace-endpoint is not"),
    (("standard", None, "ftp://c:4317", None), "not a collector URL"),
    (("standard", None, "http://c:notaport", None), "invalid port"),
    (("standard", "  ", None, None), "--trace-file is empty"),
])
def test_invalid_trace_flags_are_usage_errors(args: tuple[Any, ...], fragment: str) -> None:
    with pytest.raises(UsageError) as info:
        resolve_trace_options(*args, {})
    assert fragment in info.value.message
    assert info.value.remedy


def test_trace_file_is_made_absolute_and_both_sinks_coexist(tmp_path: Path) -> None:
    decision = resolve_trace_options("FULL", "traces/t.jsonl", "collector:4317", "otlp", {}, cwd=str(tmp_path))
    config = decision.config
    assert config is not None and config.full
    assert config.file == str(tmp_path / "traces" / "t.jsonl")
    assert config.otlp is not None and config.otlp.endpoint == "http://collector:4317"
    assert [type(s).__name__ for s in build_sinks(config)] == ["JsonlSink", "OtlpSink"]


@pytest.mark.parametrize(("url", "environ", "endpoint", "protocol"), [
    ("http://c:4317", {}, "http://c:4317", "grpc"),
    ("c", {}, "http://c:4317", "grpc"),
    ("http://c:4318", {}, "http://c:4318/v1/traces", "http/protobuf"),
    ("https://c/v1/traces", {}, "https://c/v1/traces", "http/protobuf"),
    ("http://c:9999", {"OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}, "http://c:9999/v1/traces", "http/protobuf"),
    ("http://c:4318", {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"},
     "http://c:4318", "grpc"),
])
def test_otlp_transport_follows_the_url_or_the_otel_variable(
    url: str, environ: dict[str, str], endpoint: str, protocol: str
) -> None:
    target = otlp_target(url, environ)
    assert (target.endpoint, target.protocol) == (endpoint, protocol)


def test_unsupported_otel_protocol_is_a_usage_error() -> None:
    with pytest.raises(UsageError) as info:
        otlp_target("http://c:4318", {"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"})
    assert "OTEL_EXPORTER_OTLP_PROTOCOL" in info.value.remedy


def test_missing_otel_sdk_is_a_warning_at_start(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(trace_config, "otlp_sdk_missing", lambda: ["opentelemetry.sdk.trace"])
    decision = resolve_trace_options("standard", None, "http://c:4317", "otlp", {})
    assert decision.config is not None
    assert len(decision.warnings) == 1 and "dropped and counted" in decision.warnings[0]
    assert trace_config.otlp_sdk_missing.__module__  # the real check runs below
    monkeypatch.undo()
    assert trace_config.otlp_sdk_missing() == []  # installed in this environment


def test_engine_contract_round_trips_through_the_environment() -> None:
    trace = resolve_trace_options("full", "/tmp/t.jsonl", "http://c:4318", "otlp", {}).config
    contract = EngineContract(Ordering("ltr-promptlen", {"aging_rate": 5.0}), trace)
    env = contract.env()
    assert list(env) == [CONTRACT_ENV]
    assert EngineContract.from_environ(env) == contract
    assert EngineContract.from_environ({}) == EngineContract()
    with pytest.raises(UsageError):
        EngineContract.from_json("{not json")


def test_trace_writer_and_sinks_never_import_vllm() -> None:
    for path in [REPO / "carbonforge_runtime" / "engine" / n for n in ("trace_writer.py", "trace_sinks.py")]:
        tree = ast.parse(path.read_text())
        names = [alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names]
        names += [node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)]
        assert not [n for n in names if n == "vllm" or n.startswith("vllm.")], path
    code = ("import sys; import carbonforge_runtime.engine.trace_writer, carbonforge_runtime.engine.trace_sinks, "
            "carbonforge_runtime.core.ordering.registry, carbonforge_runtime.core.contract; "
            "assert 'vllm' not in sys.modules")
    assert os.spawnv(os.P_WAIT, sys.executable, [sys.executable, "-c", code]) == 0


# ---- JSONL sink -------------------------------------------------------------------------------------


def test_jsonl_sink_appends_whole_lines_and_creates_private_files(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    sink = JsonlSink(str(path), private=True)
    sink.write([{"a": 1}, {"b": "é\n"}])
    sink.write([{"c": None}])
    sink.close()
    assert [json.loads(line) for line in path.read_text().splitlines()] == [{"a": 1}, {"b": "é\n"}, {"c": None}]
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_jsonl_sink_reopens_a_removed_file_and_fails_on_a_directory(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    sink = JsonlSink(str(path))
    sink.write([{"n": 1}])
    path.unlink()
    sink.write([{"n": 2}])  # not into the unlinked inode: into a new file at the path
    assert path.read_text() == '{"n": 2}\n'
    path.unlink()
    path.mkdir()
    with pytest.raises(SinkError, match=r"t\.jsonl"):
        sink.write([{"n": 3}])
    path.rmdir()
    sink.write([{"n": 4}])
    assert path.read_text() == '{"n": 4}\n'


def test_jsonl_sink_cuts_back_a_partial_append(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "t.jsonl"
    sink = JsonlSink(str(path))
    sink.write([{"n": 1}])
    real_write = os.write
    calls = {"n": 0}

    def disk_fills(fd: int, data: Any) -> int:
        calls["n"] += 1
        if calls["n"] == 1:
            return real_write(fd, bytes(data[:5]))  # a short write ...
        raise OSError(errno.ENOSPC, "No space left on device")  # ... then the disk is full

    monkeypatch.setattr(os, "write", disk_fills)
    with pytest.raises(SinkError, match="No space left"):
        sink.write([{"n": 2}, {"n": 3}])
    monkeypatch.undo()
    assert path.read_text() == '{"n": 1}\n'
    sink.write([{"n": 2}, {"n": 3}])  # the retry lands whole
    assert path.read_text().splitlines() == ['{"n": 1}', '{"n": 2}', '{"n": 3}']


def test_create_trace_file_tightens_an_existing_file_at_full(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "t.jsonl"
    assert create_trace_file(str(path), private=True) is False
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    os.chmod(path, 0o644)
    assert create_trace_file(str(path), private=True) is True
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    with pytest.raises(OSError):
        create_trace_file(str(tmp_path), private=False)


# ---- OTLP sink against a real receiver -------------------------------------------------------------


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_otlp_sink_exports_one_span_per_record(protocol: str) -> None:
    records = [build_record(completion(engine_request_id=f"chatcmpl-r{i}-0123abcd", priority_score=float(i),
                                       prompt_token_ids=[1], output_token_ids=[2]),
                            "trace", "full", lambda ids, skip: f"text{ids[0]}")
               for i in range(3)]
    records[2]["ttft_s"] = None
    records[2]["priority_score"] = None
    with OtlpReceiver(protocol) as receiver:
        target = otlp_target(receiver.endpoint, {})
        assert target.protocol == ("grpc" if protocol == "grpc" else "http/protobuf")
        sink = OtlpSink(target, timeout_s=5)
        sink.write(records)
        sink.close()
        wait_until(lambda: len(receiver.snapshot()) >= 3, 10, every_s=0.05)
        spans = receiver.snapshot()
    assert len(spans) == 3
    by_id = {s.attributes["cf.request_id"]: s for s in spans}
    assert set(by_id) == {"chatcmpl-r0", "chatcmpl-r1", "chatcmpl-r2"}
    span = by_id["chatcmpl-r1"]
    assert span.name == "llm_request" and span.service_name == "carbonforge-scheduler"
    assert span.kind == 1  # SPAN_KIND_INTERNAL
    assert span.start_ns == 1000 * 10**9 and span.end_ns == 1002 * 10**9
    attrs = span.attributes
    assert attrs["gen_ai.usage.prompt_tokens"] == 30 and attrs["gen_ai.usage.completion_tokens"] == 8
    assert attrs["cf.e2e_latency_s"] == 2.0 and attrs["cf.queue_wait_s"] == 0.25 and attrs["cf.ttft_s"] == 0.5
    assert attrs["cf.scheduler.family"] == "trace" and attrs["cf.priority_score"] == 1.0
    assert attrs["gen_ai.prompt"] == "text1" and attrs["gen_ai.completion"] == "text2"
    assert "cf.ttft_s" not in by_id["chatcmpl-r2"].attributes  # OTLP has no null
    assert "cf.priority_score" not in by_id["chatcmpl-r2"].attributes


def test_a_batch_sent_again_carries_the_same_span_ids() -> None:
    """A retried export (its first answer was late) must be recognisable as a copy."""
    records = [build_record(completion(engine_request_id=f"chatcmpl-r{i}-0123abcd", prompt_token_ids=[1],
                                       output_token_ids=[2]), "fcfs", "standard")
               for i in range(2)]
    with OtlpReceiver("grpc") as receiver:
        sink = OtlpSink(otlp_target(receiver.endpoint, {}), timeout_s=5)
        sink.write(records)
        sink.write(records)  # the writer's retry of the same batch
        sink.close()
        wait_until(lambda: len(receiver.snapshot()) >= 2, 10, every_s=0.05)
        wait_until(lambda: receiver.copies >= 2, 10, every_s=0.05)
    assert len(receiver.snapshot()) == 2 and receiver.copies == 2 and receiver.conflicts == []
    ids = {span.attributes["cf.request_id"]: (span.trace_id, span.span_id) for span in receiver.snapshot()}
    assert ids["chatcmpl-r0"] == tuple(f"{n:0{w}x}" for n, w in zip(span_ids(records[0]), (32, 16), strict=True))
    assert ids["chatcmpl-r0"] != ids["chatcmpl-r1"]
    # the same request id at another arrival time (a client reusing X-Request-Id) is another span
    again = dict(records[0], t_arrival=records[0]["t_arrival"] + 60)
    assert span_ids(again) != span_ids(records[0])


def test_span_attributes_of_a_standard_record_carry_no_text() -> None:
    attrs = span_attributes(build_record(completion(), "fcfs", "standard"))
    assert not {"gen_ai.prompt", "gen_ai.completion"} & set(attrs)
    assert attrs["cf.finish_reason"] == "length"


def test_otlp_sink_raises_when_the_collector_is_down() -> None:
    receiver = OtlpReceiver("http")  # never started: nothing listens on its port
    sink = OtlpSink(otlp_target(receiver.endpoint, {}), timeout_s=1)
    with pytest.raises(SinkError, match="failed"):
        sink.write([build_record(completion(), "fcfs", "standard")])


# ---- writer ----------------------------------------------------------------------------------------


class MemorySink:
    def __init__(self, name: str = "memory", fail_first: int = 0, permanent: bool = False,
                 block: threading.Event | None = None) -> None:
        self.name = name
        self.records: list[Any] = []
        self.fail_first = fail_first
        self.permanent = permanent
        self.block = block
        self.attempts = 0
        self.closed = False

    def write(self, records: Sequence[Any]) -> None:
        self.attempts += 1
        if self.block is not None:
            self.block.wait(10)
        if self.permanent:
            raise PermanentSinkError("library missing")
        if self.attempts <= self.fail_first:
            raise SinkError("collector down")
        self.records.extend(records)

    def close(self) -> None:
        self.closed = True


def fast_config(**overrides: Any) -> TraceConfig:
    values: dict[str, Any] = dict(level="standard", file="unused", backoff_initial_s=0.01, backoff_max_s=0.02,
                                  report_interval_s=0.05, flush_timeout_s=5.0)
    values.update(overrides)
    return TraceConfig(**values)


def writer_for(sinks: Sequence[Any], caplog: pytest.LogCaptureFixture, **overrides: Any) -> TraceWriter:
    log = logging.getLogger("test.trace")
    caplog.set_level(logging.INFO, logger="test.trace")
    return TraceWriter(sinks, lambda item: {"n": item}, fast_config(**overrides), log).start()


def test_writer_delivers_every_record_to_every_sink_and_flushes_on_close(caplog: pytest.LogCaptureFixture) -> None:
    first, second = MemorySink("a"), MemorySink("b")
    writer = writer_for([first, second], caplog, batch_max=7)
    for i in range(100):
        writer.submit(i)
    assert writer.close() == {"a": 0, "b": 0, "queue": 0}
    assert [r["n"] for r in first.records] == list(range(100)) == [r["n"] for r in second.records]
    assert first.closed and second.closed
    writer.submit(101)  # after close: counted, not lost silently
    assert writer.dropped()["queue"] == 1
    assert writer.close() == {"a": 0, "b": 0, "queue": 1}  # closing twice is harmless


def test_a_failing_sink_retries_with_backoff_and_does_not_hold_up_the_others(
    caplog: pytest.LogCaptureFixture,
) -> None:
    healthy, flaky = MemorySink("healthy"), MemorySink("flaky", fail_first=2)
    writer = writer_for([healthy, flaky], caplog, retry_attempts=3)
    for i in range(10):
        writer.submit(i)
    dropped = writer.close()
    assert dropped == {"healthy": 0, "flaky": 0, "queue": 0}
    assert len(healthy.records) == len(flaky.records) == 10  # two failures, then the retry landed
    text = caplog.text
    assert "sink flaky failed: collector down" in text and "sink flaky works again" in text


def test_records_given_up_on_are_counted_and_reported(caplog: pytest.LogCaptureFixture) -> None:
    healthy, dead = MemorySink("healthy"), MemorySink("dead", fail_first=10**9)
    writer = writer_for([healthy, dead], caplog, retry_attempts=2, batch_max=5)
    for i in range(12):
        writer.submit(i)
    wait_until(lambda: writer.dropped()["dead"] >= 12, 10, every_s=0.02)
    assert len(healthy.records) == 12
    assert writer.dropped()["dead"] == 12
    time.sleep(0.15)  # one report interval
    assert "12 dropped by sink dead" in caplog.text  # the periodic warning, before shutdown
    writer.close(timeout_s=0.2)


def test_permanent_failures_drop_at_once_and_are_reported(caplog: pytest.LogCaptureFixture) -> None:
    sink = MemorySink("otlp", permanent=True)
    writer = writer_for([sink], caplog)
    for i in range(4):
        writer.submit(i)
    assert writer.close()["otlp"] == 4
    assert sink.attempts == 1
    assert "library missing" in caplog.text and "records dropped at shutdown" in caplog.text


def test_once_hurried_each_record_is_written_at_once(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    from carbonforge_runtime.engine import trace_writer as writer_module

    monkeypatch.setattr(writer_module, "POLL_INTERVAL_S", 30.0)  # batching would take 30 s
    sink = MemorySink("file")
    writer = writer_for([sink], caplog)
    time.sleep(0.05)  # the writer thread is now asleep for its (long) interval
    writer.hurry()
    for n in (1, 2):
        writer.submit(n)
        wait_until(lambda n=n: len(sink.records) >= n, 5, every_s=0.001)
    assert sink.records == [{"n": 1}, {"n": 2}]
    writer.close()


def test_a_full_queue_drops_and_counts_instead_of_blocking(caplog: pytest.LogCaptureFixture) -> None:
    gate = threading.Event()
    sink = MemorySink("slow", block=gate)
    writer = writer_for([sink], caplog, queue_capacity=10, sink_capacity=10, batch_max=1)
    started = time.perf_counter()
    for i in range(5000):
        writer.submit(i)
    assert time.perf_counter() - started < 1.0  # the loop side never waits
    gate.set()
    dropped = writer.close()
    assert len(sink.records) + dropped["slow"] + dropped["queue"] == 5000
    assert dropped["queue"] > 0


def test_close_gives_up_at_its_deadline_and_counts_what_is_left(caplog: pytest.LogCaptureFixture) -> None:
    gate = threading.Event()
    stuck = MemorySink("stuck", block=gate)
    writer = writer_for([stuck], caplog, batch_max=2)
    for i in range(6):
        writer.submit(i)
    time.sleep(0.3)  # the first batch is now blocked inside write()
    started = time.monotonic()
    dropped = writer.close(timeout_s=0.3)
    assert time.monotonic() - started < 2.0
    assert dropped["stuck"] == 6  # the blocked batch and the buffered rest
    gate.set()  # the blocked write completes late: it is not counted a second time
    time.sleep(0.3)
    assert writer.dropped()["stuck"] == 6 and writer.workers[0].stats.written == 0


def test_a_failing_sink_does_not_hold_up_shutdown(caplog: pytest.LogCaptureFixture) -> None:
    healthy, dead = MemorySink("healthy"), MemorySink("dead", fail_first=10**9)
    writer = writer_for([healthy, dead], caplog, retry_attempts=1000, backoff_initial_s=0.05,
                        backoff_max_s=0.05)
    for i in range(20):
        writer.submit(i)
    wait_until(lambda: writer.workers[1].stats.failing, 5, every_s=0.01)
    started = time.monotonic()
    dropped = writer.close(timeout_s=5.0)
    assert time.monotonic() - started < 1.5
    assert len(healthy.records) == 20 and dropped == {"healthy": 0, "dead": 20, "queue": 0}


def test_writer_with_real_sinks_survives_a_file_replaced_by_a_directory(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "t.jsonl"
    log = logging.getLogger("test.trace")
    caplog.set_level(logging.INFO, logger="test.trace")
    config = fast_config(file=str(path), retry_attempts=2)
    writer = TraceWriter(build_sinks(config), lambda item: {"n": item}, config, log).start()
    writer.submit(1)
    wait_until(lambda: path.exists() and path.read_text(), 5, every_s=0.02)
    path.unlink()
    path.mkdir()
    writer.submit(2)
    wait_until(lambda: writer.dropped()[f"file {path}"] >= 1, 5, every_s=0.02)
    path.rmdir()
    writer.submit(3)
    dropped = writer.close()
    assert dropped[f"file {path}"] == 1
    assert path.read_text() == '{"n": 3}\n'
    assert "not a regular file" in caplog.text or "Is a directory" in caplog.text
