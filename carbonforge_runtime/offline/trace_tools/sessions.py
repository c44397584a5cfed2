"""``trace sessions``: conversations rebuilt from a full-level trace by the growing-prefix rule.

A trace has no session field. A request continues an earlier one when its rendered prompt
starts with the earlier request's rendered prompt followed by that request's output (then
anything: the chat template's end-of-turn markup and the next user message). Two
conversations that share only a system prompt never qualify: the earlier prompt includes
its own user message, which the other conversation does not repeat.

Matching is by hashes, never by comparing texts pairwise:

1. first pass: each prompt is indexed by ``(length, digest)``; each output by the digests of
   its normalised forms (see :func:`output_variants`); the last few characters of every prompt
   (the template's generation prompt, e.g. ``<|im_start|>assistant\\n``) are collected;
2. second pass: the places where such an ending occurs inside a prompt are its only possible
   cut points; the prompt is hashed once, incrementally, through those points, and each
   digest is looked up. At a hit, the characters after the cut are hashed once per output
   length known for that earlier prompt and looked up too.

The texts are not kept: memory is about 2 KiB per request. Among several matches the
longest prefix wins (the immediately preceding turn). When two earlier requests are
indistinguishable (same prompt and same output), the one not yet continued is chosen, so
identical conversations are still told apart.
"""

from __future__ import annotations

import bisect
import json
import math
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from hashlib import blake2b
from pathlib import Path
from typing import Any

from carbonforge_runtime.offline.trace_reader import (
    DamagedInput,
    TraceInputError,
    byte_line_batches,
    check_readable,
    loads_line,
    orjson,
)

#: Characters at the end of a prompt used to find cut points in later prompts.
TAIL_CHARS = 16
#: Above this many distinct prompt endings, cut points are found by length instead of by search.
MAX_SEARCHED_TAILS = 32
#: An earlier request may complete this long after the later one arrived (clock tolerance).
CLOCK_SLACK_S = 1.0
_DIGEST_BYTES = 12
MAX_REPORTED_BAD_LINES = 20

#: End-of-turn tokens a decoded output may end with; the next prompt renders its own.
END_MARKERS = ("<|im_end|>", "<|endoftext|>", "<|end_of_text|>", "<|eot_id|>", "<|end|>", "<|eot|>",
               "<end_of_turn>", "</s>", "<｜end▁of▁sentence｜>")
_SPECIAL_TOKEN = re.compile(r"<\|[^|<>\s]{1,40}\|>")
_EMPTY_THINK_AT_END = re.compile(r"<think>\s*</think>\s*\Z")
_OPEN_THINK_AT_END = re.compile(r"<think>\s*\Z")
_SPACE = re.compile(r"\s*")


def _digest(text: str) -> bytes:
    return blake2b(text.encode("utf-8", "surrogatepass"), digest_size=_DIGEST_BYTES).digest()


def output_variants(text: str) -> set[str]:
    """The forms an output can take when a chat template renders it back into the next prompt.

    Surrounding whitespace and trailing end-of-turn tokens are dropped (templates add their own),
    a reasoning block may be left out (``...</think>`` removed), and special tokens decoded into
    the output may be absent from the content the client sent back.
    """
    base = text
    changed = True
    while changed:
        changed = False
        base = base.rstrip()
        for marker in END_MARKERS:
            if base.endswith(marker):
                base = base[: -len(marker)]
                changed = True
    base = base.strip()
    variants = {base}
    if "</think>" in base:
        variants.add(base.rsplit("</think>", 1)[1].strip())
    variants.add(_SPECIAL_TOKEN.sub("", base).strip())
    return variants


def prompt_anchors(text: str) -> list[str]:
    """Prefixes of a later prompt that this prompt can appear as.

    The prompt itself; and, when it ends with a reasoning block that the template adds for the
    reply (an empty one when thinking is off, an opened one when the template starts the
    thinking itself), the prompt without it, since templates drop that block from earlier turns.
    """
    anchors = [text]
    for pattern in (_EMPTY_THINK_AT_END, _OPEN_THINK_AT_END):
        match = pattern.search(text)
        if match and match.start() > 0:
            anchors.append(text[: match.start()])
    return anchors


@dataclass(slots=True)
class _Request:
    request_id: str
    line: int
    t_arrival: float
    t_completion: float
    prompt_tokens: float
    output_tokens: float
    e2e_s: float
    queue_s: float
    prompt_chars: int
    parents: list[int] = field(default_factory=list)
    children: int = 0
    session: int = -1
    turn: int = 0
    parent: int | None = None


@dataclass(frozen=True)
class SessionStats:
    session_id: str
    turns: int
    first_arrival: float
    last_completion: float
    prompt_tokens: float
    output_tokens: float
    last_prompt_tokens: float
    e2e_total_s: float
    e2e_mean_s: float
    e2e_max_s: float
    queue_total_s: float
    branch_of: str | None
    request_ids: list[str]


@dataclass(frozen=True)
class Assignment:
    request_id: str
    session_id: str
    turn: int
    parent_request_id: str | None


@dataclass
class SessionsResult:
    path: str
    records: int
    records_with_text: int
    records_without_text: int
    bad_lines: int
    bad_line_examples: list[tuple[int, str]]
    damage: str | None
    sessions: list[SessionStats]
    assignments: list[Assignment]

    @property
    def multi_turn(self) -> int:
        return sum(1 for session in self.sessions if session.turns > 1)

    def to_json(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "records": self.records,
            "records_with_text": self.records_with_text,
            "records_without_text": self.records_without_text,
            "bad_lines": self.bad_lines,
            "sessions": [session.__dict__ for session in self.sessions],
        }


class _Problems:
    def __init__(self) -> None:
        self.bad = 0
        self.examples: list[tuple[int, str]] = []

    def add(self, line: int, reason: str) -> None:
        self.bad += 1
        if len(self.examples) < MAX_REPORTED_BAD_LINES:
            self.examples.append((line, reason))


def _number(record: dict[str, Any], name: str, default: float = 0.0) -> float:
    """A figure shown beside a session; missing, not a number, not finite or too large: ``default``."""
    value = record.get(name)
    if not isinstance(value, int | float) or isinstance(value, bool):
        return default
    try:
        number = float(value)
    except OverflowError:
        return default
    return number if math.isfinite(number) else default


def _records(path: Path, problems: _Problems | None) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, record) for every JSON object line; bad lines reported when ``problems`` is given."""
    fast = orjson.loads if orjson is not None else loads_line
    lineno = 0
    for batch in byte_line_batches(path):
        for line in batch:
            lineno += 1
            try:
                record = fast(line)
            except ValueError:
                text = line.decode("utf-8", "surrogateescape")
                if not text.strip():
                    continue
                try:
                    record = loads_line(text)
                except ValueError as exc:
                    if problems is not None:
                        problems.add(lineno, f"not valid JSON ({getattr(exc, 'msg', exc)})")
                    continue
            if not isinstance(record, dict) or not isinstance(record.get("request_id"), str):
                if problems is not None:
                    problems.add(lineno, "not a trace record (a JSON object with a request_id)")
                continue
            yield lineno, record


def _texts(record: dict[str, Any]) -> tuple[str, str] | None:
    prompt, output = record.get("prompt_text"), record.get("output_text")
    if isinstance(prompt, str) and isinstance(output, str) and prompt:
        return prompt, output
    return None


class _Index:
    """Digests of every prompt (and its anchors) and of every output form, by length."""

    def __init__(self) -> None:
        # (prompt length, prompt digest) -> (output length, output digest) -> request indexes
        self.prompts: dict[tuple[int, bytes], dict[tuple[int, bytes], list[int]]] = {}
        self.tails: dict[str, int] = {}
        self.lengths: list[int] = []

    def add(self, index: int, prompt: str, output: str) -> None:
        outputs = [(len(form), _digest(form)) for form in output_variants(output)]
        for anchor in prompt_anchors(prompt):
            by_output = self.prompts.setdefault((len(anchor), _digest(anchor)), {})
            for key in outputs:
                by_output.setdefault(key, []).append(index)
            tail = anchor[-TAIL_CHARS:]
            self.tails[tail] = self.tails.get(tail, 0) + 1

    def freeze(self) -> None:
        self.lengths = sorted({length for length, _ in self.prompts})

    def cut_points(self, prompt: str) -> list[int]:
        """Positions inside ``prompt`` where an indexed prompt could end."""
        size = len(prompt)
        points: set[int] = set()
        if len(self.tails) <= MAX_SEARCHED_TAILS:
            for tail in self.tails:
                start = prompt.find(tail)
                while start >= 0:
                    end = start + len(tail)
                    if end < size:
                        points.add(end)
                    start = prompt.find(tail, start + 1)
        else:
            tails = self.tails
            for length in self.lengths[: bisect.bisect_left(self.lengths, size)]:
                if prompt[max(length - TAIL_CHARS, 0):length] in tails:
                    points.add(length)
        return sorted(points)

    def matches(self, prompt: str) -> list[tuple[int, int, list[int]]]:
        """(prompt length, output length, candidate parents) for every earlier turn ``prompt`` extends."""
        found: list[tuple[int, int, list[int]]] = []
        hasher = blake2b(digest_size=_DIGEST_BYTES)
        done = 0
        for point in self.cut_points(prompt):
            hasher.update(prompt[done:point].encode("utf-8", "surrogatepass"))
            done = point
            by_output = self.prompts.get((point, hasher.copy().digest()))
            if not by_output:
                continue
            start = _SPACE.match(prompt, point).end()  # type: ignore[union-attr]
            for length in {length for length, _ in by_output}:
                if start + length > len(prompt):
                    continue
                parents = by_output.get((length, _digest(prompt[start:start + length])))
                if parents:
                    found.append((point, length, parents))
        return found


def _choose_parent(request: _Request, index: int, candidates: Sequence[int], requests: Sequence[_Request]) -> int:
    """Among indistinguishable earlier requests: one that finished in time and was not continued yet."""
    pool = [c for c in candidates if c != index]
    in_time = [c for c in pool if requests[c].t_completion <= request.t_arrival + CLOCK_SLACK_S] or pool
    free = [c for c in in_time if requests[c].children == 0] or in_time
    return max(free, key=lambda c: (requests[c].t_completion, -c))


def reconstruct(path: Path) -> SessionsResult:
    check_readable(path)
    problems = _Problems()
    requests: list[_Request] = []
    index = _Index()
    records = 0
    damage: str | None = None
    try:
        for lineno, record in _records(path, problems):
            records += 1
            texts = _texts(record)
            if texts is None:
                continue
            prompt, output = texts
            index.add(len(requests), prompt, output)
            requests.append(_Request(
                request_id=record["request_id"], line=lineno,
                t_arrival=_number(record, "t_arrival"), t_completion=_number(record, "t_completion"),
                prompt_tokens=_number(record, "prompt_tokens"), output_tokens=_number(record, "output_tokens"),
                e2e_s=_number(record, "e2e_latency_s"), queue_s=_number(record, "queue_wait_s"),
                prompt_chars=len(prompt),
            ))
    except DamagedInput as exc:
        damage = f"{exc.reason}; records before the damage were used"
    if records == 0:
        if damage:
            raise TraceInputError(f"{path}: {damage}; no trace record before it",
                                  "point the command at a JSONL trace file written by the runtime")
        if problems.bad:
            raise TraceInputError(f"{path}: no valid trace records ({problems.bad} bad lines skipped)",
                                  "point the command at a JSONL trace file written by the runtime")
        raise TraceInputError(f"{path}: empty, no trace records", "point the command at a non-empty trace file")
    if not requests:
        raise TraceInputError(
            f"{path}: sessions need the full trace level, but none of its {records} records carries "
            "prompt_text and output_text (a standard-level trace)",
            "record a trace with --request-trace full (only on traffic you may record) and run this on it",
        )
    index.freeze()

    # Second pass: which earlier requests does each prompt extend?
    position = 0
    try:
        for _, record in _records(path, None):
            texts = _texts(record)
            if texts is None:
                continue
            if position >= len(requests):
                break
            found = index.matches(texts[0])
            if found:
                best_point, best_length, _ = max(found, key=lambda item: (item[0], item[1]))
                current = requests[position]
                for point, length, parents in found:
                    if (point, length) == (best_point, best_length):
                        current.parents.extend(p for p in parents if p != position)
            position += 1
    except DamagedInput:
        pass
    return _assign(str(path), records, requests, problems, damage)


def _assign(path: str, records: int, requests: list[_Request], problems: _Problems,
            damage: str | None) -> SessionsResult:
    order = sorted(range(len(requests)), key=lambda i: (requests[i].t_arrival, i))
    children: dict[int, list[int]] = {}
    for i in order:
        request = requests[i]
        if request.parents:
            parent = _choose_parent(request, i, request.parents, requests)
            request.parent = parent
            requests[parent].children += 1
            children.setdefault(parent, []).append(i)
    sessions: list[list[int]] = []
    branch_of: list[int | None] = []
    roots = [i for i in order if requests[i].parent is None]
    stack: list[int] = []
    for root in roots:
        requests[root].session, requests[root].turn = len(sessions), 1
        sessions.append([root])
        branch_of.append(None)
        stack.append(root)
    # Children in arrival order: the first continues its parent's session, later ones branch off.
    while stack:
        node = stack.pop()
        for rank, child in enumerate(children.get(node, [])):
            if rank == 0:
                session = requests[node].session
            else:
                session = len(sessions)
                sessions.append([])
                branch_of.append(requests[node].session)
            requests[child].session, requests[child].turn = session, requests[node].turn + 1
            sessions[session].append(child)
            stack.append(child)
    ids = [f"s{number + 1}" for number in range(len(sessions))]
    stats = []
    for number, members in enumerate(sessions):
        members.sort(key=lambda i: (requests[i].turn, requests[i].t_arrival))
        chosen = [requests[i] for i in members]
        e2e = [r.e2e_s for r in chosen]
        parent_session = branch_of[number]
        stats.append(SessionStats(
            session_id=ids[number], turns=len(chosen),
            first_arrival=min(r.t_arrival for r in chosen), last_completion=max(r.t_completion for r in chosen),
            prompt_tokens=sum(r.prompt_tokens for r in chosen), output_tokens=sum(r.output_tokens for r in chosen),
            last_prompt_tokens=chosen[-1].prompt_tokens,
            e2e_total_s=sum(e2e), e2e_mean_s=sum(e2e) / len(e2e), e2e_max_s=max(e2e),
            queue_total_s=sum(r.queue_s for r in chosen),
            branch_of=None if parent_session is None else ids[parent_session],
            request_ids=[r.request_id for r in chosen],
        ))
    assignments = []
    for i in order:
        request = requests[i]
        parent_id = None if request.parent is None else requests[request.parent].request_id
        assignments.append(Assignment(request.request_id, ids[request.session], request.turn, parent_id))
    return SessionsResult(
        path=path, records=records, records_with_text=len(requests), records_without_text=records - len(requests),
        bad_lines=problems.bad, bad_line_examples=list(problems.examples), damage=damage,
        sessions=stats, assignments=assignments,
    )


def write_assignments(result: SessionsResult, out: Path) -> None:
    """Replace ``out`` with one JSON line per request, atomically. Raises OSError."""
    from carbonforge_runtime.files import write_atomic

    def write(handle: Any) -> None:
        for item in result.assignments:
            handle.write(json.dumps({"request_id": item.request_id, "session_id": item.session_id,
                                     "turn": item.turn, "parent_request_id": item.parent_request_id}) + "\n")

    write_atomic(out, write)


def render_text(result: SessionsResult, limit: int) -> str:
    from carbonforge_runtime.offline.trace_tools.summarize import fmt_s, utc

    turns = [session.turns for session in result.sessions]
    out = [f"trace: {result.path}"]
    out.append(f"records: {result.records:,} ({result.records_with_text:,} with prompt and output text)")
    if result.records_without_text:
        out.append(f"  {result.records_without_text:,} records carry no text (standard level, or a scheduler "
                   "family that omits it): they are not grouped")
    out.append(f"sessions: {len(result.sessions):,} ({result.multi_turn:,} multi-turn, "
               f"{len(result.sessions) - result.multi_turn:,} single-turn); most turns: {max(turns)}; "
               f"mean turns: {sum(turns) / len(turns):.2f}")
    branches = sum(1 for session in result.sessions if session.branch_of)
    if branches:
        out.append(f"  {branches} sessions branch off an earlier turn of another (same history, new reply)")
    out.append("")
    rows = [["session", "turns", "first arrival (UTC)", "duration (s)", "tokens in", "tokens out", "last prompt",
             "e2e mean (s)", "e2e max (s)", "queue total (s)", "branch of"]]
    shown = result.sessions if limit <= 0 else result.sessions[:limit]
    for session in shown:
        rows.append([session.session_id, str(session.turns), utc(session.first_arrival),
                     fmt_s(session.last_completion - session.first_arrival), f"{session.prompt_tokens:,.0f}",
                     f"{session.output_tokens:,.0f}", f"{session.last_prompt_tokens:,.0f}",
                     fmt_s(session.e2e_mean_s), fmt_s(session.e2e_max_s), fmt_s(session.queue_total_s),
                     session.branch_of or ""])
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        cells = [row[0].ljust(widths[0])] + [cell.rjust(widths[i]) for i, cell in enumerate(row[1:], start=1)]
        out.append("  ".join(cells).rstrip())
    if len(shown) < len(result.sessions):
        out.append(f"... {len(result.sessions) - len(shown):,} more sessions (--limit 0 shows all; -o writes "
                   "the grouping of every request)")
    return "\n".join(out)
