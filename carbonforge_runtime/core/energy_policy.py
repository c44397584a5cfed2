"""The controller's decisions: pure functions from (parameters, state, signals) to an action.

A recipe's ``controller`` block chooses a policy and its parameters::

    controller:
      policy: lock-sm-clock          # or cap-power, or none
      params:
        period_s: 2
        levels: [{below_load: 0.25, fraction: 0.6}, {below_load: 0.5, fraction: 0.75}]
        sm_clock_min_mhz: 900
        guard: {queue_wait_p90_s: 0.5, ttft_p90_s: 2.0, window_s: 30}

Load is the larger of the batch occupancy (running / ``capacity_seqs``) and the token occupancy
(tokens per step / ``token_budget``); any waiting request means full load. The load picks a level:
the first level whose ``below_load`` exceeds it, else full performance. A level's ``fraction``
places the setting inside the bounds (0 = lowest bound, 1 = highest). Rising load raises the level
at the next period; a lower level is taken only after ``down_periods`` periods in a row in which the
load, plus ``hysteresis``, still asks for it. The latency guard overrides all of this: when the p90
queue wait or TTFT over the guard window passes ``risk`` x its target, full performance at once,
held for ``hold_s``. No recent signal from the engine also means full performance.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from carbonforge_runtime.errors import RecipeError
from carbonforge_runtime.gpu.types import GpuLimits

POLICY_NONE = "none"
POLICY_SM_CLOCK = "lock-sm-clock"
POLICY_POWER = "cap-power"
POLICIES = (POLICY_NONE, POLICY_SM_CLOCK, POLICY_POWER)


@dataclass(frozen=True)
class Level:
    below_load: float  # used while the load is below this
    fraction: float  # position inside the bounds: 0 = lowest, 1 = highest


DEFAULT_LEVELS = (Level(0.25, 0.6), Level(0.5, 0.75), Level(0.75, 0.9))


@dataclass(frozen=True)
class Guard:
    queue_wait_p90_s: float | None = None
    ttft_p90_s: float | None = None
    window_s: float = 30.0
    #: At risk when the p90 passes this fraction of its target.
    risk: float = 0.8
    #: Full performance is held this long after the guard fired.
    hold_s: float = 60.0

    @property
    def active(self) -> bool:
        return self.queue_wait_p90_s is not None or self.ttft_p90_s is not None


@dataclass(frozen=True)
class ControllerParams:
    policy: str
    period_s: float = 2.0
    levels: tuple[Level, ...] = DEFAULT_LEVELS
    hysteresis: float = 0.05
    down_periods: int = 3
    sm_clock_min_mhz: int | None = None
    sm_clock_max_mhz: int | None = None
    power_limit_min_w: float | None = None
    power_limit_max_w: float | None = None
    capacity_seqs: int = 256
    token_budget: int | None = None
    #: Signals older than this mean the engine is not heard: full performance.
    stale_after_s: float = 5.0
    guard: Guard = field(default_factory=Guard)


@dataclass(frozen=True)
class Signals:
    now_s: float  # monotonic
    age_s: float | None  # since the engine's last counters; None when never heard
    waiting: int = 0
    running: int = 0
    tokens_per_step: float | None = None
    queue_wait_p90_s: float | None = None
    ttft_p90_s: float | None = None


@dataclass(frozen=True)
class ControllerState:
    level: int  # index into the levels; len(levels) is full performance
    calm_periods: int = 0
    guard_until_s: float = -math.inf


@dataclass(frozen=True)
class Decision:
    state: ControllerState
    fraction: float  # 1.0 is full performance
    changed: bool
    reason: str
    load: float | None
    guard_fired: bool = False


@dataclass(frozen=True)
class Target:
    """A setting for one GPU. ``None`` fields mean "as found" (clocks unlocked, the original limit)."""

    sm_clock_min_mhz: int | None = None
    sm_clock_max_mhz: int | None = None
    power_limit_w: float | None = None

    @property
    def full(self) -> bool:
        return self.sm_clock_max_mhz is None and self.power_limit_w is None


def initial_state(params: ControllerParams) -> ControllerState:
    """Start at full performance: savings are earned by calm periods, never assumed."""
    return ControllerState(level=len(params.levels))


def load_of(params: ControllerParams, signals: Signals) -> float:
    if signals.waiting > 0:
        return 1.0
    load = signals.running / max(params.capacity_seqs, 1)
    if params.token_budget and signals.tokens_per_step is not None:
        load = max(load, signals.tokens_per_step / params.token_budget)
    return min(max(load, 0.0), 1.0)


def level_for(params: ControllerParams, load: float) -> int:
    for i, level in enumerate(params.levels):
        if load < level.below_load:
            return i
    return len(params.levels)


def fraction_of(params: ControllerParams, level: int) -> float:
    return params.levels[level].fraction if level < len(params.levels) else 1.0


def guard_risk(guard: Guard, signals: Signals) -> str | None:
    """Why the latency targets are at risk, or ``None``."""
    checks = (("queue wait", guard.queue_wait_p90_s, signals.queue_wait_p90_s),
              ("TTFT", guard.ttft_p90_s, signals.ttft_p90_s))
    for name, target, observed in checks:
        if target is not None and observed is not None and observed > guard.risk * target:
            return (f"p90 {name} {observed:.3g} s over the last {guard.window_s:g} s is above "
                    f"{guard.risk:g} x its {target:g} s target")
    return None


def decide(params: ControllerParams, state: ControllerState, signals: Signals) -> Decision:
    """One control period."""
    full = len(params.levels)
    now = signals.now_s
    if signals.age_s is None or signals.age_s > params.stale_after_s:
        new = replace(state, level=full, calm_periods=0)
        return _decision(params, state, new, "no recent load signal from the engine: full performance", None)
    risk = guard_risk(params.guard, signals)
    if risk is not None:
        fired = now >= state.guard_until_s
        new = ControllerState(level=full, calm_periods=0, guard_until_s=now + params.guard.hold_s)
        return _decision(params, state, new, f"latency guard: {risk}: full performance", None, guard_fired=fired)
    load = load_of(params, signals)
    if now < state.guard_until_s:
        new = replace(state, level=full, calm_periods=0)
        return _decision(params, state, new, f"latency guard holds full performance for "
                         f"{state.guard_until_s - now:.0f} s more (load {load:.2f})", load)
    wanted = level_for(params, load)
    if wanted > state.level:
        new = replace(state, level=wanted, calm_periods=0)
        return _decision(params, state, new, f"load {load:.2f} rose: {_level_name(params, wanted)}", load)
    with_band = level_for(params, min(load + params.hysteresis, 1.0))
    if wanted == state.level or with_band >= state.level:
        new = replace(state, calm_periods=0)
        why = "steady" if wanted == state.level else f"within the {params.hysteresis:g} hysteresis band"
        return _decision(params, state, new, f"load {load:.2f} {why}: {_level_name(params, state.level)}", load)
    calm = state.calm_periods + 1
    if calm < params.down_periods:
        new = replace(state, calm_periods=calm)
        return _decision(params, state, new, f"load {load:.2f} is low ({calm} of {params.down_periods} calm periods "
                         f"before saving): {_level_name(params, state.level)}", load)
    new = replace(state, level=with_band, calm_periods=0)
    periods = f"{params.down_periods} period" + ("s" if params.down_periods != 1 else "")
    return _decision(params, state, new, f"load {load:.2f} stayed low for {periods}: "
                     f"{_level_name(params, with_band)}", load)


def _level_name(params: ControllerParams, level: int) -> str:
    if level >= len(params.levels):
        return "full performance"
    return f"level {level + 1} of {len(params.levels)} ({fraction_of(params, level):g} of the range)"


def _decision(params: ControllerParams, old: ControllerState, new: ControllerState, reason: str,
              load: float | None, guard_fired: bool = False) -> Decision:
    return Decision(new, fraction_of(params, new.level), new.level != old.level, reason, load, guard_fired)


def target_for(params: ControllerParams, fraction: float, limits: GpuLimits) -> Target:
    """The setting for one GPU at ``fraction`` of the allowed range; always inside the bounds."""
    fraction = min(max(fraction, 0.0), 1.0)
    if params.policy == POLICY_SM_CLOCK:
        supported = sorted(limits.sm_clocks_mhz) or [limits.sm_clock_max_mhz]
        lo = max(params.sm_clock_min_mhz or supported[0], supported[0])
        hi = min(params.sm_clock_max_mhz or limits.sm_clock_max_mhz, limits.sm_clock_max_mhz)
        lo = min(lo, hi)
        if fraction >= 1.0 and hi >= limits.sm_clock_max_mhz:
            return Target()
        inside = [c for c in supported if lo <= c <= hi] or [hi]
        want = lo + fraction * (hi - lo)
        below = [c for c in inside if c <= want]
        level = below[-1] if below else inside[0]
        return Target(sm_clock_min_mhz=min(inside[0], level), sm_clock_max_mhz=level)
    if params.policy == POLICY_POWER:
        original = limits.power_limit_w
        low_w = max(params.power_limit_min_w or limits.power_limit_min_w, limits.power_limit_min_w)
        high_w = min(params.power_limit_max_w or original, original, limits.power_limit_max_w)
        low_w = min(low_w, high_w)
        if fraction >= 1.0 and high_w >= original:
            return Target()
        watts = float(round(low_w + fraction * (high_w - low_w)))  # whole watts, kept inside the bounds
        return Target(power_limit_w=min(max(watts, low_w), high_w))
    return Target()


# ---- parameters from the recipe -------------------------------------------------------------------

_KNOWN = {"period_s", "levels", "hysteresis", "down_periods", "sm_clock_min_mhz", "sm_clock_max_mhz",
          "power_limit_min_w", "power_limit_max_w", "capacity_seqs", "token_budget", "stale_after_s", "guard"}
_GUARD_KNOWN = {"queue_wait_p90_s", "ttft_p90_s", "window_s", "risk", "hold_s"}


def parse_params(policy: str, params: Mapping[str, Any], where: str, capacity_seqs: int | None = None,
                 token_budget: int | None = None) -> ControllerParams:
    """Validate a recipe's controller block; errors name ``where`` (the recipe file) and the field."""

    def fail(name: str, problem: str) -> RecipeError:
        return RecipeError(f"{where}: field 'controller.{name}' {problem}",
                           "fix the recipe's controller block "
                           "(the README's energy controller section lists the parameters)")

    if policy not in POLICIES:
        raise fail("policy", f"must be one of {', '.join(POLICIES)}, got {policy!r}")
    unknown = sorted(set(params) - _KNOWN)
    if unknown:
        raise fail(f"params.{unknown[0]}", f"is not a known parameter (known: {', '.join(sorted(_KNOWN))})")

    def number(source: Mapping[str, Any], name: str, prefix: str, default: Any, low: float | None = None,
               high: float | None = None, integer: bool = False) -> Any:
        if name not in source or source[name] is None:
            return default
        value = source[name]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and not isinstance(value, int)):
            raise fail(f"{prefix}{name}", f"must be {'a whole number' if integer else 'a number'}, got {value!r}")
        if (low is not None and value < low) or (high is not None and value > high):
            raise fail(f"{prefix}{name}", f"must be between {low} and {high}, got {value}")
        return int(value) if integer else float(value)

    p = "params."
    levels: tuple[Level, ...] = DEFAULT_LEVELS
    if "levels" in params:
        raw = params["levels"]
        if not isinstance(raw, list) or not raw:
            raise fail("params.levels", "must be a non-empty list of {below_load, fraction}")
        parsed = []
        for i, entry in enumerate(raw):
            if not isinstance(entry, Mapping) or set(entry) != {"below_load", "fraction"}:
                raise fail(f"params.levels[{i}]", "must be a mapping with exactly below_load and fraction")
            parsed.append(Level(number(entry, "below_load", f"params.levels[{i}].", None, 0.0, 1.0),
                                number(entry, "fraction", f"params.levels[{i}].", None, 0.0, 1.0)))
        for before, after in itertools.pairwise(parsed):
            if after.below_load <= before.below_load or after.fraction < before.fraction:
                raise fail("params.levels", "must rise: each below_load above the last, fractions not falling")
        levels = tuple(parsed)
    guard_raw = params.get("guard") or {}
    if not isinstance(guard_raw, Mapping):
        raise fail("params.guard", "must be a mapping")
    guard_unknown = sorted(set(guard_raw) - _GUARD_KNOWN)
    if guard_unknown:
        raise fail(f"params.guard.{guard_unknown[0]}",
                   f"is not a known guard parameter (known: {', '.join(sorted(_GUARD_KNOWN))})")
    g = "params.guard."
    guard = Guard(
        queue_wait_p90_s=number(guard_raw, "queue_wait_p90_s", g, None, 0.001, 3600),
        ttft_p90_s=number(guard_raw, "ttft_p90_s", g, None, 0.001, 3600),
        window_s=number(guard_raw, "window_s", g, 30.0, 1, 300),
        risk=number(guard_raw, "risk", g, 0.8, 0.1, 1.0),
        hold_s=number(guard_raw, "hold_s", g, 60.0, 0, 86400),
    )
    result = ControllerParams(
        policy=policy,
        period_s=number(params, "period_s", p, 2.0, 0.5, 600),
        levels=levels,
        hysteresis=number(params, "hysteresis", p, 0.05, 0.0, 0.5),
        down_periods=number(params, "down_periods", p, 3, 1, 1000, integer=True),
        sm_clock_min_mhz=number(params, "sm_clock_min_mhz", p, None, 1, 10_000, integer=True),
        sm_clock_max_mhz=number(params, "sm_clock_max_mhz", p, None, 1, 10_000, integer=True),
        power_limit_min_w=number(params, "power_limit_min_w", p, None, 1, 5_000),
        power_limit_max_w=number(params, "power_limit_max_w", p, None, 1, 5_000),
        capacity_seqs=number(params, "capacity_seqs", p, capacity_seqs or 256, 1, 1_000_000, integer=True),
        token_budget=number(params, "token_budget", p, token_budget, 1, 10_000_000, integer=True),
        stale_after_s=number(params, "stale_after_s", p, 5.0, 1, 3600),
        guard=guard,
    )
    for low, high, name in ((result.sm_clock_min_mhz, result.sm_clock_max_mhz, "sm_clock"),
                            (result.power_limit_min_w, result.power_limit_max_w, "power_limit")):
        if low is not None and high is not None and low > high:
            raise fail(f"params.{name}_min", f"is above {name}_max")
    return result
