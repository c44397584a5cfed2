"""The paced engine (``serve --emulate``): every engine step lasts what the step-time model says its
batch costs on the modelled GPU.

The scheduler knows each step's batch when it schedules it. When the step's output comes back
(``update_from_output``), :meth:`Pacer.finish` prices the batch with the step-time model (the
twin's terms, :func:`~carbonforge_runtime.engine.step_log.step_terms`, and its formula,
:func:`~carbonforge_runtime.core.twin_data.step_time_s`), times the slowdown, and sleeps out what is
left of that time before the outputs leave for the API server. It never spins.

What is paced is the step's *period*. While the engine is busy (requests were unfinished when the
previous step ended) a step starts where the previous one ended, so the host work between two
steps (output handling, taking in new requests, scheduling) is inside the modelled time, as it is
on a GPU whose host work overlaps the forward pass. After the engine ran out of work a step starts
when the scheduler is asked for it. These are the step log's boundaries
(:mod:`~carbonforge_runtime.engine.step_log`), so a step log of a paced run shows the modelled times.

A step that ends on time (within 2% of its modelled time) ends, for the next period, at its
modelled end: the wake-up after a wait comes a fraction of a millisecond past the deadline on a
busy machine, and were the next period to start from the wake-up, every step would last that much
longer than the model (0.5% at a 25 ms step, which near saturation moves queueing by a few percent).
A step whose real work (or the machine's wake-up after the wait) took it more than 2% past its
modelled time is *late*: it ends when its work ends, and the next step starts from there (no
catching up, so one late step lengthens that step only). Late steps are counted (the metrics feed's
counters), the worst is remembered, and a run with more than
:attr:`~carbonforge_runtime.core.contract.Emulation.late_share_warning` of its steps late is
reported as not faithful: once while it runs and again at shutdown.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from carbonforge_runtime.core.contract import EMULATION_NOT_FAITHFUL_MARK, EMULATION_SUMMARY_MARK, Emulation
from carbonforge_runtime.core.feed_protocol import EngineCounters
from carbonforge_runtime.core.figure_labels import EMULATED, FigureLabel, emulated
from carbonforge_runtime.core.twin_data import StepCostModel, step_time_s
from carbonforge_runtime.engine.step_log import step_terms

#: Steps scheduled and not yet ended that the pacer remembers (one or two in flight normally).
MAX_OPEN_STEPS = 64
#: Steps before the running warning may fire (a share of a handful of steps says little).
WARN_AFTER_STEPS = 200
#: A step is late when its period exceeds its modelled time by more than this share (a wake-up a
#: millisecond late is not). A run is faithful when at most 1% of its steps are late, that is when 99%
#: of them lasted their modelled time within 2%.
LATE_TOLERANCE = 0.02
#: The last part of each wait is slept holding the interpreter lock (:func:`sleep_holding_gil`).
FINAL_WAIT_S = 0.005


def cost_model_of(emulation: Emulation) -> StepCostModel:
    """The step-time model the contract carries, in the twin's type."""
    return StepCostModel(
        name=emulation.model, version=1, gpu="emulated", tensor_parallel_size=1, floor_ms=emulation.floor_ms,
        per_batched_token_ms=emulation.per_batched_token_ms, per_kv_token_read_ms=emulation.per_kv_token_read_ms,
        attention_ms=emulation.attention_ms, overhead_ms=emulation.overhead_ms, kv_capacity_tokens=16,
        provenance="engine contract",
    )


def modelled_period_s(model: StepCostModel, slowdown: float, output: Any) -> float:
    """Seconds a step with this ``SchedulerOutput`` lasts on the modelled GPU, times ``slowdown``
    (0 for a step that computes no token)."""
    batched = int(output.total_num_scheduled_tokens)
    if batched <= 0:
        return 0.0
    _, _, kv_read, attention, _ = step_terms(output)
    return step_time_s(model, batched, kv_read, attention) * slowdown


def _libc_usleep() -> Callable[[int], int] | None:
    try:
        usleep = ctypes.PyDLL(None).usleep  # a PyDLL call keeps the interpreter lock
    except (AttributeError, OSError):
        return None
    usleep.argtypes = [ctypes.c_uint]
    usleep.restype = ctypes.c_int
    return usleep  # type: ignore[no-any-return]


_USLEEP = _libc_usleep()


def sleep_holding_gil(seconds: float) -> None:
    """Sleep without letting the engine core's other threads (its socket threads, the trace and step-log
    writers) take the interpreter lock: on a busy machine one of them, holding it while the OS runs
    something else, would otherwise delay the step's end by a scheduler slice. Only the last
    :data:`FINAL_WAIT_S` of a wait is slept this way. Falls back to ``time.sleep`` off Linux."""
    if _USLEEP is None:
        time.sleep(seconds)
    else:
        _USLEEP(max(0, int(seconds * 1e6)))


def wait_until(deadline: float, clock: Callable[[], float], sleep: Callable[[float], None],
               final_sleep: Callable[[float], None]) -> None:
    """Sleep until ``deadline`` (the clock's time): the bulk with ``sleep``, the last
    :data:`FINAL_WAIT_S` with ``final_sleep``. Never spins, and returns at once for a past deadline."""
    now = clock()
    if deadline - now > FINAL_WAIT_S:
        sleep(deadline - now - FINAL_WAIT_S)
        now = clock()
    if now < deadline:
        final_sleep(deadline - now)


def period_start(entered: float, last_end: float, busy_at_last_end: bool) -> float:
    """Where a step's period starts: at the previous step's end while the engine was busy (or when
    the step was scheduled before that end, as with asynchronous scheduling), else when it was scheduled."""
    return last_end if busy_at_last_end or entered < last_end else entered


@dataclass
class Lateness:
    """The paced steps so far, and those that ran past their modelled time."""

    steps: int = 0
    late: int = 0
    #: The worst late step: its real period over its modelled one (0 when none was late).
    worst_ratio: float = 0.0
    #: Seconds the late steps ran past their modelled ends, in all.
    late_s: float = 0.0

    def count(self, modelled_s: float, took_s: float) -> bool:
        """Count one step that took ``took_s`` against its ``modelled_s``; True when it was late (by
        more than :data:`LATE_TOLERANCE` of its modelled time)."""
        self.steps += 1
        if took_s <= modelled_s * (1 + LATE_TOLERANCE):
            return False
        self.late += 1
        self.late_s += took_s - modelled_s
        self.worst_ratio = max(self.worst_ratio, took_s / modelled_s if modelled_s > 0 else float("inf"))
        return True

    @property
    def share(self) -> float:
        return self.late / self.steps if self.steps else 0.0

    def faithful(self, threshold: float) -> bool:
        return self.share <= threshold


def label_of(lateness: Lateness, emulation: Emulation) -> FigureLabel:
    """The figure label of this run so far (:mod:`~carbonforge_runtime.core.figure_labels`)."""
    return emulated(emulation.model, emulation.version, emulation.proxy, lateness.late, lateness.steps)


def summary_line(lateness: Lateness, emulation: Emulation) -> str:
    """The line a paced engine logs at shutdown: its label, the slowdown, the late steps."""
    worst = f", worst {lateness.worst_ratio:.2f}x its modelled time" if lateness.late else ""
    return (f"{label_of(lateness, emulation).text()}; slowdown {emulation.slowdown:g}; {lateness.late} of "
            f"{lateness.steps} {EMULATION_SUMMARY_MARK}{worst}")


def not_faithful_line(lateness: Lateness, emulation: Emulation) -> str:
    return (f"{EMULATION_NOT_FAITHFUL_MARK}: {lateness.late} of {lateness.steps} steps ({lateness.share:.1%}, over "
            f"{emulation.late_share_warning:.0%}) took longer on this machine than {emulation.model} models; "
            f"the times served are this machine's, not the modelled GPU's. Raise --emulate-slowdown (now "
            f"{emulation.slowdown:g}) or lower the load")


class Pacer:
    """The engine loop's side: :meth:`scheduled` when a step is scheduled, :meth:`finish` once its
    output was processed (it sleeps there); :meth:`close` at shutdown."""

    def __init__(self, emulation: Emulation, counters: EngineCounters, log: logging.Logger,
                 clock: Callable[[], float] | None = None, sleep: Callable[[float], None] | None = None,
                 final_sleep: Callable[[float], None] | None = None) -> None:
        self.emulation = emulation
        self.model = cost_model_of(emulation)
        self.slowdown = emulation.slowdown
        self.counters = counters
        self.log = log
        self.clock = clock if clock is not None else time.monotonic
        self.sleep = sleep if sleep is not None else time.sleep
        self.final_sleep = final_sleep if final_sleep is not None else sleep_holding_gil
        self.lateness = Lateness()
        self._starts: dict[int, float] = {}
        self._last_end = float("-inf")
        self._busy_at_last_end = False
        self._warned = False
        self._closed = False

    def scheduled(self, output: object, entered: float) -> None:
        starts = self._starts
        if len(starts) >= MAX_OPEN_STEPS:
            starts.clear()
        starts[id(output)] = entered

    def finish(self, output: Any, busy: bool) -> None:
        """The step of ``output`` has been processed: wait out the rest of its modelled period.
        ``busy``: the engine has unfinished requests after it (it goes straight on)."""
        entered = self._starts.pop(id(output), None)
        now = self.clock()
        if entered is None:
            self._last_end, self._busy_at_last_end = now, busy
            return
        start = period_start(entered, self._last_end, self._busy_at_last_end)
        modelled = modelled_period_s(self.model, self.slowdown, output)
        end = now
        if modelled > 0:
            deadline = start + modelled
            if now < deadline:
                wait_until(deadline, self.clock, self.sleep, self.final_sleep)
                end = self.clock()
            late = self.lateness.count(modelled, end - start)
            counters = self.counters
            counters.emulated_steps_total += 1
            if late:
                counters.emulated_late_steps_total += 1
                self._maybe_warn()
            else:
                end = min(end, deadline)  # on time: the next period starts at the modelled end
        self._last_end, self._busy_at_last_end = end, busy

    def _maybe_warn(self) -> None:
        lateness = self.lateness
        if (not self._warned and lateness.steps >= WARN_AFTER_STEPS
                and not lateness.faithful(self.emulation.late_share_warning)):
            self._warned = True
            self.log.warning("%s", not_faithful_line(lateness, self.emulation))

    def close(self) -> None:
        """Log the summary once (and the warning when too many steps ran late)."""
        if self._closed:
            return
        self._closed = True
        self.log.info("%s", summary_line(self.lateness, self.emulation))
        if not self.lateness.faithful(self.emulation.late_share_warning):
            self.log.warning("%s", not_faithful_line(self.lateness, self.emulation))


def child_pids(pid: int) -> list[int]:
    """The child processes of ``pid`` (Linux; none where /proc does not say)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children", encoding="ascii") as handle:
            return [int(word) for word in handle.read().split()]
    except (OSError, ValueError):
        return []


def quiet_workers(log: logging.Logger) -> None:
    """Give the main thread of each of this engine core's child processes (vLLM's model workers) the
    lowest CPU priority. Between two steps a worker busy-waits for the next one (it yields the CPU
    but never sleeps, for up to a second after each step), so while the pacer sleeps that loop
    competes with the engine core's wake-up on a small machine. The workers' compute threads keep
    their priority. Best effort: a refusal is logged, never raised."""
    lowered = []
    for pid in child_pids(os.getpid()):
        try:
            os.setpriority(os.PRIO_PROCESS, pid, 19)
            lowered.append(pid)
        except OSError as exc:
            log.info("%s: could not lower the priority of worker %d (%s)", EMULATED, pid, exc)
    if lowered:
        log.info("%s: the busy-waiting main thread of worker process(es) %s runs at nice 19, so that it does "
                 "not delay the end of a paced step", EMULATED, ", ".join(map(str, lowered)))


#: The scheduler slice the pacing thread asks for (``sched_setattr``'s ``sched_runtime``, nanoseconds;
#: the kernel accepts 0.1 ms to 100 ms).
PACING_SLICE_NS = 100_000
#: ``sched_setattr``'s system call number, by machine (absent: not asked for).
_SCHED_SETATTR = {"x86_64": 314, "aarch64": 274}


class _SchedAttr(ctypes.Structure):
    """The kernel's ``struct sched_attr``, its first version (48 bytes)."""

    _fields_ = [("size", ctypes.c_uint32), ("sched_policy", ctypes.c_uint32), ("sched_flags", ctypes.c_uint64),
                ("sched_nice", ctypes.c_int32), ("sched_priority", ctypes.c_uint32),
                ("sched_runtime", ctypes.c_uint64), ("sched_deadline", ctypes.c_uint64),
                ("sched_period", ctypes.c_uint64)]


def ask_for_short_slice(slice_ns: int = PACING_SLICE_NS) -> str | None:
    """Ask the kernel to give the calling thread a short scheduler slice, keeping its policy (normal)
    and its nice value; None when granted, else why not.

    A paced step ends when the pacing thread wakes from its wait. On a machine whose cores are all
    busy (the API server streaming, the client, other processes) Linux's EEVDF scheduler lets the
    running task finish its slice (1-3 ms) before the woken thread runs, so the step ends that much
    late. A thread with a shorter slice than the running task's gets an earlier virtual deadline and
    preempts it at wake-up. Linux 6.12 and later honour a slice asked for with ``sched_setattr`` by
    an unprivileged normal-policy thread; it changes no share of the CPU, only how soon a thread runs
    after waking. Older kernels accept the call and ignore the slice."""
    number = _SCHED_SETATTR.get(platform.machine())
    if number is None or not hasattr(os, "getpriority"):
        return f"no sched_setattr on {platform.system()} {platform.machine()}"
    attr = _SchedAttr(size=ctypes.sizeof(_SchedAttr), sched_policy=os.SCHED_OTHER,
                      sched_nice=os.getpriority(os.PRIO_PROCESS, 0), sched_runtime=slice_ns)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(number, 0, ctypes.byref(attr), 0) != 0:
        return os.strerror(ctypes.get_errno())
    return None


def start_pacer(emulation: Emulation | None, counters: EngineCounters, log: logging.Logger) -> Pacer | None:
    """The engine core's pacer (None when not paced). Called on the thread that runs the engine's
    steps, which is the thread that waits them out."""
    if emulation is None:
        return None
    quiet_workers(log)
    refused = ask_for_short_slice()
    if refused is None:
        log.info("%s: the pacing thread asked for a %.1f ms scheduler slice, so that it runs as soon as a step's "
                 "wait ends", EMULATED, PACING_SLICE_NS / 1e6)
    else:
        log.info("%s: could not shorten the pacing thread's scheduler slice (%s); steps may end a slice late on "
                 "a busy machine", EMULATED, refused)
    log.info("%s: every step paced to the step-time model %s v%d%s, slowdown %g (serve --emulate)",
             EMULATED, emulation.model, emulation.version, " (a proxy)" if emulation.proxy else "", emulation.slowdown)
    return Pacer(emulation, counters, log)
