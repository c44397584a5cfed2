"""The runtime serving the recipe being calibrated, as calibrate's one child process.

:class:`ServedEngine` runs ``python -m carbonforge_runtime serve --context-key KEY`` with the step
log and the request trace on, on 127.0.0.1 and a free port, its output in a file (no pipe to drain).
The process itself is the supervisor's
(:class:`carbonforge_runtime.runtime.process.supervisor.EngineProcess`, handed in by the command
line as a :data:`ProcessFactory`): a session of its own, with a watchdog that kills its process
group if calibrate itself dies, and a stop that ends in SIGKILL to the group.

Every wait has a deadline: :meth:`ServedEngine.wait_ready` ends when the runtime says it is ready,
when it exits, or at the deadline; the loads are sent with the replay machinery
(:mod:`carbonforge_runtime.offline.replay.runner`) under a deadline; the request trace is read until
the load's records are there or the deadline passes. :meth:`ServedEngine.stop` asks the runtime to
stop (SIGTERM: it drains and stops vLLM, whose own watchdog kills vLLM's process group if the
runtime dies) and kills the runtime's process group at the end of the grace time.
"""

from __future__ import annotations

import asyncio
import socket
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from carbonforge_runtime.offline.replay.aggregate import RequestOutcome
from carbonforge_runtime.offline.replay.plan import PlannedRequest
from carbonforge_runtime.offline.trace_reader import loads_line

#: What the runtime logs once the engine answers.
READY_LINE = "ready: OpenAI API"
POLL_S = 0.25
#: Variables of this process that must not reach the child (it serves the key and port it is given).
DROPPED_ENV = ("CF_CONTEXT_KEY", "CF_PORT", "CF_HOST")


class ChildProcess(Protocol):
    """What :class:`ServedEngine` needs of its process (the supervisor's ``EngineProcess`` has it)."""

    def start(self) -> None: ...

    def poll(self) -> int | None: ...

    def stop(self, deadline: float) -> tuple[int | None, bool]: ...


#: Makes the child process from (argv, environment, output file).
ProcessFactory = Callable[[Sequence[str], Mapping[str, str], Path], ChildProcess]


class EngineTrouble(Exception):
    """The engine did not start, or a load could not be sent; ``str`` says why."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _tail(path: Path, lines: int = 12) -> str:
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


class ServedEngine:
    """One runtime serving ``context_key`` with its step log and request trace under ``directory``."""

    def __init__(self, context_key: str, directory: Path, environ: Mapping[str, str], factory: ProcessFactory,
                 argv_prefix: Sequence[str] | None = None) -> None:
        self.context_key = context_key
        self.directory = directory
        self.step_log = directory / "steps.jsonl"
        self.trace = directory / "requests.jsonl"
        self.log_dir = directory / "logs"
        self.output = self.log_dir / "runtime-output.txt"
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}/v1"
        prefix = list(argv_prefix) if argv_prefix is not None else [sys.executable, "-m", "carbonforge_runtime"]
        self.argv = [*prefix, "serve", "--context-key", context_key, "--step-log", str(self.step_log),
                     "--request-trace", "standard", "--trace-file", str(self.trace)]
        env = {name: value for name, value in environ.items() if name not in DROPPED_ENV}
        env.update({"CF_PORT": str(self.port), "CF_HOST": "127.0.0.1", "CF_LOG_DIR": str(self.log_dir),
                    "PYTHONUNBUFFERED": "1"})
        self.env = env
        self._factory = factory
        self.process: ChildProcess | None = None
        self.exit_code: int | None = None

    # --- the process --------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the runtime; raises :class:`EngineTrouble` if it cannot be started."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        for path in (self.step_log, self.trace, self.output):
            path.unlink(missing_ok=True)
        process = self._factory(self.argv, self.env, self.output)
        try:
            process.start()
        except OSError as exc:
            raise EngineTrouble(f"the runtime could not be started ({exc.strerror or exc})") from None
        self.process = process

    def running(self) -> bool:
        if self.process is None:
            return False
        code = self.process.poll()
        if code is not None:
            self.exit_code = code
        return code is None

    def wait_ready(self, deadline: float, progress: Callable[[str], None] | None = None) -> float:
        """Seconds until the runtime said it is ready; raises :class:`EngineTrouble` if it exits first or
        ``deadline`` (a ``time.monotonic()`` value) passes (the engine is left to :meth:`stop`)."""
        started = time.monotonic()
        said = started
        while True:
            if self._ready():
                return time.monotonic() - started
            if not self.running():
                raise EngineTrouble(f"the runtime exited with status {self.exit_code} before the engine was ready; "
                                    f"its last lines:\n{_tail(self.output)}")
            now = time.monotonic()
            if now >= deadline:
                raise EngineTrouble(f"the engine was not ready after {now - started:.0f} s (the phase's share of "
                                    f"the budget); the runtime's last lines:\n{_tail(self.output, 4)}")
            if progress is not None and now - said >= 10.0:
                said = now
                progress(f"engine starting, {now - started:.0f} s so far")
            time.sleep(min(POLL_S, max(0.0, deadline - now)))

    def _ready(self) -> bool:
        try:
            return READY_LINE in self.output.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return False

    def stop(self, grace_s: float) -> str:
        """Stop the runtime: SIGTERM, and its whole process group killed if it has not ended after
        ``grace_s``. Says how it ended. Safe to call twice, and when it never started."""
        process = self.process
        if process is None:
            return "never started"
        if not self.running():
            return f"had exited (status {self.exit_code})"
        code, killed = process.stop(time.monotonic() + grace_s)
        self.exit_code = code
        return f"killed (SIGKILL) after {grace_s:.0f} s" if killed else "stopped"

    # --- the loads ----------------------------------------------------------------------------------

    def send(self, plan: Sequence[PlannedRequest], deadline_s: float) -> list[RequestOutcome]:
        """Send ``plan`` (the replay machinery, at its planned times) and wait for every answer, at
        most ``deadline_s``; requests still unanswered then are cancelled and reported as failed."""
        from carbonforge_runtime.offline.replay.runner import RunOptions, run_replay

        if deadline_s <= 0:
            raise EngineTrouble("no time was left to send the load")
        options = RunOptions(base_url=self.base_url, concurrency=max(1, len(plan)), deadline_s=deadline_s,
                             request_timeout_s=deadline_s, progress_every_s=1e9)
        result = asyncio.run(run_replay(plan, options))
        return result.outcomes

    def step_count(self) -> int:
        """Steps in the step log so far (its writer may lag the engine by a moment)."""
        try:
            with self.step_log.open("rb") as handle:
                return sum(1 for line in handle if b'"kind": "step"' in line or b'"kind":"step"' in line)
        except OSError:
            return 0

    def records(self, request_ids: set[str], deadline: float) -> list[dict[str, Any]]:
        """The request trace's records of ``request_ids``, waiting for them up to ``deadline`` (a
        ``time.monotonic()`` value); what is there at the deadline otherwise."""
        while True:
            found: dict[str, dict[str, Any]] = {}
            try:
                with self.trace.open("rb") as handle:
                    for line in handle:
                        if not line.strip():
                            continue
                        try:
                            record = loads_line(line)
                        except ValueError:
                            continue  # a line still being written
                        if isinstance(record, dict) and record.get("request_id") in request_ids:
                            found[str(record["request_id"])] = record
            except OSError:
                pass
            if len(found) >= len(request_ids) or time.monotonic() >= deadline:
                return list(found.values())
            time.sleep(POLL_S)
