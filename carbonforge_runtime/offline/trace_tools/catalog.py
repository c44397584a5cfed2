"""``trace list`` and ``trace show``: find captured requests in trace files, and read one in full.

``list`` streams every file once and keeps only the page it prints: the ``limit + 1`` smallest sort
keys past the cursor, in a bounded heap of light rows (the table's columns and the record's place,
never its prompt or output text). The sort key of a row is ``(missing, value, file, line)``: records
without the sort field come last in either order, and ties keep the order of the files (by path)
and of their lines. A cursor is the key of the last row shown, so the next page is the next
``limit`` keys: one more pass over the files and the same memory, and stable while the files
only grow.

``show`` reads the files for one request id (the client's ``request_id`` or the engine's
``engine_request_id``) and returns every record that has it (``n > 1`` samples share a
``request_id``). Lines that cannot hold the id are skipped before they are parsed.

Damaged lines are counted and reported as the other trace tools do (:func:`.summarize.problem_lines`).
"""

from __future__ import annotations

import base64
import heapq
import json
import math
import operator
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from hashlib import blake2b
from pathlib import Path
from typing import Any

from carbonforge_runtime.errors import CarbonForgeError, UsageError
from carbonforge_runtime.offline.trace_reader import (
    DamagedInput,
    byte_line_batches,
    check_readable,
    line_batches,
    loads_line,
    orjson,
    trace_files,
)
from carbonforge_runtime.offline.trace_tools.summarize import (
    MAX_REPORTED_BAD_LINES,
    BadLine,
    FileReport,
    fmt_s,
)

#: Numeric record fields a listing filters and sorts on.
NUMERIC_FIELDS = (
    "t_arrival", "t_completion", "prompt_tokens", "output_tokens", "e2e_latency_s", "ttft_s", "queue_wait_s",
    "cached_prompt_tokens", "preemptions", "energy_j", "priority_score",
)
#: Short names accepted for them.
ALIASES = {
    "arrival": "t_arrival",
    "completion": "t_completion",
    "input_tokens": "prompt_tokens",
    "latency": "e2e_latency_s",
    "e2e": "e2e_latency_s",
    "ttft": "ttft_s",
    "queue_wait": "queue_wait_s",
    "cached_tokens": "cached_prompt_tokens",
    "energy": "energy_j",
    "priority": "priority_score",
}
#: Fields given in seconds, whose filter values may carry a unit (``500ms``, ``2s``, ``1m``).
DURATION_FIELDS = ("e2e_latency_s", "ttft_s", "queue_wait_s")
#: Text fields, matched exactly by options of their own.
TEXT_FILTERS = {"finish_reason": "--finish-reason", "model": "--model", "tenant": "--tenant", "task": "--task"}
OPERATORS: dict[str, Callable[[Any, Any], bool]] = {
    ">=": operator.ge, "<=": operator.le, "!=": operator.ne, "==": operator.eq,
    ">": operator.gt, "<": operator.lt, "=": operator.eq,
}
SHOWN_OPERATORS = "> >= < <= = !="
ORDERS = ("asc", "desc")
DEFAULT_SORT = "t_arrival"
DEFAULT_LIMIT = 50
_CURSOR_PREFIX = "c1."
_NUMBER = (int, float)
_CONDITION = re.compile(r"\s*([A-Za-z_][A-Za-z0-9_]*)\s*(>=|<=|!=|==|=|>|<)\s*(.*?)\s*\Z", re.S)
_SAFE_ID = re.compile(r"[A-Za-z0-9_.:-]+\Z")
_BLANK = object()
_THINK_OPEN, _THINK_CLOSE = "<think>", "</think>"


# --------------------------------------------------------------------------------------------
# The query: plain data, parsed from the command line


@dataclass(frozen=True)
class Condition:
    """``field op value`` on a numeric field (a record without the field never matches)."""

    field: str
    op: str
    value: float

    def text(self) -> str:
        return f"{self.field}{self.op}{self.value:g}"


@dataclass(frozen=True)
class Query:
    conditions: tuple[Condition, ...] = ()
    since: float | None = None
    until: float | None = None
    finish_reason: str | None = None
    model: str | None = None
    tenant: str | None = None
    task: str | None = None
    sort: str = DEFAULT_SORT
    descending: bool = False

    def fingerprint(self) -> str:
        """What a cursor must agree with: every filter and the sort (not the page size)."""
        data = [sorted(c.text() for c in self.conditions), self.since, self.until, self.finish_reason,
                self.model, self.tenant, self.task, self.sort, self.descending]
        return blake2b(json.dumps(data).encode(), digest_size=6).hexdigest()

    def describe(self) -> str:
        parts = [c.text() for c in self.conditions]
        if self.since is not None:
            parts.append(f"arrival >= {utc_ms(self.since)}")
        if self.until is not None:
            parts.append(f"arrival < {utc_ms(self.until)}")
        for name in TEXT_FILTERS:
            value = getattr(self, name)
            if value is not None:
                parts.append(f"{name} = {value}")
        return ", ".join(parts)


def _field_list() -> str:
    aliases = ", ".join(f"{alias}={name}" for alias, name in ALIASES.items())
    return f"fields: {', '.join(NUMERIC_FIELDS)} (short names: {aliases})"


def resolve_field(name: str, option: str) -> str:
    """The record field ``name`` stands for (itself or an alias); a UsageError listing them otherwise."""
    key = name.strip().lower()
    if key in NUMERIC_FIELDS:
        return key
    if key in ALIASES:
        return ALIASES[key]
    if key in TEXT_FILTERS:
        raise UsageError(f"{option}: {key} is text, not a number",
                         f"select it with {TEXT_FILTERS[key]} VALUE (exact match); {option} takes the numeric "
                         f"{_field_list()}")
    raise UsageError(f"{option}: unknown field {name!r}", f"use one of the {_field_list()}")


def _number(text: str, field_name: str) -> float:
    raw = text.strip().lower()
    factor = 1.0
    if field_name in DURATION_FIELDS:
        for suffix, scale in (("ms", 0.001), ("s", 1.0), ("m", 60.0)):
            if raw.endswith(suffix):
                raw, factor = raw[: -len(suffix)].strip(), scale
                break
    value = float(raw) * factor  # ValueError for anything else
    if not math.isfinite(value):
        raise ValueError(text)
    return value


def parse_condition(text: str) -> Condition:
    """``output_tokens>5``, ``latency >= 2s``, ``preemptions!=0``: field, operator, number."""
    match = _CONDITION.match(text)
    example = "e.g. --filter 'output_tokens>5' or --filter 'latency>=1.5'"
    if match is None:
        raise UsageError(f"--filter {text!r} is not FIELD OPERATOR NUMBER",
                         f"write {example}; operators: {SHOWN_OPERATORS}; {_field_list()}")
    name, op, raw = match.groups()
    field_name = resolve_field(name, f"--filter {text!r}")
    try:
        value = _number(raw, field_name)
    except ValueError:
        unit = " (seconds, or with a unit: 500ms, 2s, 1m)" if field_name in DURATION_FIELDS else ""
        raise UsageError(f"--filter {text!r}: {raw!r} is not a number", f"compare {field_name} with a number"
                         f"{unit}, {example}; operators: {SHOWN_OPERATORS}") from None
    return Condition(field_name, "=" if op == "==" else op, value)


def parse_time(text: str, option: str) -> float:
    """Unix seconds from Unix seconds or an ISO-8601 time (UTC unless it names an offset)."""
    raw = text.strip()
    try:
        value = float(raw)
    except ValueError:
        pass
    else:
        if math.isfinite(value):
            return value
    try:
        moment = datetime.fromisoformat(raw)
    except ValueError:
        raise UsageError(f"{option} {text!r} is not a time",
                         "give an ISO-8601 time (2026-12-05T07:30:00Z, '2026-12-05 07:30', 2026-12-05; UTC unless "
                         "it names an offset such as +02:00) or Unix seconds (1796455800)") from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return moment.timestamp()


def build_query(filters: Sequence[str] = (), since: str | None = None, until: str | None = None,
                finish_reason: str | None = None, model: str | None = None, tenant: str | None = None,
                task: str | None = None, sort: str = DEFAULT_SORT, order: str = "asc") -> Query:
    """The query of ``trace list``'s options (UsageError, with the fix, for a bad one)."""
    if order.lower() not in ORDERS:
        raise UsageError(f"--order {order!r} is not asc or desc", "give --order asc (smallest first) or --order desc")
    start = None if since is None else parse_time(since, "--since")
    end = None if until is None else parse_time(until, "--until")
    if start is not None and end is not None and start >= end:
        raise UsageError(f"--since {since} is not before --until {until}: no request can match",
                         "give a --since earlier than --until")
    return Query(
        conditions=tuple(parse_condition(text) for text in filters),
        since=start, until=end, finish_reason=finish_reason, model=model, tenant=tenant, task=task,
        sort=resolve_field(sort, "--sort"), descending=order.lower() == "desc",
    )


# --------------------------------------------------------------------------------------------
# Cursors


@dataclass(frozen=True)
class Cursor:
    """The last row of a page: its sort key (``missing``, ``value``) and its place."""

    missing: bool
    value: float
    file: str
    line: int


def encode_cursor(query: Query, cursor: Cursor) -> str:
    data = [query.fingerprint(), int(cursor.missing), cursor.value, cursor.file, cursor.line]
    packed = base64.urlsafe_b64encode(json.dumps(data, separators=(",", ":")).encode()).rstrip(b"=")
    return _CURSOR_PREFIX + packed.decode()


def decode_cursor(query: Query, text: str) -> Cursor:
    """The cursor ``text`` stands for, refused when it is damaged or was made for another query."""
    try:
        if not text.startswith(_CURSOR_PREFIX):
            raise ValueError(text)
        body = text[len(_CURSOR_PREFIX):]
        data = json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))
        fingerprint, missing, value, file, line = data
        if (not isinstance(fingerprint, str) or missing not in (0, 1) or type(value) not in _NUMBER
                or not isinstance(file, str) or type(line) is not int or not math.isfinite(value)):
            raise ValueError(text)
    except (ValueError, TypeError, OverflowError):
        raise UsageError(f"--cursor {text[:60]!r} is not a cursor of trace list",
                         "pass the next_cursor a page printed, unchanged, or leave --cursor out for the first "
                         "page") from None
    if fingerprint != query.fingerprint():
        raise UsageError("--cursor was made for other filters or another sort",
                         "repeat the options of the page it came from (only --limit may change), or leave --cursor "
                         "out to start again at the first page")
    return Cursor(bool(missing), value, file, line)


# --------------------------------------------------------------------------------------------
# Reading


class _Problems:
    """Bad lines and damage of the files read, for :func:`.summarize.problem_lines`."""

    def __init__(self) -> None:
        self.files: list[FileReport] = []
        self.examples: list[BadLine] = []
        self.total = 0

    def bad(self, report: FileReport, line: int, reason: str) -> None:
        report.bad_lines += 1
        self.total += 1
        if len(self.examples) < MAX_REPORTED_BAD_LINES:
            self.examples.append(BadLine(report.path, line, reason))


def _strict_loads(line: bytes | str) -> Any:
    """The standard library's parser, refusing NaN and Infinity (orjson's reading)."""
    return json.loads(line, parse_constant=_refuse_constant)


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number a trace may hold")


def _finite(value: Any) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def _records(path: Path, problems: _Problems,
             needle: tuple[bytes, str] | None = None) -> Iterator[tuple[FileReport, int, dict[str, Any], bool]]:
    """(report, line number, record, parsed slowly) for every JSON object of ``path``.

    Lines that are not JSON objects are reported and skipped; a line parsed by the standard
    library (``slow``) may hold numbers orjson refuses, so its caller checks them. With
    ``needle``, lines that do not contain it are skipped unparsed.
    """
    check_readable(path)
    report = FileReport(str(path))
    problems.files.append(report)
    batches: Iterator[Sequence[bytes | str]]
    fast: Callable[[Any], Any]
    if orjson is not None:
        batches, fast = byte_line_batches(path), orjson.loads
    else:  # pragma: no cover - orjson is a dependency
        batches, fast = line_batches(path), _strict_loads
    lineno = 0
    blank = 0
    try:
        for batch in batches:
            for line in batch:
                lineno += 1
                if needle is not None and needle[isinstance(line, str)] not in line:  # type: ignore[operator]
                    if not line.strip():
                        blank += 1
                    continue
                slow = False
                try:
                    record = fast(line)
                except ValueError:
                    record, slow = _parse_slow(line), True
                    if record is _BLANK:
                        blank += 1
                        continue
                    if isinstance(record, str):
                        problems.bad(report, lineno, record)
                        continue
                if type(record) is not dict:
                    problems.bad(report, lineno, "not a trace record (expected a JSON object)")
                    continue
                report.records += 1
                yield report, lineno, record, slow
    except DamagedInput as exc:
        report.damage = f"{exc.reason}; {lineno} complete lines before the damage were read"
    report.lines = lineno
    report.empty = lineno == blank


def _parse_slow(line: bytes | str) -> Any:
    """A line orjson refused: blank, a record (NaN, big integers), or the reason it is bad (a str)."""
    text = line.decode("utf-8", "surrogateescape") if isinstance(line, bytes) else line
    if not text.strip():
        return _BLANK
    try:
        record = loads_line(text)
    except ValueError as exc:
        message = getattr(exc, "msg", str(exc))
        return "unexpected text after the JSON object" if message == "Extra data" else f"not valid JSON ({message})"
    return record if not isinstance(record, str) else "not a trace record (expected a JSON object)"


# --------------------------------------------------------------------------------------------
# trace list


@dataclass(frozen=True, slots=True)
class Row:
    """One line of the table: what it shows of a record, and where the record is."""

    request_id: str
    t_arrival: float
    model: Any
    tenant: Any
    task: Any
    prompt_tokens: Any
    output_tokens: Any
    ttft_s: Any
    e2e_latency_s: Any
    queue_wait_s: Any
    finish_reason: Any
    sort_value: Any
    file: str
    line: int


#: Row fields that are record fields of the same name (the sort field is shown too when it is not one).
ROW_FIELDS = ("request_id", "t_arrival", "model", "tenant", "task", "prompt_tokens", "output_tokens", "ttft_s",
              "e2e_latency_s", "queue_wait_s", "finish_reason")


@dataclass
class Page:
    query: Query
    rows: list[Row]
    #: Records that pass the filters, in all.
    matched: int
    #: Of those, the ones before this page (at or before the cursor).
    before: int
    next_cursor: str | None
    files: list[FileReport]
    bad_lines: int
    bad_line_examples: list[BadLine]
    #: Valid records read.
    records: int

    def to_json(self) -> dict[str, Any]:
        extra = self.query.sort not in ROW_FIELDS
        rows = []
        for row in self.rows:
            item: dict[str, Any] = {name: getattr(row, name) for name in ROW_FIELDS}
            item["t_arrival_utc"] = utc_ms(row.t_arrival)
            if extra:
                item[self.query.sort] = row.sort_value
            item["file"], item["line"] = row.file, row.line
            rows.append(item)
        return {
            "rows": rows,
            "next_cursor": self.next_cursor,
            "first": self.before + 1 if rows else None,
            "matched": self.matched,
            "records": self.records,
            "sort": self.query.sort,
            "order": "desc" if self.query.descending else "asc",
            "bad_lines": self.bad_lines,
            "files": [report.path for report in self.files],
        }


def list_requests(paths: Sequence[Path], query: Query, limit: int = DEFAULT_LIMIT,
                  cursor: str | None = None) -> Page:
    """The page of ``limit`` records (0: every one) that pass ``query``, after ``cursor``, in sort order.

    One pass over the files; memory is that of ``limit + 1`` rows whatever the files' size.
    """
    if limit < 0:
        raise UsageError(f"--limit {limit} is negative", "give the number of rows per page, or 0 for every row")
    after = decode_cursor(query, cursor) if cursor is not None else None
    files = trace_files(paths)
    for path in files:  # all checked before the long read, so a mistyped name fails at once
        check_readable(path)
    names = [str(path.resolve()) for path in files]
    ranks = sorted({*names, *([after.file] if after is not None else [])})
    rank_of = {name: index for index, name in enumerate(ranks)}
    threshold: tuple[Any, ...] | None = None
    if after is not None:
        threshold = (after.missing, -after.value if query.descending else after.value, rank_of[after.file], after.line)

    problems = _Problems()
    cap = limit + 1 if limit else None
    # A max-heap of the smallest keys seen: (the key negated, the row). Keys are unique (file, line).
    heap: list[tuple[tuple[Any, ...], Row]] = []
    matched = before = 0
    invalid = 0
    sort_field = query.sort
    sign = -1 if query.descending else 1
    checked = tuple(dict.fromkeys([sort_field, *(c.field for c in query.conditions)]))
    tests = tuple((c.field, OPERATORS[c.op], c.value) for c in query.conditions)
    since, until = query.since, query.until
    texts = tuple((name, getattr(query, name)) for name in ("finish_reason", "model", "tenant")
                  if getattr(query, name) is not None)
    task = query.task

    for path, name in zip(files, names, strict=True):
        rank = rank_of[name]
        for report, lineno, record, slow in _records(path, problems):
            problem = _listing_problem(record, checked, slow)
            if problem is not None:
                problems.bad(report, lineno, problem)
                invalid += 1
                continue
            t_arrival = record["t_arrival"]
            if (since is not None and t_arrival < since) or (until is not None and t_arrival >= until):
                continue
            if texts and any(record.get(key) != wanted for key, wanted in texts):
                continue
            if task is not None:
                tags = record.get("tags")
                if type(tags) is not dict or tags.get("task") != task:
                    continue
            if tests and not _passes(record, tests):
                continue
            matched += 1
            value = record.get(sort_field)
            key = (True, 0, rank, lineno) if value is None else (False, sign * value, rank, lineno)
            if threshold is not None and key <= threshold:
                before += 1
                continue
            negated = (-key[0], -key[1], -rank, -lineno)
            if cap is None or len(heap) < cap:
                heapq.heappush(heap, (negated, _row(record, sort_field, name, lineno)))
            elif negated > heap[0][0]:
                heapq.heapreplace(heap, (negated, _row(record, sort_field, name, lineno)))

    ordered = sorted(heap, reverse=True)
    more = cap is not None and len(ordered) == cap
    if more:
        ordered.pop()
    rows = [entry[1] for entry in ordered]
    next_cursor = None
    if more and rows:
        last = rows[-1]
        missing = last.sort_value is None
        next_cursor = encode_cursor(query, Cursor(missing, 0 if missing else last.sort_value, last.file, last.line))
    page = Page(query=query, rows=rows, matched=matched, before=before, next_cursor=next_cursor,
                files=problems.files, bad_lines=problems.total,
                bad_line_examples=sorted(problems.examples, key=lambda bad: (bad.path, bad.line)),
                records=sum(report.records for report in problems.files) - invalid)
    return page


def _row(record: dict[str, Any], sort_field: str, name: str, lineno: int) -> Row:
    tags = record.get("tags")
    get = record.get
    return Row(record["request_id"], record["t_arrival"], get("model"), get("tenant"),
               tags.get("task") if type(tags) is dict else None, get("prompt_tokens"), get("output_tokens"),
               get("ttft_s"), get("e2e_latency_s"), get("queue_wait_s"), get("finish_reason"), get(sort_field),
               name, lineno)


def _passes(record: dict[str, Any], tests: tuple[tuple[str, Callable[[Any, Any], bool], float], ...]) -> bool:
    for name, compare, value in tests:
        have = record.get(name)
        if have is None or not compare(have, value):
            return False
    return True


def _listing_problem(record: dict[str, Any], checked: tuple[str, ...], slow: bool) -> str | None:
    """Why ``record`` cannot be listed: no id, no arrival time, or a filtered or sorted field that is
    not a number (``null`` and absent are fine there: such a record matches no filter on the field)."""
    request_id = record.get("request_id")
    if type(request_id) is not str:
        return "missing field 'request_id'" if request_id is None else "request_id is not a string"
    t_arrival = record.get("t_arrival")
    if type(t_arrival) not in _NUMBER or (slow and not _finite(t_arrival)):
        if t_arrival is None:
            return "missing field 't_arrival'"
        return f"t_arrival is {json.dumps(t_arrival)[:40]}, not a number"
    for name in checked:
        value = record.get(name)
        if value is not None and (type(value) not in _NUMBER or (slow and not _finite(value))):
            return f"{name} is {json.dumps(value)[:40]}, not a number"
    return None


# --------------------------------------------------------------------------------------------
# trace show


@dataclass(frozen=True)
class Found:
    """One record of the request asked for, where it is, and which of its ids matched."""

    file: str
    line: int
    record: dict[str, Any]
    matched_by: str


@dataclass
class Request:
    id: str
    found: list[Found]
    files: list[FileReport]
    bad_lines: int
    bad_line_examples: list[BadLine]

    def to_json(self, template: str | None = None) -> dict[str, Any]:
        records = []
        for item in self.found:
            entry: dict[str, Any] = {"file": item.file, "line": item.line, "matched_by": item.matched_by,
                                     "record": item.record}
            if "prompt_text" in item.record or "output_text" in item.record:
                conversation, why = read_conversation(item.record, template)
                if conversation is not None:
                    entry["template"] = conversation.template
                    entry["messages"], entry["tools"] = conversation.messages, conversation.tools
                else:
                    entry["messages"], entry["messages_not_rebuilt"] = None, why
                reasoning, content = answer_parts(item.record, conversation)
                entry["reasoning"], entry["content"] = reasoning, content
                if conversation is not None and conversation.answer is not None:
                    entry["answer"] = conversation.answer
            records.append(entry)
        return {"id": self.id, "records": records, "bad_lines": self.bad_lines}


def find_request(paths: Sequence[Path], request_id: str) -> Request:
    """Every record whose ``request_id`` or ``engine_request_id`` is ``request_id``, in file order.

    The result may be empty (the caller says what to do about it, after the warnings)."""
    files = trace_files(paths)
    for path in files:
        check_readable(path)
    problems = _Problems()
    needle: tuple[bytes, str] | None = None
    if _SAFE_ID.match(request_id):
        # Such an id is written as itself in JSON, so a line without it cannot be the request.
        needle = (request_id.encode(), request_id)
    found: list[Found] = []
    for path in files:
        for _, lineno, record, _ in _records(path, problems, needle):
            if record.get("request_id") == request_id:
                found.append(Found(str(path), lineno, record, "request_id"))
            elif record.get("engine_request_id") == request_id:
                found.append(Found(str(path), lineno, record, "engine_request_id"))
    return Request(request_id, found, problems.files, problems.total,
                   sorted(problems.examples, key=lambda bad: (bad.path, bad.line)))


def split_reasoning(text: str) -> tuple[str | None, str]:
    """(reasoning, content) of a generated text: the reasoning is what stands between ``<think>`` and
    ``</think>`` (or before a lone ``</think>``, when the template opened the block in the prompt);
    an unclosed ``<think>`` (cut short) leaves everything after it as reasoning. None without a block."""
    close = text.find(_THINK_CLOSE)
    open_at = text.find(_THINK_OPEN)
    after_open = open_at + len(_THINK_OPEN)
    if close >= 0:
        after = text[close + len(_THINK_CLOSE):]
        if 0 <= open_at < close:
            return text[after_open:close].strip(), (text[:open_at] + after).strip()
        return text[:close].strip(), after.strip()
    if open_at >= 0:
        return text[after_open:].strip(), text[:open_at].strip()
    return None, text


@dataclass(frozen=True)
class Conversation:
    """A full-level record read back by its model's chat template (:mod:`.chat_parse`)."""

    template: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    #: The answer as an assistant message (``content``, ``reasoning_content``, ``tool_calls``); None
    #: without an output text or when a tool call in it cannot be read.
    answer: dict[str, Any] | None


def check_template(name: str | None) -> None:
    """Refuse a ``--template`` that is not a vendored chat template."""
    from carbonforge_runtime.recipes import chat_templates

    if name is not None and name not in chat_templates.TEMPLATES:
        raise UsageError(f"--template {name!r} is not a vendored chat template",
                         f"give one of {', '.join(chat_templates.names())}, or leave it out to use the template of "
                         "the model the record names")


def read_conversation(record: dict[str, Any], template: str | None = None) -> tuple[Conversation | None, str]:
    """The messages behind a record's ``prompt_text``, read with ``template`` or the template of the
    record's ``model``: ``(conversation, "")``, or ``(None, why they are not shown)``. Exact or nothing."""
    prompt = record.get("prompt_text")
    if not isinstance(prompt, str):
        return None, "the prompt text is not recorded"
    from carbonforge_runtime.offline.trace_tools import chat_parse
    from carbonforge_runtime.recipes import chat_templates

    if template is not None:
        chosen = chat_templates.TEMPLATES[template]
    else:
        model = record.get("model")
        if not isinstance(model, str):
            return None, "the record does not name its model, so its chat template is not known (--template NAME " \
                         "reads it with a vendored one)"
        found = chat_templates.for_model(model)
        if found is None:
            why = chat_templates.NOT_VENDORED.get(model, "not a shipped recipe's model")
            return None, f"no vendored chat template for {model} ({why}; --template NAME reads it with a vendored one)"
        chosen = found
    try:
        parsed = chat_parse.parse_prompt(chosen, prompt)
    except chat_parse.Unparsable as exc:
        return None, f"the prompt does not read back with the {chosen.name} template ({exc.reason})"
    except CarbonForgeError as exc:
        return None, exc.message
    answer = None
    output = record.get("output_text")
    if isinstance(output, str):
        try:
            answer = chat_parse.parse_answer(chosen, output, parsed)
        except chat_parse.Unparsable:
            answer = None
    return Conversation(chosen.name, parsed.messages, parsed.tools, answer), ""


def answer_parts(record: dict[str, Any], conversation: Conversation | None) -> tuple[str | None, str | None]:
    """(reasoning, content) of the record's output: as the template's parser read it, else split at
    the ``<think>`` block; (None, None) without an output text."""
    output = record.get("output_text")
    if not isinstance(output, str):
        return None, None
    if conversation is not None and conversation.answer is not None:
        answer = conversation.answer
        return answer.get("reasoning_content"), answer.get("content") or ""
    return split_reasoning(output)


# --------------------------------------------------------------------------------------------
# Rendering


def utc_ms(unix_s: Any) -> str:
    """A Unix time as UTC text to the millisecond ("out of range" where no calendar can show it)."""
    try:
        return datetime.fromtimestamp(unix_s, tz=UTC).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]
    except (OverflowError, ValueError, OSError, TypeError):
        return "out of range"


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if type(value) is int:
        return str(value)
    if type(value) is float:
        return fmt_s(value) if value >= 0 else f"{value:.3f}"
    if isinstance(value, str):
        return value if len(value) <= 40 else value[:39] + "…"
    return json.dumps(value)[:20]


def _table(rows: list[list[str]], left: int) -> list[str]:
    """Columns padded to their widest cell: the first ``left`` aligned left, the rest right."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    out = []
    for row in rows:
        cells = [cell.ljust(widths[i]) if i < left else cell.rjust(widths[i]) for i, cell in enumerate(row)]
        out.append("  ".join(cells).rstrip())
    return out


def render_list(page: Page) -> str:
    query = page.query
    order = "descending" if query.descending else "ascending"
    criteria = query.describe()
    matching = f"matching {criteria}" if criteria else "in all"
    if not page.rows:
        where = "after the cursor" if page.before else ""
        head = f"no requests {where} ({page.matched:,} {matching}; {page.records:,} records read)"
        return " ".join(head.split())
    first = page.before + 1
    out = [f"requests {first:,}-{first + len(page.rows) - 1:,} of {page.matched:,} {matching} "
           f"({page.records:,} records read), by {query.sort} {order}", ""]
    optional = [name for name in ("model", "tenant", "task")
                if any(getattr(row, name) is not None for row in page.rows)]
    extra = query.sort not in ROW_FIELDS
    header = ["arrival (UTC)", "request id", *optional, "prompt", "output", "ttft s", "e2e s", "queue s", "finish"]
    if extra:
        header.append(query.sort)
    table = [header]
    for row in page.rows:
        cells = [utc_ms(row.t_arrival), row.request_id, *(_cell(getattr(row, name)) for name in optional),
                 _cell(row.prompt_tokens), _cell(row.output_tokens), _cell(row.ttft_s), _cell(row.e2e_latency_s),
                 _cell(row.queue_wait_s), _cell(row.finish_reason)]
        if extra:
            cells.append(_cell(row.sort_value))
        table.append(cells)
    out.extend(_table(table, 2 + len(optional)))
    if page.next_cursor is not None:
        out.append("")
        out.append(f"next page: --cursor {page.next_cursor}")
    return "\n".join(out)


def _seconds(value: Any) -> str:
    return "-" if value is None else f"{_cell(value)} s"


def _indented(text: str) -> list[str]:
    return ["    " + line for line in text.split("\n")]


def render_request(request: Request, template: str | None = None) -> str:
    """Every record of the request in full; at the full level the messages (read back with ``template``
    or the record's model's chat template), else the prompt as recorded, and the answer."""
    found = request.found
    out: list[str] = []
    if len(found) > 1:
        out.append(f"{len(found)} records have the id {request.id} (with n > 1 every sample is a record of its "
                   "own; /v1/completions writes one per prompt): each is shown below")
        out.append("")
    for index, item in enumerate(found, start=1):
        record = item.record
        get = record.get
        title = f"record {index} of {len(found)}" if len(found) > 1 else "request"
        out.append(f"{title}: {get('request_id')}   ({item.file}:{item.line})")
        facts: list[tuple[str, str]] = [("engine request id", _cell(get("engine_request_id")))]
        for name in ("model", "tenant"):
            if get(name) is not None:
                facts.append((name, str(get(name))))
        tags = get("tags")
        if isinstance(tags, dict) and tags:
            facts.append(("tags", ", ".join(f"{key}={value}" for key, value in tags.items())))
        facts += [
            ("arrival", f"{utc_ms(get('t_arrival'))} UTC ({get('t_arrival')})"),
            ("completion", f"{utc_ms(get('t_completion'))} UTC ({get('t_completion')})"),
            ("time to first token", _seconds(get("ttft_s"))),
            ("end-to-end", _seconds(get("e2e_latency_s"))),
            ("queue wait", _seconds(get("queue_wait_s"))),
            ("prompt tokens", f"{_cell(get('prompt_tokens'))} ({_cell(get('cached_prompt_tokens'))} from the "
                              "prefix cache)"),
            ("output tokens", _cell(get("output_tokens"))),
            ("finish reason", _cell(get("finish_reason"))),
            ("scheduler family", _cell(get("scheduler_family"))),
            ("priority score", _cell(get("priority_score"))),
            ("preemptions", _cell(get("preemptions"))),
            ("energy", "not metered" if get("energy_j") is None else f"{_cell(get('energy_j'))} J"),
        ]
        width = max(len(name) for name, _ in facts)
        out.extend(f"  {name.ljust(width)}  {value}" for name, value in facts)
        out.extend(_texts(record, template))
        if item.matched_by == "engine_request_id":
            out.append(f"  (found by its engine request id {request.id})")
        out.append("")
    return "\n".join(out).rstrip("\n")


def _texts(record: dict[str, Any], template: str | None) -> list[str]:
    if "prompt_text" not in record and "output_text" not in record:
        return ["", "  prompt and answer: not recorded (a standard-level trace; serve with --request-trace full "
                "to keep them)"]
    out: list[str] = []
    conversation, why = read_conversation(record, template)
    prompt = record.get("prompt_text")
    if conversation is not None:
        out += ["", f"  messages (read back from the prompt with the {conversation.template} chat template):"]
        for message in conversation.messages:
            out.extend(_message(message))
        if conversation.tools:
            names = [str(tool.get("function", {}).get("name", "?")) for tool in conversation.tools]
            out += ["", f"  tools offered: {', '.join(names)}"]
    else:
        out += ["", "  prompt (as the engine served it, chat template included):"]
        out.extend(_indented(prompt) if isinstance(prompt, str) else ["    (not recorded)"])
        if isinstance(prompt, str):
            out.append(f"  (messages not rebuilt: {why})")
    reasoning, content = answer_parts(record, conversation)
    if content is None:
        out += ["", "  answer: (not recorded)"]
        return out
    if reasoning is not None:
        out += ["", "  reasoning:"]
        out.extend(_indented(reasoning))
    out += ["", "  answer:"]
    answer = conversation.answer if conversation is not None else None
    calls = (answer or {}).get("tool_calls") or []
    if content or not calls:
        out.extend(_indented(content))
    out.extend("    " + _call(call) for call in calls)
    return out


def _call(call: Any) -> str:
    function = call.get("function", {}) if isinstance(call, dict) else {}
    return f"tool call {call.get('id', '?')}: {function.get('name', '?')}({function.get('arguments', '')})"


def _message(message: Any) -> list[str]:
    if not isinstance(message, dict):
        return ["    " + json.dumps(message)]
    role = str(message.get("role", "?"))
    if role == "tool" and message.get("tool_call_id"):
        role = f"tool {message['tool_call_id']}"
    out = [f"    [{role}]"]
    reasoning = message.get("reasoning_content")
    if isinstance(reasoning, str) and reasoning:
        out.append("      reasoning:")
        out.extend("    " + line for line in _indented(reasoning))
    content = message.get("content")
    if content:
        out.extend("  " + line for line in _indented(content if isinstance(content, str) else json.dumps(content)))
    for call in message.get("tool_calls") or []:
        out.append("      " + _call(call))
    return out
