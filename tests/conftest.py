from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import settings

from tests.support import STARTS, tiny_model_dir

# Property tests check properties, not speed: a loaded CI machine must not fail them on time.
settings.register_profile("carbonforge", deadline=None)
settings.load_profile("carbonforge")


@pytest.fixture(autouse=True)
def _no_context_key(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests decide the launch mode themselves."""
    monkeypatch.delenv("CF_CONTEXT_KEY", raising=False)
    monkeypatch.delenv("CARBONFORGE_LICENSE_KEY", raising=False)


@pytest.fixture(scope="session")
def tiny_model() -> str:
    return str(tiny_model_dir())




#: Runtime log directories that pytest-xdist's workers reported at their end (empty without xdist).
_WORKER_STARTS: list[Path] = []


def pytest_sessionfinish(session: pytest.Session) -> None:
    """An xdist worker hands the runtime starts it made to the controller, which prints the total."""
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:
        workeroutput["runtime_starts"] = [str(log_dir) for log_dir in STARTS]


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: object) -> None:
    _WORKER_STARTS.extend(Path(p) for p in getattr(node, "workeroutput", {}).get("runtime_starts", []))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """How many runtime processes the run started (each end-to-end start costs half a minute or more)."""
    starts = [*STARTS, *_WORKER_STARTS]
    if starts:
        # vllm.log appears in a runtime's log directory once it has started vLLM (a licence refusal,
        # a dry run or the doctor starts none); a two-host group counts one per host.
        engines = sum(1 for log_dir in starts if (log_dir / "vllm.log").exists())
        terminalreporter.write_line(f"runtime processes started: {len(starts)}, {engines} of them started vLLM")
