"""Tenants, priority classes and fair service among tenants. Pure.

Every waiting request belongs to a tenant (the name of its API key; requests without one form the
tenant :data:`DEFAULT_TENANT`), a priority class (an integer, higher is more urgent, default 0) and
carries its tenant's share (a positive weight, default 1). The engine's waiting queue chooses the
next request to admit in three steps (:func:`pick_fair`):

1. **The priority class.** Only requests of the highest class that has any waiting are candidates;
   but once a request has waited longer than the wait bound (``max_overtake_s``), the class of the
   oldest such request is served instead, so a busy higher class cannot starve a lower one.
2. **The tenant** (``fairness: vtc``, the default). Among the tenants of that class, the one with the
   smallest virtual token counter goes next: the Virtual Token Counter of Sheng et al., "Fairness in
   Serving Large Language Models" (OSDI 2024). A tenant's counter is the weighted service it has
   received divided by its share: ``fair_prompt_weight`` (1) per prompt token, charged when the
   queue hands the request to vLLM for admission, and ``fair_output_weight`` (2) per output token,
   charged as the tokens are generated. Ties go to the tenant whose oldest waiting request arrived
   first. A tenant that becomes backlogged after being idle has its counter lifted to the smallest
   counter of the tenants already waiting in its class (or, when none waits, to the counter of the
   last tenant whose queue in that class emptied), so idleness banks no credit. With ``fairness:
   off`` every tenant of the class is a candidate.
3. **The family.** Among the candidates, the recipe's ordering family decides as it always does
   (score, ties to the earlier arrival, and the tenant's requests past the wait bound first, oldest
   first): ``ltr-promptlen`` still orders inside a tenant's turn.

Admission order cannot shorten the engine's steps; :mod:`.prefill_budget` caps the prompt tokens
per step of a tenant holding more than its fair part of the running batch (``fair_prefill_tokens``),
so that its prompts do not stretch every other tenant's decode.

Between tenants of one class the fair share, not the wait bound, decides: under overload every
request of a tenant that sends more than its share ends up past any bound, and serving those first
would hand the engine back to whoever sends the most. No tenant starves all the same: a tenant
with requests waiting is at most the counter bound below behind the others (below).

With one tenant at one priority class (every deployment without a keys file) only step 3
remains, and the order is exactly the family's order: :func:`pick_fair` then calls :func:`pick_next`
(the registry's, kept here) on the whole queue, as before.

Why these charging points: the prompt is charged at the admission decision, so that several
admissions in one engine step see each other's cost (charging after the step would hand the whole
step to one tenant); the whole prompt is charged, cache hits included, because the cached length is
only known after vLLM allocates, and a tenant's cost should not depend on who else warmed the
cache. Output tokens are charged as generated (the engine brings the counters up to date at most
once per step, and only when a choice between tenants is to be made), not at completion: a tenant
whose long answers are still running would otherwise look unserved and win every admission.

The bound this gives (derived in the tests): while two tenants of one class both have requests
waiting, their counters differ by at most ``R x U / share`` for the smaller share, where ``R`` is
the number of requests one tenant can have running at once (``max_num_seqs``) and ``U`` the largest
weighted cost of one request, ``fair_prompt_weight x prompt + fair_output_weight x output``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from carbonforge_runtime.core.ordering.base import WaitingRequest
from carbonforge_runtime.core.ordering.prefill_budget import DEFAULT_FAIR_PREFILL_TOKENS
from carbonforge_runtime.core.request_tags import PRIORITY_ARG, SHARE_ARG, TENANT_ARG, tenant_from_arg
from carbonforge_runtime.core.tenant_labels import DEFAULT_TENANT
from carbonforge_runtime.errors import UsageError

DEFAULT_PRIORITY = 0
DEFAULT_SHARE = 1.0
#: Priority classes beyond this magnitude, and shares outside (0, MAX_SHARE], are refused as bad values.
MAX_PRIORITY = 1_000_000
MAX_SHARE = 1e6
FAIRNESS_MODES = ("vtc", "off")
#: The ``scheduler.params`` the composition reads (every family accepts them).
TENANCY_PARAMS = ("fairness", "fair_prompt_weight", "fair_output_weight", "fair_prefill_tokens")
#: The wait bound of families that do not reorder (``fcfs``, ``trace``): they carry no guard of their
#: own, and classes and tenants reorder their queue once requests of several arrive.
DEFAULT_MAX_OVERTAKE_S = 60.0


# -- reading a request's tenancy --------------------------------------------------------------------


def tenant_of(value: Any) -> str:
    """The tenant name carried in :data:`TENANT_ARG` (as the trace record reads it); :data:`DEFAULT_TENANT`
    (``default``, the requests without a named key) for anything else."""
    return tenant_from_arg(value) or DEFAULT_TENANT


def priority_of(value: Any) -> int:
    """The priority class carried in :data:`PRIORITY_ARG` (a whole number); 0 for anything else."""
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        value = int(value)
    if isinstance(value, int) and not isinstance(value, bool) and -MAX_PRIORITY <= value <= MAX_PRIORITY:
        return value
    return DEFAULT_PRIORITY


def share_of(value: Any) -> float:
    """The share carried in :data:`SHARE_ARG` (a positive finite number); 1.0 for anything else."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        share = float(value)
        if math.isfinite(share) and 0.0 < share <= MAX_SHARE:
            return share
    return DEFAULT_SHARE


def tenancy_of(extra_args: Mapping[str, Any] | None) -> tuple[str, int, float]:
    """(tenant, priority class, share) of a request's ``SamplingParams.extra_args``. Each value is
    checked on its own; one that is not what the middleware writes becomes its default. Never raises."""
    if not extra_args:
        return DEFAULT_TENANT, DEFAULT_PRIORITY, DEFAULT_SHARE
    try:
        get = extra_args.get
        return tenant_of(get(TENANT_ARG)), priority_of(get(PRIORITY_ARG)), share_of(get(SHARE_ARG))
    except Exception:  # a mapping that misbehaves must not stop the engine loop
        return DEFAULT_TENANT, DEFAULT_PRIORITY, DEFAULT_SHARE


# -- configuration ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Fairness:
    """How tenants share a priority class (from the recipe's ``scheduler.params``)."""

    mode: str = "vtc"
    prompt_weight: float = 1.0
    output_weight: float = 2.0
    #: Prompt tokens per engine step for a tenant over its fair share while others have work
    #: (:mod:`.prefill_budget`); 0: no cap.
    prefill_tokens: int = DEFAULT_FAIR_PREFILL_TOKENS

    @property
    def on(self) -> bool:
        return self.mode == "vtc"


def _weight(family: str, params: Mapping[str, Any], name: str, default: float) -> float:
    value = params.get(name, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _param_error(family, name, f"must be a number, got {str(value)[:40]}")
    try:
        ok = math.isfinite(value) and value >= 0
    except OverflowError:
        ok = False
    if not ok:
        raise _param_error(family, name, f"must be a finite number of at least 0, got {str(value)[:40]}")
    return float(value)


def _param_error(family: str, name: str, problem: str) -> UsageError:
    return UsageError(f"scheduler family {family!r}: parameter {name} {problem}",
                      f"fix scheduler.params.{name} in the recipe (see docs/ordering.md, tenants and priority classes)")


def read_fairness(family: str, params: Mapping[str, Any]) -> Fairness:
    """The :data:`TENANCY_PARAMS` of ``params`` (the others are the family's); a bad value is a usage error."""
    mode = params.get("fairness", "vtc")
    if mode not in FAIRNESS_MODES:
        raise _param_error(family, "fairness", f"must be one of {', '.join(FAIRNESS_MODES)}, got {str(mode)[:40]!r}")
    cap = params.get("fair_prefill_tokens", DEFAULT_FAIR_PREFILL_TOKENS)
    if isinstance(cap, float) and cap.is_integer():
        cap = int(cap)
    if isinstance(cap, bool) or not isinstance(cap, int) or cap < 0:
        raise _param_error(family, "fair_prefill_tokens", f"must be a whole number of at least 0, got {str(cap)[:40]}")
    return Fairness(str(mode), _weight(family, params, "fair_prompt_weight", 1.0),
                    _weight(family, params, "fair_output_weight", 2.0), cap)


# -- the counters -----------------------------------------------------------------------------------


class Ledger:
    """The virtual token counters of the tenants, and how many requests of each (class, tenant) wait.

    The queue calls :meth:`arrive` when a request joins its waiting pool, :meth:`leave` when one
    leaves it (admitted or aborted), and the engine :meth:`charge` as tokens are served.
    """

    __slots__ = ("counters", "fairness", "last_left", "shares", "waiting")

    def __init__(self, fairness: Fairness | None = None) -> None:
        self.fairness = fairness or Fairness()
        #: tenant -> weighted service received, divided by the tenant's share
        self.counters: dict[str, float] = {}
        #: (priority class, tenant) -> requests of it in the waiting pool
        self.waiting: dict[tuple[int, str], int] = {}
        #: priority class -> the last tenant whose queue in that class emptied
        self.last_left: dict[int, str] = {}
        #: tenant -> its share, as its latest request carried it
        self.shares: dict[str, float] = {}

    @property
    def mixed(self) -> bool:
        """Whether requests of more than one (class, tenant) wait: only then do classes and tenants order."""
        return len(self.waiting) > 1

    def counter(self, tenant: str) -> float:
        return self.counters.get(tenant, 0.0)

    def arrive(self, req: WaitingRequest) -> None:
        key = (req.priority, req.tenant)
        count = self.waiting.get(key, 0)
        self.shares[req.tenant] = req.share
        if count == 0 and self.fairness.on:
            self._lift(req.priority, req.tenant)
        self.waiting[key] = count + 1

    def _lift(self, priority: int, tenant: str) -> None:
        """``tenant`` becomes backlogged in ``priority``: no counter below the least-served waiting one."""
        floor: float | None = None
        for (p, other), _ in self.waiting.items():
            if p == priority and other != tenant:
                value = self.counters.get(other, 0.0)
                if floor is None or value < floor:
                    floor = value
        if floor is None and priority in self.last_left:
            floor = self.counters.get(self.last_left[priority], 0.0)
        if floor is not None and floor > self.counters.get(tenant, 0.0):
            self.counters[tenant] = floor
        elif tenant not in self.counters:
            self.counters[tenant] = 0.0

    def leave(self, req: WaitingRequest) -> None:
        key = (req.priority, req.tenant)
        count = self.waiting.get(key, 0)
        if count <= 1:
            if count:
                del self.waiting[key]
                self.last_left[req.priority] = req.tenant
        else:
            self.waiting[key] = count - 1

    def cost(self, prompt_tokens: int = 0, output_tokens: int = 0) -> float:
        fairness = self.fairness
        return fairness.prompt_weight * prompt_tokens + fairness.output_weight * output_tokens

    def charge(self, tenant: str, share: float, prompt_tokens: int = 0, output_tokens: int = 0) -> None:
        """Count service to ``tenant``: weighted tokens divided by its share."""
        cost = self.cost(prompt_tokens, output_tokens)
        if cost:
            self.counters[tenant] = self.counters.get(tenant, 0.0) + cost / share


# -- the choice -------------------------------------------------------------------------------------


def pick_next(
    waiting: Sequence[WaitingRequest], scores: Sequence[float], now: float, max_overtake_s: float | None
) -> int:
    """Index of the request to admit next, by the family's scores alone.

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


def _scores(score: Callable[[WaitingRequest, float], float | None], waiting: Sequence[WaitingRequest],
            now: float) -> list[float]:
    scores = []
    for w in waiting:
        value = score(w, now)
        scores.append(float("-inf") if value is None else float(value))
    return scores


def _score_of(score: Callable[[WaitingRequest, float], float | None], req: WaitingRequest, now: float) -> float:
    value = score(req, now)
    return float("-inf") if value is None else float(value)


def pick_fair(waiting: Sequence[WaitingRequest], score: Callable[[WaitingRequest, float], float | None], now: float,
              max_overtake_s: float | None, ledger: Ledger | None, skip: Collection[str] = ()) -> tuple[int, float]:
    """Index of the request to admit next, and its family score (``-inf`` for a family that does not score).

    See the module's description. ``ledger`` None, or a ledger that sees one (class, tenant) only,
    gives exactly :func:`pick_next`'s choice over the whole queue. ``skip`` names tenants whose
    turn is passed over for this pick (their prompt budget of the step is spent,
    :mod:`.prefill_budget`) as long as another tenant of the class has a request waiting.
    """
    if not waiting:
        raise ValueError("pick_fair needs at least one waiting request")
    if ledger is None or not ledger.mixed:
        scores = _scores(score, waiting, now)
        index = pick_next(waiting, scores, now, max_overtake_s)
        return index, scores[index]
    # The class: the highest with a request waiting, unless a request is past the wait bound: then
    # the class of the oldest such request.
    top = waiting[0].priority
    overdue = -1
    for i, w in enumerate(waiting):
        if w.priority > top:
            top = w.priority
        if max_overtake_s is not None and now - w.arrival_time > max_overtake_s and (
                overdue < 0 or w.arrival_time < waiting[overdue].arrival_time):
            overdue = i
    if overdue >= 0:
        top = waiting[overdue].priority
    # The tenant: the least-served of the class (ties: the oldest head of line).
    chosen: str | None = None
    if ledger.fairness.on:
        heads: dict[str, float] = {}
        for w in waiting:
            if w.priority == top:
                head = heads.get(w.tenant)
                if head is None or w.arrival_time < head:
                    heads[w.tenant] = w.arrival_time
        if skip and len(heads) > 1:
            others = {t: head for t, head in heads.items() if t not in skip}
            if others:
                heads = others
                if len(heads) == 1:
                    chosen = next(iter(heads))
        if chosen is None and len(heads) > 1:
            counters = ledger.counters
            chosen = min(heads, key=lambda t: (counters.get(t, 0.0), heads[t]))
    if chosen is None:
        candidates = [i for i, w in enumerate(waiting) if w.priority == top]
    else:
        candidates = [i for i, w in enumerate(waiting) if w.priority == top and w.tenant == chosen]
    # The family, inside the turn, with its wait bound (past it: oldest first), as with one tenant.
    subset = [waiting[i] for i in candidates]
    scores = _scores(score, subset, now)
    best = pick_next(subset, scores, now, max_overtake_s)
    return candidates[best], scores[best]
