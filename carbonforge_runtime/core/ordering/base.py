"""What an ordering family is: the request it scores and the interface it implements. Pure.

The engine's scheduler turns each of vLLM's waiting requests into a :class:`WaitingRequest`, asks
the recipe's :class:`Family` for a score (higher is served sooner) and admits the request the
registry's ``pick_next`` chooses. A family that does not reorder (``reorders = False``) leaves
vLLM's own queue in place and scores nothing (``None``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


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
    tenant: str = "default"  # the tenant of the request's API key (core/ordering/tenancy.py)
    priority: int = 0  # the key's priority class: a higher class is served first
    share: float = 1.0  # the key's fair share (weight) among the tenants of its class


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
    #: The wait bound once priority classes or tenants reorder the queue (the family keeps arrival order).
    max_overtake_s: float | None = None

    def __init__(self, name: str) -> None:
        self.name = name

    def score(self, req: WaitingRequest, now: float) -> float | None:
        return None

    def observe(self, req: WaitingRequest, output_tokens: int) -> None:
        return None
