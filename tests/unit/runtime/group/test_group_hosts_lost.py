"""How many hosts a group has lost, as the metric carbonforge_group_hosts_lost shows it: from where
the group watch decides (LeaderHooks and WorkerHooks over real watches on the loopback)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest

from carbonforge_runtime.runtime.group import watch as group_watch
from carbonforge_runtime.runtime.group.watch import LeaderHooks, LeaderWatch, WorkerHooks, WorkerWatch
from carbonforge_runtime.runtime.process.supervisor import GroupHooks
from tests.support import free_port

SECRET = b"a test group secret of some length"


@pytest.fixture(autouse=True)
def quick(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(group_watch, "BEAT_S", 0.1)
    monkeypatch.setattr(group_watch, "SILENCE_S", 1.0)


def until(condition: Callable[[], object], within_s: float = 5.0) -> None:
    deadline = time.monotonic() + within_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def join(leader: LeaderWatch, rank: int, nnodes: int) -> WorkerWatch:
    worker = WorkerWatch(rank, nnodes, "127.0.0.1", leader.port, join_timeout_s=10, secret=SECRET).start()
    until(lambda: worker.joined)
    return worker


def test_a_host_alone_has_lost_nothing() -> None:
    assert GroupHooks().hosts_lost() == 0


@pytest.mark.timeout(30)
def test_the_leader_counts_a_worker_that_left(tmp_path: Path) -> None:
    leader = LeaderWatch(3, free_port(), join_timeout_s=30, secret=SECRET, host="127.0.0.1").start()
    hooks = LeaderHooks(leader, tmp_path / "group-down")
    workers = [join(leader, 1, 3), join(leader, 2, 3)]
    try:
        until(lambda: leader.joined() == [1, 2])
        assert hooks.hosts_lost() == 0 and hooks.loss() is None
        workers[1].close()
        until(lambda: hooks.loss() is not None)
        assert hooks.hosts_lost() == 1
    finally:
        workers[0].close()
        leader.close()


@pytest.mark.timeout(30)
def test_the_leader_counts_ranks_that_never_joined_only_after_the_join_timeout(tmp_path: Path) -> None:
    leader = LeaderWatch(4, free_port(), join_timeout_s=0.5, secret=SECRET, host="127.0.0.1").start()
    hooks = LeaderHooks(leader, tmp_path / "group-down")
    worker = join(leader, 1, 4)
    try:
        assert hooks.hosts_lost() == 0  # still within the join timeout: ranks 2 and 3 may come
        until(lambda: hooks.loss() is not None)
        assert hooks.hosts_lost() == 2
    finally:
        worker.close()
        leader.close()


@pytest.mark.timeout(30)
def test_a_worker_counts_its_leader_gone_but_not_an_orderly_stop() -> None:
    leader = LeaderWatch(2, free_port(), join_timeout_s=30, secret=SECRET, host="127.0.0.1").start()
    worker = join(leader, 1, 2)
    hooks = WorkerHooks(worker)
    assert hooks.hosts_lost() == 0
    leader.close()  # no farewell: the leader's runtime died
    until(lambda: hooks.loss() is not None)
    assert hooks.hosts_lost() == 1
    worker.close()

    again = LeaderWatch(2, free_port(), join_timeout_s=30, secret=SECRET, host="127.0.0.1").start()
    stopped = join(again, 1, 2)
    again.close(farewell=True)
    until(lambda: stopped.leader_gone())
    assert WorkerHooks(stopped).hosts_lost() == 0
    stopped.close()
