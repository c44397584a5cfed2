"""``carbonforge-runtime trace ...``: reading trace files. Imports stay light until a command runs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

from carbonforge_runtime.cli.errors import run_guarded
from carbonforge_runtime.errors import CarbonForgeError

trace_app = typer.Typer(
    help="Read trace files: capacity-planning summary, conversations, plots.",
    no_args_is_help=True,
)

_guard = run_guarded


def _summarize(files: list[Path], window_s: float) -> Any:
    """Stream every file through one summarizer; damaged input is reported on stderr, not raised."""
    from carbonforge_runtime.offline.trace_reader import trace_files
    from carbonforge_runtime.offline.trace_tools import summarize as summary_mod

    summarizer = summary_mod.Summarizer(window_s)
    try:
        for path in trace_files(files):
            summarizer.feed_file(path)
        return summarizer.result()
    finally:
        _warn(summary_mod.problem_lines(summarizer.files, summarizer.bad_examples, summarizer.bad_total))


def _chargeback(files: list[Path], by: str, json_output: bool) -> None:
    """``summarize --by tenant``: usage per tenant; damaged input is reported on stderr, not raised."""
    from carbonforge_runtime.errors import UsageError
    from carbonforge_runtime.offline.trace_reader import trace_files
    from carbonforge_runtime.offline.trace_tools import chargeback
    from carbonforge_runtime.offline.trace_tools import summarize as summary_mod

    if by not in chargeback.GROUP_BY:
        raise UsageError(f"--by {by!r} is not a grouping", f"give --by {' or '.join(chargeback.GROUP_BY)}")
    summarizer = chargeback.TenantSummarizer()
    try:
        for path in trace_files(files):
            summarizer.feed_file(path)
        result = summarizer.result()
    finally:
        _warn(summary_mod.problem_lines(summarizer.files, summarizer.bad_examples, summarizer.bad_total))
    if json_output:
        import json

        typer.echo(json.dumps(result.to_json(), indent=2))
    else:
        typer.echo(chargeback.render_text(result))


def _warn(lines: list[str]) -> None:
    for line in lines:
        typer.echo(line, err=True)


@trace_app.command("summarize")
def summarize(
    files: list[Path] = typer.Argument(..., help="Trace files (JSONL, plain or gzip), or directories of them (the "
                                       "rank files of a data-parallel deployment), read as one trace.",
                                       show_default=False),
    window: str = typer.Option("60s", "--window", help="Window length for the over-time table (60s, 5m, 1h)."),
    json_output: bool = typer.Option(False, "--json", help="Print one JSON document instead of text."),
    by: str | None = typer.Option(None, "--by", help="Group by tenant instead: a chargeback table of requests, "
                                  "tokens, mean and p99 latency and energy per tenant (--window is not used).",
                                  show_default=False),
) -> None:
    """Latency, queueing and throughput figures, per window and per scheduler family, with a verdict."""
    from carbonforge_runtime.offline.trace_tools import summarize as summary_mod

    def run() -> None:
        if by is not None:
            _chargeback(files, by, json_output)
            return
        window_s = summary_mod.parse_window(window)
        result = _summarize(files, window_s)
        if json_output:
            import json

            typer.echo(json.dumps(result.to_json(), indent=2))
        else:
            typer.echo(summary_mod.render_text(result))

    _guard(run)


@trace_app.command("sessions")
def sessions(
    file: Path = typer.Argument(..., help="A full-level trace file (JSONL, plain or gzip).", show_default=False),
    output: Path | None = typer.Option(None, "-o", "--output",
                                       help="Write one JSON line per request: request_id, session_id, turn."),
    limit: int = typer.Option(50, "--limit", help="Sessions listed (0 = all)."),
    json_output: bool = typer.Option(False, "--json", help="Print one JSON document instead of text."),
) -> None:
    """Group the requests of a full-level trace into conversations (growing-prefix rule)."""
    from carbonforge_runtime.offline.trace_tools import sessions as sessions_mod

    def run() -> None:
        result = sessions_mod.reconstruct(file)
        warnings = [f"warning: {file}:{line}: {reason}; line skipped" for line, reason in result.bad_line_examples]
        if result.bad_lines > len(result.bad_line_examples):
            warnings.append(f"warning: ... and {result.bad_lines - len(result.bad_line_examples)} more bad lines")
        if result.damage:
            warnings.append(f"warning: {file}: {result.damage}")
        _warn(warnings)
        if output is not None:
            try:
                sessions_mod.write_assignments(result, output)
            except OSError as exc:
                raise CarbonForgeError(f"cannot write {output} ({exc.strerror})",
                                       "choose a writable path for -o") from None
        if json_output:
            import json

            typer.echo(json.dumps(result.to_json(), indent=2))
        else:
            typer.echo(sessions_mod.render_text(result, limit))
            if output is not None:
                typer.echo(f"\ngrouping of {len(result.assignments):,} requests written to {output}")

    _guard(run)


@trace_app.command("plot")
def plot(
    files: list[Path] = typer.Argument(..., help="Trace files (JSONL, plain or gzip), or directories of them.",
                                       show_default=False),
    output: Path = typer.Option(..., "-o", "--output", help="PNG file to write."),
    window: str = typer.Option("60s", "--window", help="Window length (60s, 5m, 1h)."),
) -> None:
    """Latency and queue-wait percentile bands and the request rate over time, as a PNG (needs matplotlib)."""
    from carbonforge_runtime.offline.trace_tools import plot as plot_mod
    from carbonforge_runtime.offline.trace_tools import summarize as summary_mod

    def run() -> None:
        window_s = summary_mod.parse_window(window)
        plot_mod.load_pyplot()  # fail early, before reading a large file, when matplotlib is missing
        result = _summarize(files, window_s)
        names = ", ".join(path.name for path in files)
        plot_mod.render_png(result, output, f"{names}: {result.records:,} requests")
        typer.echo(f"wrote {output} ({len(result.windows)} windows of {summary_mod.fmt_window(window_s)})")

    _guard(run)


@trace_app.command("list")
def list_requests(
    files: list[Path] = typer.Argument(..., help="Trace files (JSONL, plain or gzip), or directories of them.",
                                       show_default=False),
    limit: int = typer.Option(50, "--limit", help="Rows per page (0 = every matching row)."),
    cursor: str | None = typer.Option(None, "--cursor", help="Resume after the last row of a page: the "
                                      "next_cursor it printed (same files, filters and sort).", show_default=False),
    since: str | None = typer.Option(None, "--since", help="Arrived at or after this time: ISO-8601 (UTC unless an "
                                     "offset is given) or Unix seconds.", show_default=False),
    until: str | None = typer.Option(None, "--until", help="Arrived before this time (same forms as --since).",
                                     show_default=False),
    filters: list[str] = typer.Option([], "--filter", help="FIELD OP NUMBER on a numeric field, e.g. "
                                      "'output_tokens>5', 'latency>=2s' (OP: > >= < <= = !=; repeatable, all must "
                                      "hold).", show_default=False),
    finish_reason: str | None = typer.Option(None, "--finish-reason", help="Only this finish reason (stop, "
                                             "length, abort, error, repetition).", show_default=False),
    model: str | None = typer.Option(None, "--model", help="Only records of this model.", show_default=False),
    tenant: str | None = typer.Option(None, "--tenant", help="Only records of this tenant.", show_default=False),
    task: str | None = typer.Option(None, "--task", help="Only records tagged with this task.", show_default=False),
    sort: str = typer.Option("t_arrival", "--sort", help="Numeric field to sort by (records without it come last)."),
    order: str = typer.Option("asc", "--order", help="asc or desc."),
    json_output: bool = typer.Option(False, "--json", help="Print one JSON document: rows and next_cursor."),
) -> None:
    """The captured requests, one row each, filtered, sorted and paged (streams the files once per page)."""
    from carbonforge_runtime.offline.trace_tools import catalog
    from carbonforge_runtime.offline.trace_tools.summarize import problem_lines

    def run() -> None:
        query = catalog.build_query(filters, since, until, finish_reason, model, tenant, task, sort, order)
        page = catalog.list_requests(files, query, limit, cursor)
        _warn(problem_lines(page.files, page.bad_line_examples, page.bad_lines))
        if json_output:
            import json

            typer.echo(json.dumps(page.to_json(), indent=2))
        else:
            typer.echo(catalog.render_list(page))

    _guard(run)


@trace_app.command("show")
def show_request(
    request_id: str = typer.Argument(..., metavar="ID", help="The request's request_id (the id the client "
                                     "received) or engine_request_id.", show_default=False),
    files: list[Path] = typer.Argument(..., help="Trace files (JSONL, plain or gzip), or directories of them.",
                                       show_default=False),
    template: str | None = typer.Option(None, "--template", help="Read full-level prompts back into messages with "
                                        "this vendored chat template (default: the record's model's).",
                                        show_default=False),
    json_output: bool = typer.Option(False, "--json", help="Print the record(s) as one JSON document."),
) -> None:
    """One request in full: timings, tokens, the scheduler's view, and at the full level the messages and answer."""
    from carbonforge_runtime.offline.trace_tools import catalog
    from carbonforge_runtime.offline.trace_tools.summarize import problem_lines

    def run() -> None:
        catalog.check_template(template)
        request = catalog.find_request(files, request_id)
        _warn(problem_lines(request.files, request.bad_line_examples, request.bad_lines))
        if not request.found:
            names = " ".join(str(path) for path in files)
            raise CarbonForgeError(f"no request with the id {request_id!r} in {names}",
                                   f"run `carbonforge-runtime trace list {names}` to see the request ids")
        if json_output:
            import json

            typer.echo(json.dumps(request.to_json(template), indent=2))
        else:
            typer.echo(catalog.render_request(request, template))

    _guard(run)


@trace_app.command("export")
def export_dataset(
    files: list[Path] = typer.Argument(..., help="Full-level trace files (JSONL, plain or gzip), or directories of "
                                       "them.", show_default=False),
    output: Path = typer.Option(..., "-o", "--output", help="JSONL file to write (with --split: OUT's name with "
                                ".train and .eval before the extension)."),
    fmt: str = typer.Option("chat", "--format", help="chat: OpenAI chat fine-tuning rows ({\"messages\": [...]}); "
                            "eval: input messages and the reference answer."),
    template: str | None = typer.Option(None, "--template", help="Chat template of the served model (qwen2_5, "
                                        "qwen3, qwen3_6, qwen3_coder, qwen3_coder_vllm, qwen3_next_instruct, tiny); "
                                        "default: the one of each record's model.", show_default=False),
    include_failed: bool = typer.Option(False, "--include-failed", help="Export requests that did not finish with "
                                        "stop too (length, abort, error, repetition)."),
    split: float | None = typer.Option(None, "--split", help="Training share, e.g. 0.9: writes a train and an eval "
                                       "file, rows chosen by --seed.", show_default=False),
    seed: int = typer.Option(0, "--seed", help="Seed of the --split shuffle (same seed, same files)."),
    max_rows: int | None = typer.Option(None, "--max-rows", help="Stop after this many rows.", show_default=False),
    keep_reasoning: bool = typer.Option(False, "--keep-reasoning", help="Keep assistant reasoning as "
                                        "reasoning_content (not part of OpenAI's fine-tuning format)."),
    no_scrub: bool = typer.Option(False, "--no-scrub", help="Do not redact credentials from the texts."),
    scrub_patterns: Path | None = typer.Option(None, "--scrub-patterns", help="More patterns to redact: a file with "
                                               "one 'kind: REGEX' or 'REGEX' per line.", show_default=False),
    since: str | None = typer.Option(None, "--since", help="Arrived at or after this time: ISO-8601 (UTC unless an "
                                     "offset is given) or Unix seconds.", show_default=False),
    until: str | None = typer.Option(None, "--until", help="Arrived before this time (same forms as --since).",
                                     show_default=False),
    filters: list[str] = typer.Option([], "--filter", help="FIELD OP NUMBER on a numeric field, as trace list "
                                      "takes it (repeatable, all must hold).", show_default=False),
    finish_reason: str | None = typer.Option(None, "--finish-reason", help="Only this finish reason (replaces the "
                                             "default of stop only).", show_default=False),
    model: str | None = typer.Option(None, "--model", help="Only records of this model.", show_default=False),
    tenant: str | None = typer.Option(None, "--tenant", help="Only records of this tenant.", show_default=False),
    task: str | None = typer.Option(None, "--task", help="Only records tagged with this task.", show_default=False),
    json_output: bool = typer.Option(False, "--json", help="Print the summary as one JSON document."),
) -> None:
    """A fine-tuning or eval dataset from full-level traces: messages rebuilt by the chat template, secrets
    scrubbed, duplicates dropped."""
    from carbonforge_runtime.offline.trace_tools import catalog, scrub
    from carbonforge_runtime.offline.trace_tools import export as export_mod

    def run() -> None:
        query = catalog.build_query(filters, since, until, finish_reason, model, tenant, task)
        if no_scrub and scrub_patterns is not None:
            raise CarbonForgeError("--no-scrub and --scrub-patterns contradict each other", "give one of them")
        scrubber = None
        if not no_scrub:
            extra = scrub.load_patterns(scrub_patterns) if scrub_patterns is not None else []
            scrubber = scrub.scrubber(extra)
        options = export_mod.ExportOptions(format=fmt, template=template, include_failed=include_failed,
                                           split=split, seed=seed, max_rows=max_rows,
                                           keep_reasoning=keep_reasoning, scrubber=scrubber)
        summary = export_mod.export(files, output, options, export_mod.query_predicate(query),
                                    finish_reasons_chosen=finish_reason is not None)
        if json_output:
            import json

            typer.echo(json.dumps(summary.to_json(), indent=2))
        else:
            typer.echo(export_mod.render_summary(summary, options))

    _guard(run)
