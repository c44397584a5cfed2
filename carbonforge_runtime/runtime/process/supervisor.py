"""Starts and supervises the vLLM engine, in its own process group: the serve path's only child
processes (the offline ``sim`` and ``tune`` commands start their own, in ``cli/``).

The engine writes straight into ``vllm.log`` (no pipe to drain, so it can never block on us).
:func:`supervise` runs in phases (start, wait for ready, serve, stop), each a function that ends the
run with an :class:`~carbonforge_runtime.runtime.process.exit_report.ExitReport` or hands on to the
next. Every wait here has a deadline, taken from :mod:`~carbonforge_runtime.runtime.process.drain`,
and every path out kills the whole process group.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import math
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from carbonforge_runtime import files
from carbonforge_runtime.core.redaction import redact_args
from carbonforge_runtime.errors import DrainOverrun, StopForced
from carbonforge_runtime.runtime.process.drain import (
    EARLY_STOP_GRACE_S,
    GROUP_LOST_GRACE_S,
    KILL_WAIT_S,
    SHUTDOWN_GRACE_S,
    STRAGGLER_GRACE_S,
    deadline_within,
    drain_deadline,
    stop_bound_s,
)
from carbonforge_runtime.runtime.process.exit_report import (  # ExitReport: what supervise() returns
    ExitReport,
    describe_exit,
    log_tail,
    report_engine_exit,
)
from carbonforge_runtime.runtime.process.port_owner import foreign_listener_problem
from carbonforge_runtime.runtime.process.shutdown_watch import ShutdownWatch, group_running
from carbonforge_runtime.runtime.process.startup_phases import (
    DOWNLOADING,
    LOADING,
    STARTING,
    LogFollower,
    StartupPhases,
    scan_download,
)

POLL_INTERVAL_S = 0.5
#: During a stop with a :class:`ShutdownWatch`: how often the log is read.
WATCH_INTERVAL_S = 0.05
PROGRESS_INTERVAL_S = 10.0


_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """Ask the kernel to SIGTERM the engine if the runtime itself disappears."""
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


#: The engine's watchdog: a small process in a session of its own, started BEFORE the engine, so
#: that no engine ever runs without its kill path. It blocks reading a pipe whose only writer is the
#: runtime; the runtime writes the engine's process group on the first line once the engine is
#: spawned. End of file means the runtime is gone, however it ended (SIGKILL included), and the
#: watchdog then kills that whole process group (none, if the pipe closed before a group was named:
#: no engine was started). Nothing here depends on vLLM handling a signal (it ignores SIGTERM while it
#: initialises). On a normal stop the runtime kills the watchdog itself once the group is gone.
_WATCHDOG = """
import os, signal, sys
signal.signal(signal.SIGTERM, signal.SIG_IGN)
signal.signal(signal.SIGINT, signal.SIG_IGN)
line = sys.stdin.buffer.readline().strip()
pgid = int(line) if line.isdigit() else 0
while sys.stdin.buffer.read(4096):
    pass
if pgid > 1:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except OSError:
        pass
"""

#: How the engine and its watchdog are spawned: ``subprocess.Popen``, or a stand-in with its
#: signature (tests make a spawn fail, as EAGAIN under a pids limit would).
Spawn = Callable[..., subprocess.Popen[bytes]]


#: Probes of our own engine go straight to it: an ``http_proxy`` in the environment (common on
#: corporate hosts) must not route a loopback health check through a proxy.
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def http_ok(url: str, timeout_s: float = 2.0) -> bool:
    try:
        with _DIRECT.open(url, timeout=timeout_s) as response:
            return bool(200 <= response.status < 300)
    except (urllib.error.URLError, OSError, ValueError):
        return False


def _port_problem(engine: EngineProcess, ready_url: str, api_port: int | None) -> str | None:
    """Why the server answering ``ready_url`` is not (only) the engine, or ``None`` when it is."""
    if api_port is None or engine.pid is None:
        return None
    host = urllib.parse.urlsplit(ready_url).hostname or "127.0.0.1"
    return foreign_listener_problem(api_port, host, engine.pid)


def _follow(phases: StartupPhases, follower: LogFollower, download_folder: Path | None, now: float) -> None:
    """Bring the start-up phases up to date with what the engine wrote since the last look."""
    for line in follower.read_lines():
        phases.feed(line, now)
    if download_folder is not None and phases.phase in (STARTING, LOADING, DOWNLOADING):
        phases.note_download(*scan_download(download_folder), now)


class EngineProcess:
    """One vLLM engine. Nothing happens until :meth:`start`."""

    def __init__(self, argv: Sequence[str], env: Mapping[str, str], log_path: Path,
                 spawn: Spawn = subprocess.Popen) -> None:
        self.argv = list(argv)
        self.env = dict(env)
        self.log_path = log_path
        self._spawn = spawn
        self._proc: subprocess.Popen[bytes] | None = None
        self._watchdog: subprocess.Popen[bytes] | None = None
        self._watch_fd: int | None = None
        #: Set by :meth:`stop`: when the group is to be gone.
        self.stop_deadline: float | None = None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def start(self) -> None:
        """Start the watchdog, then the engine, then tell the watchdog the engine's process group.

        The kill path exists before the engine does: a failure to start the watchdog (EAGAIN under a
        pids limit) starts no engine, and any failure once the engine is spawned kills its whole
        process group before the error goes on. Raises ``OSError`` (or the operator's error for a
        symbolic link planted as the log)."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        try:  # a symbolic link planted as vllm.log is refused, never followed
            fd = files.open_append(self.log_path, 0o644)
        except files.SymlinkRefused as exc:
            raise exc.as_error() from None
        with os.fdopen(fd, "ab") as log:
            self._start_watchdog()
            try:
                stamp = time.strftime("%Y-%m-%dT%H:%M:%S%z")
                log.write(f"\n===== carbonforge-runtime starting vLLM at {stamp} =====\n".encode())
                log.write(("$ " + " ".join(redact_args(self.argv)) + "\n").encode())
                log.flush()
                self._proc = self._spawn(
                    self.argv,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=self.env,
                    start_new_session=True,
                    preexec_fn=_die_with_parent,
                )
                self._arm_watchdog(self._proc.pid)
            except BaseException:
                self._abandon_start()
                raise

    def _start_watchdog(self) -> None:
        read_end, write_end = os.pipe()  # neither end is inherited by the engine (close_fds)
        try:
            self._watchdog = self._spawn(
                [sys.executable, "-c", _WATCHDOG],
                stdin=read_end, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
            )
        except BaseException:
            os.close(write_end)
            raise
        finally:
            os.close(read_end)
        self._watch_fd = write_end

    def _arm_watchdog(self, pgid: int) -> None:
        """Name the engine's process group to the watchdog (it dies with the runtime from now on)."""
        assert self._watch_fd is not None
        line = f"{pgid}\n".encode()
        if os.write(self._watch_fd, line) != len(line):  # a pipe takes a short write whole
            raise OSError(f"the engine's watchdog was not told the engine's process group {pgid}")

    def _abandon_start(self) -> None:
        """A failure during :meth:`start`: kill whatever of the engine was spawned (its whole group)
        and wait for it, then release the watchdog."""
        if self._proc is not None:
            self.signal_group(signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(KILL_WAIT_S)
            until = time.monotonic() + KILL_WAIT_S
            while self.group_alive() and time.monotonic() < until:
                time.sleep(0.05)
        self.release_watchdog()

    @property
    def watchdog_pid(self) -> int | None:
        return self._watchdog.pid if self._watchdog else None

    def release_watchdog(self) -> None:
        """Once the engine's group is gone: end the watchdog without letting it act."""
        if self._watchdog is not None:
            with contextlib.suppress(OSError):
                self._watchdog.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._watchdog.wait(5.0)
            self._watchdog = None
        if self._watch_fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._watch_fd)
            self._watch_fd = None

    def poll(self) -> int | None:
        return self._proc.poll() if self._proc else None

    def signal_group(self, sig: int) -> None:
        if self._proc is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self._proc.pid, sig)

    def wait(self, timeout_s: float) -> int | None:
        if self._proc is None:
            return None
        try:
            return self._proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def group_alive(self) -> bool:
        """Whether a process of the engine's group still runs (zombies, which only wait to be
        collected by their parent, do not count)."""
        if self._proc is None:
            return False
        return group_running(self._proc.pid)

    def stop(self, deadline: float, escalate: Callable[[], bool] = lambda: False,
             watch: Callable[[], None] | None = None) -> tuple[int | None, bool]:
        """SIGTERM the engine's API server and have the whole group gone by ``deadline`` (a
        ``time.monotonic()`` value): SIGKILL to the group KILL_WAIT_S before it at the latest, at once
        as soon as ``escalate()`` is true (a second signal); every wait ends by ``deadline``.

        Only the leader is signalled: it drains in-flight requests and then shuts its own engine
        processes down in order. Signalling the whole group would kill the engine core and its
        workers mid-drain. ``watch``, when given, is called every WATCH_INTERVAL_S while waiting (a
        :class:`~carbonforge_runtime.runtime.process.shutdown_watch.ShutdownWatch` reading the log).
        Returns (engine exit code, whether SIGKILL was needed).
        """
        if self._proc is None:
            return None, False
        self.stop_deadline = deadline
        kill_at = deadline - KILL_WAIT_S
        every_s = POLL_INTERVAL_S if watch is None else WATCH_INTERVAL_S
        look = watch if watch is not None else (lambda: None)
        if self._proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self._proc.send_signal(signal.SIGTERM)
        code = self._proc.poll()
        while code is None and time.monotonic() < kill_at and not escalate():
            look()
            code = self.wait(min(every_s, max(kill_at - time.monotonic(), 0.0)))
        killed = code is None
        # Give the leader's children a moment to finish their own exit, then remove stragglers.
        stragglers_until = min(time.monotonic() + STRAGGLER_GRACE_S, kill_at)
        while not killed and self.group_alive() and time.monotonic() < stragglers_until and not escalate():
            look()
            time.sleep(min(every_s, 0.1))
        self.signal_group(signal.SIGKILL)
        if code is None:
            code = self.wait(max(deadline - time.monotonic(), 0.0))
        while self.group_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        return code, killed


class StopFlag:
    """Set from a signal handler; polled by the supervision loop. The first SIGTERM or SIGINT asks
    for a drain; a second one asks to stop at once."""

    def __init__(self) -> None:
        self.signal: int | None = None
        self.count = 0

    def __call__(self, signum: int, _frame: object) -> None:
        self.signal = signum
        self.count += 1

    @property
    def again(self) -> bool:
        """A second signal arrived: stop without waiting for the drain."""
        return self.count >= 2

    def install(self) -> None:
        signal.signal(signal.SIGTERM, self)
        signal.signal(signal.SIGINT, self)

    @property
    def set(self) -> bool:
        return self.signal is not None


@dataclass(frozen=True)
class GroupLoss:
    """The group lost a host: why, and whether it was an orderly stop (the leader stopped the group)."""

    message: str
    orderly: bool = False


class GroupHooks:
    """What the supervisor asks of a host's group watch (:mod:`carbonforge_runtime.runtime.group.watch`)."""

    #: Whether word of an orderly stop can come at all (a worker's, from its leader).
    hears_orderly_stop = False

    def loss(self) -> GroupLoss | None:
        """Set once the group can no longer serve."""
        return None

    def hosts_lost(self) -> int:
        """How many hosts of the group this host has found lost (the metric carbonforge_group_hosts_lost)."""
        return 0

    def on_loss(self, loss: GroupLoss) -> None:
        """Called once, before the engine is stopped (the leader turns /health to 503 here)."""

    def before_stop(self, deadline: float, hurry: Callable[[], bool]) -> None:
        """Called on a stop signal, before the engine is signalled; returns by ``deadline`` or when
        ``hurry()`` (a second signal)."""

    def close(self) -> None:
        """The runtime is done with the group (after the engine stopped)."""


def _group_lost(engine: EngineProcess, loss: GroupLoss, group: GroupHooks, log: logging.Logger) -> ExitReport:
    if loss.orderly:
        log.info(f"{loss.message}: stopping vLLM")
    else:
        log.error(f"{loss.message}: the group cannot serve without it; stopping vLLM")
    group.on_loss(loss)
    code, killed = engine.stop(deadline_within(GROUP_LOST_GRACE_S))
    log.info("vLLM stopped" + (" (killed)" if killed else ""))
    return ExitReport("stopped" if loss.orderly else "group-lost", code, 0 if loss.orderly else 1)


#: After a group member's engine exited on its own, how long to wait for word of an orderly stop.
ORDERLY_END_WAIT_S = 3.0


def _orderly_group_end(group: GroupHooks | None) -> GroupLoss | None:
    """The group's orderly stop, if one arrives within ORDERLY_END_WAIT_S; None otherwise."""
    if group is None or not group.hears_orderly_stop:
        return None
    deadline = time.monotonic() + ORDERLY_END_WAIT_S
    while True:
        loss = group.loss()
        if loss is not None or time.monotonic() >= deadline:
            return loss if loss is not None and loss.orderly else None
        time.sleep(0.1)


def supervise(
    engine: EngineProcess,
    ready_url: str | None,
    ready_timeout_s: float,
    drain_timeout_s: float,
    log: logging.Logger,
    on_ready: Callable[[], None],
    stop: StopFlag,
    api_port: int | None = None,
    download_folder: Path | None = None,
    group: GroupHooks | None = None,
) -> ExitReport:
    """Start the engine, wait for readiness, serve until a signal or the engine's death.

    With ``api_port``, readiness also needs the socket listening on that port to belong to the
    engine's process group: a ``/health`` answer from another server is not our engine being ready.
    Without ``ready_url`` (a headless worker of a group, which runs no API server) the engine is
    supervised from its start, with no readiness to wait for. With ``group`` (a host of a multi-host
    group) the engine is stopped as soon as the group has lost a host, and a stop waits for what
    ``group.before_stop`` waits for (a worker: its leader's end) before signalling the engine.
    Until ready, the engine's log (and ``download_folder``, the served repository's folder in the
    Hugging Face cache, for downloads) tells which start-up phase it is in.

    The phases, each ending the run with an :class:`ExitReport` or handing on to the next:
    :func:`_start`, :func:`_wait_for_ready`, :func:`_serve`, :func:`_stop`; whatever the path out,
    :func:`_let_group_leave` last."""
    if stop.set:  # the signal came while the launch was being prepared: start nothing
        log.info(f"received {_signal_name(stop)} before vLLM was started: not starting it")
        return ExitReport("stopped", None, 0)
    try:  # from the engine's spawn on, every failure kills its whole group before going on
        started = _start(engine, headless=ready_url is None, log=log)
        if ready_url is not None:
            report = _wait_for_ready(engine, started, ready_url, ready_timeout_s, log, on_ready, stop,
                                     api_port, download_folder, group)
            if report is not None:
                return report
        report = _serve(engine, log, stop, group)
        return report if report is not None else _stop(engine, drain_timeout_s, log, stop, group)
    except BaseException:
        engine.stop(deadline_within(SHUTDOWN_GRACE_S - KILL_WAIT_S))
        raise
    finally:
        _let_group_leave(engine)


@dataclass
class _Started:
    """What :func:`_start` hands on: when the engine started, and the reading of its start-up phases."""

    at: float
    phases: StartupPhases
    follower: LogFollower


def _signal_name(stop: StopFlag) -> str:
    return signal.Signals(stop.signal or signal.SIGTERM).name


def _start(engine: EngineProcess, headless: bool, log: logging.Logger) -> _Started:
    """Phase 1: start the engine; its start-up phases are read from what it appends to its log."""
    try:
        log_offset = engine.log_path.stat().st_size
    except OSError:
        log_offset = 0
    at = time.monotonic()
    engine.start()
    try:
        if headless:
            log.info("vLLM started headless (a worker of the group): it serves through the leader's API")
        return _Started(at, StartupPhases(at), LogFollower(engine.log_path, log_offset))
    except BaseException:  # nothing can be in flight yet: the group is killed at once
        engine.stop(deadline_within(EARLY_STOP_GRACE_S))
        raise


def _wait_for_ready(engine: EngineProcess, started: _Started, ready_url: str, ready_timeout_s: float,
                    log: logging.Logger, on_ready: Callable[[], None], stop: StopFlag, api_port: int | None,
                    download_folder: Path | None, group: GroupHooks | None) -> ExitReport | None:
    """Phase 2: poll until ``ready_url`` answers from the engine (``on_ready`` is then called and
    ``None`` returned), or end the run: the engine exited, the group lost a host, a stop signal, the
    port is another process's, or ``ready_timeout_s`` passed."""
    last_progress = started.at
    ready = False
    while not ready:
        code = engine.poll()  # has it exited? before: is it ready?
        if code is not None:
            return _engine_exited(engine, code, log, group, started, download_folder)
        if group is not None and (loss := group.loss()) is not None:
            return _group_lost(engine, loss, group, log)
        if stop.set:
            return _stop_before_ready(engine, log, stop)
        now = time.monotonic()
        _follow(started.phases, started.follower, download_folder, now)
        if http_ok(ready_url):
            problem = _port_problem(engine, ready_url, api_port)
            if problem is not None:
                return _refuse_foreign_port(engine, log, problem)
            ready = True
            _declare_ready(started, download_folder, log, on_ready)
        elif now - started.at > ready_timeout_s:
            return _not_ready_in_time(engine, started, ready_timeout_s, log)
        elif now - last_progress >= PROGRESS_INTERVAL_S:
            last_progress = now
            log.info(f"engine starting, {now - started.at:.0f} s so far: {started.phases.progress(now)} "
                     f"(details in {engine.log_path})")
        time.sleep(POLL_INTERVAL_S)
    return None


def _declare_ready(started: _Started, download_folder: Path | None, log: logging.Logger,
                   on_ready: Callable[[], None]) -> None:
    """The engine answers its readiness probe: log how long each start-up phase took, then ``on_ready``."""
    ready_at = time.monotonic()
    _follow(started.phases, started.follower, download_folder, ready_at)
    for line in started.phases.ready_summary(ready_at):
        log.info(line)
    on_ready()


def _not_ready_in_time(engine: EngineProcess, started: _Started, ready_timeout_s: float,
                       log: logging.Logger) -> ExitReport:
    log.error(f"vLLM did not become ready within {ready_timeout_s:g} s, still {started.phases.phase} "
              "(raise CF_READY_TIMEOUT_S if it needs longer): stopping it")
    engine.stop(deadline_within(SHUTDOWN_GRACE_S - KILL_WAIT_S))
    return ExitReport("timeout", None, 1)


def _stop_before_ready(engine: EngineProcess, log: logging.Logger, stop: StopFlag) -> ExitReport:
    """A stop signal before the engine was ready. Nothing can be in flight before ready: no drain, and
    vLLM may ignore SIGTERM while it initialises, so the group is killed after a short grace."""
    log.info(f"received {_signal_name(stop)} before vLLM was ready: stopping it now (nothing in flight)")
    code, killed = engine.stop(deadline_within(EARLY_STOP_GRACE_S))
    log.info("vLLM stopped before it was ready" + (" (killed)" if killed else ""))
    return ExitReport("stopped", code, 0)


def _refuse_foreign_port(engine: EngineProcess, log: logging.Logger, problem: str) -> ExitReport:
    """The API port answers, but not (only) from the engine: the engine is not declared ready."""
    log.error(f"{problem}; the engine is not declared ready")
    log.error("the API port must be this runtime's alone: stop the other process, or serve on "
              "a free port (CF_PORT, or --port in the vLLM arguments); stopping vLLM")
    engine.stop(deadline_within(EARLY_STOP_GRACE_S))
    return ExitReport("not-ours", None, 1)


def _serve(engine: EngineProcess, log: logging.Logger, stop: StopFlag, group: GroupHooks | None) -> ExitReport | None:
    """Phase 3: the engine serves. Returns ``None`` on a stop signal (the stop is the next phase), or
    ends the run when the engine exits or the group loses a host."""
    while True:
        code = engine.poll()
        if code is not None:
            return _engine_exited(engine, code, log, group, None, None)
        if group is not None and (loss := group.loss()) is not None:
            return _group_lost(engine, loss, group, log)
        if stop.set:
            return None
        _nap(stop, POLL_INTERVAL_S)


def _nap(stop: StopFlag, seconds: float) -> None:
    """Sleep ``seconds``, or less when a stop signal comes (seen within WATCH_INTERVAL_S)."""
    until = time.monotonic() + seconds
    while not stop.set and (left := until - time.monotonic()) > 0:
        time.sleep(min(WATCH_INTERVAL_S, left))


def _stop(engine: EngineProcess, drain_timeout_s: float, log: logging.Logger, stop: StopFlag,
          group: GroupHooks | None) -> ExitReport:
    """Phase 4: a stop signal while serving. The engine drains up to ``drain_timeout_s`` and its group
    is gone by :func:`~carbonforge_runtime.runtime.process.drain.stop_bound_s` after the signal; a
    second signal kills it at once."""
    latest = stop_bound_s(drain_timeout_s)
    deadline = drain_deadline(drain_timeout_s)
    log.info(f"received {_signal_name(stop)}: stopping vLLM "
             f"(drain up to {drain_timeout_s:g} s, stopped within {latest:g} s at the latest; "
             "a second signal stops it at once)")
    if group is not None:
        group.before_stop(deadline - KILL_WAIT_S, lambda: stop.again)
    watch, look = _shutdown_watch(engine, log)
    code, killed = engine.stop(deadline, escalate=lambda: stop.again, watch=look)
    look()
    if killed and stop.again:
        log.warning("second signal: vLLM killed without finishing its drain")
        return ExitReport("killed", code, StopForced.exit_code)
    if killed:
        log.error("vLLM did not stop within the drain time: killed")
        return ExitReport("killed", code, DrainOverrun.exit_code)
    if watch is not None and watch.ended_leader and code == -signal.SIGKILL:
        log.info("vLLM stopped (its shutdown complete)")
        return ExitReport("stopped", code, 0)
    log.info(f"vLLM stopped ({describe_exit(code if code is not None else 0)})")
    clean = code in (0, -signal.SIGTERM, 128 + signal.SIGTERM)
    return ExitReport("stopped", code, 0 if clean else 1)


def _shutdown_watch(engine: EngineProcess, log: logging.Logger) -> tuple[ShutdownWatch | None, Callable[[], None]]:
    """A :class:`ShutdownWatch` on what the engine appends to its log from now on, and the function
    that feeds it (and logs what it did); no watch for an engine that was never started."""
    if engine.pid is None:
        return None, lambda: None
    try:
        offset = engine.log_path.stat().st_size
    except OSError:
        offset = 0
    follower = LogFollower(engine.log_path, offset)
    watch = ShutdownWatch(engine.pid)
    broken: list[Exception] = []

    def look() -> None:
        if broken:
            return
        try:  # the watch only shortens a stop: a failure of its own leaves the stop as vLLM runs it
            for line in follower.read_lines():
                watch.feed(line)
        except Exception as exc:
            broken.append(exc)
            log.warning(f"reading vLLM's shutdown from its log failed ({exc}): waiting for vLLM's own exit")
        for action in watch.actions:
            log.info(action)
        watch.actions.clear()

    return watch, look


def _engine_exited(engine: EngineProcess, code: int, log: logging.Logger, group: GroupHooks | None,
                   started: _Started | None, download_folder: Path | None) -> ExitReport:
    """The engine's API server exited on its own: before it was ready (``started`` holds its start-up
    phases) or while serving (``started`` is ``None``). Its group is killed; a group member whose
    group is stopping in order ends cleanly, any other exit is reported from the engine's log."""
    engine.signal_group(signal.SIGKILL)
    ended = _orderly_group_end(group)
    if ended is not None:  # a worker's vLLM may notice its leader's stop before the word does
        log.info(f"{ended.message}: vLLM stopped ({describe_exit(code)})")
        return ExitReport("stopped", code, 0)
    tail = log_tail(engine.log_path)
    if started is not None:
        _follow(started.phases, started.follower, download_folder, time.monotonic())
    return report_engine_exit(log, code, engine.log_path, tail, started.phases if started is not None else None)


def _let_group_leave(engine: EngineProcess) -> None:
    """The last step on every path out: SIGKILLed members take a moment to leave the group (a stop has
    had its KILL_WAIT_S for that); once it is gone the watchdog is released, otherwise it stays, to
    kill the group when the runtime exits."""
    deadline = min(time.monotonic() + KILL_WAIT_S, engine.stop_deadline or math.inf)
    while engine.group_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    if not engine.group_alive():
        engine.release_watchdog()
