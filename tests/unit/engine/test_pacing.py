"""The paced engine (``serve --emulate``) on vLLM's real scheduler, built in-process with the plug-in:
each step's period is its modelled time (host work between busy steps inside it), the slowdown
stretches every step alike, idle time is in no step, and steps that run past their modelled time are
counted, reported at shutdown and warned about. A fake clock drives it: sleeping advances the clock."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from carbonforge_runtime.core.contract import CONTRACT_ENV, Emulation, EngineContract, Ordering, StepLogConfig
from carbonforge_runtime.core.feed_protocol import EngineCounters
from carbonforge_runtime.engine import pacing
from carbonforge_runtime.engine.pacing import Lateness, period_start, summary_line
from tests.support.scheduler_harness import Engine

#: max(10 ms, 0.1 ms a batched token): 10 ms a decode step, 30 ms a 300-token prompt.
MODEL = Emulation(model="test-model", floor_ms=10.0, per_batched_token_ms=0.1, per_kv_token_read_ms=0.0,
                  attention_ms=0.0, overhead_ms=0.0)
HOST_S = 0.001  # the engine's own work between two steps


class Clock:
    def __init__(self) -> None:
        self.now = 5000.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        assert seconds > 0
        self.sleeps.append(round(seconds, 9))
        self.now += seconds


class LateWakeClock(Clock):
    """Every sleep wakes up 0.1 ms past its end, as on a busy machine."""

    def sleep(self, seconds: float) -> None:
        super().sleep(seconds)
        self.now += 0.0001


class Captured(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[tuple[str, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append((record.levelname, record.getMessage()))


@pytest.fixture
def engine_log() -> Iterator[Captured]:
    handler = Captured()
    logger = logging.getLogger("vllm.carbonforge")  # vLLM's loggers do not propagate to the root
    logger.addHandler(handler)
    old = logger.level
    logger.setLevel(logging.INFO)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(old)


def paced_engine(parts: dict[str, Any], monkeypatch: pytest.MonkeyPatch, clock: Clock, steps: Path,
                 emulation: Emulation = MODEL, async_scheduling: bool = False) -> Engine:
    contract = EngineContract(Ordering("fcfs", {}), None, emulation=emulation,
                              step_log=StepLogConfig(file=str(steps), flush_timeout_s=5.0))
    monkeypatch.setenv(CONTRACT_ENV, contract.to_json())
    from carbonforge_runtime.engine import scheduler as plug_in

    monkeypatch.setattr(plug_in, "time", types.SimpleNamespace(monotonic=clock, time=plug_in.time.time))
    monkeypatch.setattr(pacing, "time", types.SimpleNamespace(monotonic=clock, sleep=clock.sleep))
    monkeypatch.setattr(pacing, "sleep_holding_gil", clock.sleep)
    monkeypatch.setattr(pacing, "quiet_workers", lambda log: None)  # no worker processes here
    return Engine(parts, max_num_seqs=4, async_scheduling=async_scheduling)  # 512 tokens a step


def step(engine: Engine, clock: Clock, forward_s: float) -> Any:
    """One synchronous engine step whose forward pass takes ``forward_s`` on this machine."""
    return engine.timed_step(clock, forward_s, HOST_S)


def drain(engine: Engine, clock: Clock, forward_s: float) -> None:
    while engine.scheduler.has_requests():
        step(engine, clock, forward_s)


def walls(path: Path) -> list[float]:
    return [round(line["wall_s"], 6) for line in map(json.loads, path.read_text().splitlines())
            if line["kind"] == "step"]


def test_a_busy_engine_is_paced_completion_to_completion(vllm_parts: dict[str, Any], monkeypatch: pytest.MonkeyPatch,
                                                         tmp_path: Path) -> None:
    clock = Clock()
    engine = paced_engine(vllm_parts, monkeypatch, clock, tmp_path / "steps.jsonl")
    engine.add("a", list(range(1, 301)), max_tokens=3)
    drain(engine, clock, forward_s=0.005)
    engine.scheduler.shutdown()
    # The prompt (300 tokens: 30 ms) after a 5 ms forward pass; then two decode steps (10 ms) whose
    # periods began when the previous step ended, so the 1 ms of host work between them is inside.
    # The last 5 ms of a wait are slept apart (holding the interpreter lock).
    assert clock.sleeps == [0.02, 0.005, 0.004, 0.004]
    assert walls(tmp_path / "steps.jsonl") == [0.03, 0.01, 0.01]
    counters = engine.scheduler.cf_counters
    assert (counters.emulated_steps_total, counters.emulated_late_steps_total) == (3, 0)


def test_the_slowdown_stretches_every_step(vllm_parts: dict[str, Any], monkeypatch: pytest.MonkeyPatch,
                                           tmp_path: Path) -> None:
    clock = Clock()
    slow = Emulation(**{**MODEL.__dict__, "slowdown": 3.0})
    engine = paced_engine(vllm_parts, monkeypatch, clock, tmp_path / "steps.jsonl", slow)
    engine.add("a", list(range(1, 301)), max_tokens=3)
    drain(engine, clock, forward_s=0.005)
    engine.scheduler.shutdown()
    assert clock.sleeps == [0.08, 0.005, 0.019, 0.005, 0.019, 0.005]
    assert walls(tmp_path / "steps.jsonl") == [0.09, 0.03, 0.03]


def test_a_late_wake_up_is_not_carried_into_the_next_period(vllm_parts: dict[str, Any],
                                                             monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Every wait wakes up 0.1 ms past its deadline (a busy machine's wake-up): each step still lasts
    its modelled time from the previous modelled end, so a run of steps lasts what the model says
    plus one wake-up, not 1% more per step (which would slow the whole run by that much)."""
    clock = LateWakeClock()
    engine = paced_engine(vllm_parts, monkeypatch, clock, tmp_path / "steps.jsonl")
    engine.add("a", list(range(1, 21)), max_tokens=50)
    drain(engine, clock, forward_s=0.002)
    engine.scheduler.shutdown()
    lateness = engine.scheduler._cf_pacer.lateness  # type: ignore[attr-defined]
    assert (lateness.steps, lateness.late) == (50, 0)
    lines = [line for line in map(json.loads, (tmp_path / "steps.jsonl").read_text().splitlines())
             if line["kind"] == "step"]
    # From the first step's end to the last's: 49 steps of 10 ms (not 49 x 10.1 ms).
    assert lines[-1]["t"] - lines[0]["t"] == pytest.approx(49 * 0.010, abs=2e-6)
    assert walls(tmp_path / "steps.jsonl")[1:] == [0.01] * 49


def test_with_asynchronous_scheduling_a_step_starts_where_the_previous_one_ended(
        vllm_parts: dict[str, Any], monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """vLLM's AsyncScheduler schedules step k+1 before step k's output is applied: k+1's period starts
    at k's end, not at its scheduling."""
    from vllm.v1.outputs import ModelRunnerOutput

    clock = Clock()
    engine = paced_engine(vllm_parts, monkeypatch, clock, tmp_path / "steps.jsonl", async_scheduling=True)
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

    inflight = schedule()
    for _ in range(3):
        clock.now += 0.002
        following = schedule()  # scheduled while the previous step runs
        clock.now += 0.002
        scheduler.update_from_output(*inflight)
        inflight = following
    scheduler.shutdown()
    # 512 tokens (51.2 ms) from its scheduling; then 89 and 2 tokens (10 ms each) from the previous end.
    assert clock.sleeps == [0.0422, 0.005, 0.001, 0.005, 0.001, 0.005]
    assert walls(tmp_path / "steps.jsonl") == [0.0512, 0.01, 0.01]


def test_idle_time_is_in_no_step(vllm_parts: dict[str, Any], monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    clock = Clock()
    engine = paced_engine(vllm_parts, monkeypatch, clock, tmp_path / "steps.jsonl")
    engine.add("a", list(range(1, 21)), max_tokens=1)
    drain(engine, clock, forward_s=0.002)
    clock.now += 7.0  # nothing to do for seconds
    engine.add("b", list(range(101, 121)), max_tokens=1)
    drain(engine, clock, forward_s=0.002)
    engine.scheduler.shutdown()
    # Each request's one step starts when it is scheduled, not when the engine last finished one.
    assert clock.sleeps == [0.003, 0.005, 0.003, 0.005]
    assert walls(tmp_path / "steps.jsonl") == [0.01, 0.01]


def test_a_cost_model_faster_than_the_machine_makes_late_steps_and_the_warning(
        vllm_parts: dict[str, Any], monkeypatch: pytest.MonkeyPatch, tmp_path: Path, engine_log: Captured) -> None:
    clock = Clock()
    fast = Emulation(**{**MODEL.__dict__, "floor_ms": 1.0, "per_batched_token_ms": 0.001})  # 1 ms a decode step
    engine = paced_engine(vllm_parts, monkeypatch, clock, tmp_path / "steps.jsonl", fast)
    engine.add("a", list(range(1, 21)), max_tokens=250)
    drain(engine, clock, forward_s=0.004)  # this machine needs 4 ms: every step is late
    counters = engine.scheduler.cf_counters
    assert counters.emulated_steps_total == 250 and counters.emulated_late_steps_total == 250
    assert clock.sleeps == []  # a late step ends when its work ends: nothing to wait out
    running = [text for level, text in engine_log.lines if level == "WARNING" and "NOT FAITHFUL" in text]
    assert len(running) == 1 and "200 of 200 steps" in running[0]  # once, while it runs
    engine.scheduler.shutdown()
    # The next period starts where the late step really ended (no catching up): 4 ms + 1 ms host work.
    assert set(walls(tmp_path / "steps.jsonl")[1:]) == {0.005}
    summary = [text for level, text in engine_log.lines if level == "INFO" and "steps ran late" in text]
    assert summary == ["emulated: the real engine paced to step-time model test-model v1, not a proxy; 100.00% of 250 "
                       "steps late (over 1%: not faithful); slowdown 1; 250 of 250 steps ran late, worst 5.00x its "
                       "modelled time"]
    final = [text for level, text in engine_log.lines if level == "WARNING" and "NOT FAITHFUL" in text]
    assert len(final) == 2 and "250 of 250 steps (100.0%, over 1%)" in final[1]
    assert "--emulate-slowdown" in final[1]


def test_a_few_late_steps_are_counted_without_the_warning(vllm_parts: dict[str, Any], monkeypatch: pytest.MonkeyPatch,
                                                          tmp_path: Path, engine_log: Captured) -> None:
    clock = Clock()
    engine = paced_engine(vllm_parts, monkeypatch, clock, tmp_path / "steps.jsonl")
    engine.add("a", list(range(1, 21)), max_tokens=300)
    for n in range(301):
        if not engine.scheduler.has_requests():
            break
        step(engine, clock, forward_s=0.012 if n == 150 else 0.002)  # one decode step of 300 takes 13 ms
    engine.scheduler.shutdown()
    lateness = engine.scheduler._cf_pacer.lateness  # type: ignore[attr-defined]
    assert (lateness.steps, lateness.late) == (300, 1)
    assert lateness.worst_ratio == pytest.approx(1.3)  # 12 ms forward + 1 ms host work against 10 ms
    assert not [text for level, text in engine_log.lines if level == "WARNING"]
    expected = ("emulated: the real engine paced to step-time model test-model v1, not a proxy; 0.33% of 300 steps "
                "late; slowdown 1; 1 of 300 steps ran late, worst 1.30x its modelled time")
    assert ("INFO", expected) in engine_log.lines


def test_a_wait_sleeps_its_last_part_apart_and_a_past_deadline_not_at_all() -> None:
    clock = Clock()
    finals: list[float] = []

    def final(seconds: float) -> None:
        finals.append(round(seconds, 9))
        clock.now += seconds

    pacing.wait_until(clock.now + 0.1, clock, clock.sleep, final)
    pacing.wait_until(clock.now + 0.003, clock, clock.sleep, final)
    pacing.wait_until(clock.now - 0.5, clock, clock.sleep, final)
    assert (clock.sleeps, finals) == ([0.095], [0.005, 0.003])
    assert pacing._USLEEP is not None  # Linux: the final part keeps the interpreter lock
    pacing.sleep_holding_gil(0.0)


def test_lateness_and_period_start_are_plain_functions() -> None:
    lateness = Lateness()
    assert lateness.count(0.010, 0.009) is False and lateness.count(0.010, 0.015) is True
    assert (lateness.steps, lateness.late, lateness.worst_ratio) == (2, 1, pytest.approx(1.5))
    assert lateness.late_s == pytest.approx(0.005) and lateness.share == 0.5
    assert not lateness.faithful(0.01) and lateness.faithful(0.5)
    # busy: from the previous end; idle: from the scheduling; scheduled before the previous end
    # (asynchronous scheduling, one step in flight): from that end.
    assert period_start(entered=12.0, last_end=10.0, busy_at_last_end=True) == 10.0
    assert period_start(entered=12.0, last_end=10.0, busy_at_last_end=False) == 12.0
    assert period_start(entered=9.0, last_end=10.0, busy_at_last_end=False) == 10.0
    lateness = Lateness()
    lateness.count(0.010, 0.0101999)  # within 2%: a wake-up a little late is not a late step
    assert lateness.late == 0
    assert summary_line(lateness, Emulation(**{**MODEL.__dict__, "proxy": True, "slowdown": 2.5})) == (
        "emulated: the real engine paced to step-time model test-model v1, a proxy; 0.00% of 1 steps late; "
        "slowdown 2.5; 0 of 1 steps ran late")


def test_the_workers_busy_wait_is_given_the_lowest_priority(engine_log: Captured) -> None:
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert worker.pid in pacing.child_pids(os.getpid())
        pacing.quiet_workers(logging.getLogger("vllm.carbonforge"))
        assert os.getpriority(os.PRIO_PROCESS, worker.pid) == 19
        assert any(str(worker.pid) in text and "nice 19" in text for _, text in engine_log.lines)
    finally:
        worker.kill()
        worker.wait(timeout=10)


def test_without_emulation_nothing_is_paced(vllm_parts: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    clock = Clock()
    monkeypatch.setenv(CONTRACT_ENV, EngineContract(Ordering("fcfs", {})).to_json())
    monkeypatch.setattr(pacing, "time", types.SimpleNamespace(monotonic=clock, sleep=clock.sleep))
    engine = Engine(vllm_parts, max_num_seqs=4)
    engine.add("a", list(range(1, 21)), max_tokens=3)
    drain(engine, clock, forward_s=0.0)
    assert clock.sleeps == [] and engine.scheduler.cf_counters.emulated_steps_total == 0


def thread_sched_field(tid: int, field: str) -> int | None:
    """A field of /proc's scheduler statistics of one thread of this process (None where absent)."""
    try:
        text = Path(f"/proc/self/task/{tid}/sched").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name.strip() == field:
            return int(value.strip().split(".")[0])
    return None


def test_the_pacing_thread_gets_a_short_slice_and_keeps_its_nice_value() -> None:
    result: dict[str, Any] = {}

    def on_a_thread_of_its_own() -> None:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, 3)
        result["default"] = thread_sched_field(tid, "se.slice")
        result["refused"] = pacing.ask_for_short_slice(250_000)
        result["slice"] = thread_sched_field(tid, "se.slice")
        result["nice"] = os.getpriority(os.PRIO_PROCESS, tid)
        result["policy"] = os.sched_getscheduler(0)

    thread = threading.Thread(target=on_a_thread_of_its_own)
    thread.start()
    thread.join(timeout=30)
    if result["default"] is None:
        pytest.skip("this kernel does not show a thread's slice in /proc")
    assert result["refused"] is None
    assert result["slice"] == 250_000 != result["default"]
    assert result["nice"] == 3 and result["policy"] == os.SCHED_OTHER


def test_the_pacer_says_when_its_slice_was_refused(monkeypatch: pytest.MonkeyPatch, engine_log: Captured) -> None:
    monkeypatch.setattr(pacing, "ask_for_short_slice", lambda: "Operation not permitted")
    monkeypatch.setattr(pacing, "quiet_workers", lambda log: None)
    pacing.start_pacer(MODEL, EngineCounters(), logging.getLogger("vllm.carbonforge"))
    assert any("could not shorten" in text and "Operation not permitted" in text for _, text in engine_log.lines)
