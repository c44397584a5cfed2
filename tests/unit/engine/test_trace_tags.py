"""Request tags and the model name in the trace: read by the scheduler from ``SamplingParams.extra_args``
(vLLM's own scheduler, driven step by step), written in the record at every level and exported as
span attributes to a real OTLP receiver."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

from carbonforge_runtime.core.request_tags import MODEL_ARG, TAGS_ARG
from carbonforge_runtime.core.trace_record import EXTRA_FIELDS, Completion, build_record, client_request_id
from carbonforge_runtime.engine.trace_sinks import OtlpSink, span_attributes, span_ids
from carbonforge_runtime.runtime.planning.trace_options import otlp_target
from tests.support import wait_until
from tests.support.otlp_receiver import OtlpReceiver
from tests.support.scheduler_harness import Engine, configure, records

TAGS = {"team": "billing", "task": "triage"}


def completion(**overrides: Any) -> Completion:
    values: dict[str, Any] = dict(
        engine_request_id="chatcmpl-abc123-0123abcd", t_arrival=1000.0, t_scheduled=1000.25,
        t_first_token=1000.5, t_completion=1002.0, prompt_tokens=30, output_tokens=8, finish_reason="stop",
        tags_arg=orjson.dumps(TAGS).decode(), model_arg="Qwen/Qwen3-0.6B",
    )
    values.update(overrides)
    return Completion(**values)


def test_the_record_carries_the_tags_and_model_at_every_level() -> None:
    assert EXTRA_FIELDS[-3:-1] == ("model", "tags")
    for level in ("standard", "full"):
        record = build_record(completion(), "fcfs", level, lambda ids, skip: "")
        assert record["tags"] == TAGS and record["model"] == "Qwen/Qwen3-0.6B", level
    bare = build_record(completion(tags_arg=None, model_arg=None), "fcfs", "standard")
    assert bare["tags"] == {} and bare["model"] is None  # present, so a reader sees "no tags" either way
    # whatever is not what the API server writes is no tags (a route the middleware does not judge)
    odd = build_record(completion(tags_arg='{"team": 5}', model_arg=["m"]), "fcfs", "standard")
    assert odd["tags"] == {} and odd["model"] is None


def test_a_responses_request_is_recorded_under_the_id_the_client_received() -> None:
    # vLLM's Responses API runs turn i of a request as the engine request <id>_<i>
    assert client_request_id("resp_838e54ef6b9b8b35_0-977183e8") == "resp_838e54ef6b9b8b35"
    assert client_request_id("resp_my_id_12-0123abcd") == "resp_my_id"
    assert client_request_id("chatcmpl-my_1-0123abcd") == "chatcmpl-my_1"  # only the Responses API's ids


def test_span_attributes_name_the_model_and_each_tag() -> None:
    attrs = span_attributes(build_record(completion(), "fcfs", "standard"))
    assert attrs["gen_ai.request.model"] == "Qwen/Qwen3-0.6B"
    assert attrs["cf.tag.team"] == "billing" and attrs["cf.tag.task"] == "triage"
    bare = span_attributes(build_record(completion(tags_arg=None, model_arg=None), "fcfs", "standard"))
    assert not [key for key in bare if key.startswith("cf.tag.") or key == "gen_ai.request.model"]


def test_the_records_of_one_request_are_spans_of_their_own_in_one_trace() -> None:
    samples = [build_record(completion(engine_request_id=f"{i}_chatcmpl-abc123-0123abcd"), "fcfs", "standard")
               for i in range(2)]
    prompts = [build_record(completion(engine_request_id=f"cmpl-abc-{i}-0123abcd"), "fcfs", "standard")
               for i in range(2)]
    for first, second in (samples, prompts):
        assert first["request_id"] == second["request_id"]
        (trace_a, span_a), (trace_b, span_b) = span_ids(first), span_ids(second)
        assert trace_a == trace_b and span_a != span_b
    assert span_ids(samples[0]) == span_ids(dict(samples[0]))  # a copy sent again keeps its ids


def test_an_otlp_collector_receives_the_tags_as_attributes() -> None:
    record = build_record(completion(), "fcfs", "standard")
    with OtlpReceiver("http") as receiver:
        sink = OtlpSink(otlp_target(receiver.endpoint, {}), timeout_s=5)
        sink.write([record])
        sink.close()
        wait_until(lambda: len(receiver.snapshot()) >= 1, 10, every_s=0.05)
        (span,) = receiver.snapshot()
    assert span.attributes["cf.tag.task"] == "triage" and span.attributes["cf.tag.team"] == "billing"
    assert span.attributes["gen_ai.request.model"] == "Qwen/Qwen3-0.6B"


def test_the_scheduler_reads_them_from_extra_args_for_every_sample_and_prompt(
    vllm_parts: dict[str, Any], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    path = tmp_path / "t.jsonl"
    configure(monkeypatch, path)
    engine = Engine(vllm_parts, max_num_seqs=4)
    extra = {TAGS_ARG: orjson.dumps(TAGS).decode(), MODEL_ARG: "tiny", "cf_true_output_tokens": 2}
    # n = 2 (two samples of one chat request) and /v1/completions with two prompts: the API server
    # hands each its own copy of the request's sampling parameters
    for rid in ("0_chatcmpl-n2-0123abcd", "1_chatcmpl-n2-0123abcd", "cmpl-two-0-89abcdef", "cmpl-two-1-89abcdef"):
        engine.add(rid, list(range(1, 10)), max_tokens=2, extra_args=dict(extra))
    engine.add("chatcmpl-plain-00000000", [5, 6, 7], max_tokens=2)
    engine.run()
    engine.scheduler.shutdown()
    got = records(path)
    assert len(got) == 5
    for record in got:
        if record["request_id"] == "chatcmpl-plain":
            assert record["tags"] == {} and record["model"] is None
        else:
            assert record["tags"] == TAGS and record["model"] == "tiny", record["engine_request_id"]
    assert sorted(r["request_id"] for r in got) == ["chatcmpl-n2", "chatcmpl-n2", "chatcmpl-plain", "cmpl-two",
                                                    "cmpl-two"]
