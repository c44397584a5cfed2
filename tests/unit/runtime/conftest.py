"""Fixtures shared by the runtime's unit tests."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from carbonforge_runtime import log as cflog


class Lines(logging.Handler):
    """The runtime logger's messages, as text."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def runtime_log() -> Iterator[Lines]:
    """Every line the runtime logs during the test, debug lines included."""
    handler = Lines()
    logger = cflog.get_logger()
    logger.addHandler(handler)
    old = logger.level
    logger.setLevel(logging.DEBUG)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(old)
