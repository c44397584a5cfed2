"""The ordering families by name, and the choice of the next request to admit. Pure.

A new family is one class (see :mod:`.base` for the interface) plus one entry in :data:`FAMILIES`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from carbonforge_runtime.core.ordering.base import ArrivalOrder, Family, WaitingRequest
from carbonforge_runtime.core.ordering.families import NOT_IMPLEMENTED, READ_PARAMETER_FILES, REORDERING_FAMILIES
from carbonforge_runtime.errors import UsageError


def _arrival_order(name: str) -> Callable[[Mapping[str, Any]], Family]:
    def factory(params: Mapping[str, Any]) -> Family:
        if params:
            raise UsageError(
                f"scheduler family {name!r} takes no parameters, got {', '.join(sorted(map(str, params)))}",
                "remove scheduler.params from the recipe (or set it to {}), or pick a family that takes them",
            )
        return ArrivalOrder(name)

    return factory


#: name -> factory(params). Families that reorder register here too.
FAMILIES: dict[str, Callable[[Mapping[str, Any]], Family]] = {
    "fcfs": _arrival_order("fcfs"),
    "trace": _arrival_order("trace"),
    **REORDERING_FAMILIES,  # ltr-promptlen, affinity, ltr, hybrid, oracle (families.py)
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


def check_family(name: str, params: Mapping[str, Any]) -> None:
    """Refuse what :func:`make_family` would refuse (an unknown family, unknown or invalid parameters),
    without reading the files the parameters name: a recipe's checks at load time."""
    token = READ_PARAMETER_FILES.set(False)
    try:
        make_family(name, params)
    finally:
        READ_PARAMETER_FILES.reset(token)


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
