"""What every benchmark shares: the engine process, CPU pinning, process trees, trace reads, percentiles.

* :class:`EngineProcess` serves one engine (the runtime, or plain vLLM) as a child process in its own
  session, with a deadline on readiness and a stop that ends in SIGKILL for every process of its
  tree; :func:`runtime` builds the usual one (``python -m carbonforge_runtime ARGS`` on a free port,
  the built-in tiny model, logs in a directory of the caller's).
* :func:`pin_processes` gives the engine's worker the first CPU to itself; :func:`lower_engine_core`
  runs the engine core's spinning main thread at nice 19.
* Process trees come from psutil (:func:`tree`, :func:`tree_cpu_s`, :func:`other_vllm_servers`).
* :class:`TraceTail` follows the runtime's request trace while it is written; :func:`jsonl_records`
  reads a whole file (a step log, sim's records), both parsed by the offline tools' trace reader.
* :func:`percentile` is the project's one quantile (nearest rank, ``core/quantiles.py``).
* :func:`timed_run` times a short child process (a CLI start, a dry run).
* :func:`commit` and :func:`command` name what made a result file (every file in ``results/`` does).

Scripts under ``benchmarks/`` put the repository on ``sys.path`` and import this module as
``benchmarks.harness``.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import psutil

from carbonforge_runtime.core.quantiles import quantile
from carbonforge_runtime.offline.trace_reader import loads_line, numbered_records

REPO = Path(__file__).resolve().parent.parent
#: The built-in tiny CPU recipe.
TINY_KEY = "cf-tiny:bf16:chat:cpu"
#: What the runtime logs once the engine answers (before it, /health may already answer).
READY_LINE = "ready: OpenAI API"
#: The engine core process's name (``comm``, cut to 15 characters by the kernel).
ENGINE_CORE_NAME = "VLLM::EngineCor"


def log(text: str) -> None:
    print(text, flush=True)


# -- percentiles ------------------------------------------------------------------------------------


def request_figures(records: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """Mean and p99 e2e and mean TTFT (seconds), and throughput (requests a second from the first
    arrival to the last completion) of the requests that finished, read alike from the runtime's
    trace records and from sim's per-request records."""
    done = [r for r in records if r.get("finish_reason") in ("length", "stop") and r.get("e2e_latency_s") is not None]
    if not done:
        nan = float("nan")
        return {"n": 0.0, "mean_e2e": nan, "p99_e2e": nan, "mean_ttft": nan, "throughput": nan}
    e2e = [float(r["e2e_latency_s"]) for r in done]
    ttft = [float(r["ttft_s"]) for r in done if r.get("ttft_s") is not None]
    span = max(float(r["t_completion"]) for r in done) - min(float(r["t_arrival"]) for r in done)
    return {"n": float(len(done)), "mean_e2e": statistics.fmean(e2e), "p99_e2e": percentile(e2e, 0.99),
            "mean_ttft": statistics.fmean(ttft) if ttft else float("nan"),
            "throughput": len(done) / span if span > 0 else float("nan")}


def percentile(values: Iterable[float], q: float) -> float:
    """The ``q``-quantile (0 <= q <= 1) of ``values`` by nearest rank, as every figure the project
    prints; NaN when there are none."""
    found = quantile(list(values), q)
    return float("nan") if found is None else float(found)


def median(values: Iterable[float]) -> float:
    """The 0.5-quantile by nearest rank (one of the values, never the mean of the middle two)."""
    return percentile(values, 0.5)


# -- processes --------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def tree(pid: int) -> list[psutil.Process]:
    """``pid``'s live descendants (not ``pid`` itself); empty once it is gone."""
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def tree_cpu_s(pid: int) -> float:
    """CPU seconds (user and system) used so far by ``pid`` and every live descendant."""
    total = 0.0
    try:
        processes = [psutil.Process(pid), *tree(pid)]
    except psutil.Error:
        return total
    for process in processes:
        with contextlib.suppress(psutil.Error):
            times = process.cpu_times()
            total += times.user + times.system
    return total


def other_vllm_servers(ours: Iterable[int]) -> int:
    """vLLM API servers on this machine outside the trees of ``ours`` (they disturb a measurement)."""
    mine = set(ours)
    for pid in list(mine):
        mine |= {p.pid for p in tree(pid)}
    count = 0
    for process in psutil.process_iter(["cmdline"]):
        cmdline = process.info.get("cmdline") or []
        if process.pid not in mine and any("vllm.entrypoints.openai.api_server" in part for part in cmdline):
            count += 1
    return count


def pin_processes() -> str | None:
    """Give the engine's worker the first CPU to itself and keep everything else off it; the worker's
    CPU list for ``VLLM_CPU_OMP_THREADS_BIND`` (None on a one-CPU machine: nothing pinned).

    The worker's step time is what the engine benchmarks compare. Left alone, the API server, the
    engine core and the load generator share the worker's CPU at random moments, and the same run
    twice differs by 30% or more; pinned, the worker runs undisturbed. This process and its children
    (the runtime, vLLM's API server and engine core) keep to the other CPUs."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        log("  one CPU only: processes not pinned (expect noisy figures)")
        return None
    os.sched_setaffinity(0, cpus[1:])
    log(f"  engine worker on CPU {cpus[0]}; API server, engine core and client on {cpus[1:]}")
    return str(cpus[0])


def lower_engine_core(root: int) -> list[int]:
    """Lower the priority (nice 19) of the engine core's main thread under process ``root``.

    While a step runs, vLLM's engine core waits for the worker's result by spinning on shared
    memory (it yields the CPU but stays runnable), so on a machine with one CPU left for it, the
    API server and the load generator beside it wait up to hundreds of milliseconds to run: the
    requests reach the engine late and in bunches. On a GPU host the engine core has a core of its
    own. At nice 19 the spinning gives way at once to the front end and the client; the engine
    core's other threads (its input and output sockets) keep their priority (on Linux a nice value
    is per thread, and the process id names the main thread)."""
    found = []
    for process in tree(root):
        with contextlib.suppress(psutil.Error):
            if process.name().startswith(ENGINE_CORE_NAME):
                found.append(process.pid)
    for pid in found:
        os.setpriority(os.PRIO_PROCESS, pid, 19)
    return found


def timed_run(argv: Sequence[str], env: Mapping[str, str], ok_codes: tuple[int, ...] = (0,),
              timeout_s: float = 120.0) -> float:
    """Wall seconds of ``argv`` as a child process (its output dropped); exits on another status."""
    started = time.perf_counter()
    done = subprocess.run(list(argv), env=dict(env), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                          timeout=timeout_s, check=False)
    elapsed = time.perf_counter() - started
    if done.returncode not in ok_codes:
        raise SystemExit(f"{list(argv)} exited {done.returncode}: {done.stderr.decode(errors='replace')[-2000:]}")
    return elapsed


def commit() -> str:
    """The checked-out commit (short), with ``+changes`` when the tree differs from it."""
    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=False)
        return done.stdout.strip() if done.returncode == 0 else ""

    head = git("rev-parse", "--short", "HEAD") or "unknown"
    return head + ("+changes" if git("status", "--porcelain", "--untracked-files=no") else "")


def command() -> str:
    """This run's command line, relative to the repository."""
    script = Path(sys.argv[0]).resolve()
    shown = script.relative_to(REPO) if script.is_relative_to(REPO) else script
    return " ".join(["python", str(shown), *sys.argv[1:]])


# -- the engine -------------------------------------------------------------------------------------


class EngineError(RuntimeError):
    """The engine did not become ready, or did not stop, in time (it was killed)."""


class EngineProcess:
    """One serving process in its own session, its stdout and stderr in ``output_path``.

    Ready when ``/health`` answers 200 (and, with ``ready_line``, once that line is in its output);
    :meth:`wait_ready` kills it at the deadline. :meth:`stop` signals the process itself (the runtime
    or vLLM's API server shuts down its own children) and kills the whole tree after the grace
    time; :meth:`kill` is the last resort, for every process of its tree known at ready or now. As a
    context manager: started and waited for on entry, stopped on exit (killed whatever happens)."""

    def __init__(self, name: str, argv: Sequence[str], env: Mapping[str, str], output_path: Path, port: int,
                 ready_line: str | None = None, engine_log_path: Path | None = None) -> None:
        self.name = name
        self.argv = list(argv)
        self.env = dict(env)
        self.output_path = output_path
        self.port = port
        self.ready_line = ready_line
        self.engine_log_path = engine_log_path
        self.ready_timeout_s = 400.0
        self.stop_timeout_s = 60.0
        self.proc: subprocess.Popen[bytes] | None = None
        self.known: set[int] = set()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    @property
    def pid(self) -> int:
        assert self.proc is not None, f"{self.name} was not started"
        return self.proc.pid

    def start(self) -> EngineProcess:
        self.output_path.parent.mkdir(parents=True, exist_ok=True)
        with self.output_path.open("wb") as out:
            self.proc = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=self.env, cwd=REPO, start_new_session=True)
        return self

    def output(self) -> str:
        try:
            return self.output_path.read_text(errors="replace")
        except OSError:
            return ""

    def engine_log(self) -> str:
        """vLLM's own log (the runtime writes it beside its own), or the output when there is none."""
        if self.engine_log_path is None:
            return self.output()
        try:
            return self.engine_log_path.read_text(errors="replace")
        except OSError:
            return ""

    def _tails(self) -> str:
        text = self.output()[-4000:]
        if self.engine_log_path is not None:
            text += f"\n--- {self.engine_log_path.name} tail ---\n{self.engine_log()[-4000:]}"
        return text

    def _healthy(self) -> bool:
        with contextlib.suppress(OSError), urllib.request.urlopen(
                f"http://127.0.0.1:{self.port}/health", timeout=2) as resp:
            return bool(resp.status == 200)
        return False

    def wait_ready(self, timeout_s: float | None = None) -> EngineProcess:
        timeout_s = self.ready_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                code = None if self.proc is None else self.proc.returncode
                raise EngineError(f"{self.name} exited ({code}) before ready:\n{self._tails()}")
            if (self.ready_line is None or self.ready_line in self.output()) and self._healthy():
                self.known = {p.pid for p in tree(self.pid)}
                return self
            time.sleep(0.5)
        self.kill()
        raise EngineError(f"{self.name} not ready within {timeout_s:.0f} s:\n{self._tails()}")

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float | None = None) -> int:
        """Send ``sig`` and wait for the exit status; past ``timeout_s``, kill and raise EngineError."""
        timeout_s = self.stop_timeout_s if timeout_s is None else timeout_s
        assert self.proc is not None, f"{self.name} was not started"
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise EngineError(f"{self.name} still running {timeout_s:.0f} s after signal {sig}: killed\n"
                              f"{self.output()[-2000:]}") from None

    def kill(self) -> None:
        """SIGKILL to its process group and to every process of its tree, known or live."""
        if self.proc is None:
            return
        pids = self.known | {p.pid for p in tree(self.proc.pid)}
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)

    def __enter__(self) -> EngineProcess:
        try:
            self.start().wait_ready()
        except BaseException:
            self.kill()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.stop()
        except EngineError as err:
            log(f"  warning: {str(err).splitlines()[0]}")
        finally:
            self.kill()


def tiny_model_dir() -> Path:
    """The built-in tiny model, built on first use where the runtime keeps it (``CF_TINY_MODEL_DIR``)."""
    from carbonforge_runtime.runtime.weights.tiny_model import ensure_tiny_model
    from carbonforge_runtime.settings import load_settings

    return ensure_tiny_model(load_settings(os.environ).tiny_model_dir)


@functools.cache
def tiny_served_name() -> str:
    """The name the built-in tiny recipe serves its model under."""
    from carbonforge_runtime.recipes import load_recipes, recipe_dirs, resolve

    return str(resolve(TINY_KEY, load_recipes(recipe_dirs(None))).model.served_name)


def runtime(args: Sequence[str], log_dir: Path, env: Mapping[str, str] | None = None, port: int | None = None,
            name: str = "the runtime") -> EngineProcess:
    """``python -m carbonforge_runtime ARGS`` on 127.0.0.1 and a free port, offline, with the tiny
    model built, a small KV cache, its logs in ``log_dir`` (its output in ``runtime-output.txt``,
    vLLM's in ``vllm.log``); ``env`` is applied last."""
    port = port or free_port()
    full = dict(os.environ)
    full.pop("CF_CONTEXT_KEY", None)
    full.update({"CF_PORT": str(port), "CF_HOST": "127.0.0.1", "CF_LOG_DIR": str(log_dir),
                 "CF_TINY_MODEL_DIR": str(tiny_model_dir()), "HF_HUB_OFFLINE": "1",
                 "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONUNBUFFERED": "1"})
    full.update(env or {})
    return EngineProcess(name, [sys.executable, "-m", "carbonforge_runtime", *args], full,
                         log_dir / "runtime-output.txt", port, ready_line=READY_LINE,
                         engine_log_path=log_dir / "vllm.log")


# -- traces and step logs ---------------------------------------------------------------------------


class TraceTail:
    """Follows a request trace file while the runtime writes it: the whole lines appended since the
    last read, keyed by request id (each line parsed as the offline tools parse it)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.records: dict[str, dict[str, Any]] = {}
        self._offset = 0

    def _read_new(self) -> None:
        if not self.path.exists():
            return
        with self.path.open("rb") as handle:
            handle.seek(self._offset)
            data = handle.read()
        end = data.rfind(b"\n") + 1
        self._offset += end
        for line in data[:end].splitlines():
            if line.strip():
                record = loads_line(line)
                self.records[record["request_id"]] = record

    def wait(self, ids: set[str], timeout_s: float = 60.0) -> list[dict[str, Any]]:
        """The records of ``ids`` (sorted by id) once all are written, or what there is at the deadline."""
        deadline = time.monotonic() + timeout_s
        while True:
            self._read_new()
            missing = ids - self.records.keys()
            if not missing or time.monotonic() > deadline:
                break
            time.sleep(0.3)
        if missing:
            print(f"  warning: {len(missing)} trace records missing", file=sys.stderr)
        return [self.records[i] for i in sorted(ids) if i in self.records]


def jsonl_records(path: Path) -> list[dict[str, Any]]:
    """Every record of a JSONL file (a request trace, sim's records, a step log) through the trace reader."""
    return [record for _, record in numbered_records(path)]


def engine_header(path: Path) -> dict[str, Any] | None:
    """The step log's ``engine`` line (the KV capacity, the limits), None without one."""
    return next((r for r in jsonl_records(path) if r.get("kind") == "engine"), None)
