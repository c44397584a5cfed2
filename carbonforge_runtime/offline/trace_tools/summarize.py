"""``trace summarize``: capacity-planning figures from trace files, streamed in bounded memory.

Records are grouped in cells by (arrival window, scheduler family). Each cell buffers raw rows
briefly, then folds them into quantile sketches (see :mod:`.sketch`) and running sums; every
other view (the whole trace, one window, one family) is a merge of cells. Memory therefore
grows with the number of windows and families, never with the number of records.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from functools import partial
from operator import is_not, sub
from pathlib import Path
from typing import Any

from carbonforge_runtime.core.figure_labels import EMULATED, MEASURED, PREDICTED
from carbonforge_runtime.errors import UsageError
from carbonforge_runtime.offline.trace_reader import (
    DamagedInput,
    TraceInputError,
    byte_line_batches,
    check_readable,
    line_batches,
    loads_line,
    orjson,
)
from carbonforge_runtime.offline.trace_tools.sketch import ALPHA, QuantileSketch

#: Percentiles reported everywhere (the maximum is reported exactly beside them).
QUANTILES = (0.5, 0.9, 0.99)
#: Rows a summarizer holds before folding them into sketches (bounds the buffer memory).
FLUSH_ROWS = 16_384
#: Bad lines shown one by one; the rest are only counted.
MAX_REPORTED_BAD_LINES = 20

# Verdict thresholds: share of summed latency spent queueing, and engine time per generated
# token relative to the best window of the trace.
QUEUE_DOMINATED_SHARE = 0.5
QUEUE_BUILDING_SHARE = 0.2
ENGINE_BOUND_RATIO = 2.0
#: A window needs this many requests to serve as the engine-speed baseline.
BASELINE_MIN_REQUESTS = 5

HEALTHY = "healthy"
QUEUE_BUILDING = "queue-building"
QUEUE_DOMINATED = "queue-dominated"
ENGINE_BOUND = "engine-bound"
VERDICTS = (HEALTHY, QUEUE_BUILDING, QUEUE_DOMINATED, ENGINE_BOUND)

_NUMERIC_FIELDS = ("t_arrival", "t_completion", "e2e_latency_s", "queue_wait_s", "prompt_tokens", "output_tokens")
_UNKNOWN_FAMILY = "unknown"
_BLANK = object()


# --------------------------------------------------------------------------------------------
# Plain results


@dataclass(frozen=True)
class Percentiles:
    p50: float | None
    p90: float | None
    p99: float | None
    max: float | None
    mean: float | None

    @classmethod
    def of(cls, sketch: QuantileSketch) -> Percentiles:
        p50, p90, p99 = sketch.quantiles(QUANTILES)
        return cls(p50, p90, p99, sketch.max if sketch.count else None, sketch.mean)


@dataclass(frozen=True)
class Verdict:
    code: str
    text: str


@dataclass(frozen=True)
class GroupStats:
    """Figures for one group of records: the whole trace, one window or one scheduler family."""

    requests: int
    first_arrival: float
    last_completion: float
    prompt_tokens: float
    output_tokens: float
    e2e_s: Percentiles
    queue_wait_s: Percentiles
    engine_s: Percentiles
    ttft_s: Percentiles | None
    ttft_records: int
    #: Summed queue wait over summed end-to-end latency.
    queue_share: float | None
    #: Summed engine time (e2e - queue wait) per generated token.
    engine_s_per_output_token: float | None
    verdict: Verdict


@dataclass(frozen=True)
class WindowStats:
    start: float
    end: float
    requests_per_s: float
    prompt_tokens_per_s: float
    output_tokens_per_s: float
    stats: GroupStats


@dataclass(frozen=True)
class BadLine:
    path: str
    line: int
    reason: str


@dataclass
class FileReport:
    path: str
    lines: int = 0
    records: int = 0
    bad_lines: int = 0
    empty: bool = False
    damage: str | None = None


@dataclass(frozen=True)
class Summary:
    files: list[FileReport]
    records: int
    bad_lines: int
    bad_line_examples: list[BadLine]
    window_s: float
    sketch_relative_error: float
    span_s: float
    requests_per_s: float | None
    prompt_tokens_per_s: float | None
    output_tokens_per_s: float | None
    overall: GroupStats
    windows: list[WindowStats]
    families: dict[str, GroupStats]
    window_verdicts: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        for window in data["windows"]:
            window["start_utc"] = utc(window["start"])
        data["first_arrival_utc"] = utc(self.overall.first_arrival)
        data["last_completion_utc"] = utc(self.overall.last_completion)
        data["label"] = figures_label(self)
        return data


#: Records that start before this Unix time (2000-01-01) are in virtual time: ``sim`` writes its
#: per-request records with the first arrival at the epoch; an engine writes wall-clock times.
VIRTUAL_TIME_BEFORE_S = 946_684_800.0


def figures_label(summary: Summary) -> dict[str, str]:
    """Where the summarized figures come from (:mod:`carbonforge_runtime.core.figure_labels`'s words):
    predicted for ``sim``'s virtual-time records; otherwise the engine that wrote the trace measured
    them, or served them emulated, which the trace itself does not record."""
    if summary.overall.first_arrival < VIRTUAL_TIME_BEFORE_S:
        return {"kind": PREDICTED, "text": f"{PREDICTED} by the twin (virtual-time records written by sim; the "
                "step-time model is named in the label of sim's result file)"}
    return {"kind": f"{MEASURED} or {EMULATED}",
            "text": f"from the engine that wrote the trace: {MEASURED} on its host, or {EMULATED} if it was "
                    "served with --emulate (the trace names neither the host nor the pacing)"}


def utc(unix_s: float) -> str:
    """A Unix time as UTC text; a time no calendar can show (year 10000 and later, before year 1)
    reads as out of range instead of failing the report."""
    try:
        return datetime.fromtimestamp(unix_s, tz=UTC).strftime("%Y-%m-%d %H:%M:%S")
    except (OverflowError, ValueError, OSError):
        return "out of range"


# --------------------------------------------------------------------------------------------
# Decisions


def verdict_for(queue_share: float | None, engine_ratio: float | None) -> Verdict:
    """Plain-language reading of one group: queueing first, then engine speed."""
    share = queue_share or 0.0
    if share >= QUEUE_DOMINATED_SHARE:
        return Verdict(QUEUE_DOMINATED, f"queue-dominated ({share:.0%} of latency is queueing): "
                       "add capacity or reduce client concurrency")
    if engine_ratio is not None and engine_ratio >= ENGINE_BOUND_RATIO:
        return Verdict(ENGINE_BOUND, f"engine-bound: engine time per generated token is {engine_ratio:.1f}x "
                       "the trace's best window; the engine itself is slow (long prompts or outputs, "
                       "large batches, or too small hardware), not the queue")
    if share >= QUEUE_BUILDING_SHARE:
        return Verdict(QUEUE_BUILDING, f"queue building ({share:.0%} of latency is queueing): "
                       "close to capacity")
    return Verdict(HEALTHY, "healthy")


def parse_window(text: str) -> float:
    """``60s``, ``5m``, ``1h``, ``500ms`` or a plain number of seconds."""
    raw = text.strip().lower()
    units = (("ms", 0.001), ("s", 1.0), ("m", 60.0), ("h", 3600.0))
    factor = 1.0
    for suffix, scale in units:
        if raw.endswith(suffix):
            raw, factor = raw[: -len(suffix)], scale
            break
    try:
        value = float(raw) * factor
    except ValueError:
        value = -1.0
    if not math.isfinite(value) or value <= 0:
        raise UsageError(f"--window {text!r} is not a duration", "give e.g. --window 60s, 5m, 1h or 500ms")
    return value


# --------------------------------------------------------------------------------------------
# Streaming aggregation


class _Cell:
    """Records of one (window, family): a short row buffer plus sketches and sums."""

    __slots__ = ("e2e", "engine", "n", "output_tokens", "packed", "prompt_tokens", "queue", "rows", "t_first",
                 "t_last", "ttft")

    def __init__(self) -> None:
        #: (t_arrival, t_completion, e2e, queue wait, prompt tokens, output tokens, ttft, line number)
        self.rows: list[tuple[Any, ...]] = []
        self.packed = False
        self.n = 0
        self.prompt_tokens = 0.0
        self.output_tokens = 0.0
        self.t_first = math.inf
        self.t_last = -math.inf
        self.e2e = QuantileSketch()
        self.queue = QuantileSketch()
        self.engine = QuantileSketch()
        self.ttft = QuantileSketch()


def _finite(value: float) -> bool:
    """A finite number that a float can hold (an integer of 400 digits is not)."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def _row_problem(row: tuple[Any, ...]) -> str | None:
    """Why a buffered row is unusable (slow path, only for batches that failed the bulk checks)."""
    for name, value in zip(_NUMERIC_FIELDS, row[:6], strict=True):
        if type(value) not in (int, float):
            return f"{name} is {json.dumps(value)[:40]}, not a number"
        if not _finite(value):
            return f"{name} is not finite (or too large)"
        if name not in ("t_arrival", "t_completion") and value < 0:
            return f"{name} is negative ({value})"
    ttft = row[6]
    if ttft is not None and (type(ttft) not in (int, float) or not _finite(ttft) or ttft < 0):
        return f"ttft_s is {json.dumps(ttft)[:40]}, not null or a non-negative number"
    return None


def _shape_problem(record: Any) -> str:
    if not isinstance(record, dict):
        return "not a trace record (expected a JSON object)"
    t_arrival = record.get("t_arrival")
    if type(t_arrival) not in (int, float):
        return f"t_arrival is {json.dumps(t_arrival)[:40]}, not a number"
    return "scheduler_family is not a string"


def _bulk_ok(columns: Sequence[Sequence[Any]]) -> bool:
    """Cheap whole-batch validation: every value a finite number, durations and counts >= 0."""
    try:
        for index, column in enumerate(columns):
            if not math.isfinite(sum(column)):
                return False
            if index >= 2 and column and min(column) < 0:
                return False
    except (TypeError, OverflowError):
        return False
    return True


class Summarizer:
    """Feed trace files in; :meth:`result` gives a :class:`Summary`."""

    def __init__(self, window_s: float = 60.0) -> None:
        self.window_s = window_s
        self.cells: dict[tuple[float, str], _Cell] = {}
        self.files: list[FileReport] = []
        self.bad_examples: list[BadLine] = []
        self.bad_total = 0
        self._has_ttft = partial(is_not, None)
        raw_decode = json.JSONDecoder().raw_decode

        def std_loads(line: bytes | str) -> Any:
            try:
                record, end = raw_decode(line)  # type: ignore[arg-type]
            except RecursionError:
                raise ValueError("nested too deeply") from None
            if end != len(line) and line[end:].strip():
                raise ValueError("extra text")
            return record

        self._std_loads = std_loads

    # -- problems ------------------------------------------------------------------------

    def _bad(self, report: FileReport, line: int, reason: str) -> None:
        report.bad_lines += 1
        self.bad_total += 1
        if len(self.bad_examples) < MAX_REPORTED_BAD_LINES:
            self.bad_examples.append(BadLine(report.path, line, reason))

    # -- folding -------------------------------------------------------------------------

    def _flush(self, cell: _Cell, report: FileReport) -> None:
        rows = cell.rows
        if not rows:
            return
        columns = list(zip(*rows, strict=True))
        ttft = list(filter(self._has_ttft, columns[6]))
        if not _bulk_ok([*columns[:6], ttft]):
            good = []
            for row in rows:
                problem = _row_problem(row)
                if problem is None:
                    good.append(row)
                else:
                    self._bad(report, row[7], problem)
            columns = list(zip(*good, strict=True)) if good else [()] * 8
            ttft = list(filter(self._has_ttft, columns[6]))
        rows.clear()
        t_arrival, t_completion, e2e, queue, prompt_tokens, output_tokens = columns[:6]
        if not e2e:
            return
        cell.n += len(e2e)
        report.records += len(e2e)
        cell.prompt_tokens += sum(prompt_tokens)
        cell.output_tokens += sum(output_tokens)
        cell.t_first = min(cell.t_first, min(t_arrival))
        cell.t_last = max(cell.t_last, max(t_completion))
        cell.e2e.add_many(e2e)
        cell.queue.add_many(queue)
        cell.engine.add_many(list(map(sub, e2e, queue)))
        cell.ttft.add_many(ttft)

    def _flush_all(self, report: FileReport) -> None:
        for cell in self.cells.values():
            if cell.rows:
                self._flush(cell, report)
                cell.packed = False
            elif not cell.packed:
                # Nothing arrived for this cell since the last flush: its window is most likely over.
                for sketch in (cell.e2e, cell.queue, cell.engine, cell.ttft):
                    sketch.pack()
                cell.packed = True

    # -- reading -------------------------------------------------------------------------

    def _parse_slow(self, report: FileReport, lineno: int, line: bytes | str) -> Any:
        """A line the fast parser refused: blank (None), bad (reported, None), or a record."""
        text = line.decode("utf-8", "surrogateescape") if isinstance(line, bytes) else line
        if not text.strip():
            return _BLANK
        try:
            return loads_line(text)
        except ValueError as exc:
            message = getattr(exc, "msg", str(exc))
            if message == "Extra data":
                self._bad(report, lineno, "unexpected text after the JSON object")
            else:
                self._bad(report, lineno, f"not valid JSON ({message})")
            return None

    def feed_file(self, path: Path) -> FileReport:
        check_readable(path)
        report = FileReport(str(path))
        self.files.append(report)
        batches: Iterator[Sequence[bytes | str]]
        if orjson is not None:
            batches, loads = byte_line_batches(path), orjson.loads
        else:
            batches, loads = line_batches(path), self._std_loads
        window_s = self.window_s
        cells = self.cells
        isfinite = math.isfinite
        # Per family: the window being filled and its buffers (traces are mostly in time order).
        open_cells: dict[Any, tuple[float, list[tuple[Any, ...]]]] = {}
        flushed_at = 0
        lineno = 0
        blank = 0
        try:
            for batch in batches:
                for line in batch:
                    lineno += 1
                    try:
                        record = loads(line)
                    except ValueError:
                        record = self._parse_slow(report, lineno, line)
                        if record is None:
                            continue
                        if record is _BLANK:
                            blank += 1
                            continue
                    try:
                        t_arrival = record["t_arrival"]
                        window = t_arrival // window_s
                        row = (t_arrival, record["t_completion"], record["e2e_latency_s"],
                               record["queue_wait_s"], record["prompt_tokens"], record["output_tokens"],
                               record.get("ttft_s"), lineno)
                        slot = open_cells.get(record.get("scheduler_family"))
                    except KeyError as exc:
                        self._bad(report, lineno, f"missing field {exc.args[0]!r}")
                        continue
                    except (TypeError, AttributeError):
                        self._bad(report, lineno, _shape_problem(record))
                        continue
                    except OverflowError:
                        self._bad(report, lineno, "t_arrival is too large to be a time")
                        continue
                    if slot is None or slot[0] != window:
                        if not isfinite(window):
                            self._bad(report, lineno, "t_arrival is not finite")
                            continue
                        family = record.get("scheduler_family")
                        key = (window, family if isinstance(family, str) else _UNKNOWN_FAMILY)
                        cell = cells.get(key)
                        if cell is None:
                            cell = cells[key] = _Cell()
                        slot = open_cells[family] = (window, cell.rows)
                    slot[1].append(row)
                # Checked per batch of lines: the buffers hold at most FLUSH_ROWS plus one batch.
                if lineno - flushed_at >= FLUSH_ROWS:
                    self._flush_all(report)
                    flushed_at = lineno
        except DamagedInput as exc:
            report.damage = f"{exc.reason}; {lineno} complete lines before the damage were read"
        self._flush_all(report)
        report.lines = lineno
        report.empty = lineno == blank
        return report

    # -- results -------------------------------------------------------------------------

    def _group(self, cells: Iterable[_Cell], baseline: float | None) -> GroupStats:
        chosen = [cell for cell in cells if cell.n]
        e2e = QuantileSketch.merged(cell.e2e for cell in chosen)
        queue = QuantileSketch.merged(cell.queue for cell in chosen)
        engine = QuantileSketch.merged(cell.engine for cell in chosen)
        ttft = QuantileSketch.merged(cell.ttft for cell in chosen)
        output_tokens = sum(cell.output_tokens for cell in chosen)
        queue_share = queue.total / e2e.total if e2e.total > 0 else None
        per_token = max(engine.total, 0.0) / output_tokens if output_tokens > 0 else None
        ratio = per_token / baseline if per_token is not None and baseline else None
        return GroupStats(
            requests=e2e.count,
            first_arrival=min(cell.t_first for cell in chosen),
            last_completion=max(cell.t_last for cell in chosen),
            prompt_tokens=sum(cell.prompt_tokens for cell in chosen),
            output_tokens=output_tokens,
            e2e_s=Percentiles.of(e2e),
            queue_wait_s=Percentiles.of(queue),
            engine_s=Percentiles.of(engine),
            ttft_s=Percentiles.of(ttft) if ttft.count else None,
            ttft_records=ttft.count,
            queue_share=queue_share,
            engine_s_per_output_token=per_token,
            verdict=verdict_for(queue_share, ratio),
        )

    def result(self) -> Summary:
        live = {key: cell for key, cell in self.cells.items() if cell.n}
        if not live:
            raise TraceInputError(self._nothing_message(), "point the command at a trace file written with "
                                  "--request-trace standard (or full) and --trace-file")
        by_window: dict[float, list[_Cell]] = {}
        by_family: dict[str, list[_Cell]] = {}
        for (window, family), cell in sorted(live.items(), key=lambda item: (item[0][0], item[0][1])):
            by_window.setdefault(window, []).append(cell)
            by_family.setdefault(family, []).append(cell)
        baseline = self._baseline(by_window)
        overall = self._group(live.values(), baseline)
        windows = []
        for window, cells in by_window.items():
            stats = self._group(cells, baseline)
            start, end = window * self.window_s, (window + 1) * self.window_s
            # The first and last windows are only partly covered by the trace: rates use the covered part.
            covered = min(end, overall.last_completion) - max(start, overall.first_arrival)
            seconds = covered if covered > 0 else self.window_s
            windows.append(WindowStats(
                start=start, end=end,
                requests_per_s=stats.requests / seconds,
                prompt_tokens_per_s=stats.prompt_tokens / seconds,
                output_tokens_per_s=stats.output_tokens / seconds,
                stats=stats,
            ))
        families = {name: self._group(cells, baseline) for name, cells in by_family.items()}
        span_s = max(overall.last_completion - overall.first_arrival, 0.0)
        counts = {code: 0 for code in VERDICTS}
        for window_stats in windows:
            counts[window_stats.stats.verdict.code] += 1
        return Summary(
            files=self.files,
            records=overall.requests,
            bad_lines=self.bad_total,
            bad_line_examples=sorted(self.bad_examples, key=lambda bad: (bad.path, bad.line)),
            window_s=self.window_s,
            sketch_relative_error=ALPHA,
            span_s=span_s,
            requests_per_s=overall.requests / span_s if span_s > 0 else None,
            prompt_tokens_per_s=overall.prompt_tokens / span_s if span_s > 0 else None,
            output_tokens_per_s=overall.output_tokens / span_s if span_s > 0 else None,
            overall=overall,
            windows=windows,
            families=families,
            window_verdicts=counts,
        )

    @staticmethod
    def _baseline(by_window: dict[float, list[_Cell]]) -> float | None:
        """Engine seconds per generated token of the fastest well-populated window."""
        candidates: list[tuple[int, float]] = []
        for cells in by_window.values():
            requests = sum(cell.n for cell in cells)
            tokens = sum(cell.output_tokens for cell in cells)
            engine = sum(cell.engine.total for cell in cells)
            if tokens > 0 and engine > 0:
                candidates.append((requests, engine / tokens))
        populated = [value for requests, value in candidates if requests >= BASELINE_MIN_REQUESTS]
        pool = populated or [value for _, value in candidates]
        return min(pool) if pool else None

    def _nothing_message(self) -> str:
        names = ", ".join(report.path for report in self.files) or "the input"
        if all(report.empty for report in self.files):
            return f"{names}: empty, no trace records to summarize"
        return f"{names}: no valid trace records ({self.bad_total} bad lines skipped)"


def summarize_files(paths: Sequence[Path], window_s: float) -> Summary:
    summarizer = Summarizer(window_s)
    for path in paths:
        summarizer.feed_file(path)
    return summarizer.result()


# --------------------------------------------------------------------------------------------
# Rendering


def fmt_s(value: float | None) -> str:
    if value is None:
        return "-"
    if value >= 100:
        return f"{value:.1f}"
    return f"{value:.3f}"


def fmt_rate(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:,.2f}" if value < 100 else f"{value:,.0f}"


def fmt_share(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def problem_lines(files: Sequence[FileReport], examples: Sequence[BadLine], bad_total: int) -> list[str]:
    """Warnings for stderr: bad lines with their numbers, damage, empty files."""
    ordered = sorted(examples, key=lambda bad: (bad.path, bad.line))
    lines = [f"warning: {bad.path}:{bad.line}: {bad.reason}; line skipped" for bad in ordered]
    if bad_total > len(examples):
        lines.append(f"warning: ... and {bad_total - len(examples)} more bad lines (skipped, counted)")
    for report in files:
        if report.damage:
            lines.append(f"warning: {report.path}: {report.damage}")
        if report.empty:
            lines.append(f"warning: {report.path}: empty file (no trace records)")
    return lines


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    out = []
    for row in rows:
        cells = [row[0].ljust(widths[0])] + [cell.rjust(widths[i]) for i, cell in enumerate(row[1:], start=1)]
        out.append("  ".join(cells).rstrip())
    return out


def _percentile_rows(stats: GroupStats) -> list[list[str]]:
    rows = [["latency (s)", "p50", "p90", "p99", "max", "mean"]]
    metrics: list[tuple[str, Percentiles | None]] = [
        ("end-to-end", stats.e2e_s), ("queue wait", stats.queue_wait_s), ("engine (e2e - queue)", stats.engine_s),
        ("time to first token", stats.ttft_s),
    ]
    for name, values in metrics:
        if values is None:
            rows.append([name, "not recorded", "", "", "", ""])
            continue
        rows.append([name, fmt_s(values.p50), fmt_s(values.p90), fmt_s(values.p99), fmt_s(values.max),
                     fmt_s(values.mean)])
    return rows


def render_text(summary: Summary) -> str:
    overall = summary.overall
    out: list[str] = []
    files = ", ".join(report.path for report in summary.files)
    bad = f", {summary.bad_lines} bad lines skipped" if summary.bad_lines else ""
    out.append(f"trace: {files}")
    out.append(f"figures: {figures_label(summary)['text']}")
    out.append(f"records: {summary.records:,}{bad}")
    out.append(f"time span: {utc(overall.first_arrival)} -> {utc(overall.last_completion)} UTC "
               f"({summary.span_s:,.1f} s)")
    out.append(f"request rate: {fmt_rate(summary.requests_per_s)} req/s")
    out.append(f"tokens in: {overall.prompt_tokens:,.0f} ({fmt_rate(summary.prompt_tokens_per_s)}/s)   "
               f"tokens out: {overall.output_tokens:,.0f} ({fmt_rate(summary.output_tokens_per_s)}/s)")
    out.append(f"share of latency spent queueing: {fmt_share(overall.queue_share)}")
    out.append("")
    out.extend(_table(_percentile_rows(overall)))
    if overall.ttft_s is None:
        out.append("  (ttft_s is null in every record: first-token time is not recorded by this engine)")
    out.append(f"  (percentiles within {summary.sketch_relative_error:.0%} relative error; max is exact)")
    counts = ", ".join(f"{n} {code}" for code, n in summary.window_verdicts.items() if n)
    out.append("")
    out.append(f"verdict (whole trace): {overall.verdict.text}")
    out.append(f"windows: {len(summary.windows)} of {fmt_window(summary.window_s)}: {counts}")
    out.append("")
    rows = [["window start (UTC)", "reqs", "req/s", "out tok/s", "e2e p50", "e2e p99", "queue p50", "queue p99",
             "queue%", "verdict"]]
    for window in summary.windows:
        stats = window.stats
        rows.append([utc(window.start), f"{stats.requests:,}", fmt_rate(window.requests_per_s),
                     fmt_rate(window.output_tokens_per_s), fmt_s(stats.e2e_s.p50), fmt_s(stats.e2e_s.p99),
                     fmt_s(stats.queue_wait_s.p50), fmt_s(stats.queue_wait_s.p99), fmt_share(stats.queue_share),
                     stats.verdict.code])
    out.extend(_table(rows))
    flagged = [window for window in summary.windows if window.stats.verdict.code != HEALTHY]
    if flagged:
        out.append("")
        for window in flagged[:10]:
            out.append(f"{utc(window.start)}: {window.stats.verdict.text}")
        if len(flagged) > 10:
            out.append(f"... and {len(flagged) - 10} more windows that are not healthy")
    if len(summary.families) > 1:
        out.append("")
        out.append("per scheduler family:")
        rows = [["family", "reqs", "e2e p50", "e2e p99", "queue p50", "queue p99", "queue%", "verdict"]]
        for name, stats in sorted(summary.families.items()):
            rows.append([name, f"{stats.requests:,}", fmt_s(stats.e2e_s.p50), fmt_s(stats.e2e_s.p99),
                         fmt_s(stats.queue_wait_s.p50), fmt_s(stats.queue_wait_s.p99), fmt_share(stats.queue_share),
                         stats.verdict.code])
        out.extend(_table(rows))
    return "\n".join(out)


def fmt_window(window_s: float) -> str:
    if window_s >= 3600 and window_s % 3600 == 0:
        return f"{window_s / 3600:g}h"
    if window_s >= 60 and window_s % 60 == 0:
        return f"{window_s / 60:g}m"
    return f"{window_s:g}s"
