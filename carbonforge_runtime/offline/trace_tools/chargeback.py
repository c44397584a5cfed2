"""``trace summarize --by tenant``: usage per tenant from trace files, for chargeback.

Per tenant (a record's ``tenant``; ``null``, absent or empty: the default tenant ``default``): the
requests, the prompt, cached prompt and output tokens, the mean and p99 end-to-end latency (the
quantile sketch of :mod:`.sketch`, within its relative error; the project's nearest-rank
convention), the requests by finish reason, and the GPU energy summed over the records that carry
one (``energy_j`` not ``null``: metered hosts only). Streamed: memory grows with the number of
tenants, never with the number of records.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from carbonforge_runtime.core.quantiles import nearest_rank
from carbonforge_runtime.core.tenant_labels import tenant_group
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
from carbonforge_runtime.offline.trace_tools.summarize import (
    MAX_REPORTED_BAD_LINES,
    BadLine,
    FileReport,
    fmt_s,
    utc,
)

#: The groupings ``trace summarize --by`` knows.
GROUP_BY = ("tenant",)
#: Latencies a tenant buffers before folding them into its sketch.
FLUSH_VALUES = 4096


@dataclass(frozen=True)
class TenantUsage:
    tenant: str
    requests: int
    prompt_tokens: int
    cached_prompt_tokens: int
    output_tokens: int
    e2e_mean_s: float | None
    e2e_p99_s: float | None
    e2e_max_s: float | None
    #: Summed over the records with ``energy_j``; None when none of the tenant's records has one.
    energy_j: float | None
    energy_metered_records: int
    #: The tenant's share of all tokens (prompt + output) in the trace.
    token_share: float | None
    finish_reasons: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Chargeback:
    files: list[FileReport]
    records: int
    bad_lines: int
    bad_line_examples: list[BadLine]
    sketch_relative_error: float
    first_arrival: float | None
    last_completion: float | None
    tenants: list[TenantUsage]
    total: TenantUsage

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["by"] = "tenant"
        data["first_arrival_utc"] = None if self.first_arrival is None else utc(self.first_arrival)
        data["last_completion_utc"] = None if self.last_completion is None else utc(self.last_completion)
        return data


class _Tenant:
    __slots__ = ("cached", "e2e", "energy", "metered", "output", "pending", "prompt", "reasons", "requests")

    def __init__(self) -> None:
        self.requests = 0
        self.prompt = 0
        self.cached = 0
        self.output = 0
        self.energy = 0.0
        self.metered = 0
        self.reasons: dict[str, int] = {}
        self.e2e = QuantileSketch()
        self.pending: list[float] = []

    def flush(self) -> None:
        if self.pending:
            self.e2e.add_many(self.pending)
            self.pending = []


def _number(value: Any) -> bool:
    return type(value) in (int, float) and _finite(value)


def _finite(value: float) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an integer too large for a float
        return False


def _count(record: dict[str, Any], name: str, optional: bool = False) -> int | str:
    """A token count of ``record`` (an optional one may be null or absent: 0), or why it is unusable."""
    value = record.get(name)
    if value is None and optional:
        return 0
    if value is None and name not in record:
        return f"missing field {name!r}"
    if value is None or not _number(value) or value < 0:
        return f"{name} is {str(value)[:40]}, not a count"
    return int(value)


def _problem_or_row(record: Any) -> str | tuple[Any, ...]:
    """``(tenant, e2e, prompt, cached, output, energy or None, finish reason, t_arrival, t_completion)``
    of one record, or why it cannot be counted."""
    if not isinstance(record, dict):
        return "not a trace record (expected a JSON object)"
    if "e2e_latency_s" not in record:
        return "missing field 'e2e_latency_s'"
    e2e = record["e2e_latency_s"]
    if not _number(e2e) or e2e < 0:
        return f"e2e_latency_s is {str(e2e)[:40]}, not a non-negative number"
    counts = [_count(record, "prompt_tokens"), _count(record, "cached_prompt_tokens", optional=True),
              _count(record, "output_tokens")]
    for count in counts:
        if isinstance(count, str):
            return count
    energy = record.get("energy_j")
    if energy is not None and (not _number(energy) or energy < 0):
        return f"energy_j is {str(energy)[:40]}, not null or a non-negative number"
    reason = record.get("finish_reason")
    t_arrival, t_completion = record.get("t_arrival"), record.get("t_completion")
    return (tenant_group(record.get("tenant")), float(e2e), *counts, energy,
            reason if isinstance(reason, str) else "unknown",
            t_arrival if _number(t_arrival) else None, t_completion if _number(t_completion) else None)


class TenantSummarizer:
    """Feed trace files in; :meth:`result` gives a :class:`Chargeback`."""

    def __init__(self) -> None:
        self.tenants: dict[str, _Tenant] = {}
        self.files: list[FileReport] = []
        self.bad_examples: list[BadLine] = []
        self.bad_total = 0
        self.first_arrival = math.inf
        self.last_completion = -math.inf

    def _bad(self, report: FileReport, line: int, reason: str) -> None:
        report.bad_lines += 1
        self.bad_total += 1
        if len(self.bad_examples) < MAX_REPORTED_BAD_LINES:
            self.bad_examples.append(BadLine(report.path, line, reason))

    def _lines(self, path: Path) -> Iterator[Sequence[bytes | str]]:
        return byte_line_batches(path) if orjson is not None else line_batches(path)

    def feed_file(self, path: Path) -> FileReport:
        check_readable(path)
        report = FileReport(str(path))
        self.files.append(report)
        loads = orjson.loads if orjson is not None else loads_line
        lineno = blank = 0
        try:
            for batch in self._lines(path):
                for line in batch:
                    lineno += 1
                    if not line.strip():
                        blank += 1
                        continue
                    try:
                        record = loads(line)
                    except ValueError:
                        try:
                            record = loads_line(line)  # NaN, Infinity and big integers: read, then refused
                        except ValueError as exc:
                            self._bad(report, lineno, f"not valid JSON ({getattr(exc, 'msg', exc)})")
                            continue
                    row = _problem_or_row(record)
                    if isinstance(row, str):
                        self._bad(report, lineno, row)
                        continue
                    self._add(row)
                    report.records += 1
        except DamagedInput as exc:
            report.damage = f"{exc.reason}; {lineno} complete lines before the damage were read"
        report.lines = lineno
        report.empty = lineno == blank
        return report

    def _add(self, row: tuple[Any, ...]) -> None:
        name, e2e, prompt, cached, output, energy, reason, t_arrival, t_completion = row
        usage = self.tenants.get(name)
        if usage is None:
            usage = self.tenants[name] = _Tenant()
        usage.requests += 1
        usage.prompt += prompt
        usage.cached += cached
        usage.output += output
        if energy is not None:
            usage.energy += energy
            usage.metered += 1
        usage.reasons[reason] = usage.reasons.get(reason, 0) + 1
        usage.pending.append(e2e)
        if len(usage.pending) >= FLUSH_VALUES:
            usage.flush()
        if t_arrival is not None and t_arrival < self.first_arrival:
            self.first_arrival = t_arrival
        if t_completion is not None and t_completion > self.last_completion:
            self.last_completion = t_completion

    def result(self) -> Chargeback:
        if not self.tenants:
            names = ", ".join(report.path for report in self.files) or "the input"
            message = (f"{names}: empty, no trace records to summarize" if all(r.empty for r in self.files)
                       else f"{names}: no valid trace records ({self.bad_total} bad lines skipped)")
            raise TraceInputError(message, "point the command at a trace file written with --request-trace "
                                  "standard (or full) and --trace-file")
        for usage in self.tenants.values():
            usage.flush()
        all_tokens = sum(u.prompt + u.output for u in self.tenants.values())
        total = _Tenant()
        for usage in self.tenants.values():
            total.requests += usage.requests
            total.prompt += usage.prompt
            total.cached += usage.cached
            total.output += usage.output
            total.energy += usage.energy
            total.metered += usage.metered
            for reason, n in usage.reasons.items():
                total.reasons[reason] = total.reasons.get(reason, 0) + n
            total.e2e.merge(usage.e2e)
        return Chargeback(
            files=self.files,
            records=total.requests,
            bad_lines=self.bad_total,
            bad_line_examples=sorted(self.bad_examples, key=lambda bad: (bad.path, bad.line)),
            sketch_relative_error=ALPHA,
            first_arrival=self.first_arrival if math.isfinite(self.first_arrival) else None,
            last_completion=self.last_completion if math.isfinite(self.last_completion) else None,
            tenants=[_usage(name, usage, all_tokens) for name, usage in sorted(self.tenants.items())],
            total=_usage("total", total, all_tokens),
        )


def _p99(sketch: QuantileSketch) -> float | None:
    """The sketch's p99; exact when its rank is the largest value's (fewer than 100 values)."""
    if sketch.count and nearest_rank(0.99, sketch.count) == sketch.count - 1:
        return sketch.max
    return sketch.quantile(0.99)


def _usage(name: str, usage: _Tenant, all_tokens: int) -> TenantUsage:
    return TenantUsage(
        tenant=name,
        requests=usage.requests,
        prompt_tokens=usage.prompt,
        cached_prompt_tokens=usage.cached,
        output_tokens=usage.output,
        e2e_mean_s=usage.e2e.mean,
        e2e_p99_s=_p99(usage.e2e),
        e2e_max_s=usage.e2e.max if usage.e2e.count else None,
        energy_j=usage.energy if usage.metered else None,
        energy_metered_records=usage.metered,
        token_share=(usage.prompt + usage.output) / all_tokens if all_tokens else None,
        finish_reasons=dict(sorted(usage.reasons.items())),
    )


def summarize_by_tenant(paths: Sequence[Path]) -> Chargeback:
    summarizer = TenantSummarizer()
    for path in paths:
        summarizer.feed_file(path)
    return summarizer.result()


# --------------------------------------------------------------------------------------------
# Rendering


def fmt_j(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:,.1f}" if value < 1000 else f"{value:,.0f}"


def render_text(result: Chargeback) -> str:
    out = [f"trace: {', '.join(report.path for report in result.files)}"]
    bad = f", {result.bad_lines} bad lines skipped" if result.bad_lines else ""
    out.append(f"records: {result.records:,}{bad}")
    if result.first_arrival is not None and result.last_completion is not None:
        out.append(f"time span: {utc(result.first_arrival)} -> {utc(result.last_completion)} UTC")
    out.append("")
    rows = [["tenant", "reqs", "error", "abort", "prompt tok", "cached tok", "output tok", "tok share", "e2e mean",
             "e2e p99", "energy J"]]
    for usage in [*result.tenants, result.total]:
        share = "-" if usage.token_share is None else f"{usage.token_share:.1%}"
        reasons = usage.finish_reasons
        rows.append([usage.tenant, f"{usage.requests:,}", f"{reasons.get('error', 0):,}",
                     f"{reasons.get('abort', 0):,}", f"{usage.prompt_tokens:,}",
                     f"{usage.cached_prompt_tokens:,}", f"{usage.output_tokens:,}", share,
                     fmt_s(usage.e2e_mean_s), fmt_s(usage.e2e_p99_s), fmt_j(usage.energy_j)])
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for index, row in enumerate(rows):
        if index == len(rows) - 1:
            out.append("  ".join("-" * width for width in widths))
        cells = [row[0].ljust(widths[0])] + [cell.rjust(widths[i]) for i, cell in enumerate(row[1:], start=1)]
        out.append("  ".join(cells).rstrip())
    out.append("")
    out.append("  (tenant: the name of the request's API key; default: requests without one. error, abort: "
               "requests with that finish reason)")
    out.append(f"  (latencies in seconds; p99 within {result.sketch_relative_error:.0%} relative error)")
    total = result.total
    if total.energy_metered_records == 0:
        out.append("  (energy: not metered, energy_j is null in every record: no NVML on the serving host)")
    elif total.energy_metered_records < total.requests:
        out.append(f"  (energy: summed over the {total.energy_metered_records:,} of {total.requests:,} records "
                   "with energy_j)")
    return "\n".join(out)
