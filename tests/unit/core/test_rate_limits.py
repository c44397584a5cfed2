"""Per-key requests per minute: the token bucket on an injected clock, and OpenAI's header format."""

from __future__ import annotations

import pytest

from carbonforge_runtime.core.rate_limits import RequestBucket, go_duration


@pytest.mark.parametrize(("seconds", "text"), [
    (0, "0s"), (-1, "0s"), (0.0004, "1ms"), (0.02, "20ms"), (0.999, "999ms"), (1, "1s"), (6, "6s"), (1.5, "1.5s"),
    (59.25, "59.25s"), (60, "1m0s"), (61.5, "1m1.5s"), (360, "6m0s"), (3600, "1h0m0s"), (3723, "1h2m3s"),
])
def test_durations_are_written_as_openai_writes_them(seconds: float, text: str) -> None:
    assert go_duration(seconds) == text


def test_a_burst_of_the_limit_then_one_request_per_interval() -> None:
    bucket = RequestBucket(per_minute=3, now=100.0)  # one request every 20 s, a burst of 3
    taken = [bucket.take(100.0) for _ in range(3)]
    assert [t.allowed for t in taken] == [True, True, True]
    assert [t.remaining for t in taken] == [2, 1, 0]
    assert [go_duration(t.reset_s) for t in taken] == ["20s", "40s", "1m0s"]
    refused = bucket.take(100.0)
    assert not refused.allowed and refused.remaining == 0 and refused.retry_after_s == pytest.approx(20.0)
    headers = dict(refused.headers())
    assert headers == {b"x-ratelimit-limit-requests": b"3", b"x-ratelimit-remaining-requests": b"0",
                       b"x-ratelimit-reset-requests": b"1m0s", b"retry-after": b"20"}
    later = bucket.take(105.0)  # a quarter of a request back: still refused, 15 s to wait
    assert not later.allowed and later.retry_after_s == pytest.approx(15.0)
    assert dict(later.headers())[b"retry-after"] == b"15"
    assert bucket.take(120.0).allowed  # one interval after the burst
    assert not bucket.take(120.0).allowed
    full = bucket.take(10_000.0)  # a long idle time refills no more than the limit
    assert full.allowed and full.remaining == 2
    assert b"retry-after" not in dict(full.headers())


def test_retry_after_is_at_least_a_second() -> None:
    bucket = RequestBucket(per_minute=6000, now=0.0)  # one every 10 ms
    for _ in range(6000):
        assert bucket.take(0.0).allowed
    refused = bucket.take(0.0)
    assert not refused.allowed and refused.retry_after_s == pytest.approx(0.01)
    assert dict(refused.headers())[b"retry-after"] == b"1" and go_duration(refused.reset_s) == "1m0s"
    assert bucket.take(0.011).allowed
