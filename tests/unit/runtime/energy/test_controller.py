"""The energy controller: the pure decision function, the bounds, and the actuator against the fake NVML."""

from __future__ import annotations

import itertools
import logging
import math
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from carbonforge_runtime.core.energy_policy import (
    DEFAULT_LEVELS,
    POLICY_POWER,
    POLICY_SM_CLOCK,
    ControllerParams,
    ControllerState,
    Guard,
    Level,
    Signals,
    Target,
    decide,
    initial_state,
    level_for,
    parse_params,
    target_for,
)
from carbonforge_runtime.errors import RecipeError
from carbonforge_runtime.gpu.fake import FakeGpuSession
from carbonforge_runtime.gpu.types import GpuLimits
from carbonforge_runtime.recipes import load_recipes, recipe_dirs
from carbonforge_runtime.runtime.energy.actuator import GpuActuator
from carbonforge_runtime.runtime.energy.controller import Controller
from carbonforge_runtime.runtime.energy.privileges import parse_cap_sys_admin
from tests.support import wait_until

CAPACITY = 100
PARAMS = ControllerParams(policy=POLICY_SM_CLOCK, capacity_seqs=CAPACITY, down_periods=3, hysteresis=0.05,
                          guard=Guard(queue_wait_p90_s=0.5, ttft_p90_s=2.0, hold_s=30.0))
FULL = len(PARAMS.levels)


def signals(t: float, running: int = 0, waiting: int = 0, queue_wait_p90_s: float | None = None,
            ttft_p90_s: float | None = None, age_s: float | None = 0.2) -> Signals:
    return Signals(now_s=t, age_s=age_s, waiting=waiting, running=running,
                   queue_wait_p90_s=queue_wait_p90_s, ttft_p90_s=ttft_p90_s)


def settle(params: ControllerParams, running: int, periods: int = 20) -> ControllerState:
    state = initial_state(params)
    for i in range(periods):
        state = decide(params, state, signals(float(i), running=running)).state
    return state


# ---- the pure decision ------------------------------------------------------------------------------------


def test_starts_at_full_performance_and_saves_only_after_calm_periods() -> None:
    state = initial_state(PARAMS)
    assert state.level == FULL
    fractions = []
    for i in range(5):
        decision = decide(PARAMS, state, signals(float(i), running=5))
        state = decision.state
        fractions.append(decision.fraction)
    # load 0.05: two calm periods hold full performance, the third takes the lowest level
    assert fractions == [1.0, 1.0, 0.6, 0.6, 0.6]


@given(level=st.integers(0, len(DEFAULT_LEVELS)), calm=st.integers(0, 5),
       running=st.integers(75, 400), waiting=st.integers(0, 50))
def test_rising_load_restores_full_performance_within_one_period(level: int, calm: int, running: int,
                                                                  waiting: int) -> None:
    state = ControllerState(level=level, calm_periods=calm)
    decision = decide(PARAMS, state, signals(100.0, running=running, waiting=waiting))
    assert decision.fraction == 1.0 and decision.state.level == FULL
    assert target_for(PARAMS, decision.fraction, limits()) == Target()  # unlocked: the GPU's maximum


def test_any_waiting_request_is_full_load() -> None:
    state = settle(PARAMS, running=1)
    assert state.level == 0
    decision = decide(PARAMS, state, signals(50.0, running=1, waiting=1))
    assert decision.changed and decision.fraction == 1.0 and decision.load == 1.0


@given(level=st.integers(0, len(DEFAULT_LEVELS)), running=st.integers(0, 100),
       queue_wait=st.floats(0.41, 100.0), ttft=st.one_of(st.none(), st.floats(0.0, 100.0)))
def test_latency_guard_overrides_any_saving_and_holds(level: int, running: int, queue_wait: float,
                                                       ttft: float | None) -> None:
    state = ControllerState(level=level)
    decision = decide(PARAMS, state, signals(10.0, running=running, queue_wait_p90_s=queue_wait, ttft_p90_s=ttft))
    assert decision.fraction == 1.0 and "latency guard" in decision.reason
    # the risk is gone and the load is low, but the hold keeps full performance ...
    held = decision.state
    for t in (11.0, 20.0, 39.0):
        later = decide(PARAMS, held, signals(t, running=0))
        assert later.fraction == 1.0 and "holds" in later.reason
        held = later.state
    # ... until it expires; then savings come back only after the calm periods
    after = [decide(PARAMS, held, signals(41.0 + i, running=0)) for i in range(1)]
    assert after[0].fraction == 1.0


def test_guard_counts_a_trip_once_per_episode_and_ttft_alone_can_fire_it() -> None:
    state = settle(PARAMS, running=1)
    first = decide(PARAMS, state, signals(100.0, running=1, ttft_p90_s=1.7))  # > 0.8 x 2.0 s
    assert first.guard_fired and first.fraction == 1.0
    second = decide(PARAMS, first.state, signals(102.0, running=1, ttft_p90_s=1.7))
    assert not second.guard_fired and second.fraction == 1.0
    calm = decide(PARAMS, settle(PARAMS, running=1), signals(100.0, running=1, ttft_p90_s=1.5))
    assert not calm.guard_fired and calm.fraction < 1.0  # 1.5 s is below 0.8 x 2.0 s


def test_no_signal_from_the_engine_means_full_performance() -> None:
    state = settle(PARAMS, running=1)
    assert decide(PARAMS, state, signals(100.0, age_s=None)).fraction == 1.0
    assert decide(PARAMS, state, signals(100.0, age_s=PARAMS.stale_after_s + 1)).fraction == 1.0


@settings(max_examples=200)
@given(load=st.floats(0.0, 1.0), noise=st.lists(st.floats(-0.024, 0.024), min_size=30, max_size=120))
def test_steady_load_never_oscillates(load: float, noise: list[float]) -> None:
    """Noise below half the hysteresis band: the level only ever moves down, a bounded number of times."""
    state = initial_state(PARAMS)
    levels = [state.level]
    for i, n in enumerate(noise):
        running = round(min(max(load + n, 0.0), 1.0) * CAPACITY)
        state = decide(PARAMS, state, signals(float(i), running=running)).state
        levels.append(state.level)
    changes = [b - a for a, b in itertools.pairwise(levels) if b != a]
    assert all(change < 0 for change in changes), levels
    assert len(changes) <= len(PARAMS.levels)


def test_exactly_steady_load_changes_at_most_once() -> None:
    for running in range(0, CAPACITY + 1, 5):
        state = initial_state(PARAMS)
        changes = 0
        for i in range(50):
            decision = decide(PARAMS, state, signals(float(i), running=running))
            changes += decision.changed
            state = decision.state
        assert changes <= 1, running


def test_load_hovering_at_a_threshold_does_not_flip_flop() -> None:
    state = settle(PARAMS, running=10)  # 0.10 (+ the band) < 0.25: lowest level
    assert state.level == 0
    changes = 0
    for i in range(60):  # 0.24 / 0.26 / 0.24 ...: crosses 0.25 both ways
        running = 24 if i % 2 else 26
        decision = decide(PARAMS, state, signals(100.0 + i, running=running))
        changes += decision.changed
        state = decision.state
    assert changes == 1  # one step up to level 2, never back down while within the band


def test_token_occupancy_counts_as_load() -> None:
    params = replace(PARAMS, token_budget=2048)
    state = settle(params, running=1)
    assert state.level == 0
    heavy = Signals(now_s=100.0, age_s=0.1, running=1, tokens_per_step=1900.0)
    assert decide(params, state, heavy).fraction == 1.0


# ---- bounds ------------------------------------------------------------------------------------------------


def limits(sm_max: int = 1980, power_w: float = 700.0, locked: bool = False) -> GpuLimits:
    clocks = tuple(range(210, sm_max + 1, 15))
    return GpuLimits(index=0, uuid="GPU-x", power_limit_w=power_w, power_limit_default_w=700.0,
                     power_limit_min_w=200.0, power_limit_max_w=700.0, sm_clock_max_mhz=sm_max,
                     sm_clocks_mhz=clocks, clocks_locked=locked)


@settings(max_examples=300)
@given(fraction=st.floats(0.0, 1.0), low=st.one_of(st.none(), st.integers(100, 2500)),
       high=st.one_of(st.none(), st.integers(100, 2500)))
def test_sm_clock_targets_stay_inside_the_bounds_and_are_supported(fraction: float, low: int | None,
                                                                    high: int | None) -> None:
    if low is not None and high is not None and low > high:
        low, high = high, low
    params = replace(PARAMS, sm_clock_min_mhz=low, sm_clock_max_mhz=high)
    lim = limits()
    target = target_for(params, fraction, lim)
    assert target.power_limit_w is None
    if target.sm_clock_max_mhz is None:
        assert fraction == 1.0 and (high is None or high >= lim.sm_clock_max_mhz)
        return
    hi = min(high or lim.sm_clock_max_mhz, lim.sm_clock_max_mhz)
    lo = min(max(low or 210, 210), hi)
    assert target.sm_clock_max_mhz <= hi
    assert target.sm_clock_min_mhz is not None and target.sm_clock_min_mhz <= target.sm_clock_max_mhz
    if any(lo <= c <= hi for c in lim.sm_clocks_mhz):
        assert lo <= target.sm_clock_min_mhz and target.sm_clock_max_mhz in lim.sm_clocks_mhz


@settings(max_examples=300)
@given(fraction=st.floats(0.0, 1.0), low=st.one_of(st.none(), st.floats(150, 800)),
       high=st.one_of(st.none(), st.floats(150, 800)), original=st.floats(250, 700))
def test_power_targets_stay_inside_the_bounds_and_never_raise_the_original(
        fraction: float, low: float | None, high: float | None, original: float) -> None:
    if low is not None and high is not None and low > high:
        low, high = high, low
    params = replace(PARAMS, policy=POLICY_POWER, power_limit_min_w=low, power_limit_max_w=high)
    target = target_for(params, fraction, limits(power_w=original))
    assert target.sm_clock_max_mhz is None
    if target.power_limit_w is None:
        assert fraction == 1.0
        return
    hi = min(high or original, original, 700.0)
    lo = min(max(low or 200.0, 200.0), hi)
    assert lo - 1e-9 <= target.power_limit_w <= hi + 1e-9
    assert target.power_limit_w <= original


def test_levels_map_to_rising_settings() -> None:
    targets = [target_for(PARAMS, level.fraction, limits()).sm_clock_max_mhz for level in PARAMS.levels]
    assert targets == sorted(targets) and len(set(targets)) == len(targets)
    assert level_for(PARAMS, 0.0) == 0 and level_for(PARAMS, 0.99) == FULL


# ---- recipe parameters -------------------------------------------------------------------------------------


def test_recipe_parameters_parse_and_default_from_the_recipe() -> None:
    params = parse_params("cap-power", {"period_s": 1, "levels": [{"below_load": 0.5, "fraction": 0.7}],
                                        "guard": {"queue_wait_p90_s": 0.25}}, "r.yaml",
                          capacity_seqs=64, token_budget=8192)
    assert params.levels == (Level(0.5, 0.7),) and params.period_s == 1.0
    assert params.capacity_seqs == 64 and params.token_budget == 8192
    assert params.guard.queue_wait_p90_s == 0.25 and params.guard.ttft_p90_s is None


@pytest.mark.parametrize(("policy", "params", "fragment"), [
    ("lock-clocks", {}, "controller.policy"),
    ("lock-sm-clock", {"period": 2}, "controller.params.period"),
    ("lock-sm-clock", {"period_s": 0.1}, "between"),
    ("lock-sm-clock", {"levels": [{"below_load": 0.5, "fraction": 0.9}, {"below_load": 0.4, "fraction": 1.0}]},
     "must rise"),
    ("lock-sm-clock", {"guard": {"p99": 1}}, "controller.params.guard.p99"),
    ("lock-sm-clock", {"sm_clock_min_mhz": 1500, "sm_clock_max_mhz": 1000}, "above"),
    ("cap-power", {"power_limit_max_w": "high"}, "a number"),
])
def test_bad_controller_blocks_name_the_file_and_field(policy: str, params: dict[str, object],
                                                       fragment: str) -> None:
    with pytest.raises(RecipeError) as caught:
        parse_params(policy, params, "recipes/x.yaml")
    assert "recipes/x.yaml" in caught.value.message and fragment in caught.value.message
    assert "energy controller section" in caught.value.remedy


def test_every_shipped_recipe_has_a_valid_controller_block() -> None:
    recipes = load_recipes(recipe_dirs(None))
    assert recipes
    for recipe in recipes.values():
        parsed = parse_params(recipe.controller.policy, recipe.controller.params, str(recipe.source))
        if recipe.key.hardware.is_cpu:
            assert parsed.policy == "none", recipe.source


# ---- the actuator and the loop against the fake NVML ---------------------------------------------------------


def low_load(now: float) -> Signals:
    return Signals(now_s=now, age_s=0.1, running=1)


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        self.t += PARAMS.period_s
        return self.t


def controller(fake: FakeGpuSession, dry_run: bool = False, privileged: bool = True,
               params: ControllerParams = PARAMS) -> Controller:
    gpus = fake.open()
    ctl = Controller(params, fake, gpus, low_load, logging.getLogger("test.controller"), dry_run=dry_run,
                     privileged=lambda: privileged, clock=Clock())
    assert ctl.start()
    return ctl


def test_dry_run_makes_no_set_call_and_logs_every_period(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="test.controller")
    fake = FakeGpuSession("h100", count=2)
    ctl = controller(fake, dry_run=True)
    for _ in range(6):
        ctl.tick()
    ctl.stop()
    assert fake.calls == []
    lines = [r.getMessage() for r in caplog.records if "(dry run)" in r.getMessage()]
    assert len(lines) == 6  # one per period, saying what it would do and why
    assert all("why: load 0.01" in line for line in lines)
    assert sum("would lock the SM clock of GPU 0 to 210-1260 MHz" in line for line in lines) == 1
    assert "would keep" in lines[0] and "would keep" in lines[-1]
    status = ctl.status()
    assert status.observe_only and status.actions == {"lock_sm_clock": 2} and status.targets[0][0] == 1260


def test_normal_mode_sets_once_and_restores_on_stop(caplog: pytest.LogCaptureFixture) -> None:
    fake = FakeGpuSession("h100", count=2, power_limit_w=650.0)
    ctl = controller(fake, params=replace(PARAMS, policy=POLICY_POWER))
    for _ in range(8):
        ctl.tick()
    sets = [c for c in fake.calls if c["call"] == "set_power_limit_w"]
    assert len(sets) == 2  # one per GPU, not one per period: written only when it changes
    assert fake.state(0)[1] == fake.state(1)[1] == sets[0]["watts"] < 650.0
    ctl.stop()
    assert fake.state(0) == fake.state(1) == (None, 650.0)  # the limit found, not the default
    ctl.stop()  # a second stop does nothing
    assert len(fake.calls) == 4


def test_permission_denied_gives_one_warning_and_observe_only(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="test.controller")
    fake = FakeGpuSession("h100", deny_set=True)
    ctl = controller(fake)
    for _ in range(10):
        ctl.tick()
    ctl.stop()
    assert len(fake.calls) == 1 and fake.calls[0]["denied"]
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "--cap-add SYS_ADMIN" in warnings[0].getMessage()
    assert ctl.status().observe_only and fake.state() == (None, 700.0)


def test_no_privilege_is_observe_only_without_trying() -> None:
    fake = FakeGpuSession("h100")
    ctl = controller(fake, privileged=False)
    for _ in range(5):
        ctl.tick()
    ctl.stop()
    assert fake.calls == [] and ctl.status().observe_reason == "no permission to change GPU settings"


def test_clocks_locked_before_the_run_are_left_alone(caplog: pytest.LogCaptureFixture) -> None:
    fake = FakeGpuSession("h100", clocks_locked=True)
    ctl = controller(fake)
    for _ in range(5):
        ctl.tick()
    ctl.stop()
    assert fake.calls == []
    assert any("nvidia-smi -rgc" in r.getMessage() for r in caplog.records)


def test_actuator_writes_only_changes_and_restores_everything_it_changed() -> None:
    fake = FakeGpuSession("l4")
    fake.open()
    lim = fake.limits(0)
    act = GpuActuator(fake, [lim], logging.getLogger("test.controller"), dry_run=False, privileged=lambda: True)
    both = Target(sm_clock_min_mhz=210, sm_clock_max_mhz=1500, power_limit_w=60.0)
    assert [a.kind for a in act.apply({0: both})] == ["lock_sm_clock", "set_power_limit"]
    assert act.apply({0: both}) == []
    assert [a.kind for a in act.apply({0: Target(power_limit_w=60.0)})] == ["unlock_sm_clock"]
    act.apply({0: both})
    assert [a.kind for a in act.restore()] == ["unlock_sm_clock", "restore_power_limit"]
    assert fake.state() == (None, 72.0) and act.restore() == []


def test_cap_sys_admin_is_read_from_the_effective_set() -> None:
    assert parse_cap_sys_admin("Name:\tx\nCapEff:\t000001ffffffffff\n") is True
    assert parse_cap_sys_admin("CapEff:\t0000000000200000\n") is True
    assert parse_cap_sys_admin("CapEff:\t00000000a80425fb\n") is False  # docker's default set
    assert parse_cap_sys_admin("nothing here") is None  # unknown: the controller does not act on it


def test_a_failing_period_returns_to_full_performance() -> None:
    fake = FakeGpuSession("h100")
    ctl = controller(fake)
    for _ in range(4):
        ctl.tick()
    assert fake.state()[0] is not None

    def broken(now: float) -> Signals:
        raise RuntimeError("boom")

    ctl.signals = broken
    ctl.params = replace(ctl.params, period_s=0.01)
    ctl.begin()
    wait_until(lambda: fake.state()[0] is None, 5, every_s=0.01)
    ctl.stop()
    assert fake.state() == (None, 700.0)
    assert math.isinf(initial_state(PARAMS).guard_until_s)
