"""The drain deadline, in one place: how long a stop may take, from the signal to the engine's process
group being gone, and the runtime's own exit after it.

vLLM drains for ``--shutdown-timeout`` (the plan's drain time); the runtime SIGKILLs the group at
:func:`stop_bound_s` less :data:`KILL_WAIT_S` at the latest; container managers are told to wait
:func:`stop_timeout_s`. Every bound the runtime announces (the stop line in its log, the dry run,
``fetch``'s ``docker run`` line, the shipped manifests) is derived from the constants here.
"""

from __future__ import annotations

import math
import time

#: After SIGTERM the engine is gone within its drain time plus this much, SIGKILL included.
SHUTDOWN_GRACE_S = 15.0
#: The last part of every stop's time, kept for after the SIGKILL: the group's processes leaving.
KILL_WAIT_S = 2.0
#: After the API server has exited, its engine processes get this long to finish exiting (within
#: the stop's time).
STRAGGLER_GRACE_S = 5.0
#: After the engine is gone: the runtime's own exit (the group, the energy controller, its log).
RUNTIME_EXIT_MARGIN_S = 5.0
#: A stop before the engine is ready: how long the API server gets to exit before SIGKILL.
EARLY_STOP_GRACE_S = 2.0
#: Once the group has lost a host, how long the engine gets to exit before SIGKILL.
GROUP_LOST_GRACE_S = 5.0


def stop_bound_s(drain_s: float) -> float:
    """The announced bound of a stop by signal: the engine's group is gone this long after the signal
    at the latest (the drain, then the grace, whose last KILL_WAIT_S follow the SIGKILL)."""
    return drain_s + SHUTDOWN_GRACE_S


def stop_timeout_s(drain_s: float) -> int:
    """How long a container manager must wait after SIGTERM before it SIGKILLs the runtime, for a
    drain time of ``drain_s``: the announced bound and the runtime's own exit, rounded up to ten
    seconds (``docker stop -t``, ``--stop-timeout``, ``terminationGracePeriodSeconds``)."""
    return math.ceil((stop_bound_s(drain_s) + RUNTIME_EXIT_MARGIN_S) / 10.0) * 10


def deadline_within(grace_s: float) -> float:
    """The deadline (a ``time.monotonic()`` value) of a stop that gives the engine ``grace_s`` before
    the SIGKILL, and KILL_WAIT_S after it for the group to leave."""
    return time.monotonic() + grace_s + KILL_WAIT_S


def drain_deadline(drain_s: float) -> float:
    """The deadline (a ``time.monotonic()`` value) of a stop by signal that starts now: the engine's
    group is gone by it, :func:`stop_bound_s` after the signal."""
    return time.monotonic() + stop_bound_s(drain_s)
