"""How a supervised run ended, and what the operator is told when the engine exits on its own: its exit
status in words, the last lines of ``vllm.log`` and, when they match a known cause, a hint.
"""

from __future__ import annotations

import logging
import re
import signal
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from carbonforge_runtime.runtime.process.startup_phases import StartupPhases


@dataclass
class ExitReport:
    """How a supervised run ended."""

    #: "stopped" (by signal, clean), "killed" (needed SIGKILL), "early-exit", "died", "timeout",
    #: "not-ours" (another process answers the API port), "group-lost"
    outcome: str
    engine_code: int | None
    exit_code: int


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"code {128 - code}, killed by {name}"
    return f"code {code}"


def log_tail(path: Path, lines: int = 25) -> list[str]:
    try:
        with path.open("r", encoding="utf-8", errors="replace") as handle:
            return [line.rstrip("\n") for line in deque(handle, maxlen=lines)]
    except OSError:
        return []


#: (pattern in vllm.log, hint for the operator). First match wins.
HINTS: tuple[tuple[re.Pattern[str], str], ...] = (
    (
        re.compile(r"out of memory|OutOfMemoryError|memory allocation failed|CUDA error: out of memory|"
                   r"No available memory for the cache blocks", re.I),
        "the GPU does not have enough free memory for this recipe: set CF_GPU_MEMORY_UTILIZATION=0.6, or "
        "CF_VLLM_EXTRA_ARGS=\"--enforce-eager\" to skip CUDA graph capture (both depart from the benchmark); "
        "check with nvidia-smi that nothing else holds GPU memory",
    ),
    (
        re.compile(r"Could not find nvcc|cuda_home='[^']*' doesn't exist", re.I),
        "the engine needs a CUDA toolkit to compile its sampler: install one on the host, or set "
        "VLLM_USE_FLASHINFER_SAMPLER=0",
    ),
    (
        re.compile(r"LocalEntryNotFoundError|outgoing traffic has been disabled|Cannot find an appropriate "
                   r"cached snapshot", re.I),
        "the model's weights are not in the Hugging Face cache and HF_HUB_OFFLINE=1 forbids downloading them: "
        "set HUGGINGFACE_HUB_CACHE to the directory you prefetched into (the engine looks in its hub/ layout)",
    ),
    (
        re.compile(r"Address already in use|address already in use", re.I),
        "another process already listens on the API port: stop it or set CF_PORT (or --port) to a free port",
    ),
    (
        re.compile(r"unrecognized arguments|error: argument", re.I),
        "vLLM rejected a command-line flag: check CF_VLLM_EXTRA_ARGS and any flags after --",
    ),
    (
        re.compile(r"gated repo|401 Client Error|Access to model .* is restricted", re.I),
        "the model is gated on Hugging Face: pass HF_TOKEN with access to it",
    ),
)


def hint_for(lines: Sequence[str]) -> str | None:
    text = "\n".join(lines)
    for pattern, hint in HINTS:
        if pattern.search(text):
            return hint
    return None


def report_engine_exit(log: logging.Logger, code: int, log_path: Path, tail: Sequence[str],
                       startup: StartupPhases | None) -> ExitReport:
    """Log that the engine exited on its own (``tail``: the last lines of its ``log_path``) and say how
    the run ended: before it was ready (``startup``, the start-up phases seen until then) or while it
    served (``startup`` is ``None``)."""
    when = f"before becoming ready, while {startup.phase}" if startup is not None else "while serving"
    log.error(f"vLLM exited ({describe_exit(code)}) {when}")
    if startup is not None:
        log.error(f"start-up phases until then: {startup.describe_durations(time.monotonic())}")
    log.error(f"last lines of {log_path}:")
    for line in tail:
        log.error(f"  | {line}")
    hint = hint_for(tail)
    if hint:
        log.error(f"hint: {hint}")
    return ExitReport("early-exit" if startup is not None else "died", code, code if code > 0 else 1)
