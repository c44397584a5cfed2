"""The step log written by the real plug-in inside vLLM's scheduler (built in-process, no model),
with token counts checked by hand, and the loop-side timing on its own."""

from __future__ import annotations

import json
import logging
import types
from pathlib import Path
from typing import Any

import pytest

from carbonforge_runtime.core.contract import CONTRACT_ENV, Emulation, EngineContract, Ordering, StepLogConfig
from carbonforge_runtime.engine.step_log import StepLog
from tests.support.scheduler_harness import Engine


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _step(engine: Engine, clock: FakeClock, forward_s: float) -> Any:
    """One synchronous engine step; 1 ms of host work after it: part of the next step if requests are
    left, else idle."""
    return engine.timed_step(clock, forward_s, 0.001)


def test_step_log_counts_a_chunked_prefill_by_hand(vllm_parts: dict[str, Any], monkeypatch: pytest.MonkeyPatch,
                                                    tmp_path: Path) -> None:
    path = tmp_path / "steps.jsonl"
    contract = EngineContract(Ordering("fcfs", {}), None, step_log=StepLogConfig(file=str(path), flush_timeout_s=5.0))
    monkeypatch.setenv(CONTRACT_ENV, contract.to_json())
    from carbonforge_runtime.engine import scheduler as plug_in

    clock = FakeClock()
    monkeypatch.setattr(plug_in, "time", types.SimpleNamespace(monotonic=clock, time=plug_in.time.time))
    engine = Engine(vllm_parts, max_num_seqs=4)  # 512 tokens a step
    a = list(range(1, 301))
    engine.add("a", a, max_tokens=3)
    engine.add("b", list(range(1001, 1301)), max_tokens=2)
    forwards = [0.25, 0.125, 0.0625]
    for forward in forwards:
        _step(engine, clock, forward)
    while engine.scheduler.has_requests():  # the empty step that hands over the finished ids
        assert _step(engine, clock, 0.5).total_num_scheduled_tokens == 0
    engine.add("c", a[:64] + list(range(2001, 2021)), max_tokens=1)  # 4 blocks of a's prompt cached
    _step(engine, clock, 0.03125)
    engine.scheduler.shutdown()

    header, *lines = _lines(path)
    steps = [line for line in lines if line["kind"] == "step"]
    assert [line["prompt_tokens"] for line in lines if line["kind"] == "request"] == [300, 300, 84]
    assert header["kind"] == "engine" and header["kv_cache_tokens"] == 200 * 16
    assert header["max_num_batched_tokens"] == 512 and header["async_scheduling"] is False
    assert header["vllm"] == "0.32.0" and header["block_size"] == 16
    assert "emulated_cost_model" not in header and "emulated_slowdown" not in header
    counts = [(s["batched_tokens"], s["prefill_tokens"], s["decode_tokens"], s["seqs"], s["kv_read_tokens"],
               s["attention_units"], s["context_tokens"]) for s in steps]
    assert counts == [
        # a's whole prompt and the first 212 tokens of b's
        (512, 512, 0, 2, 0, 300 * 150 + 212 * 106, 0),
        # a decodes on 300 tokens; b's last 88 prompt tokens on 212 computed
        (89, 88, 1, 2, 300, 88 * (212 + 44), 300 + 212),
        # both decode
        (2, 0, 2, 2, 301 + 300, 0, 601),
        # c: 64 tokens from the prefix cache, 20 computed
        (20, 20, 0, 1, 0, 20 * (64 + 10), 64),
    ]
    assert [s["step"] for s in steps] == [1, 2, 3, 4]
    # A busy engine's time between steps counts in the next step; the wait for c after the
    # engine ran out of work, and the empty step, count nowhere.
    assert [s["wall_s"] for s in steps] == [0.25, 0.125 + 0.001, 0.0625 + 0.001, 0.03125]
    assert all(s["kind"] == "step" and s["engine"] == 0 for s in steps)
    assert steps[0]["t"] < steps[-1]["t"]


def test_asynchronous_scheduling_counts_the_same_and_times_completions(
    vllm_parts: dict[str, Any], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """vLLM's AsyncScheduler: step k+1 is scheduled before step k's output is applied, with a
    placeholder for the token step k will sample; the counts are those of the synchronous engine and
    a busy engine's step lasts from one completion to the next."""
    from vllm.v1.outputs import ModelRunnerOutput

    path = tmp_path / "steps.jsonl"
    contract = EngineContract(Ordering("fcfs", {}), None, step_log=StepLogConfig(file=str(path), flush_timeout_s=5.0))
    monkeypatch.setenv(CONTRACT_ENV, contract.to_json())
    from carbonforge_runtime.engine import scheduler as plug_in

    clock = FakeClock()
    monkeypatch.setattr(plug_in, "time", types.SimpleNamespace(monotonic=clock, time=plug_in.time.time))
    engine = Engine(vllm_parts, max_num_seqs=4, async_scheduling=True)
    scheduler = engine.scheduler
    assert type(scheduler).__name__ == "CarbonForgeAsyncScheduler"
    engine.add("a", list(range(1, 301)), max_tokens=3)
    engine.add("b", list(range(1001, 1301)), max_tokens=2)

    def schedule() -> tuple[Any, Any]:
        out = scheduler.schedule()
        ids = list(out.num_scheduled_tokens)
        sampled = [[] if scheduler.requests[r].is_prefill_chunk else [7] for r in ids]
        return out, ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                      sampled_token_ids=sampled, logprobs=None, prompt_logprobs_dict={},
                                      pooler_output=[])

    inflight = schedule()  # step 1 starts at 1000
    ends = []
    for _ in range(3):
        clock.now += 0.01
        following = schedule()  # scheduled while the previous step runs
        clock.now += 0.09
        scheduler.update_from_output(*inflight)
        ends.append(clock.now)
        inflight = following
    scheduler.shutdown()
    steps = [line for line in _lines(path) if line["kind"] == "step"]
    counts = [(s["batched_tokens"], s["prefill_tokens"], s["decode_tokens"], s["kv_read_tokens"],
               s["attention_units"]) for s in steps]
    assert counts == [(512, 512, 0, 0, 300 * 150 + 212 * 106), (89, 88, 1, 300, 88 * (212 + 44)),
                      (2, 0, 2, 601, 0)]
    # the first step from its scheduling, the others from the previous completion
    assert [s["wall_s"] for s in steps] == pytest.approx([0.1, 0.1, 0.1])


def test_an_engine_without_a_step_log_writes_none(vllm_parts: dict[str, Any], monkeypatch: pytest.MonkeyPatch,
                                                  tmp_path: Path) -> None:
    monkeypatch.setenv(CONTRACT_ENV, EngineContract(Ordering("fcfs", {}), None).to_json())
    engine = Engine(vllm_parts, max_num_seqs=2)
    engine.add("a", list(range(1, 40)), max_tokens=2)
    engine.run()
    assert engine.scheduler._cf_steps is None
    engine.scheduler.shutdown()
    assert list(tmp_path.iterdir()) == []


def _out(tokens: int) -> Any:
    return types.SimpleNamespace(total_num_scheduled_tokens=tokens)


def test_asynchronous_steps_are_timed_from_the_previous_steps_end(tmp_path: Path) -> None:
    log = StepLog(StepLogConfig(file=str(tmp_path / "s.jsonl")), 0, logging.getLogger("test"))
    o1, o2, o3, empty = _out(10), _out(5), _out(1), _out(0)
    log.scheduled(o1, 0.0)
    log.scheduled(o2, 1.0)  # scheduled while o1 runs
    log.updated(o1, 5.0, True)
    log.scheduled(empty, 6.0)
    log.updated(o2, 9.0, False)
    log.updated(empty, 9.5, False)  # nothing ran: not logged, and the next step is measured from its end
    log.updated(_out(3), 10.0, True)  # never scheduled through the log: ignored
    log.scheduled(o3, 20.0)  # after an idle time
    log.updated(o3, 21.5, False)
    intake = list(log.writer._intake)
    assert [(item[1], item[2], item[3]) for item in intake] == [(0.0, 5.0, 1), (5.0, 9.0, 2), (20.0, 21.5, 3)]


def test_synchronous_steps_of_a_busy_engine_include_the_time_between_them(tmp_path: Path) -> None:
    log = StepLog(StepLogConfig(file=str(tmp_path / "s.jsonl")), 0, logging.getLogger("test"))
    o1, o2, o3, o4 = _out(10), _out(5), _out(1), _out(2)
    log.scheduled(o1, 0.0)
    log.updated(o1, 2.0, True)  # requests left: the engine core goes straight on
    log.scheduled(o2, 2.4)  # after handling outputs and arrivals: that time belongs to this step
    log.updated(o2, 4.0, False)  # nothing left: the engine waits for work
    log.scheduled(o3, 9.0)  # a request arrived at 8.9: the wait is idle time, in no step
    log.updated(o3, 10.0, True)
    log.scheduled(o4, 10.1)
    log.updated(o4, 11.0, True)
    intake = list(log.writer._intake)
    assert [(item[1], item[2]) for item in intake] == [(0.0, 2.0), (2.0, 4.0), (9.0, 10.0), (10.0, 11.0)]


def test_a_full_queue_drops_counts_and_says_so(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    log = StepLog(StepLogConfig(file=str(tmp_path / "s.jsonl"), queue_capacity=2), 0, logging.getLogger("test"))
    outputs = [_out(1) for _ in range(5)]  # kept alive, so that no two share an id
    for i, o in enumerate(outputs):
        log.scheduled(o, float(i))
        log.updated(o, i + 0.5, True)
    assert log.writer.intake_dropped == 3 and log.writer.dropped()["queue"] == 3
    with caplog.at_level(logging.WARNING, logger="test"):
        log.writer.report()
    assert "step log: records dropped" in caplog.text and "3 dropped before reaching any sink" in caplog.text


def _windows(log: StepLog) -> list[float]:
    from carbonforge_runtime.engine.step_log import _Added

    return [round(item.window, 9) for item in log.writer._intake if isinstance(item, _Added)]


def test_a_request_taken_in_by_a_waiting_engine_has_no_intake_window(tmp_path: Path) -> None:
    clock = FakeClock()
    log = StepLog(StepLogConfig(file=str(tmp_path / "s.jsonl")), 0, logging.getLogger("test"), clock=clock)
    clock.now += 5.0  # the engine waits for work since it started
    log.added(10.0, 100, 11.0, clock.now)  # taken in as it came
    clock.now += 0.0001
    log.added(10.0, 50, 11.0001, clock.now)  # in the same intake, right after
    o1 = _out(10)
    log.scheduled(o1, clock.now)
    clock.now += 0.05
    log.updated(o1, clock.now, False)  # done: the engine waits again
    clock.now += 1.0
    log.added(12.0, 20, 13.0, clock.now)  # a second later: it came while the engine waited
    assert _windows(log) == [0.0, 0.0001, 0.0]


def test_a_request_taken_in_between_steps_may_have_waited_since_the_last_schedule(tmp_path: Path) -> None:
    clock = FakeClock()
    log = StepLog(StepLogConfig(file=str(tmp_path / "s.jsonl")), 0, logging.getLogger("test"), clock=clock)
    o1, o2, o3 = _out(10), _out(5), _out(1)
    log.scheduled(o1, 1000.0)
    log.updated(o1, 1000.04, True)  # busy: the loop takes in what came during the step, then schedules
    clock.now = 1000.0401
    log.added(0.0, 8, 0.0, clock.now)  # may have come at any time since the step was scheduled
    log.scheduled(o2, 1000.0402)
    log.updated(o2, 1000.08, False)  # out of work
    clock.now = 1000.0801  # taken in just after: it may have been queued during the step
    log.added(0.0, 8, 0.0, clock.now)
    log.scheduled(o3, 1000.0802)
    assert _windows(log) == [0.0401, 0.0399]


def test_request_lines_say_when_each_new_request_entered_the_scheduler(
    vllm_parts: dict[str, Any], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import time

    path = tmp_path / "steps.jsonl"
    contract = EngineContract(Ordering("fcfs", {}), None, step_log=StepLogConfig(file=str(path), flush_timeout_s=5.0))
    monkeypatch.setenv(CONTRACT_ENV, contract.to_json())
    from carbonforge_runtime.engine import scheduler as plug_in

    clock = FakeClock()
    monkeypatch.setattr(plug_in, "time", types.SimpleNamespace(monotonic=clock, time=time.time))
    engine = Engine(vllm_parts, max_num_seqs=4)
    clock.now += 1.0
    before = time.time()
    engine.add("a", list(range(1, 101)), max_tokens=3, arrival=before - 0.25)  # on the waiting engine
    _step(engine, clock, 0.05)  # a is still running: the engine goes straight on
    engine.add("b", list(range(1001, 1041)), max_tokens=1, arrival=before - 0.1)
    while engine.scheduler.has_requests():
        _step(engine, clock, 0.05)
    engine.scheduler.shutdown()

    lines = _lines(path)
    requests = [line for line in lines if line["kind"] == "request"]
    assert [(r["t_arrival"], r["prompt_tokens"], r["engine"]) for r in requests] == [
        (round(before - 0.25, 6), 100, 0), (round(before - 0.1, 6), 40, 0)]
    assert all(before - 1e-6 <= r["t_added"] <= time.time() for r in requests)
    # a: taken in at once; b: taken in after the step, which was scheduled 51 ms before (with the 1 ms
    # of host work after it)
    assert [r["intake_window_s"] for r in requests] == [0.0, pytest.approx(0.051)]
    assert [line["kind"] for line in lines[:3]] == ["engine", "request", "step"]


def test_a_paced_engines_log_names_the_model_its_steps_follow(vllm_parts: dict[str, Any],
                                                               monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    path = tmp_path / "steps.jsonl"
    emulation = Emulation(model="a100-80-tp1", floor_ms=10.0, per_batched_token_ms=0.1, per_kv_token_read_ms=0.0,
                          attention_ms=0.0, overhead_ms=0.0, proxy=True, slowdown=0.5)
    contract = EngineContract(Ordering("fcfs", {}), None, step_log=StepLogConfig(file=str(path), flush_timeout_s=5.0),
                              emulation=emulation)
    monkeypatch.setenv(CONTRACT_ENV, contract.to_json())
    engine = Engine(vllm_parts, max_num_seqs=4)
    engine.scheduler.shutdown()
    header = _lines(path)[0]
    assert header["kind"] == "engine"
    assert (header["emulated_cost_model"], header["emulated_slowdown"]) == ("a100-80-tp1", 0.5)
