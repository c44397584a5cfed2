from __future__ import annotations

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




def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """How many runtime processes the run started (each end-to-end start costs half a minute or more)."""
    if STARTS:
        # vllm.log appears in a runtime's log directory once it has started vLLM (a licence refusal,
        # a dry run or the doctor starts none); a two-host group counts one per host.
        engines = sum(1 for log_dir in STARTS if (log_dir / "vllm.log").exists())
        terminalreporter.write_line(f"runtime processes started: {len(STARTS)}, {engines} of them started vLLM")
