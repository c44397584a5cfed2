"""The prompt budget of a tenant over its fair share (core/ordering/prefill_budget.py), and the
waiting queue passing over a tenant whose budget is spent (tenancy.pick_fair), without vLLM."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from carbonforge_runtime.core.ordering.base import WaitingRequest
from carbonforge_runtime.core.ordering.prefill_budget import (
    DEFAULT_FAIR_PREFILL_TOKENS,
    grant,
    is_prefill,
    over_share,
    prefill_budgets,
    spent,
)
from carbonforge_runtime.core.ordering.registry import make_family, make_ordering
from carbonforge_runtime.core.ordering.tenancy import Fairness, Ledger, pick_fair
from carbonforge_runtime.errors import UsageError


def req(rid: str, arrival: float, tenant: str, priority: int = 0) -> WaitingRequest:
    return WaitingRequest(rid, arrival, 100, 0, None, 0, 0, tenant=tenant, priority=priority)


def no_score(_: WaitingRequest, __: float) -> float | None:
    return None


# -- who is over its share ----------------------------------------------------------------------------


def test_a_flood_holding_most_of_the_batch_is_over_its_share_and_the_steady_tenant_is_not() -> None:
    assert over_share({"flood": 59, "steady": 5}, {"flood": 1.0, "steady": 1.0}) == {"flood"}
    assert prefill_budgets({"flood": 59, "steady": 5}, {"flood": 1.0, "steady": 1.0}, 128) == {"flood": 128}


def test_a_tenant_with_requests_waiting_but_none_running_counts_towards_the_fair_parts() -> None:
    # steady waits with nothing running: flood's fair part is half the batch, and it holds all of it
    assert over_share({"flood": 10}, {"flood": 1.0, "steady": 1.0}) == {"flood"}


def test_one_tenant_with_work_is_never_over_there_is_nobody_to_be_fair_to() -> None:
    assert over_share({"flood": 64}, {"flood": 1.0}) == set()
    assert prefill_budgets({"flood": 64}, {"flood": 1.0}, 128) == {}


def test_nobody_is_over_an_empty_batch() -> None:
    assert over_share({}, {"a": 1.0, "b": 1.0}) == set()


def test_tenants_at_exactly_their_part_are_not_capped() -> None:
    assert over_share({"a": 4, "b": 4}, {"a": 1.0, "b": 1.0}) == set()
    # shares whose quotient rounds below the part in floating point
    assert over_share({"a": 7, "b": 7}, {"a": 5.413782570073206, "b": 5.413782570073206}) == set()
    assert over_share({"a": 1, "b": 2}, {"a": 0.1, "b": 0.2}) == set()


def test_shares_set_the_fair_parts() -> None:
    # a has share 3 of 4: its part of 8 running is 6
    assert over_share({"a": 6, "b": 2}, {"a": 3.0, "b": 1.0}) == set()
    assert over_share({"a": 7, "b": 1}, {"a": 3.0, "b": 1.0}) == {"a"}
    assert over_share({"a": 5, "b": 3}, {"a": 3.0, "b": 1.0}) == {"b"}


def test_running_requests_of_a_tenant_without_work_listed_do_not_count() -> None:
    # only the tenants named in shares have work; a stray count is ignored, not divided by zero
    assert over_share({"a": 3, "b": 1, "gone": 50}, {"a": 1.0, "b": 1.0}) == {"a"}


def test_a_cap_of_zero_caps_nobody() -> None:
    assert prefill_budgets({"flood": 59, "steady": 5}, {"flood": 1.0, "steady": 1.0}, 0) == {}


@given(st.dictionaries(st.sampled_from("abcdef"), st.integers(0, 100), min_size=2),
       st.lists(st.floats(0.1, 10.0), min_size=6, max_size=6))
def test_not_every_tenant_with_work_can_be_over_its_share(running: dict[str, int], weights: list[float]) -> None:
    shares = {t: weights[i] for i, t in enumerate(sorted(running))}
    over = over_share(running, shares)
    assert over != set(shares)
    assert all(running[t] > 0 for t in over)


# -- a chunk against the budget -------------------------------------------------------------------------


def test_a_prefill_chunk_is_told_from_a_decode_as_vllm_does() -> None:
    assert is_prefill(0, 800)  # a fresh prompt
    assert is_prefill(512, 800)  # part-way through
    assert not is_prefill(799, 800)  # decoding: one token to compute, the last sampled one
    assert not is_prefill(801, 800)  # asynchronous scheduling counts a placeholder ahead
    assert is_prefill(10, 900)  # a preempted request recomputing its prompt and output


def test_a_chunk_gets_what_is_left_of_the_budget_and_never_less_than_nothing() -> None:
    assert grant(128, 800) == 128
    assert grant(128, 40) == 40
    assert grant(0, 40) == 0
    assert grant(-5, 40) == 0


def test_the_tenants_with_a_spent_budget_are_named() -> None:
    assert spent({"flood": 0, "other": 12}) == {"flood"}
    assert spent({}) == set()


# -- the parameter ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["fcfs", "ltr-promptlen"])
def test_fair_prefill_tokens_is_a_tenancy_parameter_with_a_default_and_checked(family: str) -> None:
    assert make_ordering(family, {})[1].prefill_tokens == DEFAULT_FAIR_PREFILL_TOKENS == 128
    assert make_ordering(family, {"fair_prefill_tokens": 0})[1] == Fairness("vtc", 1.0, 2.0, 0)
    assert make_ordering(family, {"fair_prefill_tokens": 256.0})[1].prefill_tokens == 256
    for bad in (-1, 1.5, True, "128"):
        with pytest.raises(UsageError, match="fair_prefill_tokens must be a whole number"):
            make_family(family, {"fair_prefill_tokens": bad})


# -- the waiting queue passes over a spent tenant ---------------------------------------------------------


def two_tenants() -> tuple[list[WaitingRequest], Ledger]:
    ledger = Ledger()
    waiting = [req("f0", 0.0, "flood"), req("f1", 0.1, "flood"), req("s0", 0.5, "steady")]
    for w in waiting:
        ledger.arrive(w)
    return waiting, ledger


def test_the_queue_passes_over_a_tenant_whose_budget_is_spent() -> None:
    waiting, ledger = two_tenants()
    # level counters: the older head of line (flood) goes first
    assert pick_fair(waiting, no_score, 1.0, None, ledger)[0] == 0
    # flood's prompt budget of the step is spent: steady is admitted instead of stopping the step
    assert pick_fair(waiting, no_score, 1.0, None, ledger, skip={"flood"})[0] == 2


def test_when_every_tenant_of_the_class_is_spent_the_choice_is_unchanged() -> None:
    waiting, ledger = two_tenants()
    assert pick_fair(waiting, no_score, 1.0, None, ledger, skip={"flood", "steady"})[0] == 0


def test_a_spent_tenant_alone_in_the_queue_is_still_chosen() -> None:
    ledger = Ledger()
    waiting = [req("f0", 0.0, "flood"), req("f1", 0.1, "flood")]
    for w in waiting:
        ledger.arrive(w)
    assert pick_fair(waiting, no_score, 1.0, None, ledger, skip={"flood"})[0] == 0


def test_passing_over_stays_inside_the_highest_class() -> None:
    ledger = Ledger()
    waiting = [req("low", 0.0, "steady", 0), req("hi", 0.1, "flood", 1)]
    for w in waiting:
        ledger.arrive(w)
    assert pick_fair(waiting, no_score, 1.0, None, ledger, skip={"flood"})[0] == 1


def test_the_ledger_remembers_each_tenants_share() -> None:
    ledger = Ledger()
    ledger.arrive(WaitingRequest("a", 0.0, 10, 0, None, 0, 0, tenant="a", share=3.0))
    ledger.arrive(WaitingRequest("b", 0.0, 10, 0, None, 0, 0, tenant="b"))
    assert ledger.shares == {"a": 3.0, "b": 1.0}
