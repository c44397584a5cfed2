"""Helpers for tests that run the real runtime (and the real vLLM CPU engine) as a process."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TypeVar

import psutil

REPO = Path(__file__).resolve().parents[2]
TEST_RECIPES = REPO / "tests" / "support" / "recipes"
TINY_KEY = "cf-tiny:bf16:chat:cpu"
TINY_SERVED_NAME = "carbonforge/tiny-chat"

T = TypeVar("T")

#: Runtime processes started by this test run (``RuntimeProcess.start``); the suite prints the count.
STARTS: list[Path] = []


def worker_core() -> str | None:
    """The CPU an engine started by this pytest-xdist worker binds its threads to (worker ``gwN`` takes
    core N modulo the machine's cores), so that two engines side by side do not share one core as
    vLLM's automatic binding would make them; None outside xdist (vLLM's own binding applies)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if not worker.startswith("gw"):
        return None
    cores = sorted(os.sched_getaffinity(0))
    return str(cores[int(worker[2:]) % len(cores)])


def wait_until(check: Callable[[], T], timeout_s: float, *, every_s: float = 0.2, what: str = "") -> T:
    """Call ``check`` until it returns something true or ``timeout_s`` has passed; its last result.

    With ``what``, running out of time is a failure ("timed out after N s waiting for WHAT");
    without, the caller asserts on the result it gets back. ``check`` is always called once more at
    the deadline, so a slow last poll still counts."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = check()
        if result or time.monotonic() >= deadline:
            break
        time.sleep(min(every_s, max(deadline - time.monotonic(), 0.0)))
    if not result and what:
        raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")
    return result


def group_env(recipe: object) -> dict[str, str]:
    """The variables that make this host the leader of a group sized for ``recipe`` (empty for a
    single-host recipe), so that a test can plan every shipped recipe."""
    split = getattr(recipe, "hosts", None)
    if split is None:
        return {}
    return {"CF_NNODES": str(split.nodes), "CF_NODE_RANK": "0", "CF_MASTER_ADDR": "10.0.0.1"}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def tiny_model_dir() -> Path:
    """One copy of the built-in tiny model for the whole test run."""
    from carbonforge_runtime.runtime.weights.tiny_model import ensure_tiny_model

    base = Path(os.environ.get("CF_TEST_CACHE", Path.home() / ".cache" / "carbonforge-tests"))
    return ensure_tiny_model(base / "tiny-chat")


def descendants(pid: int) -> set[int]:
    """All live descendants of ``pid``."""
    try:
        return {child.pid for child in psutil.Process(pid).children(recursive=True)}
    except psutil.Error:
        return set()


def listening_ports(pid: int) -> set[int]:
    """TCP ports a process listens on."""
    try:
        connections = psutil.Process(pid).net_connections(kind="tcp")
    except psutil.Error:
        return set()
    return {c.laddr.port for c in connections if c.status == psutil.CONN_LISTEN}


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, exited but not yet reaped, does not)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def group_members(pgid: int) -> set[int]:
    """Live processes (zombies excluded) whose process group is ``pgid``."""
    members = set()
    for process in psutil.process_iter():
        with contextlib.suppress(psutil.Error, OSError):
            if process.status() != psutil.STATUS_ZOMBIE and os.getpgid(process.pid) == pgid:
                members.add(process.pid)
    return members


class RuntimeProcess:
    """``python -m carbonforge_runtime ARGS`` with its stdout and stderr in ``log_dir/runtime-output.txt``
    (``runtime.log`` there is the runtime's own log file)."""

    def __init__(self, args: Sequence[str], log_dir: Path, port: int | None = None,
                 env: Mapping[str, str] | None = None, python: Sequence[str] | None = None) -> None:
        self.args = list(args)
        self.log_dir = log_dir
        self.port = port or free_port()
        self.env = dict(os.environ)
        self.env.update({
            "CF_PORT": str(self.port),
            "CF_HOST": "127.0.0.1",
            "CF_LOG_DIR": str(log_dir),
            "CF_TINY_MODEL_DIR": str(tiny_model_dir()),
            "HF_HUB_OFFLINE": "1",
            "VLLM_CPU_KVCACHE_SPACE": "1",
            # As the shipped CPU recipes set it, for the recipes tests write and for override mode.
            "VLLM_USE_AOT_COMPILE": "0",
        })
        self.env.pop("CF_CONTEXT_KEY", None)
        core = worker_core()
        if core is not None:
            self.env["VLLM_CPU_OMP_THREADS_BIND"] = core
        self.env.update(env or {})
        self.python = list(python or [sys.executable, "-m", "carbonforge_runtime"])
        self.proc: subprocess.Popen[bytes] | None = None
        self.known_children: set[int] = set()

    @property
    def output_path(self) -> Path:
        return self.log_dir / "runtime-output.txt"

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self) -> RuntimeProcess:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        STARTS.append(self.log_dir)
        with self.output_path.open("wb") as out:
            self.proc = subprocess.Popen(
                [*self.python, *self.args], stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=self.env, cwd=REPO, start_new_session=True,
            )
        return self

    def output(self) -> str:
        try:
            return self.output_path.read_text(errors="replace")
        except OSError:
            return ""

    def engine_log(self) -> str:
        try:
            return (self.log_dir / "vllm.log").read_text(errors="replace")
        except OSError:
            return ""

    def says(self, text: str) -> bool:
        """``text`` is in the runtime's output (a check to wait on)."""
        return text in self.output()

    def engine_log_search(self, pattern: str) -> re.Match[str] | None:
        """``pattern`` in vllm.log (a check to wait on)."""
        return re.search(pattern, self.engine_log())

    def wait_ready(self, timeout_s: float = 400.0) -> RuntimeProcess:
        proc = self.proc
        assert proc is not None

        def ready_or_exited() -> bool:
            if proc.poll() is not None:
                return True
            if "ready: OpenAI API" not in self.output():
                return False
            with contextlib.suppress(OSError), urllib.request.urlopen(
                f"http://127.0.0.1:{self.port}/health", timeout=2
            ) as resp:
                return bool(resp.status == 200)
            return False

        if wait_until(ready_or_exited, timeout_s, every_s=0.5) and proc.poll() is None:
            self.known_children = descendants(proc.pid)
            return self
        if proc.poll() is not None:
            raise AssertionError(f"runtime exited ({proc.returncode}) before ready:\n{self.output()}\n"
                                 f"--- vllm.log tail ---\n{self.engine_log()[-4000:]}")
        self.kill()
        raise AssertionError(f"runtime not ready within {timeout_s} s:\n{self.output()}\n"
                             f"--- vllm.log tail ---\n{self.engine_log()[-4000:]}")

    def wait(self, timeout_s: float) -> int:
        assert self.proc is not None
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"runtime still running after {timeout_s} s:\n{self.output()}") from None

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 90.0) -> int:
        assert self.proc is not None
        self.proc.send_signal(sig)
        return self.wait(timeout_s)

    def kill(self) -> None:
        """Last-resort cleanup: the runtime's group and every engine process it started."""
        pids = set(self.known_children)
        if self.proc is not None:
            pids |= descendants(self.proc.pid)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        if self.proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=10)

    def engine_pid(self) -> int:
        """The runtime's direct child: vLLM's API server process, never the watchdog beside it
        (``python -c``). Under a wrapper such as strace, the child is the runtime it runs."""
        assert self.proc is not None
        try:
            children = psutil.Process(self.proc.pid).children()
        except psutil.Error:
            children = []
        for child in sorted(children, key=lambda c: c.pid):
            try:
                if child.cmdline()[1:2] != ["-c"]:
                    return child.pid
            except psutil.Error:
                continue
        raise AssertionError("the runtime has no child process")

    def leftover_children(self) -> set[int]:
        return {pid for pid in self.known_children if alive(pid)}

    def describe(self, pids: set[int]) -> str:
        lines = []
        for pid in sorted(pids):
            try:
                process = psutil.Process(pid)
                cmd = " ".join(process.cmdline())
                lines.append(f"pid {pid} state {process.status()} ppid {process.ppid()} pgid {os.getpgid(pid)}: "
                             f"{cmd[:150]}")
            except (psutil.Error, OSError):
                continue
        return "\n".join(lines)


def synthetic_mooncake(path: Path, count: int, seed: int, per_second: float, prompt: tuple[int, int],
                       output: tuple[int, int]) -> Path:
    """A Mooncake-format trace of ``count`` unshared prompts: Poisson arrivals at ``per_second``,
    prompt and output sizes uniform in the given [low, high) ranges."""
    import json
    import random

    rng = random.Random(seed)
    t = 0.0
    rows = []
    for _ in range(count):
        t += rng.expovariate(per_second)
        rows.append({"timestamp": int(t * 1000), "input_length": rng.randrange(*prompt),
                     "output_length": rng.randrange(*output), "hash_ids": []})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def offline_argv(args: Sequence[str], placeholders: Mapping[str, str], key: str, output: Path) -> list[str]:
    """A test's arguments for an offline command, placeholders replaced, with ``--context-key KEY`` and
    ``--output OUTPUT`` added unless the test gives its own."""
    argv = [placeholders.get(a, a) for a in args]
    if "--context-key" not in argv:
        argv += ["--context-key", key]
    if "--output" not in argv:
        argv += ["--output", str(output)]
    return argv
