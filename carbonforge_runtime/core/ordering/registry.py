"""The ordering families by name, and the choice of the next request to admit. Pure.

A new family is one class (see :mod:`.base` for the interface) plus one entry in :data:`FAMILIES`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from carbonforge_runtime.core.ordering.base import ArrivalOrder, Family
from carbonforge_runtime.core.ordering.families import NOT_IMPLEMENTED, READ_PARAMETER_FILES, REORDERING_FAMILIES
from carbonforge_runtime.core.ordering.tenancy import (
    DEFAULT_MAX_OVERTAKE_S,
    TENANCY_PARAMS,
    Fairness,
    read_fairness,
)
from carbonforge_runtime.core.ordering.tenancy import pick_next as pick_next  # the choice of the next request
from carbonforge_runtime.errors import UsageError


def _arrival_order(name: str) -> Callable[[Mapping[str, Any]], Family]:
    def factory(params: Mapping[str, Any]) -> Family:
        unknown = [str(k) for k in params if k != "max_overtake_s"]
        if unknown:
            raise UsageError(
                f"scheduler family {name!r} takes no parameters, got {', '.join(sorted(unknown))}",
                "remove scheduler.params from the recipe (or set it to {}), or pick a family that takes them "
                f"(it takes only the wait bound max_overtake_s and the tenancy's {', '.join(TENANCY_PARAMS)})",
            )
        family = ArrivalOrder(name)
        bound = params.get("max_overtake_s", DEFAULT_MAX_OVERTAKE_S)
        if isinstance(bound, bool) or not isinstance(bound, (int, float)) or not 0 < bound < float("inf"):
            raise UsageError(f"scheduler family {name!r}: parameter max_overtake_s must be a positive number, "
                             f"got {str(bound)[:40]}", "fix scheduler.params.max_overtake_s in the recipe")
        #: The wait bound once classes or tenants reorder the queue (the family itself keeps arrival order).
        family.max_overtake_s = float(bound)
        return family

    return factory


#: name -> factory(params). Families that reorder register here too.
FAMILIES: dict[str, Callable[[Mapping[str, Any]], Family]] = {
    "fcfs": _arrival_order("fcfs"),
    "trace": _arrival_order("trace"),
    **REORDERING_FAMILIES,  # ltr-promptlen, affinity, ltr, hybrid, oracle (families.py)
}


def make_family(name: str, params: Mapping[str, Any]) -> Family:
    """The family called ``name``; an unknown name is a usage error naming the known ones. The
    composition's parameters (:data:`TENANCY_PARAMS`) are checked here and left out of the family's."""
    return make_ordering(name, params)[0]


def make_ordering(name: str, params: Mapping[str, Any]) -> tuple[Family, Fairness]:
    """The family called ``name`` and how tenants share a priority class (:mod:`.tenancy`)."""
    if not isinstance(params, Mapping):
        raise UsageError(f"scheduler family {name!r}: params must be a mapping",
                         "write scheduler.params as a YAML mapping, e.g. params: {aging_rate: 10}")
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
    fairness = read_fairness(name, params)
    return factory({k: v for k, v in params.items() if k not in TENANCY_PARAMS}), fairness


def check_family(name: str, params: Mapping[str, Any]) -> None:
    """Refuse what :func:`make_family` would refuse (an unknown family, unknown or invalid parameters),
    without reading the files the parameters name: a recipe's checks at load time."""
    token = READ_PARAMETER_FILES.set(False)
    try:
        make_family(name, params)
    finally:
        READ_PARAMETER_FILES.reset(token)
