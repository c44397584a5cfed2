"""The shim's hooks inside vLLM's real scheduler: energy_j from the fake NVML, and the metrics feed.

Driven step by step like tests/unit/engine/test_scheduler.py, with a pause in each step standing in for the model.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

from carbonforge_runtime.core.contract import CONTRACT_ENV, EnergyMetering, EngineContract, MetricsFeed, TraceConfig
from carbonforge_runtime.core.feed_protocol import EngineState, RequestSample
from carbonforge_runtime.gpu.fake import FakeGpuSession
from carbonforge_runtime.runtime.metrics.receiver import FeedReceiver
from tests.support import wait_until
from tests.support.scheduler_harness import Engine, records

#: A pause per step long enough that the run lasts well over 1.5 s (about 140 steps) on any machine.
STEP_S = 0.02
WATTS = 400.0


class TimedEngine(Engine):
    def step(self, token: int = 7) -> tuple[Any, dict[int, Any]]:
        from vllm.v1.outputs import ModelRunnerOutput

        out = self.scheduler.schedule()
        time.sleep(STEP_S)  # the model's forward pass
        ids = list(out.num_scheduled_tokens)
        runner = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                   sampled_token_ids=[[token] for _ in ids], logprobs=None,
                                   prompt_logprobs_dict={}, pooler_output=[])
        return out, self.scheduler.update_from_output(out, runner)


def test_every_record_carries_energy_j_and_they_add_up_to_the_counter(
    vllm_parts: dict[str, Any], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    script = tmp_path / "nvml.json"
    script.write_text(json.dumps({"kind": "h100", "count": 2, "power_w": WATTS}))
    path = tmp_path / "t.jsonl"
    trace = TraceConfig(level="standard", file=str(path), flush_timeout_s=5.0)
    contract = EngineContract(tracing=trace, energy_meter=EnergyMetering(gpus=(), fake_nvml=str(script)))
    monkeypatch.setenv(CONTRACT_ENV, contract.to_json())
    engine = TimedEngine(vllm_parts, max_num_seqs=4)
    assert engine.scheduler._cf_energy is not None
    for i in range(10):
        engine.add(f"chatcmpl-r{i}-0000000{i}", list(range(1, 30 + 20 * i)), max_tokens=20 + 8 * i)
    t0 = time.monotonic()
    engine.run(steps=10_000)
    t1 = time.monotonic()
    engine.scheduler.shutdown()
    got = records(path)
    assert len(got) == 10
    energies = [r["energy_j"] for r in got]
    assert all(isinstance(e, float) and e > 0 for e in energies), energies
    fake = FakeGpuSession("h100", count=2, power_w=WATTS)
    counter_delta = 2 * (fake.energy_at(t1) - fake.energy_at(t0))
    assert t1 - t0 > 1.5  # long enough for the 20-100 ms counter updates to be a small part of it
    assert sum(energies) == pytest.approx(counter_delta, rel=0.02)
    by_id = {r["request_id"]: r for r in got}
    assert by_id["chatcmpl-r9"]["energy_j"] > by_id["chatcmpl-r0"]["energy_j"]  # longest request, most energy


def test_the_feed_carries_records_and_counters_to_the_runtime(
    vllm_parts: dict[str, Any], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    sock = tmp_path / "feed.sock"
    samples: list[RequestSample] = []
    states: list[EngineState] = []
    receiver = FeedReceiver(str(sock), lambda got, rank: samples.extend(got), lambda state, rank: states.append(state),
                            logging.getLogger("test")).start()
    try:
        # tracing off, metrics on: the contract names the feed and no trace part
        monkeypatch.setenv(CONTRACT_ENV, EngineContract(metrics_feed=MetricsFeed(str(sock))).to_json())
        engine = Engine(vllm_parts, max_num_seqs=2)
        for i in range(5):
            engine.add(f"chatcmpl-f{i}-0000000{i}", list(range(1, 20)), max_tokens=3)
        engine.run()
        engine.scheduler.shutdown()
        wait_until(lambda: len(samples) >= 5 and states, 5, every_s=0.02)
    finally:
        receiver.close()
    assert len(samples) == 5 and {s.output_tokens for s in samples} == {3}
    assert all(s.family == "fcfs" and s.finish_reason == "length" and s.energy_j is None for s in samples)
    last = states[-1]
    assert last.counters.requests_completed_total == 5 and last.counters.waiting == 0
    assert last.counters.running == 0
    assert last.sinks == {}  # no trace sink: nothing to count
    assert receiver.stats.lost == 0 and not os.path.exists(sock)
