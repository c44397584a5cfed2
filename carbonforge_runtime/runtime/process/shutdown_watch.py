"""Ends the parts of a stopping vLLM that have nothing left to do, instead of waiting for them.

After its drain, vLLM spends seconds on processes that hold nothing any more: its executor waits
5 s for the model workers to leave by themselves (they do not, on these builds), then 4 s after a
SIGTERM they ignore, before it SIGKILLs them; the engine core and the API server then take a second
or two each to tear down their interpreters. :class:`ShutdownWatch` reads ``vllm.log`` during a stop
and acts at three points, each one a line the process concerned writes only when its part is done:

1. An engine core logs ``[shutdown] Executor: waiting for worker exit``: it has left its busy loop
   (its drain is over) and its executor has given up on its workers. Its descendants (the workers)
   are SIGKILLed, as vLLM itself does 9 s later. Workers hold no trace record.
2. An engine core logs :data:`~carbonforge_runtime.core.contract.CORE_DONE_MARKER` with its pid: the
   scheduler has written every trace record and the executor is down. If that core had nothing in
   flight when the stop began (vLLM logged no ``draining in-flight requests`` for it), it is
   SIGKILLed; one that drained requests exits by itself, so that its last outputs reach the API
   server on vLLM's own path.
3. The API server logs uvicorn's ``Application shutdown complete.`` after
   ``[shutdown] API server: engine client stopped``, and nothing else is left in the group: every
   engine core has exited and every HTTP connection is closed. The API server is SIGKILLed; the stop
   counts as clean (:attr:`ShutdownWatch.ended_leader`).

A process is only ever signalled when it is in the engine's process group, found from the pid vLLM
puts before each of its lines. When a line never comes (another log level, a core that failed), the
stop goes on as before, within the same deadlines. Reads ``/proc`` and the log; never waits.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from carbonforge_runtime.core.contract import CORE_DONE_MARKER

#: vLLM's prefix on every line of an engine-core process (``EngineCore``, ``EngineCore_DP1``, ...).
_CORE_PREFIX = re.compile(r"^\(EngineCore[A-Za-z0-9_]* pid=(\d+)\)")
_API_PREFIX = re.compile(r"^\(APIServer pid=(\d+)\)")
_CORE_DONE = re.compile(re.escape(CORE_DONE_MARKER) + r" (\d+)")
WORKERS_WAITED = "[shutdown] Executor: waiting for worker exit"
DRAINING = "[shutdown] EngineCore: draining in-flight requests"
CLIENT_STOPPED = "[shutdown] API server: engine client stopped"
#: uvicorn's last line of its shutdown: every connection is closed, the application's shutdown done.
_HTTP_DONE = re.compile(r"^INFO:\s+Application shutdown complete\.\s*$")


def group_descendants(pid: int, pgid: int, proc: Path = Path("/proc")) -> set[int]:
    """The live descendants of ``pid`` that are in process group ``pgid``, except Python's
    multiprocessing resource trackers: each leaves by itself once its parent is gone, after removing
    what that parent left behind (shared memory), so it is never signalled."""
    parents: dict[int, int] = {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        stat = _stat(proc, int(entry.name))
        if stat is not None and stat[2] == pgid and stat[0] != "Z":
            parents[int(entry.name)] = stat[1]
    found: set[int] = set()
    frontier = {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier and child not in found}
        found |= frontier
    return {child for child in found if not _resource_tracker(proc, child)}


def _resource_tracker(proc: Path, pid: int) -> bool:
    try:
        return b"multiprocessing.resource_tracker" in (proc / str(pid) / "cmdline").read_bytes()
    except OSError:
        return False


def _stat(proc: Path, pid: int) -> tuple[str, int, int] | None:
    """(state, parent pid, process group) of ``pid``, or None when it is gone."""
    try:
        text = (proc / str(pid) / "stat").read_text()
    except OSError:
        return None
    fields = text[text.rfind(")") + 2:].split()
    try:
        return fields[0], int(fields[1]), int(fields[2])
    except (IndexError, ValueError):
        return None


def group_running(pgid: int, proc: Path = Path("/proc")) -> bool:
    """Whether a process of group ``pgid`` still runs. A zombie does not: it holds no port and no
    memory, and waits only for its parent (often the container's init, once vLLM's processes are
    orphans) to collect its exit status, which can take seconds."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    for entry in proc.iterdir():
        if entry.name.isdigit():
            stat = _stat(proc, int(entry.name))
            if stat is not None and stat[2] == pgid and stat[0] != "Z":
                return True
    return False


def in_group(pid: int, pgid: int, proc: Path = Path("/proc")) -> bool:
    stat = _stat(proc, pid)
    return stat is not None and stat[2] == pgid and stat[0] != "Z"


@dataclass
class ShutdownWatch:
    """Follows the lines vLLM appends during one stop (:meth:`feed`) and signals the processes
    whose part is over. ``leader`` is the API server, whose pid is the group's id."""

    leader: int
    kill: Callable[[int, int], None] = os.kill
    descendants: Callable[[int, int], set[int]] = group_descendants
    member: Callable[[int, int], bool] = in_group
    #: Engine cores that had requests in flight when the stop began.
    drained: set[int] = field(default_factory=set)
    #: Engine cores whose workers were ended, and cores ended.
    workers_ended: set[int] = field(default_factory=set)
    cores_ended: set[int] = field(default_factory=set)
    client_stopped: bool = False
    #: Set once the API server was ended after its own shutdown had completed.
    ended_leader: bool = False
    #: What was done, one line each, for the runtime's log.
    actions: list[str] = field(default_factory=list)

    def feed(self, line: str) -> None:
        core = _CORE_PREFIX.match(line)
        if core is not None:  # a line of an engine core's own (a core's pid comes only from these)
            pid = int(core[1])
            done = _CORE_DONE.search(line)
            if DRAINING in line:
                self.drained.add(pid)
            elif WORKERS_WAITED in line:
                self._end_workers(pid)
            elif done is not None and int(done[1]) == pid:
                self._end_core(pid)
            return
        api = _API_PREFIX.match(line)
        if api is not None and int(api[1]) == self.leader and CLIENT_STOPPED in line:
            self.client_stopped = True
        elif self.client_stopped and _HTTP_DONE.match(line):
            self._end_leader()

    def _signal(self, pid: int) -> bool:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            self.kill(pid, signal.SIGKILL)
            return True
        return False

    def _end_workers(self, core: int) -> None:
        if core == self.leader or core in self.workers_ended or not self.member(core, self.leader):
            return
        self.workers_ended.add(core)
        workers = sorted(self.descendants(core, self.leader))
        ended = [pid for pid in workers if self._signal(pid)]
        if ended:
            self.actions.append(f"engine core {core} finished its drain and waits for its workers: "
                                f"ended {len(ended)} worker process(es) at once")

    def _end_core(self, core: int) -> None:
        if core == self.leader or core in self.cores_ended or core in self.drained:
            return
        if not self.member(core, self.leader):
            return
        self.cores_ended.add(core)
        for pid in sorted(self.descendants(core, self.leader)):
            self._signal(pid)
        if self._signal(core):
            self.actions.append(f"engine core {core} wrote its trace records and had nothing in flight: "
                                "ended without waiting for its teardown")

    def _end_leader(self) -> None:
        if self.ended_leader or self.descendants(self.leader, self.leader):
            return  # an engine process (or another API server) is still there: let vLLM finish
        if self._signal(self.leader):
            self.ended_leader = True
            self.actions.append("vLLM's API server completed its shutdown (every connection closed): "
                                "ended without waiting for its interpreter's exit")
