"""Per-key limits: requests per minute (a token bucket) and requests in flight, and the headers that
report them, in the OpenAI API's format.

A key with ``requests_per_minute: N`` has a bucket of N requests that refills at N per minute: a
burst of N is allowed, then one request every 60/N seconds. The headers of a counted answer are
OpenAI's: ``x-ratelimit-limit-requests`` (N), ``x-ratelimit-remaining-requests`` (what is left after
this request) and ``x-ratelimit-reset-requests`` (how long until the bucket is full again, written
as Go writes a duration: ``6s``, ``1m0s``, ``250ms``). A refused request gets ``Retry-After``: the
whole seconds until one request is allowed again.

O(1) per request, no thread; the clock is passed in (``time.monotonic`` in the API server), so
tests drive it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

LIMIT_HEADER = b"x-ratelimit-limit-requests"
REMAINING_HEADER = b"x-ratelimit-remaining-requests"
RESET_HEADER = b"x-ratelimit-reset-requests"
RETRY_AFTER_HEADER = b"retry-after"
#: What a request refused for the in-flight limit is told to wait: a slot frees when a request ends,
#: which no one can foresee.
CONCURRENCY_RETRY_AFTER_S = 1


def go_duration(seconds: float) -> str:
    """``seconds`` as Go's ``time.Duration`` prints it, as OpenAI's reset headers do: ``0s``,
    ``250ms``, ``6s``, ``1.5s``, ``1m0s``, ``1h2m3s``."""
    if seconds <= 0:
        return "0s"
    millis = math.ceil(seconds * 1000 - 1e-6)
    if millis < 1000:
        return f"{millis}ms"
    hours, rest = divmod(millis, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    whole, frac = divmod(rest, 1000)
    secs = f"{whole}.{frac:03d}".rstrip("0").rstrip(".") if frac else str(whole)
    if hours:
        return f"{hours}h{minutes}m{secs}s"
    if minutes:
        return f"{minutes}m{secs}s"
    return f"{secs}s"


@dataclass(frozen=True)
class Taken:
    """What the bucket said about one request: allowed or not, what is left, the seconds until the
    bucket is full (``reset_s``) and until the next request is allowed (``retry_after_s``, 0 when
    one is)."""

    allowed: bool
    limit: int
    remaining: int
    reset_s: float
    retry_after_s: float

    def headers(self) -> list[tuple[bytes, bytes]]:
        """The ``x-ratelimit-*-requests`` headers (and ``Retry-After`` when refused)."""
        out = [(LIMIT_HEADER, str(self.limit).encode()), (REMAINING_HEADER, str(self.remaining).encode()),
               (RESET_HEADER, go_duration(self.reset_s).encode())]
        if not self.allowed:
            out.append((RETRY_AFTER_HEADER, str(max(1, math.ceil(self.retry_after_s))).encode()))
        return out


class RequestBucket:
    """A token bucket of ``per_minute`` requests, refilled at ``per_minute`` a minute."""

    __slots__ = ("limit", "per_s", "stamp", "tokens")

    def __init__(self, per_minute: int, now: float) -> None:
        self.limit = per_minute
        self.per_s = per_minute / 60.0
        self.tokens = float(per_minute)
        self.stamp = now

    def take(self, now: float) -> Taken:
        """Spend one request at ``now`` if the bucket holds one."""
        tokens = min(float(self.limit), self.tokens + (now - self.stamp) * self.per_s)
        self.stamp = now
        allowed = tokens >= 1.0
        if allowed:
            tokens -= 1.0
        self.tokens = tokens
        retry = 0.0 if tokens >= 1.0 else (1.0 - tokens) / self.per_s
        return Taken(allowed, self.limit, int(tokens), (self.limit - tokens) / self.per_s, retry)
