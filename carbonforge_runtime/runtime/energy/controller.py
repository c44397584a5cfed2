"""The control loop: every period, signals -> :func:`~carbonforge_runtime.core.energy_policy.decide` ->
per-GPU targets -> :class:`~carbonforge_runtime.runtime.energy.actuator.GpuActuator`.

Nothing is set before :meth:`Controller.begin` (called once the engine is ready, so start-up is
never slowed down), and :meth:`Controller.stop` restores what was found; the runtime calls it on
every way out of the supervised run.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from carbonforge_runtime.core.energy_policy import (
    ControllerParams,
    Decision,
    Signals,
    Target,
    decide,
    initial_state,
    target_for,
)
from carbonforge_runtime.gpu.types import GpuError, GpuId, GpuLimits, GpuSession
from carbonforge_runtime.runtime.energy.actuator import Action, GpuActuator, describe
from carbonforge_runtime.runtime.energy.privileges import may_set_gpu


@dataclass
class ControllerStatus:
    """What the metrics show about the controller."""

    policy: str
    observe_only: bool
    observe_reason: str
    #: GPU index -> (target max SM clock in MHz, target power limit in W): the effective ceiling.
    targets: dict[int, tuple[float, float]] = field(default_factory=dict)
    actions: dict[str, int] = field(default_factory=dict)
    guard_trips: int = 0
    #: "setting" (GPU settings the driver refused) and "period" (control periods that failed) -> count
    failures: dict[str, int] = field(default_factory=dict)
    load: float | None = None
    reason: str = ""


class Controller:
    def __init__(
        self,
        params: ControllerParams,
        session: GpuSession,
        gpus: Sequence[GpuId],
        signals: Callable[[float], Signals],
        log: logging.Logger,
        dry_run: bool,
        privileged: Callable[[], bool] = may_set_gpu,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.params = params
        self.session = session
        self.gpus = list(gpus)
        self.signals = signals
        self.log = log
        self.dry_run = dry_run
        self.privileged = privileged
        self.clock = clock
        self.state = initial_state(params)
        self.limits: list[GpuLimits] = []
        self.actuator: GpuActuator | None = None
        self.last: Decision | None = None
        self.guard_trips = 0
        self.failed_periods = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._stopped = False

    def start(self) -> bool:
        """Read every GPU's bounds and settings as found. False (with a warning) when that fails."""
        try:
            self.limits = [self.session.limits(g.index) for g in self.gpus]
        except GpuError as exc:
            self.log.warning("energy controller off: cannot read the GPUs' clock and power bounds (%s)", exc)
            return False
        self.actuator = GpuActuator(self.session, self.limits, self.log, self.dry_run, self.privileged)
        mode = "acting" if not self.actuator.observe_only else f"observe-only: {self.actuator.observe_reason}"
        found = "; ".join(f"GPU {lim.index}: {describe(Target(), lim)}" for lim in self.limits)
        self.log.info("energy controller %s on %d GPU(s), every %g s (%s); found %s", self.params.policy,
                      len(self.limits), self.params.period_s, mode, found)
        return True

    def begin(self) -> None:
        """Start the periodic loop (once the engine is ready)."""
        if self.actuator is None or self._thread is not None or self._stopped:
            return
        self._thread = threading.Thread(target=self._run, name="cf-energy-controller", daemon=True)
        self._thread.start()

    def targets(self, fraction: float) -> dict[int, Target]:
        return {lim.index: target_for(self.params, fraction, lim) for lim in self.limits}

    def tick(self) -> Decision:
        """One control period (public so tests can drive it without a thread)."""
        assert self.actuator is not None
        now = self.clock()
        with self._lock:
            decision = decide(self.params, self.state, self.signals(now))
            self.state = decision.state
            self.last = decision
            if decision.guard_fired:
                self.guard_trips += 1
            actions = self.actuator.apply(self.targets(decision.fraction))
        self._log(decision, actions)
        return decision

    def _log(self, decision: Decision, actions: list[Action]) -> None:
        actuator = self.actuator
        assert actuator is not None
        if actuator.observe_only:
            prefix = "energy controller (dry run)" if self.dry_run else "energy controller (observe-only)"
            if actions:
                what = "; ".join(a.text for a in actions)
                self.log.info("%s: would %s; why: %s", prefix, what, decision.reason)
            elif self.dry_run:  # a dry run says what it would do every period, even "nothing"
                kept = "; ".join(f"GPU {lim.index} {describe(actuator.intended[lim.index], lim)}"
                                 for lim in self.limits)
                self.log.info("%s: would keep %s; why: %s", prefix, kept, decision.reason)
            return
        for action in actions:
            if action.applied:
                self.log.info("energy controller: %s; why: %s", action.text, decision.reason)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.tick()
            except Exception as exc:  # a bug must not leave a saving in force
                self.failed_periods += 1
                self.log.warning("energy controller: a period failed (%s); back to full performance", exc)
                try:
                    with self._lock:
                        if self.actuator is not None:
                            self.actuator.apply(self.targets(1.0))
                except Exception as again:
                    self.log.warning("energy controller: could not return to full performance: %s", again)
            self._stop.wait(self.params.period_s)

    def stop(self) -> None:
        """Stop the loop and put every GPU back as found. Safe to call more than once."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(5.0)
        with self._lock:
            if self._stopped or self.actuator is None:
                self._stopped = True
                return
            self._stopped = True
            restored = self.actuator.restore()
        for action in restored:
            self.log.info("energy controller: %s (stopping)", action.text)

    def status(self) -> ControllerStatus:
        with self._lock:
            actuator = self.actuator
            status = ControllerStatus(self.params.policy, bool(actuator and actuator.observe_only),
                                      actuator.observe_reason if actuator else "")
            if actuator is None:
                return status
            shown = actuator.intended if actuator.observe_only else actuator.applied
            for lim in self.limits:
                target = shown[lim.index]
                clock = target.sm_clock_max_mhz or lim.sm_clock_max_mhz
                watts = target.power_limit_w if target.power_limit_w is not None else lim.power_limit_w
                status.targets[lim.index] = (float(clock), float(watts))
            status.actions = dict(actuator.actions)
            status.guard_trips = self.guard_trips
            status.failures = {"setting": actuator.failures, "period": self.failed_periods}
            if self.last is not None:
                status.load = self.last.load
                status.reason = self.last.reason
            return status
