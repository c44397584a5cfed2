"""Traces the twin replays, read into :class:`~carbonforge_runtime.core.twin_data.SimRequest` lists.

* A request's tenant and priority class: the ``tenant`` and ``priority`` fields of our JSONL traces
  and Mooncake JSONL, or columns of those names in the Azure CSV, where present (absent: the
  default tenant, class 0).
* Our JSONL traces (standard and full level) and the Azure CSV: read as ``replay`` reads them
  (:func:`carbonforge_runtime.offline.replay.trace.load_recording`). A full-level trace's prompt
  text names its content blocks: the text is cut in pieces of :data:`TEXT_CHARS_PER_BLOCK`
  characters and each block is named by a running checksum of the text up to its end, so prompts
  that start with the same text share those blocks in the prefix cache (about four characters a
  token). Standard-level and Azure prompts share nothing.
* Mooncake JSONL (``timestamp`` in milliseconds, ``input_length``, ``output_length``,
  ``hash_ids``): each hash id names one block of ``block_tokens`` prompt tokens (512 in the
  published traces); equal ids give identical tokens, so requests that share ids share exactly
  those blocks in vLLM's prefix cache.

Every file goes through the offline tools' bounded reader
(:mod:`carbonforge_runtime.offline.trace_reader`).
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from carbonforge_runtime.core.twin_data import SimError, SimRequest
from carbonforge_runtime.offline.replay.trace import load_recording, priority_field, tenant_field
from carbonforge_runtime.offline.trace_reader import (
    MAX_REQUEST_TOKENS,
    SIM_TRACE_INPUTS,
    check_readable,
    numbered_records,
)

MOONCAKE_FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")
#: Tokens a Mooncake hash id stands for, in the published traces.
MOONCAKE_BLOCK_TOKENS = 512
#: Characters of prompt text per content block of a full-level trace (16 tokens of about 4 characters).
TEXT_CHARS_PER_BLOCK = 64
TEXT_BLOCK_TOKENS = 16
#: Hash ids are spelled into token ids; larger ones are no Mooncake trace.
MAX_HASH_ID = (1 << 54) - 1


@dataclass(frozen=True)
class SimTrace:
    path: str
    kind: str  # azure-csv, jsonl-standard, jsonl-full, mooncake-jsonl
    requests: tuple[SimRequest, ...]


@dataclass(frozen=True)
class WindowOptions:
    """The options ``sim`` shares with ``replay``: which requests, how fast, how large."""

    start: int = 0
    limit: int | None = None
    rate: float = 1.0
    token_scale: float = 1.0

    def validate(self) -> None:
        if not math.isfinite(self.rate) or self.rate <= 0:
            raise SimError(f"rate {self.rate} must be a positive number",
                           "pass --rate 1 to keep the recorded pace, 2 for twice as fast, 0.5 for half")
        if not math.isfinite(self.token_scale) or self.token_scale <= 0:
            raise SimError(f"token scale {self.token_scale} must be a positive number",
                           "pass --token-scale 1 to keep the recorded sizes, 0.25 for a quarter")
        if self.start < 0:
            raise SimError(f"start {self.start} is negative", "pass --start 0 or a later request index")
        if self.limit is not None and self.limit < 1:
            raise SimError(f"limit {self.limit} must be at least 1", "pass --limit N with N >= 1, or omit it")


def _fail(path: Path, line: int | None, problem: str, remedy: str = "fix or drop that line") -> SimError:
    return SimError(f"{path}:{line}: {problem}" if line is not None else f"{path}: {problem}", remedy)


def _first_record(path: Path) -> dict[str, Any] | None:
    for _, record in numbered_records(path):
        return record
    return None


def load_trace(path: Path, mooncake_block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> SimTrace:
    """Read ``path`` in whichever supported format it is (``.csv``: Azure; JSON lines: Mooncake when
    its first record has Mooncake's fields, else our trace)."""
    path = Path(path)
    check_readable(path, inputs=SIM_TRACE_INPUTS)
    if path.suffix.lower() != ".csv":
        first = _first_record(path)
        if first is not None and "input_length" in first and "t_arrival" not in first:
            return _load_mooncake(path, mooncake_block_tokens)
    recording = load_recording(path)
    requests = []
    for req in recording.requests:
        blocks = text_blocks(req.prompt_text) if req.prompt_text is not None else None
        requests.append(SimRequest(req.index, req.arrival_s, req.prompt_tokens, req.output_tokens, blocks,
                                   TEXT_BLOCK_TOKENS if blocks is not None else 0, req.tenant, req.priority))
    return SimTrace(str(path), recording.kind, tuple(requests))


def text_blocks(text: str) -> tuple[int, ...]:
    """Content ids of a prompt text: a running CRC-32 over pieces of :data:`TEXT_CHARS_PER_BLOCK`
    characters (chained, so an id names the whole text up to the end of its block)."""
    data = text.encode("utf-8", "surrogatepass")
    ids = []
    running = 0
    for offset in range(0, len(data), TEXT_CHARS_PER_BLOCK):
        running = zlib.crc32(data[offset:offset + TEXT_CHARS_PER_BLOCK], running)
        ids.append(running | ((offset // TEXT_CHARS_PER_BLOCK) << 32))
    return tuple(ids)


def _whole(path: Path, line: int, name: str, raw: Any, minimum: int, maximum: int = MAX_REQUEST_TOKENS) -> int:
    if isinstance(raw, float) and raw.is_integer():
        raw = int(raw)
    if isinstance(raw, bool) or not isinstance(raw, int):
        raise _fail(path, line, f"{name}={str(raw)[:40]!r} is not a whole number")
    if not minimum <= raw <= maximum:
        raise _fail(path, line, f"{name}={raw} is outside {minimum}..{maximum:,}")
    return raw


def _load_mooncake(path: Path, block_tokens: int) -> SimTrace:
    rows: list[tuple[float, int, int, tuple[int, ...], str | None, int]] = []
    for number, record in numbered_records(path):
        missing = [name for name in MOONCAKE_FIELDS if name not in record]
        if missing:
            raise _fail(path, number, f"lacks the Mooncake field(s) {', '.join(missing)}",
                        "a Mooncake trace has timestamp, input_length, output_length and hash_ids on every line")
        stamp = record["timestamp"]
        if isinstance(stamp, bool) or not isinstance(stamp, (int, float)) or not math.isfinite(stamp) or stamp < 0:
            raise _fail(path, number, f"timestamp={str(stamp)[:40]!r} is not a non-negative number of milliseconds")
        prompt = _whole(path, number, "input_length", record["input_length"], 1)
        output = _whole(path, number, "output_length", record["output_length"], 0)
        raw_ids = record["hash_ids"]
        if not isinstance(raw_ids, list):
            raise _fail(path, number, "hash_ids is not a list")
        needed = -(-prompt // block_tokens)
        if len(raw_ids) > needed:
            raise _fail(path, number, f"has {len(raw_ids)} hash ids for {prompt} tokens (at most {needed} blocks of "
                        f"{block_tokens})", "check --mooncake-block-tokens against the trace's block size")
        ids = tuple(_whole(path, number, "hash id", raw, 0, MAX_HASH_ID) for raw in raw_ids)
        tenant = tenant_field(path, number, record.get("tenant"))
        rows.append((float(stamp) / 1000.0, prompt, max(output, 1), ids, tenant,
                     priority_field(path, number, record.get("priority"))))
    if not rows:
        raise _fail(path, None, "is empty", "replay a trace with at least one request")
    rows.sort(key=lambda row: row[0])  # stable: the file's order among equal timestamps
    first = rows[0][0]
    requests = tuple(SimRequest(i, stamp - first, prompt, output, ids, block_tokens, tenant, priority)
                     for i, (stamp, prompt, output, ids, tenant, priority) in enumerate(rows))
    return SimTrace(str(path), "mooncake-jsonl", requests)


def window(trace: SimTrace, options: WindowOptions) -> list[SimRequest]:
    """The requests to simulate: ``start``/``limit`` applied, arrivals from 0 divided by ``rate``,
    sizes times ``token_scale`` (at least 1 token; shared blocks scale with them)."""
    options.validate()
    chosen = trace.requests[options.start:]
    if options.limit is not None:
        chosen = chosen[:options.limit]
    if not chosen:
        raise SimError(f"{trace.path}: no request left after skipping {options.start} of {len(trace.requests)}",
                       "pass a smaller --start")
    first = chosen[0].arrival_s
    scale = options.token_scale
    out = []
    for req in chosen:
        arrival = (req.arrival_s - first) / options.rate
        if not math.isfinite(arrival):
            raise SimError(f"{trace.path}: the arrivals at --rate {options.rate:g} are no schedule",
                           "check the trace's time stamps or pass --start/--limit")
        prompt = max(1, min(round(req.prompt_tokens * scale), MAX_REQUEST_TOKENS))
        output = max(1, min(round(req.output_tokens * scale), MAX_REQUEST_TOKENS))
        block = max(1, round(req.block_tokens * scale)) if req.blocks is not None else 0
        out.append(SimRequest(req.index, arrival, prompt, output, req.blocks, block, req.tenant, req.priority))
    return out
