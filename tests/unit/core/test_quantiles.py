"""The one quantile convention, and every percentile the project reports follows it."""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from carbonforge_runtime.core.quantiles import nearest_rank, quantile
from carbonforge_runtime.offline.replay.aggregate import percentile
from carbonforge_runtime.offline.trace_tools.sketch import QuantileSketch, exact_quantile
from carbonforge_runtime.runtime.metrics.state import RuntimeState


def test_nearest_rank_on_small_examples() -> None:
    values = [10.0, 20.0, 30.0, 40.0, 50.0, 60.0, 70.0, 80.0, 90.0, 100.0]
    assert quantile(values, 0.5) == 50.0
    assert quantile(values, 0.9) == 90.0
    assert quantile(values, 0.91) == 100.0
    assert quantile(values, 0.0) == 10.0 and quantile(values, 1.0) == 100.0
    assert quantile([], 0.5) is None
    assert nearest_rank(0.9, 30) == 26  # 0.9 * 30 in floating point is 27.000000000000004


@given(st.lists(st.floats(min_value=0, max_value=1e6), min_size=1, max_size=200),
       st.sampled_from([0.5, 0.9, 0.95, 0.99]))
def test_the_value_has_at_least_q_of_the_values_at_or_below_it(values: list[float], q: float) -> None:
    found = quantile(values, q)
    assert found is not None and found in values
    at_or_below = sum(1 for v in values if v <= found)
    below = sum(1 for v in values if v < found)
    assert at_or_below >= math.ceil(q * len(values) - 1e-9)
    assert below < max(math.ceil(q * len(values) - 1e-9), 1)


def test_replay_trace_tools_and_metrics_agree() -> None:
    values = [float(v) for v in range(1, 31)]
    sketch = QuantileSketch()
    for v in values:
        sketch.add(v)
    assert percentile(values, 90) == exact_quantile(values, 0.9) == quantile(values, 0.9) == 27.0
    estimate = sketch.quantile(0.9)
    assert estimate is not None and abs(estimate - 27.0) <= 0.02 * 27.0
    state = RuntimeState(clock=lambda: 100.0)
    from carbonforge_runtime.core.feed_protocol import RequestSample

    state.on_records([RequestSample("fcfs", "stop", v, v, v, 1, 1, None) for v in values])
    signals = state.signals(100.0, 60.0)
    assert signals.queue_wait_p90_s == 27.0
