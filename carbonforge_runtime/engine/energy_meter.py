"""Energy per request, in the engine process: ``energy_j`` on every trace record.

The scheduler shim calls two O(1) hooks on the engine loop (:meth:`EnergyMeter.step_started` and
:meth:`EnergyMeter.step_ended`: a dict write and a deque append); a sampler thread reads the GPUs'
energy counter every :data:`SAMPLE_INTERVAL_S` (the driver updates it every 20-100 ms) and charges
finished steps with :class:`~carbonforge_runtime.core.energy_attribution.EnergyAttributor`; the trace
writer's builder thread asks for a completed request's joules once the samples cover its end.

NVML is reached only through :mod:`carbonforge_runtime.gpu.select` (which imports
:mod:`carbonforge_runtime.gpu.nvml`). Without NVML there is no meter and ``energy_j`` is null.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from carbonforge_runtime.core.contract import EnergyMetering
from carbonforge_runtime.core.energy_attribution import EnergyAttributor
from carbonforge_runtime.gpu.types import GpuError, GpuSession

SAMPLE_INTERVAL_S = 0.025
#: Longest a record waits for the samples that cover its last step.
COVER_TIMEOUT_S = 0.5
#: Consecutive failed counter reads after which the meter turns itself off.
MAX_READ_FAILURES = 20
#: Finished steps held for the sampler; beyond this (sampler stalled) steps are dropped and counted.
MAX_QUEUED_STEPS = 50_000
#: A counter that has not moved for this long is taken as flat (no power), not as not-yet-updated.
FLAT_COUNTER_S = 0.25


class EnergyMeter:
    def __init__(
        self,
        session: GpuSession,
        indices: Sequence[int],
        log: logging.Logger,
        interval_s: float = SAMPLE_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.session = session
        self.indices = list(indices)
        self.log = log
        self.interval_s = interval_s
        self.clock = clock
        self.wall_clock = wall_clock
        self.attributor = EnergyAttributor()
        #: False once the meter stopped (closed, or the counter cannot be read): records get null.
        self.enabled = True
        self.dropped_steps = 0
        self._starts: dict[int, float] = {}
        self._ended: deque[tuple[float | None, float, Mapping[str, int], bool | None]] = deque()
        self._lock = threading.Lock()
        self._progress = threading.Condition(self._lock)
        self._processed_until = float("-inf")
        self._stop = threading.Event()
        self._failures = 0
        self._closed = False
        self._offset = wall_clock() - clock()  # wall - monotonic, to place a record's completion
        self._last_read: tuple[float, float] | None = None  # (time, counter) of the previous read
        self._last_added = float("-inf")
        self._thread = threading.Thread(target=self._run, name="cf-energy-meter", daemon=True)

    # -- engine loop (O(1), never raises) --

    def step_started(self, key: object, t: float) -> None:
        if self.enabled:
            self._starts[id(key)] = t

    def step_ended(self, key: object, t: float, shares: Mapping[str, int], busy_after: bool | None = None) -> None:
        """``busy_after``: whether the engine still has unfinished requests (if not, what follows is idle)."""
        if not self.enabled:
            return
        start = self._starts.pop(id(key), None)
        if len(self._ended) >= MAX_QUEUED_STEPS:
            self.dropped_steps += 1
            return
        self._ended.append((start, t, shares, busy_after))

    # -- sampler thread --

    def _read(self) -> float:
        return sum(self.session.energy_j(i) for i in self.indices)

    def start(self) -> EnergyMeter:
        """Find the counter's next update (so the first sample is placed in time, and a failing counter
        shows at once: the error is raised here), then sample in the background."""
        previous_t, previous = self.clock(), self._read()
        deadline = previous_t + FLAT_COUNTER_S
        point = None
        while point is None:
            time.sleep(0.002)
            value, t = self._read(), self.clock()
            if value != previous:
                point = ((previous_t + t) / 2.0, value)
            elif t >= deadline:
                point = (t, value)
            previous_t = t
        with self._lock:
            self.attributor.add_sample(*point)
        self._last_read = (previous_t, point[1])
        self._last_added = point[0]
        self._thread.start()
        return self

    def sample_once(self) -> None:
        """One sampler iteration: read, take the steps that ended before the read, charge them.

        The driver's counter moves in steps (every 20-100 ms), so a reading is the energy as of the
        counter's last update, not as of the read. A new value is therefore placed halfway between the
        read that first showed it and the read before, which removes most of that lag; steps ending
        after the last update wait for the next one.
        """
        energy = self._read()
        t = self.clock()
        steps = []
        while self._ended:
            steps.append(self._ended.popleft())
        previous = self._last_read
        self._last_read = (t, energy)
        point: tuple[float, float] | None = None
        if previous is not None and energy != previous[1]:
            point = ((previous[0] + t) / 2.0, energy)
        elif t - self._last_added >= FLAT_COUNTER_S:
            point = (t, energy)
        with self._progress:
            attributor = self.attributor
            if point is not None:
                attributor.add_sample(*point)
                self._last_added = point[0]
            for start, end, shares, busy_after in steps:
                attributor.add_step(start, end, shares, busy_after)
            attributor.advance()
            covered = attributor.covered_until
            if covered is not None:
                self._processed_until = covered
            self._progress.notify_all()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.sample_once()
                self._failures = 0
            except GpuError as exc:
                self._failures += 1
                if self._failures >= MAX_READ_FAILURES:
                    self.log.warning("energy per request is off from now on: the GPU energy counter cannot be "
                                     "read (%s); energy_j is null in later records", exc)
                    self._disable()
                    return
            except Exception as exc:  # a bug here must not take the engine down
                self.log.warning("energy per request is off from now on: %s", exc)
                self._disable()
                return

    def _disable(self) -> None:
        with self._progress:
            self.enabled = False
            self._progress.notify_all()

    # -- builder thread --

    def energy_for(self, engine_request_id: str, t_completion: float) -> float | None:
        """Joules charged to a completed request (``t_completion`` in Unix seconds); waits until the
        samples cover its completion, at most :data:`COVER_TIMEOUT_S`. ``None`` when the meter is off."""
        target = min(t_completion - self._offset, self.clock())
        deadline = self.clock() + COVER_TIMEOUT_S
        with self._progress:
            while self.enabled and self._processed_until < target:
                left = deadline - self.clock()
                if left <= 0:
                    break
                self._progress.wait(left)
            if not self.enabled:
                return None
            return round(self.attributor.take(engine_request_id), 6)

    def wrap_build(self, build: Callable[[Any], Any]) -> Callable[[Any], Any]:
        """``build`` with ``energy_j`` filled in on the completion first."""

        def build_with_energy(done: Any) -> Any:
            done.energy_j = self.energy_for(done.engine_request_id, done.t_completion)
            return build(done)

        return build_with_energy

    def close(self) -> None:
        """Stop sampling, log the totals once, release NVML. Safe to call more than once (vLLM's
        shutdown and the exit hook both call it)."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(2.0)
        with self._progress:
            totals = self.attributor.totals
            if totals.steps:
                self.log.info(
                    "energy per request: %.1f J attributed to requests over %d steps; %.1f J unattributed "
                    "(idle %.1f J, empty steps %.1f J, after completion %.1f J)",
                    totals.attributed_j, totals.steps, totals.unattributed_j, totals.idle_j,
                    totals.empty_step_j, totals.late_j,
                )
            self.enabled = False
            self._progress.notify_all()
        with contextlib.suppress(GpuError):
            self.session.close()


def start_meter(wanted: EnergyMetering | None, log: logging.Logger) -> EnergyMeter | None:
    """The meter the engine contract asks for (``None`` when it asks for none, or when the counter
    cannot be read here: energy_j is then null)."""
    if wanted is None:
        return None
    from carbonforge_runtime.gpu.select import open_session

    opened = open_session(wanted.fake_nvml, log)
    if opened is None:
        log.warning("energy per request is off: NVML is not usable in the engine process; energy_j is null")
        return None
    session, gpus = opened
    uuids = list(wanted.gpus)
    indices = [g.index for g in gpus if not uuids or g.uuid in uuids]
    if not indices:
        session.close()
        log.warning("energy per request is off: none of the GPUs %s is visible in the engine process", uuids)
        return None
    meter = EnergyMeter(session, indices, log)
    try:
        meter.start()
    except GpuError as exc:
        session.close()
        log.warning("energy per request is off: the GPU energy counter cannot be read (%s); energy_j is null", exc)
        return None
    log.info("energy per request: sampling the energy counter of %d GPU(s) every %.0f ms",
             len(indices), meter.interval_s * 1000)
    return meter
