"""``trace export``: full-level trace records turned into a fine-tuning or an evaluation dataset.

Each record's ``prompt_text`` is read back into the request's ``messages`` (and ``tools``) by the
served model's chat template (:mod:`.chat_parse`); its ``output_text`` becomes the assistant answer,
reasoning and tool calls parsed as vLLM parses them. Formats (one JSON object per line):

* ``chat``: OpenAI's chat fine-tuning format, ``{"messages": [... input ..., answer]}`` with
  ``"tools"`` when the request had tools;
* ``eval``: ``{"messages": [... input ...], "reference": answer, "tools": [...],
  "metadata": {"request_id", "model", "task", "finish_reason"}}``: the input and the reference
  answer to grade a model's own answer against.

Only successful requests (``finish_reason`` ``stop``) are exported unless told otherwise: ``length``
was cut short, ``abort`` and ``error`` did not finish. Exact duplicates (same row once scrubbed,
metadata aside) are written once. A request whose prompt or answer cannot be read exactly is skipped
and counted with the reason, never guessed. Strings are scrubbed of credentials (:mod:`.scrub`)
unless that is turned off. Files are written whole or not at all.
"""

from __future__ import annotations

import json
import random
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from hashlib import blake2b
from pathlib import Path
from typing import IO, Any

from carbonforge_runtime import files
from carbonforge_runtime.errors import CarbonForgeError, UsageError
from carbonforge_runtime.offline.trace_reader import (
    DamagedInput,
    TraceInputError,
    check_readable,
    json_lines,
    trace_files,
)
from carbonforge_runtime.offline.trace_tools import chat_parse
from carbonforge_runtime.offline.trace_tools.scrub import Scrubber
from carbonforge_runtime.recipes import chat_templates

FORMATS = ("chat", "eval")
#: Finish reasons exported by default: the request ended on its own.
SUCCESS = ("stop",)
#: Reasons shown per skipped prompt in the summary (the rest are counted).
MAX_REASONS = 8

Record = dict[str, Any]


@dataclass
class ExportOptions:
    format: str = "chat"
    template: str | None = None
    include_failed: bool = False
    split: float | None = None
    seed: int = 0
    max_rows: int | None = None
    keep_reasoning: bool = False
    scrubber: Scrubber | None = None


@dataclass
class ExportSummary:
    records: int = 0
    matched: int = 0
    written: int = 0
    outputs: list[tuple[str, int]] = field(default_factory=list)
    failed: Counter[str] = field(default_factory=Counter)
    unparsable: Counter[str] = field(default_factory=Counter)
    no_template: Counter[str] = field(default_factory=Counter)
    no_text: int = 0
    standard_level: int = 0
    duplicates: int = 0
    bad_lines: int = 0
    damage: list[str] = field(default_factory=list)
    capped: bool = False
    scrubbed: bool = True
    redactions: Counter[str] = field(default_factory=Counter)

    def to_json(self) -> dict[str, Any]:
        return {
            "records": self.records, "matched": self.matched, "written": self.written,
            "outputs": [{"path": path, "rows": rows} for path, rows in self.outputs],
            "skipped_failed": dict(self.failed), "skipped_unparsable": dict(self.unparsable),
            "skipped_no_template": dict(self.no_template), "skipped_no_text": self.no_text,
            "skipped_standard_level": self.standard_level, "duplicates": self.duplicates,
            "bad_lines": self.bad_lines, "capped": self.capped, "scrubbed": self.scrubbed,
            "redactions": dict(self.redactions),
        }


def validate(options: ExportOptions) -> None:
    if options.format not in FORMATS:
        raise UsageError(f"--format {options.format!r} is not one of {', '.join(FORMATS)}",
                         "give --format chat (fine-tuning) or --format eval (input and reference answer)")
    if options.template is not None and options.template not in chat_templates.TEMPLATES:
        raise UsageError(f"--template {options.template!r} is not a vendored chat template",
                         f"give one of {', '.join(chat_templates.names())}")
    if options.split is not None and not 0.0 < options.split < 1.0:
        raise UsageError(f"--split {options.split} is not between 0 and 1",
                         "give the training share, e.g. --split 0.9 (90 % train, 10 % eval)")
    if options.max_rows is not None and options.max_rows < 1:
        raise UsageError(f"--max-rows {options.max_rows} is not a positive number", "give --max-rows 1 or more")


def split_paths(output: Path) -> tuple[Path, Path]:
    """``out.jsonl`` -> ``out.train.jsonl`` and ``out.eval.jsonl`` (before the last extension)."""
    stem, suffix = output.stem, output.suffix
    return output.with_name(f"{stem}.train{suffix}"), output.with_name(f"{stem}.eval{suffix}")


def _template_of(record: Record, options: ExportOptions, summary: ExportSummary) -> chat_templates.ChatTemplate | None:
    if options.template is not None:
        return chat_templates.TEMPLATES[options.template]
    model = record.get("model")
    if not isinstance(model, str) or not model:
        raise UsageError(
            "the trace records do not name the model that served them, so its chat template is not known",
            f"give --template NAME, one of {', '.join(chat_templates.names())}",
        )
    template = chat_templates.for_model(model)
    if template is None:
        why = chat_templates.NOT_VENDORED.get(model, "not a shipped recipe's model")
        summary.no_template[f"{model} ({why}; --template NAME reads it with a vendored one)"] += 1
    return template


def _clean_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Tools as a client sends them: vLLM's null fields (unset options) left out."""
    out = []
    for tool in tools:
        item = {key: value for key, value in tool.items() if value is not None}
        if isinstance(item.get("function"), dict):
            item["function"] = {key: value for key, value in item["function"].items() if value is not None}
        out.append(item)
    return out


def _without_reasoning(message: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in message.items() if key != "reasoning_content"}


def build_row(record: Record, template: chat_templates.ChatTemplate, options: ExportOptions) -> dict[str, Any]:
    """The dataset row of one record; chat_parse.Unparsable when it cannot be read exactly."""
    prompt = chat_parse.parse_prompt(template, record["prompt_text"])
    try:
        answer = chat_parse.parse_answer(template, record["output_text"], prompt)
    except chat_parse.Unparsable as exc:
        raise chat_parse.Unparsable(f"answer: {exc.reason}") from None
    messages = prompt.messages
    if not options.keep_reasoning:
        messages = [_without_reasoning(message) for message in messages]
        answer = _without_reasoning(answer)
    tools = _clean_tools(prompt.tools) if prompt.tools else None
    if options.format == "chat":
        row: dict[str, Any] = {"messages": [*messages, answer]}
        if tools:
            row["tools"] = tools
    else:
        row = {"messages": messages, "reference": answer}
        if tools:
            row["tools"] = tools
        tags = record.get("tags")
        row["metadata"] = {"request_id": record.get("request_id"), "model": record.get("model"),
                           "task": tags.get("task") if isinstance(tags, dict) else None,
                           "finish_reason": record.get("finish_reason")}
    return row


def query_predicate(query: Any) -> Callable[[Record], bool]:
    """``trace list``'s filters (a catalog.Query) as a test of one record, with the same semantics: a time
    range on arrival, exact text fields, the task tag, numeric conditions (a record without the field, or
    with a value that is not a number, fails them)."""
    from carbonforge_runtime.offline.trace_tools import catalog

    tests = tuple((c.field, catalog.OPERATORS[c.op], c.value) for c in query.conditions)
    texts = tuple((name, getattr(query, name)) for name in ("finish_reason", "model", "tenant")
                  if getattr(query, name) is not None)

    def accepts(record: Record) -> bool:
        arrival = record.get("t_arrival")
        if query.since is not None or query.until is not None:
            if not isinstance(arrival, int | float) or isinstance(arrival, bool):
                return False
            if (query.since is not None and arrival < query.since) or (query.until is not None
                                                                        and arrival >= query.until):
                return False
        if any(record.get(name) != wanted for name, wanted in texts):
            return False
        if query.task is not None:
            tags = record.get("tags")
            if not isinstance(tags, dict) or tags.get("task") != query.task:
                return False
        for name, compare, value in tests:
            have = record.get(name)
            if not isinstance(have, int | float) or isinstance(have, bool) or not compare(have, value):
                return False
        return True

    return accepts


def _records(path: Path, summary: ExportSummary) -> Any:
    check_readable(path)
    try:
        for _number, record in json_lines(path):
            if isinstance(record, dict):
                yield record
            else:  # not JSON, or JSON that is not an object
                summary.bad_lines += 1
    except DamagedInput as exc:
        summary.damage.append(f"{path}: {exc.reason}; the records before it were read")


def export(paths: Sequence[Path], output: Path, options: ExportOptions,
           predicate: Callable[[Record], bool] = lambda record: True, *,
           finish_reasons_chosen: bool = False) -> ExportSummary:
    """Read ``paths`` (files or directories), keep the records ``predicate`` accepts, write the dataset.

    With ``finish_reasons_chosen`` (the caller filters on finish_reason itself), the default of
    successful requests only is not applied."""
    validate(options)
    summary = ExportSummary(scrubbed=options.scrubber is not None)
    inputs = trace_files(paths)
    for path in inputs:
        check_readable(path)
    seen: set[bytes] = set()
    rows: list[str] = []
    done = False
    for path in inputs:
        if done:
            break
        for record in _records(path, summary):
            summary.records += 1
            if not predicate(record):
                continue
            summary.matched += 1
            if "prompt_text" not in record and "output_text" not in record:
                summary.standard_level += 1
                continue
            reason = record.get("finish_reason")
            if not (options.include_failed or finish_reasons_chosen) and reason not in SUCCESS:
                summary.failed[str(reason)] += 1
                continue
            if not isinstance(record.get("prompt_text"), str) or not isinstance(record.get("output_text"), str):
                summary.no_text += 1
                continue
            template = _template_of(record, options, summary)
            if template is None:
                continue
            try:
                row = build_row(record, template, options)
            except chat_parse.Unparsable as exc:
                summary.unparsable[exc.reason] += 1
                continue
            counted = Counter(options.scrubber.counts) if options.scrubber is not None else None
            if options.scrubber is not None:
                row = _scrub_row(row, options.scrubber)
            identity = {key: value for key, value in row.items() if key != "metadata"}
            key = blake2b(json.dumps(identity, ensure_ascii=False, sort_keys=True).encode("utf-8", "surrogatepass"),
                          digest_size=16).digest()
            if key in seen:
                summary.duplicates += 1
                if options.scrubber is not None and counted is not None:
                    options.scrubber.counts = counted  # redactions are counted in the rows written
                continue
            seen.add(key)
            rows.append(json.dumps(row, ensure_ascii=False))
            if options.max_rows is not None and len(rows) >= options.max_rows:
                summary.capped = True
                done = True
                break
    if options.scrubber is not None:
        summary.redactions = Counter(options.scrubber.counts)
    if summary.matched and summary.standard_level == summary.matched:
        raise TraceInputError(
            f"the {summary.matched} matching records are standard-level: they hold no prompt_text or output_text "
            "to build messages from",
            "record with the full level (serve --request-trace full, only on traffic you may keep) and export that",
        )
    _write(output, rows, options, summary)
    return summary


def _scrub_row(row: dict[str, Any], scrubber: Scrubber) -> dict[str, Any]:
    """Every string of the row scrubbed (metadata aside); tool call arguments (JSON text) through their
    parsed form, so that they stay JSON."""

    def message(item: Any) -> Any:
        if not isinstance(item, dict):
            return scrubber.value(item)
        out = {}
        for key, value in item.items():
            if key == "tool_calls" and isinstance(value, list):
                out[key] = [call_of(call) for call in value]
            else:
                out[key] = scrubber.value(value)
        return out

    def call_of(call: Any) -> Any:
        if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
            return scrubber.value(call)
        function = dict(call["function"])
        try:
            arguments = json.loads(function.get("arguments") or "{}")
        except ValueError:
            function["arguments"] = scrubber.value(function.get("arguments"))
        else:
            function["arguments"] = json.dumps(scrubber.value(arguments), ensure_ascii=False)
        return {**call, "function": function}

    out: dict[str, Any] = {}
    for key, value in row.items():
        if key == "messages":
            out[key] = [message(item) for item in value]
        elif key == "reference":
            out[key] = message(value)
        elif key == "metadata":
            out[key] = value
        else:
            out[key] = scrubber.value(value)
    return out


def _write(output: Path, rows: list[str], options: ExportOptions, summary: ExportSummary) -> None:
    def lines(chosen: list[str]) -> Callable[[IO[Any]], None]:
        def write(handle: IO[Any]) -> None:
            for line in chosen:
                handle.write(line + "\n")
        return write

    targets: list[tuple[Path, list[str]]]
    if options.split is None:
        targets = [(output, rows)]
    else:
        order = list(range(len(rows)))
        random.Random(options.seed).shuffle(order)
        cut = round(len(rows) * options.split)
        train = set(order[:cut])
        train_path, eval_path = split_paths(output)
        targets = [(train_path, [row for i, row in enumerate(rows) if i in train]),
                   (eval_path, [row for i, row in enumerate(rows) if i not in train])]
    for path, chosen in targets:
        try:
            files.write_atomic(path, lines(chosen))
        except OSError as exc:
            raise CarbonForgeError(f"cannot write {path} ({exc.strerror or exc})",
                                   "choose a writable path for -o") from None
        summary.outputs.append((str(path), len(chosen)))
    summary.written = len(rows)


def render_summary(summary: ExportSummary, options: ExportOptions) -> str:
    out = []
    for path, count in summary.outputs:
        out.append(f"wrote {count:,} rows to {path} (format {options.format})")
    out.append(f"read {summary.records:,} records; {summary.matched:,} matched the filters")
    skipped: list[str] = []
    if summary.failed:
        detail = ", ".join(f"{reason} {count:,}" for reason, count in summary.failed.most_common())
        skipped.append(f"{sum(summary.failed.values()):,} not successful ({detail}; --include-failed keeps them)")
    if summary.duplicates:
        skipped.append(f"{summary.duplicates:,} exact duplicates")
    if summary.unparsable:
        skipped.append(f"{sum(summary.unparsable.values()):,} whose prompt or answer cannot be read exactly:")
        for reason, count in summary.unparsable.most_common(MAX_REASONS):
            skipped.append(f"    {count:,}  {reason}")
        if len(summary.unparsable) > MAX_REASONS:
            skipped.append(f"    ... and {len(summary.unparsable) - MAX_REASONS} other reasons")
    for model, count in summary.no_template.most_common():
        skipped.append(f"{count:,} served by {model}")
    if summary.no_text:
        skipped.append(f"{summary.no_text:,} full-level records without prompt_text or output_text")
    if summary.standard_level:
        skipped.append(f"{summary.standard_level:,} standard-level records (no texts)")
    if summary.bad_lines:
        skipped.append(f"{summary.bad_lines:,} lines that are not JSON objects")
    if skipped:
        out.append("skipped: " + skipped[0])
        out.extend("         " + line for line in skipped[1:])
    if summary.capped:
        out.append(f"stopped at --max-rows {options.max_rows:,}")
    out.extend(f"warning: {damage}" for damage in summary.damage)
    if not summary.scrubbed:
        out.append("scrubbing: off (--no-scrub): credentials in the texts are exported as they are")
    elif summary.redactions:
        detail = ", ".join(f"{kind} {count:,}" for kind, count in summary.redactions.most_common())
        out.append(f"scrubbing: {sum(summary.redactions.values()):,} values redacted ({detail})")
    else:
        out.append("scrubbing: nothing matched the credential patterns")
    return "\n".join(out)
