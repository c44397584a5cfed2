"""Tenants, priority classes and the virtual token counter (core/ordering/tenancy.py), without vLLM."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from carbonforge_runtime.core.ordering.base import WaitingRequest
from carbonforge_runtime.core.ordering.registry import make_family, make_ordering, pick_next
from carbonforge_runtime.core.ordering.tenancy import (
    DEFAULT_TENANT,
    Fairness,
    Ledger,
    pick_fair,
    read_fairness,
    tenancy_of,
)
from carbonforge_runtime.errors import UsageError

FAMILIES = ("fcfs", "ltr-promptlen", "affinity", "ltr", "hybrid", "oracle")


def req(rid: str, arrival: float = 0.0, prompt: int = 100, tenant: str = DEFAULT_TENANT, priority: int = 0,
        share: float = 1.0, cached: int = 0, true_out: int | None = None) -> WaitingRequest:
    return WaitingRequest(rid, arrival, prompt, cached, None, 0, 0, true_out, tenant=tenant, priority=priority,
                          share=share)


class Queue:
    """The engine's queue in miniature: a pool, the ledger's bookkeeping, and prompt charges at pop."""

    def __init__(self, family: str = "fcfs", params: Mapping[str, Any] | None = None) -> None:
        self.family, fairness = make_ordering(family, dict(params or {}))
        self.ledger = Ledger(fairness)
        self.pool: list[WaitingRequest] = []

    def add(self, *reqs: WaitingRequest) -> None:
        for r in reqs:
            self.pool.append(r)
            self.ledger.arrive(r)

    def pop(self, now: float) -> WaitingRequest:
        index, _ = pick_fair(self.pool, self.family.score, now, getattr(self.family, "max_overtake_s", None),
                             self.ledger)
        chosen = self.pool.pop(index)
        self.ledger.leave(chosen)
        self.ledger.charge(chosen.tenant, chosen.share, prompt_tokens=chosen.prompt_tokens)
        return chosen

    def drain(self, now: float) -> list[str]:
        return [self.pop(now).request_id for _ in range(len(self.pool))]


# -- reading a request's tenancy --------------------------------------------------------------------


def test_a_requests_tenancy_is_read_from_its_extra_args_and_bad_values_become_defaults() -> None:
    assert tenancy_of(None) == (DEFAULT_TENANT, 0, 1.0)
    assert tenancy_of({}) == (DEFAULT_TENANT, 0, 1.0)
    assert tenancy_of({"cf_tenant": "team-a", "cf_priority": 2, "cf_share": 3}) == ("team-a", 2, 3.0)
    assert tenancy_of({"cf_tenant": "team-a", "cf_priority": 2.0, "cf_share": 0.5}) == ("team-a", 2, 0.5)
    # each value is checked on its own: a bad one becomes its default, the others stand
    for bad_tenant in (123, "", "  ", "x" * 65, "a\nb", None, ["a"]):
        assert tenancy_of({"cf_tenant": bad_tenant, "cf_priority": 1})[:2] == (DEFAULT_TENANT, 1)
    for bad_priority in (True, "high", 1.5, math.nan, math.inf, 10**7, None, [1]):
        assert tenancy_of({"cf_tenant": "t", "cf_priority": bad_priority}) == ("t", 0, 1.0)
    for bad_share in (0, -1, math.nan, math.inf, True, "2", 1e9, None):
        assert tenancy_of({"cf_tenant": "t", "cf_share": bad_share}) == ("t", 0, 1.0)


def test_a_mapping_that_raises_gives_the_defaults_instead_of_stopping_the_engine() -> None:
    class Hostile(dict):  # type: ignore[type-arg]
        def get(self, key: Any, default: Any = None) -> Any:
            raise RuntimeError("boom")

    assert tenancy_of(Hostile(x=1)) == (DEFAULT_TENANT, 0, 1.0)


# -- parameters -------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_takes_the_tenancy_parameters_and_refuses_bad_ones(family: str) -> None:
    made, fairness = make_ordering(family, {"fairness": "off", "fair_prompt_weight": 0.5, "fair_output_weight": 4})
    assert made.name == family
    assert fairness == Fairness("off", 0.5, 4.0) and not fairness.on
    assert make_ordering(family, {})[1] == Fairness("vtc", 1.0, 2.0)
    with pytest.raises(UsageError, match="fairness must be one of vtc, off"):
        make_family(family, {"fairness": "wfq"})
    with pytest.raises(UsageError, match="fair_output_weight"):
        make_family(family, {"fair_output_weight": -1})
    with pytest.raises(UsageError, match="fair_prompt_weight"):
        make_family(family, {"fair_prompt_weight": True})


def test_fcfs_carries_a_wait_bound_for_when_classes_or_tenants_reorder_its_queue() -> None:
    assert make_family("fcfs", {}).max_overtake_s == 60.0  # type: ignore[attr-defined]
    assert make_family("trace", {"max_overtake_s": 5}).max_overtake_s == 5.0  # type: ignore[attr-defined]
    for bad in (0, -1, True, "x", math.inf):
        with pytest.raises(UsageError, match="max_overtake_s"):
            make_family("fcfs", {"max_overtake_s": bad})
    with pytest.raises(UsageError, match="takes no parameters, got aging_rate"):
        make_family("fcfs", {"aging_rate": 3})
    assert read_fairness("fcfs", {"max_overtake_s": 5}) == Fairness()


# -- the counters and the choice --------------------------------------------------------------------


def test_the_least_served_tenant_goes_next() -> None:
    q = Queue()
    q.add(req("a1", 0.0, 100, "a"), req("a2", 0.1, 100, "a"), req("a3", 0.2, 100, "a"), req("b1", 0.3, 100, "b"),
          req("b2", 0.4, 100, "b"))
    # equal counters at first: the older head of line (a); then each admission charges 100 prompt tokens
    assert q.drain(1.0) == ["a1", "b1", "a2", "b2", "a3"]
    assert q.ledger.counters == {"a": 300.0, "b": 200.0}


def test_output_tokens_count_twice_a_prompt_token_by_default() -> None:
    ledger = Ledger()
    ledger.charge("a", 1.0, prompt_tokens=10, output_tokens=5)
    ledger.charge("b", 2.0, prompt_tokens=10, output_tokens=5)
    assert ledger.counters == {"a": 20.0, "b": 10.0}
    custom = Ledger(Fairness("vtc", 0.0, 1.0))
    custom.charge("a", 1.0, prompt_tokens=1000, output_tokens=3)
    assert custom.counters == {"a": 3.0}


def test_a_tenant_back_from_idle_is_lifted_to_the_least_served_waiting_tenant() -> None:
    q = Queue()
    q.add(*(req(f"a{i}", i * 0.01, 100, "a") for i in range(10)))
    served = [q.pop(1.0).request_id for _ in range(6)]  # a alone: 600 tokens of service
    assert served == [f"a{i}" for i in range(6)]
    q.add(req("b1", 2.0, 100, "b"), req("b2", 2.1, 100, "b"))
    # b banked nothing while idle: it starts level with a (600), not at 0, so it does not get the
    # next six admissions; it alternates with a instead (ties go to the older head of line, a)
    assert q.ledger.counter("b") == 600.0
    assert q.drain(3.0) == ["a6", "b1", "a7", "b2", "a8", "a9"]


def test_with_no_tenant_waiting_a_newcomer_is_lifted_to_the_last_one_that_left() -> None:
    q = Queue()
    q.add(req("a1", 0.0, 500, "a"))
    assert q.drain(1.0) == ["a1"]
    q.add(req("b1", 2.0, 100, "b"))
    assert q.ledger.counter("b") == 500.0
    # lifting never lowers a counter
    ledger = Ledger()
    ledger.counters["c"] = 900.0
    ledger.arrive(req("c1", tenant="c"))
    assert ledger.counter("c") == 900.0


def test_shares_weigh_the_service_each_backlogged_tenant_gets() -> None:
    q = Queue()
    q.add(*(req(f"a{i}", 0.0, 100, "a", share=2.0) for i in range(300)))
    q.add(*(req(f"b{i}", 0.0, 100, "b", share=1.0) for i in range(300)))
    first = [q.pop(1.0).tenant for _ in range(300)]
    assert first.count("a") == 200 and first.count("b") == 100


def test_fairness_off_leaves_tenants_of_a_class_to_the_family() -> None:
    q = Queue("ltr-promptlen", {"fairness": "off", "aging_rate": 0})
    q.add(req("a-big", 0.0, 900, "a"), req("a-small", 0.1, 10, "a"), req("b-mid", 0.2, 50, "b"))
    assert q.drain(1.0) == ["a-small", "b-mid", "a-big"]


def test_the_family_orders_inside_a_tenants_turn() -> None:
    q = Queue("ltr-promptlen", {"aging_rate": 0})
    q.add(req("a-big", 0.0, 900, "a"), req("a-small", 0.1, 10, "a"), req("a-mid", 0.2, 300, "a"),
          req("b-big", 0.3, 800, "b"), req("b-small", 0.4, 20, "b"))
    # a (older head) first and takes its smallest; then b (counter 0) its smallest; then a (10) ...
    assert q.drain(1.0) == ["a-small", "b-small", "a-mid", "b-big", "a-big"]


def test_a_higher_priority_class_goes_first_whatever_the_counters() -> None:
    q = Queue()
    q.ledger.counters["vip"] = 1e9  # served a lot already
    q.add(req("low1", 0.0, 10, "free", 0), req("low2", 0.1, 10, "free", 0), req("hi1", 0.5, 5000, "vip", 5),
          req("mid1", 0.6, 10, "paid", 1), req("hi2", 0.7, 5000, "vip", 5))
    assert q.drain(1.0) == ["hi1", "hi2", "mid1", "low1", "low2"]


def test_the_wait_bound_lets_a_starved_lower_class_through_oldest_first() -> None:
    q = Queue("fcfs", {"max_overtake_s": 10})
    q.add(req("batch-old", 0.0, 10, "jobs", 0), req("batch-new", 5.0, 10, "jobs", 0),
          req("chat1", 11.0, 10, "app", 1), req("chat2", 11.5, 10, "app", 1))
    # at t=12 batch-old has waited 12 s > 10: its class goes first; batch-new (7 s) does not yet
    assert q.pop(12.0).request_id == "batch-old"
    assert q.pop(12.0).request_id == "chat1"
    # at t=16 batch-new is past the bound too
    assert q.pop(16.0).request_id == "batch-new"
    assert q.drain(16.0) == ["chat2"]


def test_inside_a_tenants_turn_its_requests_past_the_bound_go_first() -> None:
    q = Queue("ltr-promptlen", {"aging_rate": 0, "max_overtake_s": 10})
    q.add(req("a-old-big", 0.0, 900, "a"), req("a-small", 8.0, 10, "a"), req("b1", 8.5, 10, "b"))
    assert q.drain(12.0)[0] == "a-old-big"


def test_between_tenants_of_one_class_the_share_not_the_bound_decides() -> None:
    q = Queue("fcfs", {"max_overtake_s": 10})
    q.ledger.counters.update({"flood": 5000.0})
    q.add(*(req(f"f{i}", i * 0.1, 100, "flood") for i in range(5)))
    q.add(req("s1", 30.0, 100, "steady"))
    assert q.ledger.counter("steady") == 5000.0  # lifted level with the flood on arrival
    # a tie goes to the older head of line; then the steady tenant is the less served, though every
    # flood request is past the bound at t=31
    assert [q.pop(31.0).request_id for _ in range(3)] == ["f0", "s1", "f1"]


# -- single tenant: exactly the family's order --------------------------------------------------------


waiting_lists = st.lists(
    st.tuples(st.floats(0, 100), st.integers(1, 4000), st.integers(0, 4000), st.integers(1, 2000)),
    min_size=1, max_size=40)


@settings(max_examples=150, deadline=None)
@given(items=waiting_lists, family=st.sampled_from(FAMILIES), now=st.floats(0, 200),
       tenant=st.sampled_from([DEFAULT_TENANT, "team-a"]), priority=st.integers(-3, 3))
def test_one_tenant_at_one_class_gets_exactly_the_familys_order(
        items: list[tuple[float, int, int, int]], family: str, now: float, tenant: str, priority: int) -> None:
    queue = Queue(family, {"max_overtake_s": 30})
    reqs = [req(f"r{i}", arrival, prompt, tenant, priority, cached=min(cached, prompt), true_out=out)
            for i, (arrival, prompt, cached, out) in enumerate(items)]
    queue.add(*reqs)
    fam = make_family(family, {"max_overtake_s": 30})
    pool = list(reqs)
    while pool:
        scores = [float("-inf") if (s := fam.score(r, now)) is None else float(s) for r in pool]
        expected = pool.pop(pick_next(pool, scores, now, 30.0)).request_id
        assert queue.pop(now).request_id == expected


def test_single_tenant_order_matches_the_families_on_a_long_queue() -> None:
    import random

    rng = random.Random(3)
    for family in FAMILIES:
        reqs = [req(f"r{i}", i * 0.05, rng.randint(1, 3000), true_out=rng.randint(1, 800)) for i in range(300)]
        queue = Queue(family, {})
        queue.add(*reqs)
        fam = make_family(family, {})
        pool = list(reqs)
        order = []
        for step in range(300):
            now = 15.0 + step * 0.5
            scores = [float("-inf") if (s := fam.score(r, now)) is None else float(s) for r in pool]
            order.append(pool.pop(pick_next(pool, scores, now, getattr(fam, "max_overtake_s", None))).request_id)
            assert queue.pop(now).request_id == order[-1], family


# -- the bound on the service gap ---------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.tuples(st.integers(1, 300), st.integers(1, 60)), min_size=4, max_size=40),
       shares=st.tuples(st.sampled_from([0.5, 1.0, 2.0, 3.0]), st.sampled_from([0.5, 1.0, 2.0, 3.0])),
       slots=st.integers(1, 6), prompt_weight=st.sampled_from([0.0, 1.0]), output_weight=st.sampled_from([1.0, 2.0]))
def test_two_backlogged_tenants_counters_never_differ_by_more_than_the_bound(
        sizes: list[tuple[int, int]], shares: tuple[float, float], slots: int, prompt_weight: float,
        output_weight: float) -> None:
    """An engine of ``slots`` running requests, one output token per request per step, both tenants
    always backlogged. Output tokens are charged as generated (before each choice), the prompt at
    admission. Bound: a tenant's counter can pass the other's only through requests it has running
    when it was last chosen (it was the smaller then), at most ``slots`` of them, each worth at most
    ``U`` (its prompt and output, weighted) divided by its share: ``|c_a - c_b| <= slots x U / min(share)``."""
    q = Queue("fcfs", {"fair_prompt_weight": prompt_weight, "fair_output_weight": output_weight})
    share = {"a": shares[0], "b": shares[1]}
    biggest = max(prompt_weight * p + output_weight * o for p, o in sizes)
    bound = slots * biggest / min(shares)
    counter = 0

    def refill() -> None:
        nonlocal counter
        for tenant in ("a", "b"):
            while sum(1 for r in q.pool if r.tenant == tenant) < 2:
                p, o = sizes[counter % len(sizes)]
                q.add(req(f"{tenant}{counter}", counter * 1e-3, p, tenant, share=share[tenant], true_out=o))
                counter += 1

    running: list[list[Any]] = []  # [request, output tokens left]
    for _ in range(400):
        refill()
        while len(running) < slots:
            refill()
            chosen = q.pop(1.0)
            assert chosen.true_output_tokens is not None
            running.append([chosen, chosen.true_output_tokens])
        for item in running:  # one step: one token each, charged as generated
            q.ledger.charge(item[0].tenant, item[0].share, output_tokens=1)
            item[1] -= 1
        running = [item for item in running if item[1] > 0]
        gap = abs(q.ledger.counter("a") - q.ledger.counter("b"))
        assert gap <= bound + 1e-9, (gap, bound)


def test_the_ledger_counts_who_waits_per_class_and_tenant() -> None:
    ledger = Ledger()
    a1, a2, b1 = req("a1", tenant="a"), req("a2", tenant="a", priority=1), req("b1", tenant="b")
    for r in (a1, a2, b1):
        ledger.arrive(r)
    assert ledger.waiting == {(0, "a"): 1, (1, "a"): 1, (0, "b"): 1} and ledger.mixed
    ledger.leave(a2)
    ledger.leave(b1)
    assert ledger.waiting == {(0, "a"): 1} and not ledger.mixed
    ledger.leave(b1)  # leaving twice changes nothing
    assert ledger.waiting == {(0, "a"): 1}
    with pytest.raises(ValueError):
        pick_fair([], lambda r, now: None, 0.0, None, ledger)
