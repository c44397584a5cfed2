"""The controller's only writer to the GPUs: applies targets, writes a setting only when it changes,
and puts back what it found on :meth:`GpuActuator.restore`.

Observe-only (``CF_DRY_RUN=1``, or no permission) makes no set call at all: the intended action is
returned for the log instead. A set call refused for lack of permission, or not supported by the
GPU, gives one warning and switches to observe-only for the rest of the run.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from carbonforge_runtime.core.energy_policy import Target
from carbonforge_runtime.gpu.types import GpuError, GpuLimits, GpuSession
from carbonforge_runtime.runtime.energy.privileges import may_set_gpu

PERMISSION_REMEDY = ("run the container with --cap-add SYS_ADMIN (or as root) to let the controller act, "
                     "or set CF_DRY_RUN=1 to run it observe-only on purpose")
RESET_REMEDY = "reset by hand with `nvidia-smi -rgc` (clocks) and `nvidia-smi -pl <watts>` (power limit)"


@dataclass(frozen=True)
class Action:
    index: int
    kind: str  # lock_sm_clock, unlock_sm_clock, set_power_limit, restore_power_limit
    text: str
    applied: bool


def describe(target: Target, limits: GpuLimits) -> str:
    clocks = ("SM clock unlocked" if target.sm_clock_max_mhz is None
              else f"SM clock locked to {target.sm_clock_min_mhz}-{target.sm_clock_max_mhz} MHz")
    watts = limits.power_limit_w if target.power_limit_w is None else target.power_limit_w
    return f"{clocks}, power limit {watts:g} W"


class GpuActuator:
    def __init__(self, session: GpuSession, limits: Sequence[GpuLimits], log: logging.Logger,
                 dry_run: bool, privileged: Callable[[], bool] = may_set_gpu) -> None:
        self.session = session
        self.limits = {lim.index: lim for lim in limits}
        self.log = log
        self.dry_run = dry_run
        #: Why the actuator only observes ("" while it acts).
        self.observe_reason = "dry run (CF_DRY_RUN=1)" if dry_run else ""
        if not dry_run and not privileged():
            self.observe_reason = "no permission to change GPU settings"
            log.warning("energy controller: this process lacks CAP_SYS_ADMIN, so it cannot change GPU clocks or "
                        "power limits; it stays observe-only (fix: %s)", PERMISSION_REMEDY)
        #: What is in force on each GPU (Target() = as found).
        self.applied: dict[int, Target] = {i: Target() for i in self.limits}
        #: What observe-only mode would have in force.
        self.intended: dict[int, Target] = {i: Target() for i in self.limits}
        self.actions: Counter[str] = Counter()
        self.set_calls = 0
        #: GPU settings the driver refused (the metric carbonforge_controller_failures_total{stage="setting"}).
        self.failures = 0
        self.clock_managed = {i: not lim.clocks_locked for i, lim in self.limits.items()}
        for i, lim in self.limits.items():
            if lim.clocks_locked:
                log.warning("energy controller: the clocks of GPU %d are already held by a setting made outside "
                            "this run (a run killed with SIGKILL leaves its lock behind); the controller leaves "
                            "them alone (%s)", i, RESET_REMEDY)

    @property
    def observe_only(self) -> bool:
        return bool(self.observe_reason)

    def _effective(self, index: int, target: Target) -> Target:
        if not self.clock_managed.get(index, False):
            return Target(power_limit_w=target.power_limit_w)
        return target

    def plan(self, index: int, current: Target, target: Target) -> list[tuple[str, str, Callable[[], None]]]:
        """The set calls that take one GPU from ``current`` to ``target`` (none when equal)."""
        calls: list[tuple[str, str, Callable[[], None]]] = []
        lim = self.limits[index]
        if (target.sm_clock_min_mhz, target.sm_clock_max_mhz) != (current.sm_clock_min_mhz, current.sm_clock_max_mhz):
            if target.sm_clock_max_mhz is None:
                calls.append(("unlock_sm_clock", f"unlock the SM clock of GPU {index}",
                              lambda: self.session.reset_locked_clocks(index)))
            else:
                low, high = target.sm_clock_min_mhz or target.sm_clock_max_mhz, target.sm_clock_max_mhz
                calls.append(("lock_sm_clock", f"lock the SM clock of GPU {index} to {low}-{high} MHz",
                              lambda: self.session.set_locked_clocks(index, low, high)))
        if target.power_limit_w != current.power_limit_w:
            if target.power_limit_w is None:
                watts, kind = lim.power_limit_w, "restore_power_limit"
                text = f"restore the power limit of GPU {index} to {watts:g} W"
            else:
                watts, kind = target.power_limit_w, "set_power_limit"
                text = f"cap the power limit of GPU {index} at {watts:g} W"
            calls.append((kind, text, lambda: self.session.set_power_limit_w(index, watts)))
        return calls

    def apply(self, targets: Mapping[int, Target]) -> list[Action]:
        """Move every GPU to its target; returns what was done (or, observe-only, what would be)."""
        done: list[Action] = []
        for index, wanted in targets.items():
            if index not in self.limits:
                continue
            target = self._effective(index, wanted)
            if self.observe_only:
                for kind, text, _ in self.plan(index, self.intended[index], target):
                    done.append(Action(index, kind, text, applied=False))
                    self.actions[kind] += 1
                self.intended[index] = target
                continue
            current = self.applied[index]
            for kind, text, call in self.plan(index, current, target):
                try:
                    self.set_calls += 1
                    call()
                except GpuError as exc:
                    self.failures += 1
                    if self._give_up(exc):
                        done.append(Action(index, kind, text, applied=False))
                        self.intended = dict(self.applied)
                        self.intended[index] = target
                        return done
                    self.log.warning("energy controller: could not %s: %s", text, exc)
                    continue
                current = self._after(current, kind, target)
                self.applied[index] = current
                self.actions[kind] += 1
                done.append(Action(index, kind, text, applied=True))
            self.intended[index] = self.applied[index]
        return done

    @staticmethod
    def _after(current: Target, kind: str, target: Target) -> Target:
        if kind in ("lock_sm_clock", "unlock_sm_clock"):
            return Target(target.sm_clock_min_mhz, target.sm_clock_max_mhz, current.power_limit_w)
        return Target(current.sm_clock_min_mhz, current.sm_clock_max_mhz, target.power_limit_w)

    def _give_up(self, exc: GpuError) -> bool:
        """Switch to observe-only on a refusal no retry can fix (one warning)."""
        if exc.kind == "no-permission":
            self.observe_reason = "NVML refused a set call (no permission)"
            self.log.warning("energy controller: NVML refused to change a GPU setting (%s); the controller stays "
                             "observe-only (fix: %s)", exc, PERMISSION_REMEDY)
            return True
        if exc.kind == "not-supported":
            self.observe_reason = "the GPU does not support the setting"
            self.log.warning("energy controller: this GPU does not support the setting (%s); the controller stays "
                             "observe-only (choose another policy in the recipe, or none)", exc)
            return True
        return False

    def restore(self) -> list[Action]:
        """Put back what was found on every GPU this run changed. Safe to call more than once."""
        done: list[Action] = []
        for index, current in self.applied.items():
            if current.full:
                continue
            for kind, text, call in self.plan(index, current, Target()):
                try:
                    self.set_calls += 1
                    call()
                except GpuError as exc:
                    self.log.error("energy controller: could not %s at exit: %s; %s", text, exc, RESET_REMEDY)
                    continue
                current = self._after(current, kind, Target())
                self.applied[index] = current
                done.append(Action(index, kind, text, applied=True))
        return done
