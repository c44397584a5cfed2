"""The one reader of trace files for every offline tool (trace summarize/sessions/plot, replay, ltr).

JSONL, plain or gzip (detected by content), streamed in batches of lines. Every problem with the
file itself (missing, unreadable, a line that is not a JSON object, gzip damage) is a
:class:`TraceInputError` (exit code 1) naming the file and, where there is one, the line. What a
record must contain is each tool's own business.

``orjson`` is re-exported for the parsers (``None`` when it is not installed).

Lines come out decoded as UTF-8, with undecodable bytes kept as surrogate escapes so one bad
byte spoils at most its own line. A gzip stream that is cut short or corrupt yields every
complete line before the damage, then raises :class:`DamagedInput`.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from carbonforge_runtime import files
from carbonforge_runtime.errors import CarbonForgeError

try:  # parses a trace line about three times faster than the standard library, same results
    import orjson
except ImportError:  # pragma: no cover - a dependency; the standard library is the fallback
    orjson = None  # type: ignore[assignment]

GZIP_MAGIC = b"\x1f\x8b"
_BOM = b"\xef\xbb\xbf"
_READ_BYTES = 1 << 20
#: Cap on the output of one decompression call, so memory stays bounded whatever the ratio.
_MAX_INFLATE_BYTES = 1 << 20
#: The longest line read. A full-level record with a long prompt and output is well under a MiB.
MAX_LINE_BYTES = 16 << 20
#: The largest prompt or output size a trace may give one request: ten million tokens, beyond the
#: context of any model. A larger count is a damaged or hostile file, refused with its line.
MAX_REQUEST_TOKENS = 10_000_000


class TraceInputError(CarbonForgeError):
    """A trace file cannot be read, or holds nothing to analyse."""


class DamagedInput(Exception):
    """The stream ended in damage; everything before it was already yielded."""

    def __init__(self, reason: str, lines_read: int = 0) -> None:
        super().__init__(reason)
        self.reason = reason
        self.lines_read = lines_read


def loads_line(line: bytes | str) -> Any:
    """One line parsed as JSON (the standard library's reading: NaN, Infinity and big integers
    allowed); ValueError for anything that is not JSON, nesting too deep for the parser included."""
    try:
        return json.loads(line)
    except RecursionError:
        raise ValueError("nested too deeply to be a trace record") from None


#: What the trace inputs of ``sim``, ``tune`` and ``replay`` can be (for the fix of a missing one).
SIM_TRACE_INPUTS = "the trace is an Azure-format CSV, a Mooncake JSONL trace or a trace written by serve's --trace-file"
REPLAY_TRACE_INPUTS = "the trace is an Azure-format CSV or a trace written by serve's --trace-file"


def check_readable(path: Path, kind: str = "trace file", written_by: str = "--trace-file of the runtime",
                   *, inputs: str | None = None) -> None:
    """Refuse, with the fix, a ``kind`` of file (written by the runtime's ``written_by``, or, for a command
    that reads other formats too, one of ``inputs``) that is missing, a directory or unreadable."""
    if not path.exists():
        raise TraceInputError(f"{kind} {path} does not exist",
                              f"check the path ({inputs if inputs is not None else written_by})")
    if path.is_dir():
        raise TraceInputError(f"{path} is a directory, not a {kind}", "pass the JSONL file itself")
    try:
        with files.open_regular(path):
            pass
    except files.NotRegularFile as exc:
        raise TraceInputError(f"{kind} {exc}", files.NOT_REGULAR_REMEDY) from None
    except OSError as exc:
        raise TraceInputError(f"{kind} {path} cannot be read ({exc.strerror})",
                              "check the file's permissions") from None


#: What a directory given to the trace tools is searched for (the rank files of data parallel,
#: rotated or compressed copies).
TRACE_FILE_PATTERNS = ("*.jsonl", "*.jsonl.gz")


def trace_files(paths: Sequence[Path]) -> list[Path]:
    """``paths`` with every directory replaced by the trace files in it (sorted by name), each file
    once even when it is named twice (directly and through its directory)."""
    out: list[Path] = []
    seen: set[Path] = set()
    for path in paths:
        if path.is_dir():
            found = sorted({f for pattern in TRACE_FILE_PATTERNS for f in path.glob(pattern) if f.is_file()})
            if not found:
                raise TraceInputError(
                    f"{path} holds no trace files ({' or '.join(TRACE_FILE_PATTERNS)})",
                    "pass the directory the runtime writes its traces to (--trace-file's directory), or the files",
                )
        else:
            found = [path]
        for file in found:
            key = file.resolve() if file.exists() else file
            if key not in seen:
                seen.add(key)
                out.append(file)
    return out


def is_gzip(path: Path) -> bool:
    with files.open_regular(path) as handle:
        return handle.read(2) == GZIP_MAGIC


def _decode(block: bytes) -> list[str]:
    return block.decode("utf-8", "surrogateescape").split("\n")


def _raw_blocks(path: Path) -> Iterator[bytes]:
    with files.open_regular(path) as handle:
        while block := handle.read(_READ_BYTES):
            yield block


def _inflated_blocks(path: Path) -> Iterator[bytes]:
    """Decompressed data of every gzip member in turn; DamagedInput on truncation or corruption."""
    inflater = zlib.decompressobj(wbits=31)
    member_started = False
    for raw in _raw_blocks(path):
        data = raw
        while data:
            member_started = True
            try:
                out = inflater.decompress(data, _MAX_INFLATE_BYTES)
            except zlib.error as exc:
                raise DamagedInput(f"gzip data is corrupt ({exc})") from None
            if out:
                yield out
            if inflater.eof:
                # End of one member; concatenated members (appended files) continue.
                data = inflater.unused_data
                inflater = zlib.decompressobj(wbits=31)
                member_started = False
                if data and not data.startswith(GZIP_MAGIC[:len(data)]):
                    if data.strip(b"\x00"):
                        raise DamagedInput("unexpected bytes after the end of the gzip data")
                    data = b""
            else:
                data = inflater.unconsumed_tail
    if member_started:
        try:
            tail = inflater.flush()
        except zlib.error:
            tail = b""
        if tail:
            yield tail
        raise DamagedInput("gzip data is truncated (the file ends before the end of the compressed stream)")


def _too_long(line: int) -> str:
    return f"line {line} is longer than {MAX_LINE_BYTES // (1 << 20)} MiB (is this a trace file?)"


def _line_blocks(path: Path) -> Iterator[bytes]:
    """The file's bytes in blocks of whole lines (no final newline; a leading BOM removed).

    The last line may lack its newline (it is then still yielded), except after damage: a
    line cut by the damage is dropped, and DamagedInput is raised after the complete ones. A line
    longer than :data:`MAX_LINE_BYTES` is damage too, so memory stays bounded whatever the file.
    """
    blocks = _inflated_blocks(path) if is_gzip(path) else _raw_blocks(path)
    pending: list[bytes] = []  # the start of a line that has not ended yet, in pieces
    pending_bytes = 0
    first = True
    lines_before = 0  # complete lines yielded so far, so that a refusal names its line
    for block in blocks:
        if first:
            first = False
            if block.startswith(_BOM):
                block = block[len(_BOM):]
        cut = block.rfind(b"\n")
        if cut < 0:
            pending.append(block)
            pending_bytes += len(block)
            if pending_bytes > MAX_LINE_BYTES:
                raise DamagedInput(_too_long(lines_before + 1))
            continue
        if pending_bytes + block.find(b"\n") > MAX_LINE_BYTES:  # the line that ends in this block
            raise DamagedInput(_too_long(lines_before + 1))
        head = b"".join([*pending, block[:cut]]) if pending else block[:cut]
        pending, pending_bytes = ([block[cut + 1:]], len(block) - cut - 1) if cut + 1 < len(block) else ([], 0)
        lines_before += head.count(b"\n") + 1
        yield head
    if pending:
        yield b"".join(pending)


def line_batches(path: Path) -> Iterator[list[str]]:
    """Every line of the file, decoded, in order, in lists of many lines."""
    for block in _line_blocks(path):
        yield _decode(block)


def byte_line_batches(path: Path) -> Iterator[list[bytes]]:
    """Every line of the file as bytes, in order, in lists of many lines."""
    for block in _line_blocks(path):
        yield block.split(b"\n")


@dataclass(frozen=True)
class NotJson:
    """A line that did not parse: what the parser said."""

    problem: str


def json_lines(path: Path) -> Iterator[tuple[int, Any]]:
    """Every non-blank line of a JSONL file (plain or gzip) as (line number, parsed value), in file
    order; a line that is not JSON comes as a :class:`NotJson`, for the caller to refuse or count.

    Damaged gzip data raises :class:`DamagedInput` (with the lines read before it) after every line
    before the damage was yielded. The one loop under the trace reader, the step-log reader and the
    dataset export."""
    number = 0
    try:
        for batch in line_batches(path):
            for line in batch:
                number += 1
                if not line.strip():
                    continue
                try:
                    value = loads_line(line)
                except ValueError as exc:
                    value = NotJson(str(exc))
                yield number, value
    except DamagedInput as exc:
        raise DamagedInput(exc.reason, number) from None


def numbered_records(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """Every non-blank line of a JSONL trace as (line number, JSON object), in file order.

    Raises :class:`TraceInputError` for a file that cannot be read, a line that is not a JSON
    object, or damaged gzip data (after yielding every record before the damage)."""
    check_readable(path)
    try:
        for number, record in json_lines(path):
            if isinstance(record, NotJson):
                raise TraceInputError(f"{path}:{number}: is not JSON ({record.problem})",
                                      "a JSONL trace has one JSON object per line")
            if not isinstance(record, dict):
                raise TraceInputError(f"{path}:{number}: is not a JSON object",
                                      "a JSONL trace has one JSON object per line")
            yield number, record
    except DamagedInput as exc:
        raise TraceInputError(f"{path}: {exc.reason}; the records up to line {exc.lines_read} were read",
                              "copy the file again from its source, or decompress what is left "
                              "(zcat FILE > FILE.jsonl) and use that") from None
