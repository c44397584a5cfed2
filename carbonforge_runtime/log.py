"""The runtime's own short log: stderr, and while serving also ``runtime.log`` in the log directory.

The engine's output goes to vllm.log instead. Messages are composed with secrets already redacted
(command lines through ``redact_args``, endpoints through ``redact_url``), so both destinations get
the same safe text.
"""

from __future__ import annotations

import io
import logging
import logging.handlers
import sys
from pathlib import Path

from carbonforge_runtime import files

LOGGER_NAME = "carbonforge"
#: The runtime's own log file, beside vllm.log in the log directory.
RUNTIME_LOG_NAME = "runtime.log"
#: Size-based rotation of runtime.log: up to 10 MiB per file, three older files kept (runtime.log.1 .. .3).
RUNTIME_LOG_MAX_BYTES = 10 * 1024 * 1024
RUNTIME_LOG_BACKUPS = 3
_FORMAT = "%(asctime)s carbonforge %(levelname)s %(message)s"
_DATE_FORMAT = "%Y-%m-%dT%H:%M:%S"


def get_logger() -> logging.Logger:
    return logging.getLogger(LOGGER_NAME)


def configure(level: int = logging.INFO) -> None:
    logger = get_logger()
    if logger.handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(_FORMAT, _DATE_FORMAT))
    logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False


class _Pending(logging.Handler):
    """Keeps the records of a launch until it is known to go ahead (bounded)."""

    LIMIT = 1000

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        if len(self.records) < self.LIMIT:
            self.records.append(record)


class _NoFollowRotatingHandler(logging.handlers.RotatingFileHandler):
    """Size-based rotation that never writes through a symbolic link: the file is opened (at start
    and after each rotation) with ``O_NOFOLLOW``, so a link planted as runtime.log is refused. The
    rotation itself only renames and removes names, which moves or deletes a planted link without
    touching what it points at."""

    _refusal_shown = False

    def _open(self) -> io.TextIOWrapper:
        fd = files.open_append(self.baseFilename, 0o644)
        return open(fd, "a", encoding=self.encoding, errors=self.errors)

    def handleError(self, record: logging.LogRecord) -> None:
        refused = sys.exc_info()[1]
        if isinstance(refused, files.SymlinkRefused):  # one line, once: not a traceback per record
            if not self._refusal_shown:
                self._refusal_shown = True
                sys.stderr.write(f"carbonforge: runtime.log is not written: {refused}; fix: {refused.remedy}\n")
            return
        super().handleError(record)


class RuntimeLogFile:
    """The runtime's log in ``runtime.log`` beside vllm.log, rotated by size.

    Created when a serve starts, it holds the records logged while the launch is prepared; :meth:`open`
    (once the log directory is known to be writable and the launch goes ahead) writes them, and every
    later record, to the file. A launch refused earlier writes no file. :meth:`close` detaches it."""

    def __init__(self) -> None:
        self._pending: _Pending | None = _Pending()
        self.handler: logging.handlers.RotatingFileHandler | None = None
        get_logger().addHandler(self._pending)

    def open(self, log_dir: Path) -> None:
        logger = get_logger()
        handler = _NoFollowRotatingHandler(
            log_dir / RUNTIME_LOG_NAME, maxBytes=RUNTIME_LOG_MAX_BYTES, backupCount=RUNTIME_LOG_BACKUPS,
            encoding="utf-8",
        )
        handler.setFormatter(logging.Formatter(_FORMAT, _DATE_FORMAT))
        if self._pending is not None:
            logger.removeHandler(self._pending)
            for record in self._pending.records:
                handler.handle(record)
            self._pending = None
        logger.addHandler(handler)
        self.handler = handler

    def close(self) -> None:
        logger = get_logger()
        if self._pending is not None:
            logger.removeHandler(self._pending)
            self._pending = None
        if self.handler is not None:
            logger.removeHandler(self.handler)
            self.handler.close()
            self.handler = None


def banner(lines: list[str]) -> str:
    """A loud multi-line block for warnings an operator must not miss."""
    width = max(len(line) for line in lines) + 4
    rule = "!" * width
    body = [f"! {line.ljust(width - 4)} !" for line in lines]
    return "\n".join([rule, *body, rule])
