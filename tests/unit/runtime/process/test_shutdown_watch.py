"""What the stop's log watch ends, and when: a core's workers once its executor waits for them, a core
that had nothing in flight once its records are written, the API server once its HTTP shutdown is
complete; nothing while a request is in flight, nothing outside the engine's group."""

from __future__ import annotations

import signal
from pathlib import Path

from carbonforge_runtime.core.contract import CORE_DONE_MARKER
from carbonforge_runtime.runtime.process import shutdown_watch
from carbonforge_runtime.runtime.process.shutdown_watch import ShutdownWatch

LEADER, CORE, WORKER, TRACKER = 100, 200, 300, 400


def api(line: str) -> str:
    return f"(APIServer pid={LEADER}) INFO 12-04 16:57:24 [launcher.py:254] {line}"


def core(line: str, pid: int = CORE) -> str:
    return f"(EngineCore pid={pid}) INFO 12-04 16:57:24 [core.py:1454] {line}"


#: A stop with nothing in flight, as vLLM 0.32 and the scheduler log it (the leader's uvicorn lines
#: carry no prefix).
IDLE_STOP = [
    api("[shutdown] API server: shutdown triggered"),
    api("[shutdown] Process manager: send sigterm to process EngineCore"),
    core("[shutdown] EngineCore: trigger received signal=SIGTERM"),
    core("[shutdown] EngineCore: start mode=drain timeout=15s"),
    core("[shutdown] EngineCore: request processing complete; starting resource teardown"),
    core("[shutdown] EngineCore: exiting busy loop"),
    core("[shutdown] Executor: waiting for worker exit count=1"),
    core("[shutdown] Executor: all workers exited gracefully"),
    core(f"{CORE_DONE_MARKER} {CORE}"),
    api("[shutdown] MPClient: engine manager stopped"),
    api("[shutdown] API server: engine client stopped"),
    api("[shutdown] API server: shutting down FastAPI HTTP server"),
    "INFO:     Shutting down",
    "INFO:     Waiting for application shutdown.",
    "INFO:     Application shutdown complete.",
]


class Group:
    """A fake engine group: the leader, one core with one worker; a signal ends the process."""

    def __init__(self) -> None:
        self.alive = {LEADER, CORE, WORKER}
        self.parent = {CORE: LEADER, WORKER: CORE}
        self.signals: list[tuple[int, int]] = []

    def kill(self, pid: int, sig: int) -> None:
        if pid not in self.alive:
            raise ProcessLookupError(pid)
        self.signals.append((pid, sig))
        self.alive.discard(pid)

    def descendants(self, pid: int, pgid: int) -> set[int]:
        assert pgid == LEADER
        found, frontier = set(), {pid}
        while frontier:
            frontier = {c for c, p in self.parent.items() if p in frontier and c in self.alive} - found
            found |= frontier
        return found

    def member(self, pid: int, pgid: int) -> bool:
        return pgid == LEADER and pid in self.alive

    def watch(self) -> ShutdownWatch:
        return ShutdownWatch(LEADER, kill=self.kill, descendants=self.descendants, member=self.member)


def feed_until(watch: ShutdownWatch, lines: list[str], last: str) -> None:
    for line in lines:
        watch.feed(line)
        if last in line:
            return
    raise AssertionError(f"{last!r} not in the lines")


def test_a_stop_with_nothing_in_flight_ends_workers_then_core_then_leader_each_after_its_line() -> None:
    group = Group()
    watch = group.watch()
    feed_until(watch, IDLE_STOP, "exiting busy loop")
    assert group.signals == []  # the drain is over, but the executor has not given up on its workers yet
    feed_until(watch, IDLE_STOP[6:], "waiting for worker exit")
    assert group.signals == [(WORKER, signal.SIGKILL)]
    feed_until(watch, IDLE_STOP[7:], CORE_DONE_MARKER)
    assert group.signals[1:] == [(CORE, signal.SIGKILL)]
    feed_until(watch, IDLE_STOP[9:], "shutting down FastAPI")
    assert len(group.signals) == 2 and not watch.ended_leader
    for line in IDLE_STOP[12:]:
        watch.feed(line)
    assert group.signals[2:] == [(LEADER, signal.SIGKILL)] and watch.ended_leader
    assert len(watch.actions) == 3


def test_while_a_request_is_in_flight_nothing_is_ended_and_a_core_that_drained_exits_by_itself() -> None:
    group = Group()
    watch = group.watch()
    draining = [
        core("[shutdown] EngineCore: start mode=drain timeout=15s"),
        core("[shutdown] EngineCore: draining in-flight requests count=3 timeout=15s"),
        core("drain deadline near: ending 1 request(s) still in flight as aborted"),
        core(f"some request text mentioning {CORE_DONE_MARKER} {CORE} before the drain is over"),
        api("Avg prompt throughput: 1.0 tokens/s"),
    ]
    for line in draining:
        watch.feed(line)
    assert group.signals == []  # the drain is running: nothing is touched
    for line in [core("[shutdown] EngineCore: exiting busy loop"),
                 core("[shutdown] Executor: waiting for worker exit count=1")]:
        watch.feed(line)
    assert group.signals == [(WORKER, signal.SIGKILL)]
    watch.feed(core(f"{CORE_DONE_MARKER} {CORE}"))
    assert group.signals == [(WORKER, signal.SIGKILL)]  # it had requests in flight: its exit is its own
    assert CORE in group.alive


def test_lines_that_are_not_the_processes_own_end_nothing() -> None:
    group = Group()
    watch = group.watch()
    forged = [
        api(f"{CORE_DONE_MARKER} {CORE}"),  # the marker in an API server line (a logged prompt)
        f"{CORE_DONE_MARKER} {CORE}",
        core(f"{CORE_DONE_MARKER} {CORE + 1}"),  # another pid than the line's own
        api("[shutdown] Executor: waiting for worker exit count=1"),
        "INFO:     Application shutdown complete.",  # before the engine client stopped
        core("[shutdown] Executor: waiting for worker exit count=1", pid=999),  # not in the group
        core(f"{CORE_DONE_MARKER} 999", pid=999),
        core("[shutdown] Executor: waiting for worker exit count=1", pid=LEADER),
        core(f"{CORE_DONE_MARKER} {LEADER}", pid=LEADER),
    ]
    for line in forged:
        watch.feed(line)
    assert group.signals == [] and watch.actions == []


def test_the_leader_is_left_alone_while_an_engine_process_of_its_own_remains() -> None:
    group = Group()
    watch = group.watch()
    for line in IDLE_STOP:
        if "waiting for worker exit" in line or CORE_DONE_MARKER in line:
            continue  # the lines that end the core and its worker never came
        watch.feed(line)
    assert group.signals == [] and not watch.ended_leader


def test_a_process_already_gone_is_not_counted_as_ended() -> None:
    group = Group()
    group.alive.discard(WORKER)
    watch = group.watch()
    for line in IDLE_STOP[:7]:
        watch.feed(line)
    assert group.signals == [] and watch.actions == []


def fake_proc(root: Path, table: dict[int, tuple[str, int, int, str]]) -> Path:
    """A /proc with ``pid: (state, ppid, pgrp, cmdline)`` entries."""
    for pid, (state, ppid, pgrp, cmdline) in table.items():
        folder = root / str(pid)
        folder.mkdir(parents=True)
        (folder / "stat").write_text(f"{pid} (python (x)) {state} {ppid} {pgrp} {pgrp} 0 -1 4194560 0\n")
        (folder / "cmdline").write_bytes(cmdline.replace(" ", "\0").encode())
    (root / "self").mkdir()
    return root


def test_descendants_are_those_of_the_group_without_resource_trackers_or_zombies(tmp_path: Path) -> None:
    proc = fake_proc(tmp_path, {
        LEADER: ("S", 1, LEADER, "python -m vllm.entrypoints.openai.api_server"),
        TRACKER: ("S", LEADER, LEADER, "python -B -c from multiprocessing.resource_tracker import main;main(31)"),
        CORE: ("S", LEADER, LEADER, "VLLM::EngineCore"),
        WORKER: ("S", CORE, LEADER, "VLLM::Worker"),
        301: ("Z", CORE, LEADER, ""),
        302: ("S", CORE, 302, "a child that left the group"),
    })
    assert shutdown_watch.group_descendants(LEADER, LEADER, proc) == {CORE, WORKER}
    assert shutdown_watch.group_descendants(CORE, LEADER, proc) == {WORKER}
    assert shutdown_watch.in_group(CORE, LEADER, proc) and not shutdown_watch.in_group(302, LEADER, proc)
    assert not shutdown_watch.in_group(301, LEADER, proc)


def test_a_group_of_zombies_is_not_running(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(shutdown_watch.os, "killpg", lambda pgid, sig: None)  # the group exists
    zombies = fake_proc(tmp_path / "z", {LEADER: ("Z", 1, LEADER, ""), CORE: ("Z", 1, LEADER, "")})
    assert not shutdown_watch.group_running(LEADER, zombies)
    running = fake_proc(tmp_path / "r", {LEADER: ("Z", 1, LEADER, ""), TRACKER: ("S", 1, LEADER, "tracker")})
    assert shutdown_watch.group_running(LEADER, running)
