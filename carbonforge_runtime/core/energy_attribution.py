"""Which request used which joules: a pure accounting of engine steps against an energy counter.

Inputs, in time order:

* samples of the GPUs' cumulative energy counter, ``(t, joules)``;
* engine steps, ``(t_start, t_end, {request_id: tokens scheduled}, busy_after)``, where ``busy_after``
  says whether the engine still had unfinished requests when the step ended.

Method. Between two samples the counter is interpolated linearly. Each step is charged the energy
of its time span, and that energy is split between the requests of the step in proportion to the
tokens each had scheduled in it (a prefill chunk of 512 tokens carries 512 times the weight of one
decode token). A step's span starts where the previous step ended, so back-to-back steps (and the
overlapping steps of asynchronous scheduling) tile time with no gap and no double count, and a stall
of the engine loop while requests are in flight is charged to them. When the previous step left the
engine with nothing to do, the span starts at the step's own start and the idle energy in between is
left unattributed (when that is not known, a gap longer than ``idle_gap_s`` counts as idle). A
request's energy is the sum of its shares.

Conservation: attributed + unattributed equals the counter's (interpolated) increase from the first
step's start to the last processed step's end, exactly.
"""

from __future__ import annotations

import bisect
from collections import OrderedDict, deque
from collections.abc import Mapping
from dataclasses import dataclass, field

#: Steps further apart than this (end of one to start of the next) are separated by idle time.
IDLE_GAP_S = 0.25
#: How many taken request ids are remembered, to recognise a share arriving after the take.
TAKEN_MEMORY = 4096


@dataclass
class Step:
    t_start: float | None
    t_end: float
    shares: Mapping[str, int]
    busy_after: bool | None = None  # unfinished requests left when it ended (None: not known)


@dataclass
class EnergyTotals:
    attributed_j: float = 0.0
    idle_j: float = 0.0  # between steps while the engine had nothing to run
    empty_step_j: float = 0.0  # steps that scheduled no token
    late_j: float = 0.0  # shares of requests already taken (aborted while a step was in flight)
    steps: int = 0
    first_t: float | None = None
    last_t: float | None = None

    @property
    def unattributed_j(self) -> float:
        return self.idle_j + self.empty_step_j + self.late_j


@dataclass
class EnergyAttributor:
    """Not thread-safe: the caller serialises access."""

    idle_gap_s: float = IDLE_GAP_S
    totals: EnergyTotals = field(default_factory=EnergyTotals)
    _times: list[float] = field(default_factory=list)
    _values: list[float] = field(default_factory=list)
    _pending: deque[Step] = field(default_factory=deque)
    _prev_end: float | None = None
    _prev_busy: bool | None = None
    _per_request: dict[str, float] = field(default_factory=dict)
    _taken: OrderedDict[str, None] = field(default_factory=OrderedDict)

    # -- inputs --

    def add_sample(self, t: float, energy_j: float) -> None:
        """A counter reading. Out-of-order or decreasing readings are ignored (a counter never goes back)."""
        if self._times and (t <= self._times[-1] or energy_j < self._values[-1]):
            return
        self._times.append(t)
        self._values.append(energy_j)

    def add_step(self, t_start: float | None, t_end: float, shares: Mapping[str, int],
                 busy_after: bool | None = None) -> None:
        self._pending.append(Step(t_start, t_end, shares, busy_after))

    # -- processing --

    @property
    def covered_until(self) -> float | None:
        """The time of the latest sample: steps ending by then can be charged."""
        return self._times[-1] if self._times else None

    def energy_at(self, t: float) -> float:
        """The counter at ``t``, interpolated (clamped to the first/last sample outside them)."""
        times, values = self._times, self._values
        if not times:
            raise ValueError("no energy sample yet")
        if t <= times[0]:
            return values[0]
        if t >= times[-1]:
            return values[-1]
        i = bisect.bisect_right(times, t)
        t0, t1 = times[i - 1], times[i]
        v0, v1 = values[i - 1], values[i]
        return v0 + (v1 - v0) * (t - t0) / (t1 - t0)

    def advance(self) -> int:
        """Charge every pending step that ends by the latest sample; returns how many were charged."""
        covered = self.covered_until
        if covered is None:
            return 0
        done = 0
        while self._pending and self._pending[0].t_end <= covered:
            self._charge(self._pending.popleft())
            done += 1
        self._trim()
        return done

    def _charge(self, step: Step) -> None:
        totals = self.totals
        prev = self._prev_end
        start = step.t_start if step.t_start is not None else (prev if prev is not None else step.t_end)
        if prev is not None:
            idle = (not self._prev_busy) if self._prev_busy is not None else start - prev > self.idle_gap_s
            if idle and start > prev:
                totals.idle_j += self.energy_at(start) - self.energy_at(prev)
            else:
                start = prev  # back to back, overlapping, or a stall with work in flight: tile from the last end
        end = max(step.t_end, start)
        energy = self.energy_at(end) - self.energy_at(start)
        self._prev_end = end
        self._prev_busy = step.busy_after
        if totals.first_t is None:
            totals.first_t = start
        totals.last_t = end
        totals.steps += 1
        total_tokens = sum(step.shares.values())
        if total_tokens <= 0:
            totals.empty_step_j += energy
            return
        per_request = self._per_request
        for request_id, tokens in step.shares.items():
            if tokens <= 0:
                continue
            part = energy * tokens / total_tokens
            if request_id in self._taken:
                totals.late_j += part
            else:
                per_request[request_id] = per_request.get(request_id, 0.0) + part
                totals.attributed_j += part

    def _trim(self) -> None:
        """Drop samples no pending or future step can need (keep the one at or before the last end)."""
        keep_from = self._prev_end
        if keep_from is None or len(self._times) < 64:
            return
        i = bisect.bisect_right(self._times, keep_from) - 1
        if i > 0:
            del self._times[:i]
            del self._values[:i]

    # -- output --

    def take(self, request_id: str) -> float:
        """The joules charged to ``request_id`` so far, forgetting it (0.0 if it never ran)."""
        joules = self._per_request.pop(request_id, 0.0)
        self._taken[request_id] = None
        if len(self._taken) > TAKEN_MEMORY:
            self._taken.popitem(last=False)
        return joules

    def peek(self, request_id: str) -> float:
        return self._per_request.get(request_id, 0.0)

    @property
    def open_requests(self) -> int:
        return len(self._per_request)
