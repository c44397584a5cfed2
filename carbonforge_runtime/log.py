"""The runtime's own short log (stderr). The engine's output goes to vllm.log instead."""

from __future__ import annotations

import logging
import sys

LOGGER_NAME = "carbonforge"


def get_logger() -> logging.Logger:
    return logging.getLogger(LOGGER_NAME)


def configure(level: int = logging.INFO) -> None:
    logger = get_logger()
    if logger.handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s carbonforge %(levelname)s %(message)s", "%Y-%m-%dT%H:%M:%S"))
    logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False


def banner(lines: list[str]) -> str:
    """A loud multi-line block for warnings an operator must not miss."""
    width = max(len(line) for line in lines) + 4
    rule = "!" * width
    body = [f"! {line.ljust(width - 4)} !" for line in lines]
    return "\n".join([rule, *body, rule])
