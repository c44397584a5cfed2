"""Follow a runtime's request trace file while it is written: the records of given request ids."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any


class TraceTail:
    """Reads whole lines appended to ``path`` since the last read, keyed by request id."""

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
            record = json.loads(line)
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
