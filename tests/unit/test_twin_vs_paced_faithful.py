"""The paced-engine benchmark's test of a faithful run (late steps, stalled arrivals) and of its overtaking count."""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass

from benchmarks.twin_vs_paced import (
    ARRIVAL_STALL_S,
    LATE_LIMIT,
    CollectorPauses,
    arrival_timing,
    overtakers,
    unfaithful,
)
from carbonforge_runtime.offline.replay.aggregate import RequestOutcome


@dataclass
class _Result:
    started_at: float
    outcomes: list[RequestOutcome]


def _run(extra_lag_s: dict[int, float]) -> tuple[_Result, list[dict[str, object]]]:
    """Ten requests due every 0.1 s, each stamped 8 ms after it is due (the usual hand-over)
    plus the extra lag given for some of them."""
    outcomes, records = [], []
    for i in range(10):
        due = 0.1 * i
        outcomes.append(RequestOutcome(i, due, sent_s=due + 0.001, request_id=f"cmpl-{i}"))
        records.append({"request_id": f"cmpl-{i}", "t_arrival": 1000.0 + due + 0.008 + extra_lag_s.get(i, 0.0)})
    return _Result(1000.0, outcomes), records


def _row(**changes: float) -> dict[str, float | list[str]]:
    row: dict[str, float | list[str]] = {"late_share": 0.0, "n": 10.0, "sent": 10, "stalled_arrivals": 0.0,
                                         "arrival_excess_s": 0.0, "client_lag_s": 0.0, "errors": []}
    row.update(changes)
    return row


def test_a_steady_run_has_no_stalled_arrival() -> None:
    timing = arrival_timing(*_run({3: 0.004}))
    assert timing["stalled"] == 0
    assert abs(timing["worst_excess_s"] - 0.004) < 1e-9
    assert abs(timing["client_lag_s"] - 0.001) < 1e-9


def test_arrivals_held_up_by_a_stall_are_counted_beyond_the_usual_hand_over() -> None:
    timing = arrival_timing(*_run({6: 0.49, 7: 0.39, 8: ARRIVAL_STALL_S / 2}))
    assert timing["stalled"] == 2
    assert abs(timing["worst_excess_s"] - 0.49) < 1e-9


def test_a_run_is_faithful_only_without_late_steps_stalls_or_lost_requests() -> None:
    assert unfaithful(_row()) == ""
    assert "steps late" in unfaithful(_row(late_share=LATE_LIMIT * 2))
    stalled = unfaithful(_row(stalled_arrivals=15, arrival_excess_s=0.493, client_lag_s=0.002))
    assert "15 arrivals stalled, the worst 493 ms" in stalled and "send lag 2 ms" in stalled
    assert "1 requests not served" in unfaithful(_row(n=9.0))


def _admitted(pairs: list[tuple[float, float]]) -> list[dict[str, float]]:
    """Trace records from (arrival, admission) times."""
    return [{"t_arrival": arrival, "queue_wait_s": admitted - arrival} for arrival, admitted in pairs]


def test_requests_admitted_in_arrival_order_overtake_no_one() -> None:
    # Three arrive during one step and are all admitted at its end; a fourth waits for the next step.
    records = _admitted([(0.0, 0.05), (0.01, 0.05), (0.02, 0.0502), (0.06, 0.10)])
    assert overtakers(records) == 0
    # Records come in completion order, not arrival order.
    assert overtakers(list(reversed(records))) == 0


def test_a_request_admitted_before_an_earlier_arrival_is_an_overtaker() -> None:
    # The long prompt that arrived first waits two steps; the two short ones behind it go first.
    records = _admitted([(0.0, 0.15), (0.01, 0.05), (0.02, 0.10), (0.2, 0.25)])
    assert overtakers(records) == 2
    assert overtakers([*records, {"t_arrival": 0.3, "queue_wait_s": None}]) == 2


def test_a_collection_before_the_replays_clock_is_not_counted_as_a_pause_during_it() -> None:
    with CollectorPauses() as pauses:
        gc.collect()  # as the replay does before its clock starts
        clock_start = time.time()
        assert pauses.worst_s(clock_start, clock_start + 60) == 0.0
        gc.collect()
    assert gc.callbacks.count(pauses._note) == 0
    assert pauses.worst_s(clock_start, clock_start + 60) == pauses.pauses[-1][1] > 0
