"""Scheduler families: how a waiting request is scored. Pure: no vLLM import.

The shim (``scheduler/shim.py``) turns each of vLLM's waiting requests into a
:class:`WaitingRequest`, asks the recipe's :class:`Family` for a score (higher is served
sooner) and admits the request :func:`pick_next` chooses. A family that does not reorder
(``reorders = False``) leaves vLLM's own queue in place and scores nothing (``None``).

A new family is one class plus one entry in :data:`FAMILIES`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from carbonforge_runtime.errors import UsageError
from carbonforge_runtime.scheduler.families import NOT_IMPLEMENTED, REORDERING_FAMILIES


@dataclass
class WaitingRequest:
    """What a family may look at; built by the shim from vLLM's request."""

    request_id: str  # the id the client received
    arrival_time: float  # Unix seconds
    prompt_tokens: int
    cached_tokens: int  # reusable prefix-cached tokens at peek time (0 when unknown / not asked)
    max_tokens: int | None  # the client's max_tokens
    prefix_hash: int  # stable hash of the leading prompt tokens
    num_preemptions: int
    true_output_tokens: int | None = None  # only for the benchmark-only oracle family


class Family(Protocol):
    name: str
    reorders: bool  # False: vLLM's own queue order is kept and score() returns None
    needs_cache_lookup: bool  # True: score() reads cached_tokens, so the shim asks the prefix cache

    def score(self, req: WaitingRequest, now: float) -> float | None:
        """Higher is served sooner; ``None`` for a family that does not reorder."""
        ...

    def observe(self, req: WaitingRequest, output_tokens: int) -> None:
        """Called once per completed request (for families that learn online)."""
        ...


class ArrivalOrder:
    """vLLM's own first-come-first-served order, under a given name (``fcfs``, ``trace``)."""

    reorders = False
    needs_cache_lookup = False

    def __init__(self, name: str) -> None:
        self.name = name

    def score(self, req: WaitingRequest, now: float) -> float | None:
        return None

    def observe(self, req: WaitingRequest, output_tokens: int) -> None:
        return None


def _arrival_order(name: str) -> Callable[[Mapping[str, Any]], Family]:
    def factory(params: Mapping[str, Any]) -> Family:
        return ArrivalOrder(name)

    return factory


#: name -> factory(params). Families that reorder register here too.
FAMILIES: dict[str, Callable[[Mapping[str, Any]], Family]] = {
    "fcfs": _arrival_order("fcfs"),
    "trace": _arrival_order("trace"),
    **REORDERING_FAMILIES,  # ltr-promptlen, affinity, ltr, hybrid, oracle (scheduler/families.py)
}


def make_family(name: str, params: Mapping[str, Any]) -> Family:
    """The family called ``name``; an unknown name is a usage error naming the known ones."""
    factory = FAMILIES.get(name)
    if factory is None and name in NOT_IMPLEMENTED:
        known = ", ".join(sorted(FAMILIES))
        raise UsageError(NOT_IMPLEMENTED[name], f"set the recipe's scheduler.family to one of: {known}")
    if factory is None:
        known = ", ".join(sorted(FAMILIES))
        raise UsageError(
            f"unknown scheduler family {name!r}",
            f"set the recipe's scheduler.family to one of: {known}",
        )
    return factory(params)


def pick_next(
    waiting: Sequence[WaitingRequest], scores: Sequence[float], now: float, max_overtake_s: float | None
) -> int:
    """Index of the request to admit next.

    A request that has waited longer than ``max_overtake_s`` goes first (oldest first), so no
    request starves; otherwise the highest score wins, ties going to the earlier arrival.
    """
    if not waiting:
        raise ValueError("pick_next needs at least one waiting request")
    if max_overtake_s is not None:
        overdue = [i for i, req in enumerate(waiting) if now - req.arrival_time > max_overtake_s]
        if overdue:
            return min(overdue, key=lambda i: waiting[i].arrival_time)
    best = 0
    for i in range(1, len(waiting)):
        if scores[i] > scores[best] or (
            scores[i] == scores[best] and waiting[i].arrival_time < waiting[best].arrival_time
        ):
            best = i
    return best
