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


# -- the prompt budget of a tenant over its share (core/ordering/prefill_budget.py) ------------------------


def prompt_tokens_by_tenant(engine: Engine, out: Any) -> dict[str, int]:
    """Prompt tokens each tenant had computed in the step ``out`` scheduled (decodes left out)."""
    by: dict[str, int] = {}
    for rid, n in out.num_scheduled_tokens.items():
        request = engine.added[rid]
        if request.num_computed_tokens - n < request.num_prompt_tokens:  # the chunk started in the prompt
            tenant = rid.split("-")[1].rstrip("0123456789")
            by[tenant] = by.get(tenant, 0) + n
    return by


def flood_beside_a_decoding_tenant(engine: Engine) -> list[tuple[dict[str, int], list[str], list[str]]]:
    """``steady`` decodes a 60-token answer; then ``flood`` sends six 300-token prompts for 100-token
    answers (so the flood keeps more requests running than steady until steady is done). Per step: the
    prompt tokens by tenant, the requests scheduled and those admitted."""
    now = time.time()
    engine.add("chatcmpl-steady0-00000000", prompt(100, 1), max_tokens=60, arrival=now, **tag("steady"))
    steps = []
    out, _ = engine.step()
    steps.append((prompt_tokens_by_tenant(engine, out), list(out.num_scheduled_tokens),
                  [n.req_id for n in out.scheduled_new_reqs]))
    for i in range(6):
        engine.add(f"chatcmpl-flood{i}-00000000", prompt(300, 1000 + 400 * i), max_tokens=100,
                   arrival=now + 0.01 * (i + 1), **tag("flood"))
    for _ in range(300):
        if not engine.scheduler.has_requests():
            break
        out, _ = engine.step()
        steps.append((prompt_tokens_by_tenant(engine, out), list(out.num_scheduled_tokens),
                      [n.req_id for n in out.scheduled_new_reqs]))
    return steps


def test_a_tenant_over_its_share_gets_at_most_its_prompt_budget_per_step(
        vllm_parts: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.v1.core.sched.scheduler import Scheduler

    # the hook is a method of vLLM 0.32's scheduler; if vLLM renames it, nothing below is capped
    assert callable(getattr(Scheduler, "_reserve_prefill_lookahead", None))
    configure(monkeypatch, None, params={"fair_prefill_tokens": 48})
    engine = Engine(vllm_parts, max_num_seqs=8)
    steps = flood_beside_a_decoding_tenant(engine)
    assert steps[0][0] == {"steady": 100}
    # the flood's first step: nobody of it was running yet, so it was not over its share (512-token budget)
    assert steps[1][0]["flood"] == 511
    capped = [s for s in steps[2:] if "chatcmpl-steady0-00000000" in s[1]]
    assert len(capped) > 10
    flood_prompt = [s[0].get("flood", 0) for s in capped]
    # from then on, while steady runs, at most 48 of the flood's prompt tokens per step, and the cap binds
    assert max(flood_prompt) == 48
    assert flood_prompt.count(48) >= 10
    # steady decodes in every step (decode tokens are never capped)
    assert all("chatcmpl-steady0-00000000" in s[1] for s in steps[:len(capped) + 2])
    # every flood request is served in the end
    assert sorted(a for s in steps for a in s[2]) == sorted(
        ["chatcmpl-steady0-00000000"] + [f"chatcmpl-flood{i}-00000000" for i in range(6)])
    assert engine.scheduler._cf_prefill_left == {}  # the budgets live for one step only


def test_without_the_cap_the_flood_takes_whole_steps(vllm_parts: dict[str, Any],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    configure(monkeypatch, None, params={"fair_prefill_tokens": 0})
    engine = Engine(vllm_parts, max_num_seqs=8)
    steps = flood_beside_a_decoding_tenant(engine)
    assert max(s[0].get("flood", 0) for s in steps[2:]) > 48 * 4


def test_one_tenant_is_never_capped(vllm_parts: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    configure(monkeypatch, None, family="ltr-promptlen", params={"fair_prefill_tokens": 16})
    engine = Engine(vllm_parts, max_num_seqs=8)
    now = time.time()
    for i in range(4):
        engine.add(f"chatcmpl-flood{i}-00000000", prompt(300, 1000 + 400 * i), max_tokens=2,
                   arrival=now + 0.01 * i, **tag("flood"))
    out, _ = engine.step()
    assert prompt_tokens_by_tenant(engine, out) == {"flood": 512}  # vLLM's whole token budget
    out, _ = engine.step()
    assert prompt_tokens_by_tenant(engine, out)["flood"] > 16


def test_a_newcomer_is_admitted_in_the_step_where_the_floods_budget_is_spent(
        vllm_parts: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    # only output tokens are charged, so steady (decoding since long before the flood) is the more served
    configure(monkeypatch, None, family="ltr-promptlen",
              params={"aging_rate": 0, "fair_prefill_tokens": 32, "fair_prompt_weight": 0})
    engine = Engine(vllm_parts, max_num_seqs=8)
    now = time.time()
    engine.add("chatcmpl-steady0-00000000", prompt(100, 1), max_tokens=60, arrival=now, **tag("steady"))
    for _ in range(20):
        engine.step()
    for i in range(6):
        engine.add(f"chatcmpl-flood{i}-00000000", prompt(300, 1000 + 400 * i), max_tokens=100,
                   arrival=now + 0.01 * (i + 1), **tag("flood"))
    engine.step()  # flood0 and most of flood1 (nobody of the flood running yet: no cap)
    engine.step()  # the flood is over its share: 32 tokens of flood1's prompt, then no admission
    engine.add("chatcmpl-steady1-00000000", prompt(40, 3000), max_tokens=2, arrival=now + 1.0, **tag("steady"))
    # outside a step nobody is capped: the least-served tenant, the flood, would be admitted next
    assert engine.scheduler.waiting.peek_request().request_id.startswith("chatcmpl-flood")
    out, _ = engine.step()
    # in the step the flood's budget is spent on its running prompt, so steady1 goes in instead of nobody
    assert [n.req_id for n in out.scheduled_new_reqs] == ["chatcmpl-steady1-00000000"]
    assert prompt_tokens_by_tenant(engine, out) == {"flood": 32, "steady": 40}


#: A step costs at least 40 ms and 0.3 ms a token beyond that (the shape of the shipped GPU models).
KNEE = StepCostModel(name="knee", version=1, gpu="test", tensor_parallel_size=1, floor_ms=40.0,
                     per_batched_token_ms=0.3, per_kv_token_read_ms=0.0, attention_ms=0.0, overhead_ms=0.0,
                     kv_capacity_tokens=64_000, provenance="test")


def prompt_flood() -> list[SimRequest]:
    reqs = [SimRequest(i, i * 0.02, 600, 40, tenant="flood") for i in range(200)]
    reqs += [SimRequest(200 + i, 1.0 + 2.0 * i, 50, 100, tenant="steady") for i in range(8)]
    return sorted(reqs, key=lambda r: r.arrival_s)


def steady_time_per_token(run: Any) -> float:
    mine = [o for o in run.outcomes if o.tenant == "steady"]
    assert len(mine) == 8 and all(o.completion_s is not None for o in mine)
    return sum((o.completion_s - o.first_token_s) / (o.generated_tokens - 1) for o in mine) / len(mine)


def test_on_the_twin_the_prompt_budget_keeps_a_steady_tenants_decode_fast_beside_a_prompt_flood() -> None:
    settings = dict(max_num_seqs=16, max_num_batched_tokens=2048, kv_tokens=64_000)
    capped = run_twin(prompt_flood(), twin(params={}, **settings), KNEE)
    uncapped = run_twin(prompt_flood(), twin(params={"fair_prefill_tokens": 0}, **settings), KNEE)
    # uncapped, most steps carry the flood's prompts; capped, they carry at most 128 of its tokens
    assert steady_time_per_token(uncapped) > 0.08  # 90 ms: twice the floor
    assert steady_time_per_token(capped) < 0.6 * steady_time_per_token(uncapped)  # 42 ms
    # the same work, and no slower: the flood's chunks fill decode steps that cost the floor anyway
    assert capped.prefill_tokens == uncapped.prefill_tokens
    assert capped.makespan_s <= uncapped.makespan_s * 1.02
