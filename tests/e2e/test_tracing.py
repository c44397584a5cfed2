"""Request tracing end to end: carbonforge-runtime runs the real vLLM CPU engine with the shim inside;
the real openai client sends the load; a real OTLP receiver (gRPC or HTTP) takes the spans.

Three engine sessions, each shared by the checks that need its configuration:

* recipe mode, level ``full``, JSONL + OTLP/gRPC, max-num-seqs 2: exact records for 48 mixed
  requests, full-level text, request tags and the model name from every API, queueing under a
  burst, then sink faults (collector stopped, trace file replaced by a directory) and the drop
  accounting reported at shutdown;
* override mode (a model path and vLLM flags after the double dash, CF_CONTEXT_KEY set and ignored),
  level ``standard``, JSONL + OTLP/HTTP: the HTTP transport, a plain and a streamed chat, then SIGTERM
  under load, leaving no engine process;

A level without a sink (one warning, tracing off, serving works) is checked on the default engine in
test_serve.py.
"""

from __future__ import annotations

import json
import os
import re
import signal
import stat
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.support import TINY_KEY, TINY_SERVED_NAME, RuntimeProcess, wait_until
from tests.support.burst import send_burst
from tests.support.otlp_receiver import OtlpReceiver, ReceivedSpan
from tests.support.serving import chat_both_ways

QUEUE_KEY = "cf-tiny-queue:bf16:chat:cpu"
QUEUE_RECIPE = """\
key: cf-tiny-queue:bf16:chat:cpu
plan: free
description: The tiny CPU model with only two concurrent sequences, so that requests queue.
model:
  repo: carbonforge-test/tiny-queue
  served_name: carbonforge/tiny-chat
  builtin: tiny-chat
vllm:
  dtype: bfloat16
  max_model_len: 2048
  max_num_seqs: 2
  enable_prefix_caching: true
drain_timeout_s: 15
env:
  VLLM_CPU_KVCACHE_SPACE: "1"
  HF_HUB_OFFLINE: "1"
scheduler:
  family: trace
  params: {}
controller:
  policy: none
"""
WORDS = ("invoice", "payment", "dashboard", "overdue", "receipt", "terms", "billing", "history")


@dataclass
class Answer:
    id: str
    prompt_tokens: int
    completion_tokens: int
    content: str
    user_text: str | None  # the chat user message; None for /v1/completions
    stream: bool


def client_for(runtime: RuntimeProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=runtime.base_url, api_key="unused", timeout=300, max_retries=0)


def prompt_text(i: int, words: int) -> str:
    return f"request {i}: " + " ".join(WORDS[(i + k) % len(WORDS)] for k in range(words))


def ask(client: openai.OpenAI, i: int, max_tokens: int, words: int, stream: bool, chat: bool = True) -> Answer:
    text = prompt_text(i, words)
    extra = {"ignore_eos": True}
    if not chat:
        done = client.completions.create(model=TINY_SERVED_NAME, prompt=text, max_tokens=max_tokens,
                                         extra_body=extra)
        assert done.usage is not None
        return Answer(done.id, done.usage.prompt_tokens, done.usage.completion_tokens, done.choices[0].text,
                      None, False)
    messages: Any = [{"role": "user", "content": text}]
    if not stream:
        reply = client.chat.completions.create(model=TINY_SERVED_NAME, messages=messages, max_tokens=max_tokens,
                                               extra_body=extra)
        assert reply.usage is not None
        return Answer(reply.id, reply.usage.prompt_tokens, reply.usage.completion_tokens,
                      reply.choices[0].message.content or "", text, False)
    pieces, usage, rid = [], None, None
    for chunk in client.chat.completions.create(model=TINY_SERVED_NAME, messages=messages, max_tokens=max_tokens,
                                                stream=True, stream_options={"include_usage": True},
                                                extra_body=extra):
        rid = chunk.id
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            usage = chunk.usage
    assert usage is not None and rid is not None
    return Answer(rid, usage.prompt_tokens, usage.completion_tokens, "".join(pieces), text, True)


def send_all(client: openai.OpenAI, count: int, start: int, max_tokens: Any = None, words: Any = None,
             chat_only: bool = False) -> list[Answer]:
    """``count`` concurrent requests: streaming and not, chat and completions, mixed lengths."""
    with ThreadPoolExecutor(max_workers=count) as pool:
        futures = [
            pool.submit(ask, client, i, max_tokens or 1 + (i * 7) % 24, words or 1 + (i * 11) % 60,
                        stream=i % 2 == 1, chat=chat_only or i % 6 != 4)
            for i in range(start, start + count)
        ]
        return [f.result() for f in futures]


def read_records(path: Path) -> list[dict[str, Any]]:
    try:
        return [json.loads(line) for line in path.read_text().splitlines()]
    except OSError:
        return []


def wait_records(path: Path, count: int, timeout_s: float = 20.0) -> list[dict[str, Any]]:
    wait_until(lambda: len(read_records(path)) >= count, timeout_s, every_s=0.1)
    return read_records(path)


def dropped_total(log: str, sink: str) -> int:
    """The drops of ``sink`` the engine has reported so far (its periodic and shutdown lines)."""
    totals = [int(m) for m in re.findall(rf"dropped by sink {sink} \S+ \((\d+) in total", log)]
    return max(totals, default=0)


def spans_accounted(s: Session, count: int, timeout_s: float = 40.0) -> tuple[list[ReceivedSpan], int]:
    """The spans received and the OTLP drops reported, once they add up to ``count``. A collector
    that answers an export after its deadline (this test's receiver shares a process with busy client
    threads) makes the sink retry and, after its last attempt, count a drop: delivered plus counted
    drops is the guarantee, and drops are reported every 10 s."""
    def dropped() -> int:
        return dropped_total(s.runtime.engine_log(), "OTLP grpc")

    wait_until(lambda: len(s.receiver.snapshot()) + dropped() >= count, timeout_s, every_s=0.5)
    return s.receiver.snapshot(), dropped()




def check_standard(record: dict[str, Any], answer: Answer, family: str) -> None:
    assert record["request_id"] == answer.id
    assert record["prompt_tokens"] == answer.prompt_tokens
    assert record["output_tokens"] == answer.completion_tokens
    assert record["t_arrival"] <= record["t_completion"]
    assert abs(record["e2e_latency_s"] - (record["t_completion"] - record["t_arrival"])) <= 0.001
    assert 0 <= record["queue_wait_s"] <= record["ttft_s"] <= record["e2e_latency_s"]
    assert record["scheduler_family"] == family and record["priority_score"] is None
    assert record["finish_reason"] == "length"
    assert abs(record["t_arrival"] - time.time()) < 600  # Unix seconds


def check_span(span: ReceivedSpan, record: dict[str, Any], full: bool) -> None:
    assert span.name == "llm_request" and span.service_name == "carbonforge-scheduler"
    assert abs(span.start_ns - record["t_arrival"] * 1e9) < 2000
    assert abs(span.end_ns - record["t_completion"] * 1e9) < 2000
    attrs = span.attributes
    assert attrs["cf.request_id"] == record["request_id"]
    assert attrs["gen_ai.usage.prompt_tokens"] == record["prompt_tokens"]
    assert attrs["gen_ai.usage.completion_tokens"] == record["output_tokens"]
    assert attrs["cf.e2e_latency_s"] == record["e2e_latency_s"]
    assert attrs["cf.queue_wait_s"] == record["queue_wait_s"]
    assert attrs["cf.ttft_s"] == record["ttft_s"]
    assert attrs["cf.scheduler.family"] == record["scheduler_family"]
    assert "cf.priority_score" not in attrs  # null for a family that does not reorder
    if full:
        assert attrs["gen_ai.prompt"] == record["prompt_text"]
        assert attrs["gen_ai.completion"] == record["output_text"]
    else:
        assert "gen_ai.prompt" not in attrs and "gen_ai.completion" not in attrs


# ---- session 1: recipe mode, full, JSONL + gRPC ------------------------------------------------------


@dataclass
class Session:
    runtime: RuntimeProcess
    receiver: OtlpReceiver
    trace: Path
    client: openai.OpenAI
    sent: int = 0


@pytest.fixture(scope="class")
def full_session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Session]:
    """One engine for the class below; it stops at the end of the class, before the next session."""
    base = tmp_path_factory.mktemp("trace-full")
    (base / "recipes").mkdir()
    (base / "recipes" / "cf-tiny-queue--bf16--chat--cpu.yaml").write_text(QUEUE_RECIPE)
    trace = base / "traces" / "requests.jsonl"
    receiver = OtlpReceiver("grpc").start()
    runtime = RuntimeProcess(
        ["--context-key", QUEUE_KEY, "--request-trace", "full", "--trace-file", str(trace),
         "--trace-endpoint", receiver.endpoint, "--trace-format", "otlp"],
        base / "logs", env={"CF_RECIPES_DIR": str(base / "recipes")},
    ).start()
    try:
        runtime.wait_ready()
        yield Session(runtime, receiver, trace, client_for(runtime))
    finally:
        runtime.kill()
        receiver.stop()


class TestFullLevelRecipeSession:
    """Checks run in order on one engine; the faults come last."""

    def test_every_request_gets_one_exact_record_in_both_sinks(self, full_session: Session) -> None:
        s = full_session
        out = s.runtime.output()
        assert "REQUEST TRACE LEVEL full" in out  # the prominent warning, at start
        assert stat.S_IMODE(os.stat(s.trace).st_mode) == 0o600
        answers = send_all(s.client, 48, start=0)
        s.sent += 48
        assert len({a.id for a in answers}) == 48
        assert sum(a.stream for a in answers) == 24 and sum(a.user_text is None for a in answers) == 8
        records = wait_records(s.trace, 48)
        assert len(records) == 48, "one record per completed request"
        by_id = {r["request_id"]: r for r in records}
        assert set(by_id) == {a.id for a in answers}
        for answer in answers:
            record = by_id[answer.id]
            check_standard(record, answer, family="trace")
            # full level: the rendered prompt the engine served, and the text the client got
            if answer.user_text is not None:
                assert record["prompt_text"].startswith("<|im_start|>")
                assert f"<|im_start|>user\n{answer.user_text}<|im_end|>" in record["prompt_text"]
                assert record["prompt_text"].endswith("<|im_start|>assistant\n<think>\n")
            else:
                assert record["prompt_text"] == answer.user_text or answer.id.startswith("cmpl-")
            assert record["output_text"] == answer.content
        assert stat.S_IMODE(os.stat(s.trace).st_mode) == 0o600
        spans, dropped = spans_accounted(s, 48)
        assert len(spans) + dropped == 48, "one span per completed request, or a drop counted and reported"
        assert dropped <= 4, f"{dropped} spans dropped: the collector was unreachable, not just slow"
        span_by_id = {span.attributes["cf.request_id"]: span for span in spans}
        assert len(span_by_id) == len(spans) and set(span_by_id) <= set(by_id)  # both sinks: the same requests
        for rid, span in span_by_id.items():
            check_span(span, by_id[rid], full=True)


    def test_tags_and_model_reach_both_sinks_from_every_api(self, full_session: Session) -> None:
        """The OpenAI SDK tags requests with ``metadata`` and ``X-CF-Task``: every record of a request (both
        samples of ``n=2``, both prompts of a completion, a Responses call) carries them, a client's own
        values in the reserved ``vllm_xargs`` keys lose to the header, no answer shows the channel, and a
        request past the OpenAI limits is refused before the engine."""
        s = full_session
        before = len(read_records(s.trace))
        meta = {"team": "billing", "task": "from-metadata"}
        header = {"X-CF-Task": "invoice-triage"}
        want = {"team": "billing", "task": "invoice-triage"}
        messages: Any = [{"role": "user", "content": prompt_text(400, 6)}]
        chat = s.client.chat.completions.create(model=TINY_SERVED_NAME, messages=messages, max_tokens=3, n=2,
                                                temperature=1.0, metadata=meta, extra_headers=header)
        completion = s.client.completions.create(model=TINY_SERVED_NAME, prompt=["one two", "three four"],
                                                 max_tokens=3, extra_body={"metadata": meta}, extra_headers=header)
        response = s.client.responses.create(model=TINY_SERVED_NAME, input="hello", max_output_tokens=4,
                                             metadata=meta, extra_headers=header)
        spoof = s.client.chat.completions.create(
            model=TINY_SERVED_NAME, messages=messages, max_tokens=2, extra_headers=header,
            extra_body={"vllm_xargs": {"cf_tags": '{"task": "someone-else"}', "cf_model": "other"}})
        with pytest.raises(openai.BadRequestError) as refused:
            s.client.chat.completions.create(model=TINY_SERVED_NAME, messages=messages, max_tokens=2,
                                             metadata={f"k{i}": "v" for i in range(17)})
        assert refused.value.status_code == 400 and refused.value.param == "metadata"
        s.sent += 6  # two samples, two prompts, the response, the spoof; the refused request never ran
        for answer in (chat, completion, response, spoof):
            assert "cf_tags" not in answer.model_dump_json() and "cf_model" not in answer.model_dump_json()
        expected = {chat.id: 2, completion.id: 2, response.id: 1, spoof.id: 1}
        records = [r for r in wait_records(s.trace, before + 6) if r["request_id"] in expected]
        assert sorted(r["request_id"] for r in records) == sorted(k for k, n in expected.items() for _ in range(n)), \
            [(r["request_id"], r["tags"]) for r in read_records(s.trace)]
        for record in records:
            assert record["tags"] == (want if record["request_id"] != spoof.id else {"task": "invoice-triage"})
            assert record["model"] == TINY_SERVED_NAME

        def tagged_spans() -> list[ReceivedSpan]:
            return [span for span in s.receiver.snapshot() if span.attributes["cf.request_id"] in expected]

        wait_until(lambda: len(tagged_spans()) >= 6, 40, every_s=0.5)
        for span in tagged_spans():
            assert span.attributes["cf.tag.task"] == "invoice-triage"
            assert span.attributes["gen_ai.request.model"] == TINY_SERVED_NAME
            assert ("cf.tag.team" in span.attributes) == (span.attributes["cf.request_id"] != spoof.id)

    def test_queue_wait_grows_across_a_burst(self, full_session: Session) -> None:
        s = full_session
        before = len(read_records(s.trace))
        # From a child process, so the whole burst reaches the engine at once and queues there.
        texts = [prompt_text(i, 20) for i in range(100, 116)]
        # 768 tokens each (about half a second per request here, more under load): long enough that the
        # engine's two sequences, not the API server's intake of the burst, set the pace even on a busy
        # machine (with 96 tokens a request took 0.07 s, as long as the intake of a burst under load)
        ids = set(send_burst(s.runtime.base_url, TINY_SERVED_NAME, texts, 768))
        s.sent += 16
        burst = [r for r in wait_records(s.trace, before + 16) if r["request_id"] in ids]
        assert len(burst) == 16
        by_admission = sorted(burst, key=lambda r: r["t_arrival"] + r["queue_wait_s"])
        waits = [r["queue_wait_s"] for r in by_admission]
        # two sequences at a time: the requests admitted late in the burst waited for the ones before
        # (a loaded client can spread the last arrivals out, so compare halves, not single requests)
        assert max(waits) > 0.05, waits
        assert sum(waits[8:]) / 8 > 2 * sum(waits[:4]) / 4, waits
        # the waits come from the engine's ceiling: every request that waited was admitted right after
        # another request of the burst completed and freed its place (on a busy machine the API server
        # can take the burst in over seconds, so the spread of the arrivals proves nothing either way)
        completions = sorted(r["t_completion"] for r in burst)
        for r in burst:
            if r["queue_wait_s"] > 0.5:
                admitted = r["t_arrival"] + r["queue_wait_s"]
                freed = [c for c in completions if c <= admitted + 1e-3]
                assert freed and admitted - freed[-1] < 0.5, (r, completions)
        # between admission and completion, never more than max-num-seqs requests at once
        events = sorted([(r["t_arrival"] + r["queue_wait_s"] + 1e-5, 1) for r in burst]
                        + [(r["t_completion"], -1) for r in burst])
        running = peak = 0
        for _, delta in events:
            running += delta
            peak = max(peak, running)
        assert peak <= 2, events


    def test_sink_faults_do_not_stop_serving_and_drops_are_counted(self, full_session: Session) -> None:
        s = full_session
        spans_before, dropped_before = spans_accounted(s, s.sent)
        records_before = len(wait_records(s.trace, s.sent))
        assert len(spans_before) + dropped_before == records_before == s.sent

        # 1. the collector goes away: serving continues, the file keeps every record
        s.receiver.stop()
        answers = send_all(s.client, 8, start=200)
        s.sent += 8
        records = wait_records(s.trace, records_before + 8)
        assert {a.id for a in answers} <= {r["request_id"] for r in records}
        assert len(records) == records_before + 8
        assert wait_until(lambda: s.runtime.engine_log_search(r"sink OTLP grpc \S+ failed"), 30), \
            s.runtime.engine_log()[-3000:]

        # 2. the trace file is replaced by something unwritable: serving continues, drops are reported
        s.trace.unlink()
        s.trace.mkdir()
        more = send_all(s.client, 6, start=300)
        s.sent += 6
        assert all(a.completion_tokens > 0 for a in more)
        assert wait_until(lambda: s.runtime.engine_log_search(r"sink file \S+ failed"), 30), \
            s.runtime.engine_log()[-3000:]
        dropped_line = r"records dropped in the last [\d.]+ s: .*dropped by sink file"
        assert wait_until(lambda: s.runtime.engine_log_search(dropped_line), 40), \
            s.runtime.engine_log()[-3000:]

        # 3. at shutdown every record is accounted for: delivered + dropped = completed. (Exact only on
        # a machine that answers an export within the exporter's timeout: an export that times out
        # after the collector took it counts as both, so this module runs one engine at a time.)
        assert s.runtime.stop(signal.SIGTERM, timeout_s=90) == 0, s.runtime.output()
        log = s.runtime.engine_log()
        assert "request trace: flushed at shutdown" in log, log[-3000:]

        assert dropped_total(log, "file") == 6
        spans = s.receiver.snapshot()  # one per span id: a late export sent again is a copy, set aside
        assert len({span.attributes["cf.engine_request_id"] for span in spans}) == len(spans), "one span id a record"
        assert s.receiver.conflicts == [], "a re-sent span carries the same ids and content as the first"
        assert len(spans) + dropped_total(log, "OTLP grpc") == s.sent == 48 + 6 + 16 + 8 + 6


# ---- session 2: override mode, standard, JSONL + HTTP, SIGTERM under load ----------------------------


def test_override_mode_http_export_and_sigterm_under_load(tmp_path: Path, tiny_model: str) -> None:
    trace = tmp_path / "requests.jsonl"
    with OtlpReceiver("http") as receiver:
        runtime = RuntimeProcess(
            ["--request-trace", "standard", "--trace-file", str(trace), "--trace-endpoint",
             f"http://127.0.0.1:{receiver.port}", "--trace-format", "otlp", "--",
             tiny_model, "--served-model-name", TINY_SERVED_NAME, "--dtype", "bfloat16", "--max-model-len", "2048",
             "--shutdown-timeout", "20"],
            tmp_path / "logs",
            # the URL alone would mean gRPC; CF_CONTEXT_KEY is ignored in override mode
            env={"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf", "CF_CONTEXT_KEY": TINY_KEY},
        ).start()
        try:
            runtime.wait_ready()
            assert "CF_CONTEXT_KEY is ignored" in runtime.output()
            assert f"request trace: standard -> file {trace}, OTLP http/protobuf http://127.0.0.1:{receiver.port}" \
                   f"/v1/traces" in runtime.output()
            assert "CarbonForge scheduler on vLLM Scheduler: family fcfs" in runtime.engine_log()
            client = client_for(runtime)
            answers = send_all(client, 12, start=0)
            records = wait_records(trace, 12)
            assert len(records) == 12
            by_id = {r["request_id"]: r for r in records}
            for answer in answers:
                check_standard(by_id[answer.id], answer, family="fcfs")
                assert "prompt_text" not in by_id[answer.id]
            wait_until(lambda: len(receiver.snapshot()) >= 12, 20, every_s=0.05)
            spans = receiver.snapshot()
            assert {sp.attributes["cf.request_id"] for sp in spans} == set(by_id)
            for span in spans:
                check_span(span, by_id[span.attributes["cf.request_id"]], full=False)
            chat_both_ways(runtime.base_url, TINY_SERVED_NAME)  # the name given after the double dash

            # SIGTERM under a load of 32: short requests complete around the signal, long ones are in flight
            pool = ThreadPoolExecutor(max_workers=32)
            wanted = {i: 16 + (i * 37) % 96 if i % 2 == 0 else 700 + (i * 37) % 500 for i in range(32)}
            futures: dict[int, Future[Answer]] = {
                i: pool.submit(ask, client, 1000 + i, tokens, 1 + (i * 13) % 40, stream=i % 4 < 2)
                for i, tokens in wanted.items()
            }
            wait_until(lambda: sum(f.done() for f in futures.values()) >= 8, 120, every_s=0.02)
            in_flight = 32 - sum(f.done() for f in futures.values())
            assert in_flight > 0, "the load finished before the signal"
            code = runtime.stop(signal.SIGTERM, timeout_s=120)
            # vLLM drains in-flight requests within --shutdown-timeout, then the runtime exits cleanly.
            assert code == 0, runtime.output()
            left = runtime.leftover_children()
            assert left == set(), "engine processes survived the runtime:\n" + runtime.describe(left)
            assert "vLLM stopped" in runtime.output()
            complete: list[Answer] = []
            for i, future in futures.items():
                try:
                    answer = future.result(timeout=60)
                except Exception:  # cut off by the shutdown: no complete response, no promise
                    continue
                if answer.completion_tokens == wanted[i]:
                    complete.append(answer)
            pool.shutdown(wait=True)
        finally:
            runtime.kill()
        print(f"SIGTERM with {in_flight} of 32 requests in flight: {len(complete)} complete responses, "
              f"runtime exit code {code}")
        assert len(complete) >= 8
        after = {r["request_id"]: r for r in read_records(trace)}
        missing = [a.id for a in complete if a.id not in after]
        assert not missing, f"{len(missing)} completed requests have no record after exit"
        for answer in complete:
            assert after[answer.id]["output_tokens"] == answer.completion_tokens
