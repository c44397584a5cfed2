"""Tenants and priority classes inside vLLM's real scheduler (the shim's queue), and in the twin."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

from carbonforge_runtime.core.request_tags import PRIORITY_ARG, SHARE_ARG, TENANT_ARG
from carbonforge_runtime.core.twin_data import SimRequest, StepCostModel, TwinSettings
from carbonforge_runtime.engine.twin import run_twin
from tests.support.scheduler_harness import Engine, configure, records

FLAT = StepCostModel(name="flat", version=1, gpu="test", tensor_parallel_size=1, floor_ms=10.0,
                     per_batched_token_ms=0.0, per_kv_token_read_ms=0.0, attention_ms=0.0, overhead_ms=0.0,
                     kv_capacity_tokens=16_000, provenance="test")


def tag(tenant: Any = None, priority: Any = None, share: Any = None) -> dict[str, Any]:
    extra: dict[str, Any] = {}
    for key, value in ((TENANT_ARG, tenant), (PRIORITY_ARG, priority), (SHARE_ARG, share)):
        if value is not None:
            extra[key] = value
    return {"extra_args": extra} if extra else {}


def admitted(engine: Engine) -> list[str]:
    return [rid.split("-")[1] for ids in engine.run(steps=200) for rid in ids]


def prompt(n: int, start: int = 1) -> list[int]:
    return list(range(start, start + n))


def test_one_tenant_keeps_vllms_own_queue_and_order(vllm_parts: dict[str, Any],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.v1.core.sched.request_queue import FCFSRequestQueue

    configure(monkeypatch, None)
    engine = Engine(vllm_parts, max_num_seqs=1)
    now = time.time()
    for i in range(4):
        engine.add(f"chatcmpl-r{i}-00000000", prompt(10, 100 * i + 1), arrival=now + i * 0.01, **tag("team-a", 2))
    assert isinstance(engine.scheduler.waiting, FCFSRequestQueue)
    assert admitted(engine) == ["r0", "r1", "r2", "r3"]
    assert isinstance(engine.scheduler.waiting, FCFSRequestQueue)
    assert engine.scheduler._cf_live == {}  # nothing tracked, as before


def test_a_second_tenant_turns_fcfs_into_the_fair_queue(vllm_parts: dict[str, Any],
                                                        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from carbonforge_runtime.engine.scheduler import ScoredQueue

    path = tmp_path / "t.jsonl"
    configure(monkeypatch, path)
    engine = Engine(vllm_parts, max_num_seqs=1)
    now = time.time()
    for i in range(3):
        engine.add(f"chatcmpl-a{i}-00000000", prompt(20, 100 * i + 1), max_tokens=3, arrival=now + i * 0.01,
                   **tag("a"))
    engine.add("chatcmpl-b0-00000000", prompt(20, 901), max_tokens=3, arrival=now + 0.05, **tag("b"))
    assert isinstance(engine.scheduler.waiting, ScoredQueue)
    # FCFS would admit a0 a1 a2 b0; b arrived level with a (0), a0 went first (older head of line),
    # then b0 (a was charged a0's 20 prompt tokens), then a's other two
    assert admitted(engine) == ["a0", "b0", "a1", "a2"]
    engine.scheduler.shutdown()
    assert [r["priority_score"] for r in records(path)] == [None] * 4  # fcfs scores nothing
    ledger = engine.scheduler._cf_ledger
    # prompt tokens x 1 plus output tokens x 2, every output token charged by the end
    assert ledger.counters == {"a": 3 * (20 + 2 * 3), "b": 20 + 2 * 3}
    assert ledger.waiting == {}


def test_fairness_off_keeps_fcfs_across_tenants(vllm_parts: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.v1.core.sched.request_queue import FCFSRequestQueue

    configure(monkeypatch, None, params={"fairness": "off"})
    engine = Engine(vllm_parts, max_num_seqs=1)
    now = time.time()
    for i, tenant in enumerate(("a", "a", "b", "a")):
        engine.add(f"chatcmpl-{tenant}{i}-00000000", prompt(10, 100 * i + 1), arrival=now + i * 0.01, **tag(tenant))
    assert isinstance(engine.scheduler.waiting, FCFSRequestQueue)
    assert admitted(engine) == ["a0", "a1", "b2", "a3"]


def test_a_higher_priority_class_is_admitted_first(vllm_parts: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    configure(monkeypatch, None, family="ltr-promptlen", params={"aging_rate": 0, "fairness": "off"})
    engine = Engine(vllm_parts, max_num_seqs=1)
    now = time.time()
    engine.add("chatcmpl-low0-00000000", prompt(5, 1), arrival=now, **tag("jobs", 0))
    engine.add("chatcmpl-low1-00000000", prompt(8, 101), arrival=now + 0.01, **tag("jobs", 0))
    engine.add("chatcmpl-hibig-00000000", prompt(60, 201), arrival=now + 0.02, **tag("app", 3))
    engine.add("chatcmpl-hismall-00000000", prompt(30, 301), arrival=now + 0.03, **tag("app", 3))
    # inside the class the family still orders (fewer prompt tokens first)
    assert admitted(engine) == ["hismall", "hibig", "low0", "low1"]


def test_bad_tenancy_values_fall_back_to_the_defaults_and_never_stop_the_engine(
        vllm_parts: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    from carbonforge_runtime.engine.scheduler import waiting_request

    configure(monkeypatch, None, family="ltr-promptlen")
    engine = Engine(vllm_parts, max_num_seqs=2)
    bad = engine.add("chatcmpl-bad-00000000", prompt(10), **tag(12345, "urgent", -1.0))
    odd = engine.add("chatcmpl-odd-00000000", prompt(10, 50), **tag("", 1e30, float("nan")))
    good = engine.add("chatcmpl-good-00000000", prompt(10, 90), **tag("team", 2, 2.5))
    assert (waiting_request(bad).tenant, waiting_request(bad).priority, waiting_request(bad).share) == (
        "default", 0, 1.0)
    assert (waiting_request(odd).tenant, waiting_request(odd).priority, waiting_request(odd).share) == (
        "default", 0, 1.0)
    assert (waiting_request(good).tenant, waiting_request(good).priority, waiting_request(good).share) == (
        "team", 2, 2.5)
    assert sorted(admitted(engine)) == ["bad", "good", "odd"]


def test_an_aborted_waiting_request_leaves_the_ledger(vllm_parts: dict[str, Any],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.v1.request import RequestStatus

    configure(monkeypatch, None, family="ltr-promptlen")
    engine = Engine(vllm_parts, max_num_seqs=1)
    engine.add("chatcmpl-a0-00000000", prompt(10), **tag("a"))
    engine.add("chatcmpl-b0-00000000", prompt(10, 50), **tag("b"))
    assert engine.scheduler._cf_ledger.waiting == {(0, "a"): 1, (0, "b"): 1}
    engine.scheduler.finish_requests("chatcmpl-b0-00000000", RequestStatus.FINISHED_ABORTED)
    assert engine.scheduler._cf_ledger.waiting == {(0, "a"): 1}
    assert admitted(engine) == ["a0"]
    assert engine.scheduler._cf_ledger.counters == {"a": 10 + 2 * 2, "b": 0.0}


# -- the twin -----------------------------------------------------------------------------------------


def twin(**changes: Any) -> TwinSettings:
    base: dict[str, Any] = dict(family="fcfs", params={}, max_num_seqs=2, max_num_batched_tokens=256,
                                max_model_len=4096, kv_tokens=16_000, async_scheduling=False)
    base.update(changes)
    return TwinSettings(**base)


def flood(tenants: bool) -> list[SimRequest]:
    reqs = [SimRequest(i, i * 0.01, 32, 40, tenant="flood" if tenants else None) for i in range(40)]
    reqs += [SimRequest(40 + i, 0.5 + i * 0.5, 32, 40, tenant="steady" if tenants else None) for i in range(4)]
    return sorted(reqs, key=lambda r: r.arrival_s)


def steady_waits(run: Any) -> list[float]:
    return [o.scheduled_s - o.arrival_s for o in run.outcomes if o.tenant == "steady"]


@pytest.mark.parametrize("asynchronous", [False, True])
def test_the_twin_serves_a_steady_tenant_promptly_beside_a_flood(asynchronous: bool) -> None:
    fair = run_twin(flood(True), twin(async_scheduling=asynchronous), FLAT)
    fcfs = run_twin(flood(True), twin(async_scheduling=asynchronous, params={"fairness": "off"}), FLAT)
    assert max(steady_waits(fair)) < 0.5  # one request's run is 40 steps of 10 ms
    assert min(steady_waits(fcfs)) > 2.0  # behind the flood's queue
    # the engine does the same work either way
    assert fair.makespan_s == pytest.approx(fcfs.makespan_s, rel=0.02)


def test_the_twin_with_one_tenant_named_gives_the_untagged_results() -> None:
    plain = run_twin(flood(False), twin(family="ltr-promptlen"), FLAT)
    named = run_twin([SimRequest(r.index, r.arrival_s, r.prompt_tokens, r.output_tokens, tenant="only", priority=1)
                      for r in flood(False)], twin(family="ltr-promptlen"), FLAT)
    assert [(o.scheduled_s, o.completion_s) for o in plain.outcomes] == [
        (o.scheduled_s, o.completion_s) for o in named.outcomes]
