"""Energy per request: the pure attribution, the engine-side meter with the fake NVML, and energy_j in records."""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from carbonforge_runtime.core.contract import EnergyMetering
from carbonforge_runtime.core.energy_attribution import EnergyAttributor
from carbonforge_runtime.core.trace_record import Completion, build_record
from carbonforge_runtime.engine.energy_meter import EnergyMeter, start_meter
from carbonforge_runtime.engine.trace_writer import TraceWriter
from carbonforge_runtime.gpu.fake import FakeGpuSession
from carbonforge_runtime.runtime.planning.trace_options import TraceConfig
from tests.support import wait_until

LOG = logging.getLogger("test.energy")


def linear_counter(attributor: EnergyAttributor, watts: float, until: float, every: float = 0.05) -> None:
    t = 0.0
    while t <= until + every:
        attributor.add_sample(t, 1000.0 + watts * t)
        t += every


# ---- the pure attribution ----------------------------------------------------------------------------------


def test_a_step_is_shared_by_tokens_scheduled() -> None:
    a = EnergyAttributor()
    linear_counter(a, watts=100.0, until=1.0)
    a.add_step(0.0, 0.1, {"prefill": 90, "decode": 10})  # 10 J
    a.add_step(0.1, 0.2, {"decode": 1, "other": 1})  # 10 J
    assert a.advance() == 2
    assert a.take("prefill") == pytest.approx(9.0)
    assert a.take("decode") == pytest.approx(1.0 + 5.0)
    assert a.take("other") == pytest.approx(5.0)
    assert a.take("never-ran") == 0.0


def test_idle_time_between_steps_is_not_charged_to_anyone() -> None:
    a = EnergyAttributor(idle_gap_s=0.25)
    linear_counter(a, watts=100.0, until=3.0)
    a.add_step(0.0, 0.5, {"r1": 1})
    a.add_step(2.0, 2.5, {"r2": 1})  # 1.5 s idle before it
    a.add_step(2.51, 2.6, {"r2": 1})  # back to back: tiles from 2.5
    a.advance()
    assert a.take("r1") == pytest.approx(50.0)
    assert a.take("r2") == pytest.approx(60.0)
    assert a.totals.idle_j == pytest.approx(150.0)


def test_the_engine_says_when_it_goes_idle_and_a_stall_with_work_in_flight_is_charged() -> None:
    a = EnergyAttributor(idle_gap_s=0.25)
    linear_counter(a, watts=100.0, until=5.0)
    a.add_step(0.0, 0.5, {"r1": 1}, busy_after=True)
    a.add_step(1.5, 2.0, {"r1": 1}, busy_after=False)  # a 1 s stall with r1 in flight: charged to r1
    a.add_step(2.1, 2.5, {"r2": 1}, busy_after=False)  # nothing was left after the last step: 0.1 s idle
    a.advance()
    assert a.take("r1") == pytest.approx(200.0)
    assert a.take("r2") == pytest.approx(40.0)
    assert a.totals.idle_j == pytest.approx(10.0)


def test_overlapping_async_steps_tile_time_without_double_counting() -> None:
    a = EnergyAttributor()
    linear_counter(a, watts=200.0, until=1.0)
    # asynchronous scheduling: step n+1 is scheduled before step n's output is processed
    a.add_step(0.00, 0.20, {"x": 1})
    a.add_step(0.10, 0.30, {"x": 1})
    a.add_step(0.20, 0.40, {"x": 1})
    a.advance()
    assert a.take("x") == pytest.approx(200.0 * 0.40)


def test_steps_wait_for_a_sample_that_covers_their_end() -> None:
    a = EnergyAttributor()
    a.add_sample(0.0, 0.0)
    a.add_step(0.0, 0.3, {"x": 1})
    assert a.advance() == 0 and a.peek("x") == 0.0
    a.add_sample(0.4, 40.0)
    assert a.advance() == 1 and a.take("x") == pytest.approx(30.0)


def test_a_share_arriving_after_the_take_is_counted_as_late() -> None:
    a = EnergyAttributor()
    linear_counter(a, watts=10.0, until=1.0)
    a.add_step(0.0, 0.5, {"gone": 1})
    a.advance()
    assert a.take("gone") == pytest.approx(5.0)
    a.add_step(0.5, 1.0, {"gone": 1, "stays": 1})
    a.advance()
    assert a.totals.late_j == pytest.approx(2.5) and a.take("stays") == pytest.approx(2.5)


@settings(max_examples=150, deadline=None)
@given(
    steps=st.lists(st.tuples(st.floats(0.0, 0.3), st.floats(0.001, 0.2),
                             st.dictionaries(st.sampled_from("abcdefgh"), st.integers(0, 600), max_size=6)),
                   min_size=1, max_size=80),
    power=st.lists(st.floats(50.0, 700.0), min_size=1, max_size=20),
)
def test_every_joule_between_first_start_and_last_end_is_accounted_for(
        steps: list[tuple[float, float, dict[str, int]]], power: list[float]) -> None:
    a = EnergyAttributor()
    t, energy, sample_every = 0.0, 5000.0, 0.037
    # steps at arbitrary gaps (some idle) and durations
    timeline = []
    now = 1.0
    for gap, duration, shares in steps:
        start = now + gap
        timeline.append((start, start + duration, shares))
        now = start + duration
    i = 0
    samples_t, samples_e = [], []
    while t <= now + sample_every:
        a.add_sample(t, energy)
        samples_t.append(t)
        samples_e.append(energy)
        energy += power[i % len(power)] * sample_every
        t += sample_every
        i += 1
    for start, end, shares in timeline:
        a.add_step(start, end, shares)
    a.advance()
    full = EnergyAttributor()  # the same samples, never trimmed, to interpolate the expectation
    full._times, full._values = list(samples_t), list(samples_e)
    taken = sum(a.take(r) for r in "abcdefgh")
    totals = a.totals
    expected = full.energy_at(timeline[-1][1]) - full.energy_at(timeline[0][0])
    assert taken + totals.unattributed_j == pytest.approx(expected, rel=1e-9, abs=1e-6)
    assert taken == pytest.approx(totals.attributed_j, rel=1e-9, abs=1e-6)


# ---- the meter with the scripted fake NVML ---------------------------------------------------------------


class Steps:
    """Drives a meter like an engine loop: steps back to back, each sharing work among live requests."""

    def __init__(self, meter: EnergyMeter, step_s: float = 0.004) -> None:
        self.meter = meter
        self.step_s = step_s

    def run(self, work: dict[str, int]) -> dict[str, float]:
        """Each request needs ``work[rid]`` steps; returns wall completion times."""
        left = dict(work)
        done: dict[str, float] = {}
        rng = random.Random(7)
        while left:
            key = object()
            self.meter.step_started(key, time.monotonic())
            shares = {rid: (rng.randint(50, 500) if n == work[rid] else 1) for rid, n in left.items()}
            time.sleep(self.step_s)
            self.meter.step_ended(key, time.monotonic(), shares)
            for rid in list(left):
                left[rid] -= 1
                if left[rid] == 0:
                    del left[rid]
                    done[rid] = time.time()
        return done


def test_meter_charges_every_request_and_the_sum_matches_the_counter_within_2_percent() -> None:
    fake = FakeGpuSession("h100", count=2, power_w=[(0.0, 300.0), (1e9, 300.0)], energy_update_s=0.05)
    fake.origin_s = time.monotonic()
    fake.power_steps = [(0.0, 280.0), (0.5, 520.0), (1.2, 150.0)]  # scripted: prefill-like burst, then decode
    meter = EnergyMeter(fake, [0, 1], LOG).start()
    t0 = time.monotonic()
    work = {f"r{i}": 60 + 50 * i for i in range(8)}  # about 1.7 s of steps
    done = Steps(meter).run(work)
    t1 = time.monotonic()
    joules = {rid: meter.energy_for(rid, done[rid]) for rid in work}
    meter.close()
    meter.close()  # vLLM's shutdown and the exit hook both close it: the second is a no-op
    assert all(j is not None and j > 0 for j in joules.values())
    total = sum(j for j in joules.values() if j is not None)
    counter_delta = 2 * (fake.energy_at(t1) - fake.energy_at(t0))
    assert total == pytest.approx(counter_delta, rel=0.02)
    # the request that ran longest took the most energy
    assert max(joules, key=lambda r: joules[r] or 0.0) == "r7"
    assert fake.closed == 1


def test_meter_off_means_null_and_a_failing_counter_turns_it_off(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeGpuSession("h100")
    meter = EnergyMeter(fake, [0], LOG, interval_s=0.005).start()
    monkeypatch.setattr("carbonforge_runtime.engine.energy_meter.MAX_READ_FAILURES", 3)

    def broken(index: int) -> float:
        from carbonforge_runtime.gpu.types import GpuError

        raise GpuError("gpu-lost", "GPU is lost")

    monkeypatch.setattr(fake, "energy_j", broken)
    wait_until(lambda: not meter.enabled, 5, every_s=0.01)
    assert not meter.enabled
    assert meter.energy_for("x", time.time()) is None
    meter.step_ended(object(), time.monotonic(), {"x": 1})  # hooks are no-ops once off
    assert len(meter._ended) == 0
    meter.close()


def test_start_meter_needs_the_runtimes_request_and_nvml(tmp_path: Any, caplog: pytest.LogCaptureFixture) -> None:
    assert start_meter(None, LOG) is None  # the runtime asked for nothing
    script = tmp_path / "nvml.json"
    script.write_text('{"unavailable": "no-driver"}')
    assert start_meter(EnergyMetering(gpus=(), fake_nvml=str(script)), LOG) is None
    assert "energy_j is null" in caplog.text
    script.write_text('{"kind": "l4", "count": 2}')
    meter = start_meter(EnergyMetering(gpus=("GPU-fake-l4-1",), fake_nvml=str(script)), LOG)
    assert meter is not None and meter.indices == [1]
    meter.close()


# ---- energy_j in the records ---------------------------------------------------------------------------


class MemorySink:
    name = "memory"

    def __init__(self) -> None:
        self.records: list[Any] = []

    def write(self, records: Sequence[Any]) -> None:
        self.records.extend(records)

    def close(self) -> None:
        pass


def completion(rid: str, t_completion: float) -> Completion:
    return Completion(engine_request_id=rid, t_arrival=t_completion - 1.0, t_scheduled=t_completion - 0.9,
                      t_first_token=t_completion - 0.8, t_completion=t_completion, prompt_tokens=10,
                      output_tokens=5, finish_reason="stop")


def test_every_record_gets_energy_j_through_the_writer_and_adds_up() -> None:
    fake = FakeGpuSession("a100-80", power_w=250.0)
    meter = EnergyMeter(fake, [0], LOG).start()
    sink = MemorySink()
    config = TraceConfig(level="standard", file="unused", flush_timeout_s=5.0)
    build = meter.wrap_build(lambda done: build_record(done, family="fcfs", level="standard"))
    writer = TraceWriter([sink], build, config, LOG).start()
    t0 = time.monotonic()
    work = {f"chatcmpl-{i}-0000000{i}": 200 + 60 * i for i in range(6)}  # about 2 s of steps
    done = Steps(meter).run(work)
    t1 = time.monotonic()
    for rid, t_done in sorted(done.items(), key=lambda kv: kv[1]):
        writer.submit(completion(rid, t_done))
    writer.close()
    meter.close()
    assert len(sink.records) == len(work)
    energies = [r["energy_j"] for r in sink.records]
    assert all(isinstance(e, float) and e > 0 for e in energies)
    assert sum(energies) == pytest.approx(fake.energy_at(t1) - fake.energy_at(t0), rel=0.02)


def test_energy_j_is_null_without_nvml() -> None:
    record = build_record(completion("chatcmpl-a-01234567", time.time()), family="fcfs", level="standard")
    assert "energy_j" in record and record["energy_j"] is None


class _Untouchable(dict):  # type: ignore[type-arg]
    """A step's shares that fail if the engine-loop hook walks them (that work belongs to the sampler)."""

    def _refuse(self, *args: object) -> None:
        raise AssertionError("the engine-loop hook iterated over the step's requests")

    __iter__ = items = keys = values = __len__ = _refuse  # type: ignore[assignment]


def test_engine_loop_hooks_do_no_per_request_work() -> None:
    """The two hooks the engine loop calls only note the step; they never walk its requests
    (their cost is measured by benchmarks/bench_tracing.py, not asserted here)."""
    fake = FakeGpuSession("h100")
    meter = EnergyMeter(fake, [0], LOG, interval_s=3600).start()
    shares = _Untouchable({f"r{i}": 1 for i in range(256)})
    key = object()
    meter.step_started(key, 1.0)
    meter.step_ended(key, 2.0, shares)
    meter.enabled = False  # the sampler must not charge the untouchable step during close
    meter.close()


def test_sampler_thread_keeps_up_with_a_busy_engine() -> None:
    fake = FakeGpuSession("h100")
    meter = EnergyMeter(fake, [0], LOG).start()
    stop = threading.Event()

    def engine() -> None:
        while not stop.is_set():
            key = object()
            meter.step_started(key, time.monotonic())
            meter.step_ended(key, time.monotonic(), {"a": 1, "b": 2})
            time.sleep(0.001)  # 1,000 steps a second: several times a real engine's rate

    thread = threading.Thread(target=engine)
    thread.start()
    time.sleep(0.5)
    stop.set()
    thread.join()
    assert meter.energy_for("a", time.time()) is not None
    meter.close()
    assert meter.dropped_steps == 0 and meter.attributor.totals.steps > 100


def test_the_gpu_check_script_runs_on_the_fake_and_sets_nothing(tmp_path: Any) -> None:
    import subprocess
    import sys

    from tests.support import REPO

    script = tmp_path / "nvml.json"
    script.write_text('{"kind": "h100", "count": 2, "power_w": 200}')
    out = tmp_path / "energy-gpu.log"
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "energy_gpu.py"), "--seconds", "1",
                           "--period-s", "0.02", "--fake-nvml", str(script), "--out", str(out)],
                          capture_output=True, timeout=120)
    assert done.returncode == 0, done.stderr.decode()
    text = out.read_text()
    assert "counter moved" in text and "power integral" in text and "one energy counter read" in text
    assert "would lock the SM clock of GPU 0" in text and "; cap the power limit of GPU 1 at" in text
    assert "latency guard" in text and text.count("0 set calls made (a dry run makes none)") == 2


def test_the_span_carries_energy_when_there_is_some() -> None:
    from carbonforge_runtime.engine.trace_sinks import span_attributes

    done = completion("chatcmpl-s-01234567", time.time())
    assert "cf.energy_j" not in span_attributes(build_record(done, family="fcfs", level="standard"))
    done.energy_j = 3.25
    assert span_attributes(build_record(done, family="fcfs", level="standard"))["cf.energy_j"] == 3.25
