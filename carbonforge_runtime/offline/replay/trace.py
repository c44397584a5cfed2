"""Reading a recording to replay: our JSONL traces (standard or full level) and the Azure CSV format.

JSONL traces are read by the offline tools' one reader (:mod:`carbonforge_runtime.offline.trace_reader`),
whose :class:`~carbonforge_runtime.offline.trace_reader.TraceInputError` covers a file that cannot be
read as JSON lines. Every other problem a user can cause (empty file, unknown columns, a bad value on
a given line) is a :class:`ReplayError` naming the file, the line and the fix.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from carbonforge_runtime.errors import UsageError
from carbonforge_runtime.offline.trace_reader import (
    MAX_REQUEST_TOKENS,
    REPLAY_TRACE_INPUTS,
    DamagedInput,
    TraceInputError,
    check_readable,
    line_batches,
    numbered_records,
)

AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
#: Optional columns (and JSONL fields): the request's tenant and priority class, for the twin's fairness.
TENANCY_COLUMNS = ("tenant", "priority")
#: Digits of a fraction of a second that are read (nanoseconds); more are ignored.
_FRACTION_DIGITS = 9


class ReplayError(UsageError):
    """The recording or the replay options cannot be used."""


@dataclass(frozen=True)
class RecordedRequest:
    """One request of a recording, as the replayer needs it."""

    index: int  # position in arrival order
    arrival_s: float  # seconds after the first arrival of the recording
    prompt_tokens: int
    output_tokens: int
    prompt_text: str | None = None  # the rendered prompt (full-level traces)
    prefix_hash: int | None = None  # the engine's prefix hash, when the trace carries it
    template: str | None = None  # the generator's template name (synthetic workloads)
    tenant: str | None = None  # the tenant column (None: the default tenant)
    priority: int = 0  # the priority column: the request's priority class


@dataclass(frozen=True)
class Recording:
    path: str
    kind: str  # "azure-csv", "jsonl-standard" or "jsonl-full"
    requests: tuple[RecordedRequest, ...]

    @property
    def has_text(self) -> bool:
        return self.kind == "jsonl-full"


def load_recording(path: Path | str) -> Recording:
    """Read ``path``: ``.csv`` is the Azure format, anything else JSON lines."""
    path = Path(path)
    check_readable(path, inputs=REPLAY_TRACE_INPUTS)
    if path.suffix.lower() == ".csv":
        return _load_azure(path)
    return _load_jsonl(path)


def _fail(path: Path, line: int | None, problem: str, remedy: str) -> ReplayError:
    where = f"{path}:{line}" if line is not None else str(path)
    return ReplayError(f"{where}: {problem}", remedy)


def _shown(raw: Any) -> str:
    """A value for a message: its repr, cut short (a hostile value may be megabytes long)."""
    text = repr(raw)
    return text if len(text) <= 40 else text[:37] + "..."


def _count(path: Path, line: int, name: str, raw: Any, minimum: int = 0) -> int:
    if isinstance(raw, bool):
        raise _fail(path, line, f"{name} is a boolean, not a token count", "fix or drop that line")
    if isinstance(raw, float) and raw.is_integer():
        raw = int(raw)
    if isinstance(raw, str):
        try:
            raw = int(raw.strip())
        except ValueError:
            raise _fail(path, line, f"{name}={_shown(raw)} is not a whole number", "fix or drop that line") from None
    if not isinstance(raw, int):
        raise _fail(path, line, f"{name}={_shown(raw)} is not a whole number", "fix or drop that line")
    if raw < minimum:
        raise _fail(path, line, f"{name}={_shown(raw)} is below {minimum}", "fix or drop that line")
    if raw > MAX_REQUEST_TOKENS:
        raise _fail(path, line, f"{name}={_shown(raw)} is above {MAX_REQUEST_TOKENS:,} (no model takes that many)",
                    "fix or drop that line")
    return raw


def _seconds(path: Path, line: int, name: str, raw: Any) -> float:
    """A JSON time stamp: a finite number of seconds."""
    if isinstance(raw, bool) or not isinstance(raw, (int, float)):
        raise _fail(path, line, f"{name}={_shown(raw)} is not a number of seconds", "fix or drop that line")
    try:
        value = float(raw)
    except OverflowError:
        value = math.inf
    if not math.isfinite(value):
        raise _fail(path, line, f"{name}={_shown(raw)} is not a finite number of seconds", "fix or drop that line")
    return value


def _parse_timestamp(path: Path, line: int, raw: str) -> float:
    text = raw.strip()
    try:
        value = float(text)
    except ValueError:
        pass
    else:
        if not math.isfinite(value):
            raise _fail(path, line, f"TIMESTAMP {_shown(raw)} is not a finite number of seconds", "fix that line")
        return value
    # "2023-11-16 18:15:46.6805900": up to 7 fraction digits, which fromisoformat may not take.
    main, _, fraction = text.partition(".")
    try:
        stamp = datetime.fromisoformat(main)
    except ValueError:
        raise _fail(path, line, f"TIMESTAMP {_shown(raw)} is neither a date-time nor a number of seconds",
                    "use 'YYYY-MM-DD HH:MM:SS[.fraction]' or Unix seconds") from None
    if stamp.tzinfo is None:
        stamp = stamp.replace(tzinfo=UTC)
    try:
        seconds = stamp.timestamp()
    except (OverflowError, ValueError, OSError):
        raise _fail(path, line, f"TIMESTAMP {_shown(raw)} is out of range", "fix that line") from None
    if fraction:
        if not (fraction.isascii() and fraction.isdigit()):
            raise _fail(path, line, f"TIMESTAMP {_shown(raw)} has a malformed fraction of a second", "fix that line")
        digits = fraction[:_FRACTION_DIGITS]
        seconds += int(digits) / 10 ** len(digits)
    return seconds


def _csv_lines(path: Path) -> Iterator[str]:
    """The lines of a CSV recording through the offline tools' bounded reader (plain or gzip)."""
    try:
        for batch in line_batches(path):
            yield from batch
    except DamagedInput as exc:
        raise TraceInputError(f"{path}: {exc.reason}",
                              "copy the file again from its source; an Azure trace has one short row per "
                              "request") from None


def _load_azure(path: Path) -> Recording:
    reader = csv.reader(_csv_lines(path))
    try:
        return _read_azure(path, reader)
    except csv.Error as exc:
        raise _fail(path, reader.line_num, f"is not CSV ({exc})",
                    f"an Azure trace is CSV with the header {','.join(AZURE_COLUMNS)}") from None


def _read_azure(path: Path, reader: Any) -> Recording:
    header = next(reader, None)
    if header is None or not any(cell.strip() for cell in header):
        raise _fail(path, None, "the file is empty",
                    f"an Azure trace starts with the header {','.join(AZURE_COLUMNS)}")
    columns = [cell.strip() for cell in header]
    unknown = [c for c in columns if c not in AZURE_COLUMNS and c not in TENANCY_COLUMNS]
    missing = [c for c in AZURE_COLUMNS if c not in columns]
    if unknown or missing:
        parts = []
        if unknown:
            parts.append(f"unknown column(s) {', '.join(_shown(c) for c in unknown[:5])}")
        if missing:
            parts.append(f"missing column(s) {', '.join(missing)}")
        raise _fail(path, 1, "; ".join(parts),
                    f"the Azure trace format has exactly the columns {','.join(AZURE_COLUMNS)} "
                    f"(and optionally {','.join(TENANCY_COLUMNS)})")
    where = {name: columns.index(name) for name in AZURE_COLUMNS + TENANCY_COLUMNS if name in columns}
    rows: list[tuple[float, int, int, str | None, int]] = []
    for row in reader:
        number = reader.line_num
        if not row or not any(cell.strip() for cell in row):
            continue
        if len(row) != len(columns):
            raise _fail(path, number, f"has {len(row)} fields, the header has {len(columns)}", "fix that line")
        stamp = _parse_timestamp(path, number, row[where["TIMESTAMP"]])
        prompt = _count(path, number, "ContextTokens", row[where["ContextTokens"]], minimum=1)
        output = _count(path, number, "GeneratedTokens", row[where["GeneratedTokens"]], minimum=0)
        tenant = tenant_field(path, number, row[where["tenant"]].strip() or None) if "tenant" in where else None
        priority = priority_field(path, number, row[where["priority"]]) if "priority" in where else 0
        rows.append((stamp, prompt, max(output, 1), tenant, priority))
    if not rows:
        raise _fail(path, None, "has a header but no requests", "replay a trace with at least one request")
    return Recording(str(path), "azure-csv", _ordered((s, p, o, None, None, None, t, c) for s, p, o, t, c in rows))


def tenant_field(path: Path, line: int, raw: Any) -> str | None:
    """A tenant name (``None`` or absent: the default tenant)."""
    if raw is None:
        return None
    if not isinstance(raw, str) or not 0 < len(raw) <= 256 or not raw.isprintable():
        raise _fail(path, line, f"tenant={_shown(raw)} is not a tenant name (printable text of 1 to 256 characters)",
                    "fix or drop that line")
    return raw


def priority_field(path: Path, line: int, raw: Any) -> int:
    """A priority class: a whole number (empty or absent: 0)."""
    if raw is None or (isinstance(raw, str) and not raw.strip()):
        return 0
    if isinstance(raw, str):
        try:
            raw = int(raw.strip())
        except ValueError:
            raise _fail(path, line, f"priority={_shown(raw)} is not a whole number", "fix or drop that line") from None
    if isinstance(raw, float) and raw.is_integer():
        raw = int(raw)
    if isinstance(raw, bool) or not isinstance(raw, int) or abs(raw) > 1_000_000:
        raise _fail(path, line, f"priority={_shown(raw)} is not a whole number within +-1,000,000",
                    "fix or drop that line")
    return raw


def _load_jsonl(path: Path) -> Recording:
    rows: list[tuple[float, int, int, str | None, int | None, str | None, str | None, int]] = []
    texts = 0
    for number, record in numbered_records(path):
        missing = [name for name in ("t_arrival", "prompt_tokens", "output_tokens") if name not in record]
        if missing:
            raise _fail(path, number, f"lacks the field(s) {', '.join(missing)}",
                        "replay a trace written by --request-trace (standard or full level)")
        arrival = _seconds(path, number, "t_arrival", record["t_arrival"])
        prompt = _count(path, number, "prompt_tokens", record["prompt_tokens"], minimum=1)
        output = _count(path, number, "output_tokens", record["output_tokens"], minimum=0)
        text = record.get("prompt_text")
        if text is not None and not isinstance(text, str):
            raise _fail(path, number, "prompt_text is not a string", "fix or drop that line")
        texts += text is not None
        raw_hash = record.get("prefix_hash")
        prefix_hash = int(raw_hash) if isinstance(raw_hash, int) and not isinstance(raw_hash, bool) else None
        template = record.get("template") if isinstance(record.get("template"), str) else None
        tenant = tenant_field(path, number, record.get("tenant"))
        priority = priority_field(path, number, record.get("priority"))
        rows.append((arrival, prompt, max(output, 1), text, prefix_hash, template, tenant, priority))
    if not rows:
        raise _fail(path, None, "is empty", "replay a trace with at least one request")
    kind = "jsonl-full" if texts == len(rows) else "jsonl-standard"
    if kind == "jsonl-standard":
        rows = [(s, p, o, None, h, t, n, c) for s, p, o, _, h, t, n, c in rows]
    return Recording(str(path), kind, _ordered(rows))


def _ordered(rows: Iterable[tuple[float, int, int, str | None, int | None, str | None, str | None, int]]
             ) -> tuple[RecordedRequest, ...]:
    # A stable sort keeps the file's order among equal timestamps.
    ordered = sorted(rows, key=lambda row: row[0])
    first = ordered[0][0]
    return tuple(
        RecordedRequest(i, stamp - first, prompt, output, text, prefix_hash, template, tenant, priority)
        for i, (stamp, prompt, output, text, prefix_hash, template, tenant, priority) in enumerate(ordered)
    )


def write_jsonl(path: Path, records: Iterable[Mapping[str, Any]]) -> None:
    """Replace ``path`` with trace-shaped records, one JSON object per line, atomically."""
    from carbonforge_runtime.files import write_atomic

    def write(handle: Any) -> None:
        for record in records:
            handle.write(json.dumps(record, separators=(",", ":")) + "\n")

    write_atomic(path, write)
