"""The tenant in the trace: read by the scheduler from ``SamplingParams.extra_args`` (vLLM's own scheduler,
driven step by step), checked and written in the record at every level, exported as the span attribute
``cf.tenant``, and carried by the metrics feed to the runtime."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from carbonforge_runtime.core.feed_protocol import RequestSample, compact
from carbonforge_runtime.core.request_tags import MAX_TENANT_CHARS, TENANT_ARG, tenant_from_arg
from carbonforge_runtime.core.trace_record import EXTRA_FIELDS, LEVEL_FULL, LEVEL_STANDARD, Completion, build_record
from carbonforge_runtime.engine.trace_sinks import OtlpSink, span_attributes
from carbonforge_runtime.runtime.planning.trace_options import otlp_target
from tests.support import wait_until
from tests.support.otlp_receiver import OtlpReceiver
from tests.support.scheduler_harness import Engine, configure, records


def completion(**overrides: Any) -> Completion:
    values: dict[str, Any] = dict(
        engine_request_id="chatcmpl-abc123-0123abcd", t_arrival=1000.0, t_scheduled=1000.25,
        t_first_token=1000.5, t_completion=1002.0, prompt_tokens=30, output_tokens=8, finish_reason="stop",
        cached_prompt_tokens=16, tenant_arg="team-billing",
    )
    values.update(overrides)
    return Completion(**values)


def test_the_record_carries_the_tenant_at_every_level() -> None:
    assert EXTRA_FIELDS[-1] == "tenant"
    for level in (LEVEL_STANDARD, LEVEL_FULL):
        record = build_record(completion(), "fcfs", level, lambda ids, skip: "")
        assert record["tenant"] == "team-billing", level
    bare = build_record(completion(tenant_arg=None), "fcfs", LEVEL_STANDARD)
    assert "tenant" in bare and bare["tenant"] is None  # written as null: the default tenant


@pytest.mark.parametrize("value", [
    "", "   ", "x" * (MAX_TENANT_CHARS + 1), "bad\nname", "tab\there", "\x00", 7, 1.5, True, ["acme"],
    {"name": "acme"}, b"acme",
])
def test_anything_but_a_printable_name_is_no_tenant(value: Any) -> None:
    assert tenant_from_arg(value) is None
    assert build_record(completion(tenant_arg=value), "fcfs", LEVEL_STANDARD)["tenant"] is None


@pytest.mark.parametrize("value", ["acme", "x" * MAX_TENANT_CHARS, "Équipe données", "a b", "default"])
def test_a_printable_name_up_to_the_limit_is_kept_as_sent(value: str) -> None:
    assert tenant_from_arg(value) == value
    assert build_record(completion(tenant_arg=value), "fcfs", LEVEL_STANDARD)["tenant"] == value


def test_the_span_names_the_tenant_and_leaves_it_out_without_one() -> None:
    assert span_attributes(build_record(completion(), "fcfs", LEVEL_STANDARD))["cf.tenant"] == "team-billing"
    bare = span_attributes(build_record(completion(tenant_arg=None), "fcfs", LEVEL_STANDARD))
    assert "cf.tenant" not in bare


def test_an_otlp_collector_receives_the_tenant() -> None:
    record = build_record(completion(), "fcfs", LEVEL_STANDARD)
    with OtlpReceiver("http") as receiver:
        sink = OtlpSink(otlp_target(receiver.endpoint, {}), timeout_s=5)
        sink.write([record])
        sink.close()
        wait_until(lambda: len(receiver.snapshot()) >= 1, 10, every_s=0.05)
        (span,) = receiver.snapshot()
    assert span.attributes["cf.tenant"] == "team-billing"


def test_the_metrics_feed_carries_the_tenant_and_cached_tokens() -> None:
    record = build_record(completion(), "fcfs", LEVEL_STANDARD)
    got = RequestSample.from_compact(compact(record))
    assert (got.tenant, got.cached_prompt_tokens, got.prompt_tokens) == ("team-billing", 16, 30)
    bare = RequestSample.from_compact(compact(build_record(completion(tenant_arg=None, cached_prompt_tokens=None),
                                                          "fcfs", LEVEL_STANDARD)))
    assert (bare.tenant, bare.cached_prompt_tokens) == (None, 0)
    # the runtime checks the wire again: a datagram from an older engine, or a forged name, is no tenant
    assert RequestSample.from_compact({"tn": "x\n" * 40}).tenant is None
    assert RequestSample.from_compact({}).tenant is None


def test_the_scheduler_reads_the_tenant_from_extra_args(
    vllm_parts: dict[str, Any], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    path = tmp_path / "t.jsonl"
    configure(monkeypatch, path)
    engine = Engine(vllm_parts, max_num_seqs=4)
    for rid in ("0_chatcmpl-n2-0123abcd", "1_chatcmpl-n2-0123abcd"):
        engine.add(rid, list(range(1, 10)), max_tokens=2, extra_args={TENANT_ARG: "acme"})
    engine.add("chatcmpl-odd-00000000", [5, 6, 7], max_tokens=2, extra_args={TENANT_ARG: 42})
    engine.add("chatcmpl-plain-00000000", [5, 6, 7], max_tokens=2)
    engine.run()
    engine.scheduler.shutdown()
    got = {(r["engine_request_id"], r["tenant"]) for r in records(path)}
    assert got == {("0_chatcmpl-n2-0123abcd", "acme"), ("1_chatcmpl-n2-0123abcd", "acme"),
                   ("chatcmpl-odd-00000000", None), ("chatcmpl-plain-00000000", None)}
