"""The reordering families: ``ltr-promptlen``, ``affinity``, ``ltr``, ``hybrid`` and ``oracle``. Pure.

Every family scores a waiting request as ``base + guard``, higher served sooner:

* ``base`` is the family's own preference, in tokens: minus the expected cost of the request
  (uncached prompt tokens, predicted or true output tokens) for the size-based families, plus
  the reusable cached prefix for ``affinity``.
* ``guard`` is the starvation guard, a term that grows with the time the request has waited:
  ``aging: linear`` (default) adds ``aging_rate`` tokens of credit per second waited; ``aging:
  ratio`` turns a cost-based score into a response ratio, ``(cost + aging_rate * wait) / cost``,
  so a small request ages faster, as in highest-response-ratio-next.
* On top of the score, ``max_overtake_s`` is a hard bound enforced by
  :func:`carbonforge_runtime.core.ordering.registry.pick_next`: once a request has waited that long,
  no request that arrived after it is admitted before it.

Parameters come from the recipe's ``scheduler.params``; an unknown or ill-typed one is a
:class:`~carbonforge_runtime.errors.UsageError` at start.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from carbonforge_runtime.core.ordering.base import Family, WaitingRequest
from carbonforge_runtime.core.ordering.ltr import LtrModel, LtrParams
from carbonforge_runtime.errors import UsageError

AGING_MODES = ("linear", "ratio")
GUARD_PARAMS = ("aging", "aging_rate", "max_overtake_s")
LTR_PARAMS = ("model", "learn", "prior_weight", "ridge", "max_weight", "max_keys", "use_max_tokens")

#: Families only a benchmark may use: a recipe in the shipped recipes directory must not name them.
BENCHMARK_ONLY = frozenset({"oracle"})
#: Default ``cache_lookup_limit`` of the size-based families: a prefix-cache lookup costs 20-40 us
#: per waiting request in vLLM (benchmarks/bench_scoring.py), so beyond this many waiting requests the
#: uncached prompt size is approximated by the whole prompt (``affinity`` has its own ``max_queue``).
DEFAULT_CACHE_LOOKUP_LIMIT = 16
#: Default ``max_queue`` of ``affinity``: beyond it, arrival order (no lookups).
DEFAULT_AFFINITY_MAX_QUEUE = 64
#: Family names reserved for later releases; naming one fails at start with this explanation.
NOT_IMPLEMENTED = {"tie": "the 'tie' family is not implemented in this release"}


# -- parameters -------------------------------------------------------------------------------------


def _finite(value: float) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an integer beyond any float
        return False


class _Params:
    """Typed reads of one family's ``scheduler.params``, naming the family and parameter in errors."""

    def __init__(self, family: str, params: Mapping[str, Any], allowed: tuple[str, ...]) -> None:
        if not isinstance(params, Mapping):
            raise UsageError(f"scheduler family {family!r}: params must be a mapping",
                             "write scheduler.params as a YAML mapping, e.g. params: {aging_rate: 10}")
        unknown = sorted(str(k) for k in params if k not in allowed)
        if unknown:
            raise UsageError(
                f"scheduler family {family!r} has no parameter(s) {', '.join(unknown)}",
                f"use only: {', '.join(sorted(allowed))} (see the README's request ordering section)",
            )
        self.family = family
        self.params = params

    def fail(self, name: str, problem: str) -> UsageError:
        return UsageError(f"scheduler family {self.family!r}: parameter {name} {problem}",
                          f"fix scheduler.params.{name} in the recipe (see the README's request ordering section)")

    def number(self, name: str, default: float, minimum: float = 0.0, nullable: bool = False) -> float | None:
        value = self.params.get(name, default)
        if value is None and nullable:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not _finite(value):
            raise self.fail(name, f"must be a finite number, got {str(value)[:40]}")
        if value < minimum:
            raise self.fail(name, f"must be at least {minimum:g}, got {value!r}")
        return float(value)

    def real(self, name: str, default: float, minimum: float = 0.0) -> float:
        value = self.number(name, default, minimum)
        assert value is not None
        return value

    def flag(self, name: str, default: bool) -> bool:
        value = self.params.get(name, default)
        if not isinstance(value, bool):
            raise self.fail(name, f"must be true or false, got {value!r}")
        return value

    def choice(self, name: str, default: str, choices: tuple[str, ...]) -> str:
        value = self.params.get(name, default)
        if value not in choices:
            raise self.fail(name, f"must be one of {', '.join(choices)}, got {value!r}")
        return str(value)

    def integer(self, name: str, default: int | None, minimum: int = 0) -> int | None:
        value = self.params.get(name, default)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(name, f"must be a whole number, got {value!r}")
        if value < minimum:
            raise self.fail(name, f"must be at least {minimum}, got {value}")
        return value


@dataclass(frozen=True)
class Guard:
    """The starvation guard every reordering family carries."""

    aging: str = "linear"
    aging_rate: float = 20.0  # tokens of credit per second waited
    max_overtake_s: float = 60.0  # hard bound, enforced by pick_next

    @classmethod
    def read(cls, p: _Params, default_rate: float, cost_based: bool) -> Guard:
        aging = p.choice("aging", "linear", AGING_MODES if cost_based else ("linear",))
        rate = p.real("aging_rate", default_rate)
        bound = p.number("max_overtake_s", cls.max_overtake_s, minimum=0.0)
        assert bound is not None
        if bound <= 0:
            raise p.fail("max_overtake_s", "must be positive")
        return cls(aging, rate, bound)


def _uncached(req: WaitingRequest) -> int:
    uncached = req.prompt_tokens - req.cached_tokens
    return uncached if uncached > 0 else 0


# -- families ---------------------------------------------------------------------------------------


class CostFamily:
    """Shortest-expected-cost first, with the guard. Subclasses define :meth:`cost` (tokens, >= 0)."""

    reorders = True
    needs_cache_lookup = False

    def __init__(self, name: str, guard: Guard, cache_lookup_limit: int | None = None) -> None:
        self.name = name
        self.guard = guard
        self.max_overtake_s = guard.max_overtake_s
        #: Past this many waiting requests the shim stops asking the prefix cache (cached_tokens = 0).
        self.cache_lookup_limit = cache_lookup_limit
        self._ratio = guard.aging == "ratio"
        self._rate = guard.aging_rate

    def cost(self, req: WaitingRequest) -> float:
        raise NotImplementedError

    def score(self, req: WaitingRequest, now: float) -> float | None:
        cost = self.cost(req)
        wait = now - req.arrival_time
        if wait < 0.0:
            wait = 0.0
        if self._ratio:
            cost = cost if cost > 1.0 else 1.0
            return (cost + self._rate * wait) / cost
        return self._rate * wait - cost

    def observe(self, req: WaitingRequest, output_tokens: int) -> None:
        return None


class PromptLength(CostFamily):
    """``ltr-promptlen``: fewer uncached prompt tokens first (prefill work)."""

    def __init__(self, guard: Guard, count_cached: bool, cache_lookup_limit: int | None) -> None:
        super().__init__("ltr-promptlen", guard, cache_lookup_limit)
        self.needs_cache_lookup = count_cached

    def cost(self, req: WaitingRequest) -> float:
        return float(_uncached(req))


class Affinity:
    """``affinity``: more reusable prefix-cached tokens first; arrival order when the queue is long.

    The score is ``cached_tokens + aging_rate * wait``. Past ``max_queue`` waiting requests the
    shim stops asking the prefix cache (see ``cache_lookup_limit``), every ``cached_tokens`` is
    then 0, and the guard's equal aging makes the order the arrival order.
    """

    name = "affinity"
    reorders = True
    needs_cache_lookup = True

    def __init__(self, guard: Guard, max_queue: int | None, min_cached_tokens: int) -> None:
        self.guard = guard
        self.max_overtake_s = guard.max_overtake_s
        self.cache_lookup_limit = max_queue
        self.min_cached_tokens = min_cached_tokens
        self._rate = guard.aging_rate

    def score(self, req: WaitingRequest, now: float) -> float | None:
        cached = req.cached_tokens if req.cached_tokens >= self.min_cached_tokens else 0
        wait = now - req.arrival_time
        return cached + self._rate * (wait if wait > 0.0 else 0.0)

    def observe(self, req: WaitingRequest, output_tokens: int) -> None:
        return None


class Ranker(CostFamily):
    """``ltr``: predicted output tokens (a learned ranker) first, plus optional prompt weight."""

    def __init__(self, guard: Guard, model: LtrModel, learn: bool, prompt_weight: float,
                 cache_lookup_limit: int | None, name: str = "ltr") -> None:
        super().__init__(name, guard, cache_lookup_limit)
        self.model = model
        self.learn = learn
        self.prompt_weight = prompt_weight
        self.needs_cache_lookup = prompt_weight > 0

    def predicted_output(self, req: WaitingRequest) -> float:
        return self.model.predict(req.prefix_hash, req.prompt_tokens, req.max_tokens)

    def cost(self, req: WaitingRequest) -> float:
        if self.prompt_weight:
            return self.model.predict(req.prefix_hash, req.prompt_tokens, req.max_tokens) + (
                self.prompt_weight * _uncached(req))
        return self.model.predict(req.prefix_hash, req.prompt_tokens, req.max_tokens)

    def observe(self, req: WaitingRequest, output_tokens: int) -> None:
        if self.learn:
            self.model.observe(req.prefix_hash, req.prompt_tokens, output_tokens)


class Hybrid(Ranker):
    """``hybrid``: ``output_weight * predicted output + prompt_weight * uncached prompt - cache_weight * cached``."""

    def __init__(self, guard: Guard, model: LtrModel, learn: bool, output_weight: float, prompt_weight: float,
                 cache_weight: float, cache_lookup_limit: int | None) -> None:
        super().__init__(guard, model, learn, prompt_weight, cache_lookup_limit, name="hybrid")
        self.output_weight = output_weight
        self.cache_weight = cache_weight
        self.needs_cache_lookup = prompt_weight > 0 or cache_weight > 0

    def cost(self, req: WaitingRequest) -> float:
        cost = self.output_weight * self.model.predict(req.prefix_hash, req.prompt_tokens, req.max_tokens)
        cost += self.prompt_weight * _uncached(req) - self.cache_weight * req.cached_tokens
        return cost if cost > 0.0 else 0.0


class Oracle(CostFamily):
    """``oracle`` (benchmarks only): the true output length, which the replayer sends with each request."""

    def __init__(self, guard: Guard, prompt_weight: float, unknown_output_tokens: float,
                 cache_lookup_limit: int | None) -> None:
        super().__init__("oracle", guard, cache_lookup_limit)
        self.prompt_weight = prompt_weight
        self.unknown_output_tokens = unknown_output_tokens
        self.needs_cache_lookup = prompt_weight > 0

    def cost(self, req: WaitingRequest) -> float:
        if req.true_output_tokens is not None:
            output = float(req.true_output_tokens)
        elif req.max_tokens is not None:
            output = float(req.max_tokens)
        else:
            output = self.unknown_output_tokens
        if self.prompt_weight:
            output += self.prompt_weight * _uncached(req)
        return output


# -- factories --------------------------------------------------------------------------------------


#: False while parameters are only being checked (a recipe file as it is loaded): the files they
#: name (the ranker model) are then left for the launch to read, where they are needed.
READ_PARAMETER_FILES: ContextVar[bool] = ContextVar("read_parameter_files", default=True)


def _load_model(p: _Params) -> LtrModel:
    ltr_params = LtrParams.from_mapping({k: v for k, v in p.params.items() if k in LtrParams.__dataclass_fields__},
                                        where=f"scheduler family {p.family!r}")
    path = p.params.get("model")
    if path is None:
        return LtrModel(params=ltr_params)
    if not isinstance(path, str) or not path:
        raise p.fail("model", f"must be the path of a model file, got {path!r}")
    if not READ_PARAMETER_FILES.get():
        return LtrModel(params=ltr_params)
    return LtrModel.load(Path(path).expanduser(), ltr_params)


def _lookup_limit(p: _Params) -> int | None:
    return p.integer("cache_lookup_limit", DEFAULT_CACHE_LOOKUP_LIMIT, minimum=0)


def make_promptlen(params: Mapping[str, Any]) -> Family:
    p = _Params("ltr-promptlen", params, (*GUARD_PARAMS, "count_cached", "cache_lookup_limit"))
    return PromptLength(Guard.read(p, default_rate=200.0, cost_based=True), p.flag("count_cached", True),
                        _lookup_limit(p))


def make_affinity(params: Mapping[str, Any]) -> Family:
    p = _Params("affinity", params, (*GUARD_PARAMS, "max_queue", "min_cached_tokens"))
    guard = Guard.read(p, default_rate=100.0, cost_based=False)
    max_queue = p.integer("max_queue", DEFAULT_AFFINITY_MAX_QUEUE, minimum=1)
    min_cached = p.integer("min_cached_tokens", 0, minimum=0)
    if min_cached is None:
        raise p.fail("min_cached_tokens", "must be a whole number, got None")
    return Affinity(guard, max_queue, min_cached)


def make_ltr(params: Mapping[str, Any]) -> Family:
    p = _Params("ltr", params, (*GUARD_PARAMS, *LTR_PARAMS, "prompt_weight", "cache_lookup_limit"))
    guard = Guard.read(p, default_rate=20.0, cost_based=True)
    return Ranker(guard, _load_model(p), p.flag("learn", True), p.real("prompt_weight", 0.0), _lookup_limit(p))


def make_hybrid(params: Mapping[str, Any]) -> Family:
    p = _Params("hybrid", params, (*GUARD_PARAMS, *LTR_PARAMS, "output_weight", "prompt_weight", "cache_weight",
                                   "cache_lookup_limit"))
    guard = Guard.read(p, default_rate=20.0, cost_based=True)
    return Hybrid(guard, _load_model(p), p.flag("learn", True), p.real("output_weight", 1.0),
                  p.real("prompt_weight", 0.02), p.real("cache_weight", 0.0), _lookup_limit(p))


def make_oracle(params: Mapping[str, Any]) -> Family:
    p = _Params("oracle", params, (*GUARD_PARAMS, "prompt_weight", "unknown_output_tokens", "cache_lookup_limit"))
    guard = Guard.read(p, default_rate=20.0, cost_based=True)
    return Oracle(guard, p.real("prompt_weight", 0.0), p.real("unknown_output_tokens", 256.0), _lookup_limit(p))


#: The families this module adds to :data:`carbonforge_runtime.core.ordering.registry.FAMILIES`.
REORDERING_FAMILIES: dict[str, Callable[[Mapping[str, Any]], Family]] = {
    "ltr-promptlen": make_promptlen,
    "affinity": make_affinity,
    "ltr": make_ltr,
    "hybrid": make_hybrid,
    "oracle": make_oracle,
}
