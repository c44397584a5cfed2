"""The scheduler shim inside the real vLLM scheduler, driven step by step without a model.

These tests build vLLM's own V1 scheduler (CPU config, the built-in tiny model's tokenizer) through
``make_scheduler`` and feed it hand-made model outputs, the way vLLM's scheduler tests do.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

from carbonforge_runtime.core.contract import CONTRACT_ENV, EngineContract, Ordering, TraceConfig
from carbonforge_runtime.core.ordering import registry as policy
from carbonforge_runtime.core.ordering.base import Family, WaitingRequest
from carbonforge_runtime.errors import UsageError
from tests.support import wait_until
from tests.support.scheduler_harness import BLOCK, Engine, configure, records


def test_queued_request_waits_and_every_completion_is_recorded_once(
    vllm_parts: dict[str, Any], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    path = tmp_path / "t.jsonl"
    configure(monkeypatch, path, family="trace")
    engine = Engine(vllm_parts, max_num_seqs=1)
    from vllm.v1.core.sched.request_queue import FCFSRequestQueue
    from vllm.v1.request import RequestStatus

    assert isinstance(engine.scheduler.waiting, FCFSRequestQueue)  # fcfs/trace keep vLLM's own queue
    now = time.time()  # both arrive together: the one admitted later waited longer
    engine.add("chatcmpl-first-0123abcd", list(range(1, 20)), max_tokens=3, arrival=now)
    engine.add("chatcmpl-second-89abcdef", list(range(1, 20)), max_tokens=2, arrival=now)
    engine.add("chatcmpl-gone-00000000", [5, 6, 7], max_tokens=2)
    engine.scheduler.finish_requests("chatcmpl-gone-00000000", RequestStatus.FINISHED_ABORTED)  # client left
    admitted = engine.run()
    assert [ids for ids in admitted if ids] == [["chatcmpl-first-0123abcd"], ["chatcmpl-second-89abcdef"]]
    # an abort arriving for an already finished request changes nothing
    engine.scheduler.finish_requests(["chatcmpl-first-0123abcd"], RequestStatus.FINISHED_ABORTED)
    engine.scheduler.shutdown()
    got = {r["request_id"]: r for r in records(path)}
    assert len(records(path)) == 3 and set(got) == {"chatcmpl-first", "chatcmpl-second", "chatcmpl-gone"}
    first, second, gone = got["chatcmpl-first"], got["chatcmpl-second"], got["chatcmpl-gone"]
    assert (first["output_tokens"], second["output_tokens"], gone["output_tokens"]) == (3, 2, 0)
    assert first["prompt_tokens"] == 19 and first["finish_reason"] == "length"
    assert gone["finish_reason"] == "abort" and gone["ttft_s"] is None
    assert second["queue_wait_s"] > first["queue_wait_s"]  # it waited for the only slot
    assert second["cached_prompt_tokens"] == BLOCK  # the first request's full block was reused
    for r in (first, second):
        assert r["scheduler_family"] == "trace" and r["priority_score"] is None
        assert 0 <= r["queue_wait_s"] <= r["ttft_s"] <= r["e2e_latency_s"]
        assert abs(r["e2e_latency_s"] - (r["t_completion"] - r["t_arrival"])) < 1e-6
    counters = engine.scheduler.cf_counters
    assert counters.requests_arrived_total == 3 and counters.requests_completed_total == 3
    # first: 19 prompt + 2 decode steps; second: 3 uncached prompt tokens + 1 decode step
    assert counters.steps == 6 and counters.tokens_scheduled_total == 19 + 2 + 3 + 1
    assert counters.running == 0 and counters.waiting == 0


def test_stop_token_and_full_level_text(
    vllm_parts: dict[str, Any], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    path = tmp_path / "t.jsonl"
    configure(monkeypatch, path, level="full")
    engine = Engine(vllm_parts, max_num_seqs=4)
    tokenizer = engine.tokenizer
    prompt_text = "<|im_start|>user\nhello there<|im_end|>\n<|im_start|>assistant\n"
    prompt = tokenizer.encode(prompt_text, add_special_tokens=False)
    word = tokenizer.encode(" parse", add_special_tokens=False)[0]
    engine.add("chatcmpl-full-0123abcd", prompt, max_tokens=3)
    engine.add("chatcmpl-eos-0123abcd", prompt, max_tokens=3, stop_token_ids=[word])
    engine.run(token=word)
    engine.scheduler.shutdown()
    got = {r["request_id"]: r for r in records(path)}
    full, stopped = got["chatcmpl-full"], got["chatcmpl-eos"]
    assert full["prompt_text"] == prompt_text  # rendered prompt, special tokens kept
    assert full["output_text"] == tokenizer.decode([word] * 3, skip_special_tokens=True)
    assert stopped["finish_reason"] == "stop" and stopped["output_tokens"] == 1


class ShortestFirst:
    """A test family: fewer prompt tokens first."""

    name = "shortest-first"
    reorders = True
    needs_cache_lookup = True
    max_overtake_s = None

    def __init__(self, params: Mapping[str, Any]) -> None:
        self.seen: list[tuple[str, int]] = []
        self.cached: dict[str, int] = {}

    def score(self, req: WaitingRequest, now: float) -> float | None:
        self.cached[req.request_id] = req.cached_tokens
        return -float(req.prompt_tokens)

    def observe(self, req: WaitingRequest, output_tokens: int) -> None:
        self.seen.append((req.request_id, output_tokens))


@pytest.fixture
def shortest_first(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[ShortestFirst]]:
    made: list[ShortestFirst] = []

    def factory(params: Mapping[str, Any]) -> Family:
        made.append(ShortestFirst(params))
        return made[-1]

    factories: dict[str, Callable[[Mapping[str, Any]], Family]] = dict(policy.FAMILIES)
    factories["shortest-first"] = factory
    monkeypatch.setattr(policy, "FAMILIES", factories)
    import carbonforge_runtime.engine.scheduler as shim

    monkeypatch.setattr(shim, "make_family", policy.make_family)
    yield made


def test_a_reordering_family_orders_admission_and_records_its_score(
    vllm_parts: dict[str, Any], monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
    shortest_first: list[ShortestFirst],
) -> None:
    path = tmp_path / "t.jsonl"
    configure(monkeypatch, path, family="shortest-first")
    engine = Engine(vllm_parts, max_num_seqs=1)
    from carbonforge_runtime.engine.scheduler import ScoredQueue

    assert isinstance(engine.scheduler.waiting, ScoredQueue)
    now = time.time()
    engine.add("chatcmpl-long-00000001", list(range(1, 41)), max_tokens=2, arrival=now - 0.3)
    engine.add("chatcmpl-mid-00000002", list(range(1, 21)), max_tokens=2, arrival=now - 0.2)
    engine.add("chatcmpl-short-00000003", list(range(100, 105)), max_tokens=2, arrival=now - 0.1,
               extra_args={"cf_true_output_tokens": 2})
    admitted = [ids[0] for ids in engine.run() if ids]
    assert admitted == ["chatcmpl-short-00000003", "chatcmpl-mid-00000002", "chatcmpl-long-00000001"]
    engine.scheduler.shutdown()
    got = {r["request_id"]: r for r in records(path)}
    assert {k: v["priority_score"] for k, v in got.items()} == {
        "chatcmpl-short": -5.0, "chatcmpl-mid": -20.0, "chatcmpl-long": -40.0}
    assert all(r["scheduler_family"] == "shortest-first" for r in got.values())
    family = shortest_first[0]
    assert sorted(family.seen) == [("chatcmpl-long", 2), ("chatcmpl-mid", 2), ("chatcmpl-short", 2)]
    # the prefix cache was asked at peek time: "long" shares its first block with the finished "mid"
    assert family.cached["chatcmpl-long"] == BLOCK


def test_scored_queue_keeps_put_back_requests_first(
    vllm_parts: dict[str, Any], monkeypatch: pytest.MonkeyPatch, shortest_first: list[ShortestFirst]
) -> None:
    configure(monkeypatch, None, family="shortest-first")
    engine = Engine(vllm_parts, max_num_seqs=2)
    queue = engine.scheduler.waiting
    a = engine.add("chatcmpl-a-00000001", list(range(1, 30)))
    b = engine.add("chatcmpl-b-00000002", list(range(1, 10)))
    assert queue.peek_request() is b and len(queue) == 2
    assert queue.pop_request() is b
    queue.prepend_request(b)  # e.g. preempted: back at the front whatever its score
    c = engine.add("chatcmpl-c-00000003", [1, 2])
    assert [r.request_id for r in queue] == ["chatcmpl-b-00000002", "chatcmpl-a-00000001", "chatcmpl-c-00000003"]
    assert queue.pop_request() is b and queue.pop_request() is c
    queue.remove_requests([a])
    assert not queue and len(queue) == 0
    with pytest.raises(IndexError):
        queue.peek_request()


def test_async_scheduling_gets_the_async_base(
    vllm_parts: dict[str, Any], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler

    path = tmp_path / "t.jsonl"
    configure(monkeypatch, path)
    engine = Engine(vllm_parts, max_num_seqs=2, async_scheduling=True)
    assert isinstance(engine.scheduler, AsyncScheduler)
    engine.add("chatcmpl-async-0123abcd", list(range(1, 10)), max_tokens=2)
    engine.run()
    engine.scheduler.shutdown()
    assert [(r["request_id"], r["output_tokens"]) for r in records(path)] == [("chatcmpl-async", 2)]


@pytest.mark.parametrize("dp_size", [1, 2])
def test_a_data_parallel_rank_writes_its_own_file(
    dp_size: int, vllm_parts: dict[str, Any], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """vLLM runs each rank of a dense model as an independent engine core and keeps its rank in
    ``data_parallel_index``; with data parallel the rank's records go to its own file."""

    def rank_one(max_num_seqs: int, async_scheduling: bool) -> Any:
        config, kv, som = vllm_parts["build"](max_num_seqs, async_scheduling)
        config.parallel_config.data_parallel_index = 1
        return config, kv, som

    path = tmp_path / "requests.jsonl"
    trace = TraceConfig(level="standard", file=str(path), flush_timeout_s=5.0, data_parallel_size=dp_size)
    monkeypatch.setenv(CONTRACT_ENV, EngineContract(Ordering("fcfs", {}), trace).to_json())
    engine = Engine(dict(vllm_parts, build=rank_one), max_num_seqs=2)
    engine.add("chatcmpl-dp-0123abcd", list(range(1, 10)), max_tokens=2)
    engine.run()
    engine.scheduler.shutdown()
    written = tmp_path / ("requests.dp1.jsonl" if dp_size == 2 else "requests.jsonl")
    assert sorted(p.name for p in tmp_path.iterdir()) == [written.name]
    assert [r["request_id"] for r in records(written)] == ["chatcmpl-dp"]


def test_no_trace_and_fcfs_tracks_nothing(vllm_parts: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    configure(monkeypatch, None)
    engine = Engine(vllm_parts, max_num_seqs=2)
    engine.add("chatcmpl-x-0123abcd", [1, 2, 3])
    engine.run()
    assert engine.scheduler._cf_live == {} and engine.scheduler._cf_writer is None
    assert engine.scheduler.cf_counters.requests_arrived_total == 1
    engine.scheduler.shutdown()


def test_unknown_family_fails_the_engine_start(vllm_parts: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    configure(monkeypatch, None, family="no-such-family")
    with pytest.raises(UsageError, match="no-such-family"):
        Engine(vllm_parts, max_num_seqs=2)


def test_records_are_written_before_the_engine_leaves_its_loop_on_sigterm(
    vllm_parts: dict[str, Any], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """vLLM's engine core exits its loop once has_requests() is False after a SIGTERM, and may be
    killed before shutdown() runs: the records must be in the file by then."""
    path = tmp_path / "t.jsonl"
    configure(monkeypatch, path)
    seen: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))  # the engine's handler
    try:
        engine = Engine(vllm_parts, max_num_seqs=2)
        engine.add("chatcmpl-inflight-0123abcd", list(range(1, 10)), max_tokens=3)
        engine.step()
        os.kill(os.getpid(), signal.SIGTERM)  # the drain starts with a request in flight
        wait_until(lambda: seen, 5, every_s=0.01)
        assert seen == [signal.SIGTERM]  # vLLM's own handler still runs
        assert engine.scheduler.has_requests()  # still draining
        while engine.scheduler.has_requests():
            engine.step()
        # has_requests() just returned False: the loop would exit here, before shutdown()
        assert [r["request_id"] for r in records(path)] == ["chatcmpl-inflight"]
        assert engine.scheduler._cf_writer._closed
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_a_contract_of_another_version_stops_the_engine_start_with_a_clear_message(
    vllm_parts: dict[str, Any], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from carbonforge_runtime.core.contract import CONTRACT_ENV, ContractError

    monkeypatch.setenv(CONTRACT_ENV, json.dumps({"version": 99, "ordering": {"family": "fcfs", "params": {}}}))
    with caplog.at_level(logging.ERROR, logger="vllm.carbonforge"), pytest.raises(ContractError) as refused:
        Engine(vllm_parts, max_num_seqs=2)
    assert "version mismatch" in refused.value.message and "99" in refused.value.message
    assert "CarbonForge scheduler cannot start" in caplog.text
    assert "same carbonforge-runtime installation" in caplog.text


@pytest.mark.parametrize(("timeout_s", "flush_s", "delay"), [
    (30, 4.0, 24.0),   # the flush time plus the margin before vLLM's SIGKILL
    (6, 4.0, 3.0),     # never more than half the drain
    (0, 4.0, 0.0),     # no drain: vLLM aborts at once itself
])
def test_the_leftovers_are_ended_before_vllms_drain_deadline(timeout_s: int, flush_s: float, delay: float) -> None:
    from carbonforge_runtime.engine.scheduler import abort_delay

    assert abort_delay(timeout_s, flush_s) == pytest.approx(delay)


def test_requests_still_running_at_the_drain_deadline_end_as_aborts_with_records_and_answers(
    vllm_parts: dict[str, Any], monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """vLLM SIGKILLs the engine core at its drain deadline; before that, the shim ends what still
    runs as aborts: one record each, an abort output to each client, and an engine with no work."""
    from vllm.v1.engine import FinishReason

    path = tmp_path / "t.jsonl"
    configure(monkeypatch, path)
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: None)  # the engine's handler
    try:
        engine = Engine(vllm_parts, max_num_seqs=2)
        engine.scheduler.vllm_config.shutdown_timeout = 2  # flush 5 s in the harness: abort after 1 s
        ids = [f"chatcmpl-long{i}-0123abcd" for i in range(3)]  # two run, one waits
        for rid in ids:
            engine.add(rid, list(range(1, 10)), max_tokens=400)
        engine.step()
        os.kill(os.getpid(), signal.SIGTERM)
        wait_until(lambda: engine.scheduler._cf_stopping, 5, every_s=0.01)
        _, outputs = engine.step()
        assert all(o.finish_reason is None for eco in outputs.values() for o in eco.outputs)  # still draining
        time.sleep(1.1)
        with caplog.at_level(logging.INFO, logger="vllm.carbonforge"):
            _, outputs = engine.step()
            ended = {o.request_id: o.finish_reason for eco in outputs.values() for o in eco.outputs
                     if o.finish_reason is not None}
            assert ended == dict.fromkeys(ids, FinishReason.ABORT)
            assert set().union(*(eco.finished_requests or set() for eco in outputs.values())) == set(ids)
            engine.step()  # the step that tells the scheduler's output the ids are gone
            assert not engine.scheduler.has_requests()  # the engine leaves its loop on its own
        got = records(path)
        assert sorted(r["request_id"] for r in got) == sorted(rid.rsplit("-", 1)[0] for rid in ids)
        assert {r["finish_reason"] for r in got} == {"abort"}
        assert "ending 3 request(s) still in flight as aborted" in caplog.text
        assert "3 requests reached the engine, 3 ended; 0 dropped before the sinks" in caplog.text
        assert f"file {path}: 3 written, 0 dropped" in caplog.text
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_an_engine_shut_down_with_requests_unfinished_still_writes_their_records(
    vllm_parts: dict[str, Any], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    path = tmp_path / "t.jsonl"
    configure(monkeypatch, path)
    engine = Engine(vllm_parts, max_num_seqs=1)
    engine.add("chatcmpl-running-0123abcd", list(range(1, 10)), max_tokens=400)
    engine.add("chatcmpl-queued-0123abcd", list(range(1, 10)), max_tokens=400)
    engine.step()
    engine.scheduler.shutdown()
    got = records(path)
    assert sorted(r["request_id"] for r in got) == ["chatcmpl-queued", "chatcmpl-running"]
    assert {r["finish_reason"] for r in got} == {"abort"}
    assert next(r for r in got if r["request_id"] == "chatcmpl-queued")["ttft_s"] is None
