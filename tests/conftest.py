from __future__ import annotations

import pytest

from tests.support import tiny_model_dir


@pytest.fixture(autouse=True)
def _no_context_key(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests decide the launch mode themselves."""
    monkeypatch.delenv("CF_CONTEXT_KEY", raising=False)
    monkeypatch.delenv("CARBONFORGE_LICENSE_KEY", raising=False)


@pytest.fixture(scope="session")
def tiny_model() -> str:
    return str(tiny_model_dir())


