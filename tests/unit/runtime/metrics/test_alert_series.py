"""The series the alert rules (deploy/observability/alerts/) need beyond the others: the recipe's
queue-wait target, the hosts a multi-host group lost, and the energy controller's failures."""

from __future__ import annotations

import logging
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import replace

import pytest
from prometheus_client.parser import text_string_to_metric_families

from carbonforge_runtime.core.energy_policy import Signals, parse_params
from carbonforge_runtime.gpu.fake import FakeGpuBackend, FakeGpuSession, host
from carbonforge_runtime.recipes.model import ControllerSpec
from carbonforge_runtime.runtime.energy.controller import Controller
from carbonforge_runtime.runtime.metrics.exposition import exposition, make_registry
from carbonforge_runtime.runtime.metrics.state import Info, RuntimeState
from carbonforge_runtime.runtime.serve.launch import ServeOptions, prepare
from carbonforge_runtime.runtime.serve.observability import Needs, Observability
from carbonforge_runtime.settings import load_settings
from tests.support import TINY_KEY

LOG = logging.getLogger("test.alert-series")
PROMTOOL = shutil.which("promtool")


def scrape(state: RuntimeState) -> dict[str, list[tuple[dict[str, str], float]]]:
    text = exposition(make_registry(state.snapshot))
    if PROMTOOL is not None:
        checked = subprocess.run([PROMTOOL, "check", "metrics"], input=text, capture_output=True, timeout=60,
                                 check=False)
        assert checked.returncode == 0 and checked.stdout == b"" and checked.stderr == b"", checked
    found: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text.decode()):
        for sample in family.samples:
            found.setdefault(sample.name, []).append((dict(sample.labels), sample.value))
    return found


def info(target: float | None) -> Info:
    return Info("0.2.0", "0.32.0", "k", "r", "free", None, queue_wait_target_s=target)


def test_the_queue_wait_target_is_exported_only_when_the_recipe_sets_one() -> None:
    state = RuntimeState()
    state.info = info(0.5)
    assert scrape(state)["carbonforge_queue_wait_target_seconds"] == [({}, 0.5)]
    state.info = info(None)
    assert "carbonforge_queue_wait_target_seconds" not in scrape(state)


@pytest.mark.parametrize(("controller", "target"), [
    (ControllerSpec("lock-sm-clock", {"guard": {"queue_wait_p90_s": 0.25}}), 0.25),
    (ControllerSpec("lock-sm-clock", {}), None),  # a controller without a queue-wait target
    (ControllerSpec("none"), None),
])
def test_the_target_comes_from_the_recipes_latency_guard(controller: ControllerSpec, target: float | None) -> None:
    env: dict[str, str] = {}
    settings = load_settings(env)
    prepared = prepare(ServeOptions(context_key=TINY_KEY), settings, env, FakeGpuBackend(host(None)))
    recipe = replace(prepared.plan.recipe, controller=controller)
    launch = replace(prepared.plan, recipe=recipe)
    prepared = replace(prepared, serve_plan=replace(prepared.serve_plan, launch=launch))
    obs = Observability(prepared, ServeOptions(context_key=TINY_KEY), settings, env, LOG)
    try:
        obs.start(Needs(gpu=False, metrics=False))  # no GPU here: the controller stays off, the target shows
        assert obs.state.info.queue_wait_target_s == target
        assert ("carbonforge_queue_wait_target_seconds" in scrape(obs.state)) == (target is not None)
    finally:
        obs.close()


def test_group_hosts_lost_is_absent_alone_and_follows_the_group() -> None:
    state = RuntimeState()
    assert "carbonforge_group_hosts_lost" not in scrape(state)
    lost = [0]
    state.group_hosts_lost = lambda: lost[0]
    assert scrape(state)["carbonforge_group_hosts_lost"] == [({}, 0.0)]
    lost[0] = 2
    assert scrape(state)["carbonforge_group_hosts_lost"] == [({}, 2.0)]


def _failures(state: RuntimeState) -> dict[str, float]:
    return {labels["stage"]: value for labels, value in scrape(state)["carbonforge_controller_failures_total"]}


def _controller(session: FakeGpuSession, signals: Callable[[float], Signals]) -> Controller:
    params = parse_params("lock-sm-clock", {"down_periods": 1}, "r.yaml", capacity_seqs=16)
    ctl = Controller(params, session, session.open(), signals, LOG, dry_run=False, privileged=lambda: True)
    assert ctl.start()
    return ctl


def test_a_controller_that_acts_has_no_failures() -> None:
    state = RuntimeState()
    ctl = _controller(FakeGpuSession("h100"), lambda now: Signals(now, 0.1, running=1))
    ctl.tick()
    state.controller = ctl.status
    found = scrape(state)
    assert _failures(state) == {"setting": 0.0, "period": 0.0}
    assert sum(v for _, v in found["carbonforge_controller_actions_total"]) >= 1  # it did act


def test_a_setting_the_driver_refuses_is_a_failure() -> None:
    state = RuntimeState()
    ctl = _controller(FakeGpuSession("h100", deny_set=True), lambda now: Signals(now, 0.1, running=1))
    ctl.tick()
    state.controller = ctl.status
    assert _failures(state) == {"setting": 1.0, "period": 0.0}
    assert scrape(state)["carbonforge_controller_observe_only"] == [({}, 1.0)]


@pytest.mark.timeout(30)
def test_a_period_that_fails_is_a_failure() -> None:
    def broken(now: float) -> Signals:
        raise RuntimeError("no signals")

    state = RuntimeState()
    ctl = _controller(FakeGpuSession("h100"), broken)
    state.controller = ctl.status
    ctl.begin()
    try:
        deadline = time.monotonic() + 10
        while ctl.failed_periods == 0:
            assert time.monotonic() < deadline, "the failing period was not counted"
            time.sleep(0.02)
    finally:
        ctl.stop()
    assert _failures(state)["period"] >= 1 and _failures(state)["setting"] == 0
