"""What ``top`` shows, from scrapes of the runtime's metrics (and vLLM's own): plain functions, no I/O.

Rates come from two successive scrapes; latency percentiles from the histogram buckets' growth across
the scrapes kept (the last minute), or from the whole histogram (since the runtime started) when there
is only one scrape or a counter went backwards (the runtime restarted).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from carbonforge_runtime.core.quantiles import nearest_rank
from carbonforge_runtime.offline.top.page import Samples, buckets, by_label, info, total

#: How far back the latency percentiles look in the live view.
WINDOW_S = 60.0
#: The percentiles shown.
QUANTILES = (0.5, 0.9, 0.99)
#: The screen ``top`` lays out for: a plain ``docker exec -it`` terminal.
WIDTH, HEIGHT = 80, 24
#: How many of runtime.log's warnings are shown.
WARNINGS_SHOWN = 3

_TTFT = "carbonforge_request_time_to_first_token_seconds"
_E2E = "carbonforge_request_e2e_latency_seconds"
_OUTPUT_TOKENS = "carbonforge_request_output_tokens_total"
_FINISHED = "carbonforge_requests_total"


@dataclass(frozen=True)
class Scrape:
    """One read of the pages, at ``at`` (seconds on a monotonic clock)."""

    at: float
    runtime: Samples
    #: vLLM's own page (KV use, preemptions, generated tokens); None when it did not answer.
    engine: Samples | None = None


@dataclass(frozen=True)
class Latency:
    """One histogram over the window: how many requests, and the percentiles of :data:`QUANTILES`."""

    count: int
    percentiles: tuple[float | None, ...]


@dataclass(frozen=True)
class RankRow:
    """One data-parallel rank (vLLM's engine index); None where no series carries the value."""

    rank: str
    running: float | None
    waiting: float | None
    ceiling: int | None
    scheduled_tps: float | None
    kv_use: float | None
    preemptions: float | None
    trace_drops: float | None


@dataclass(frozen=True)
class View:
    """Everything the screen shows, as numbers (None: not known, or not metered)."""

    title: str
    running: float | None
    waiting: float | None
    ceiling: int | None
    finished_per_s: float | None
    output_tps: float | None
    scheduled_tps: float | None
    #: The latency window in seconds; None: since the runtime started.
    window_s: float | None
    ttft: Latency
    e2e: Latency
    ranks: tuple[RankRow, ...]
    power_w: float | None
    gpus: int
    j_per_token: float | None
    warnings: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()


def bucket_quantile(cumulative: Sequence[tuple[float, float]], q: float) -> float | None:
    """The q-quantile of a histogram's cumulative ``(upper bound, count)`` buckets, under the project's
    nearest-rank convention (:mod:`carbonforge_runtime.core.quantiles`): the upper bound of the bucket
    that holds the value of that rank, so never below the true quantile. ``inf`` when that value lies
    beyond the last finite bound; None when the histogram is empty."""
    if not cumulative or cumulative[-1][1] <= 0:
        return None
    count = round(cumulative[-1][1])
    rank = nearest_rank(q, count) + 1
    for bound, seen in cumulative:
        if seen >= rank - 1e-9:
            return bound
    return math.inf


def bucket_growth(old: Sequence[tuple[float, float]],
                  new: Sequence[tuple[float, float]]) -> tuple[tuple[float, float], ...] | None:
    """The cumulative buckets of what ``new`` added to ``old``; None when any count went backwards
    (the runtime restarted between them) or the bounds differ."""
    before = dict(old)
    grown = tuple((bound, count - before.get(bound, 0.0)) for bound, count in new)
    if any(count < 0 for _, count in grown) or (before and set(before) != {b for b, _ in new}):
        return None
    return grown


def latency(first: Scrape, last: Scrape, histogram: str, windowed: bool) -> Latency:
    """``histogram`` between two scrapes (or whole, in ``last``, when not ``windowed`` or it restarted)."""
    cumulative = buckets(last.runtime, histogram)
    if windowed:
        cumulative = bucket_growth(buckets(first.runtime, histogram), cumulative) or cumulative
    count = round(cumulative[-1][1]) if cumulative else 0
    return Latency(count, tuple(bucket_quantile(cumulative, q) for q in QUANTILES))


def rate(new: float | None, old: float | None, seconds: float) -> float | None:
    """Per second between two readings of a counter; None when unknown or it went backwards."""
    if new is None or old is None or seconds <= 0 or new < old:
        return None
    return (new - old) / seconds


def _per_rank(samples: Samples | None, name: str, label: str) -> dict[str, float]:
    return by_label(samples, name, label) if samples is not None else {}


def build_view(scrapes: Sequence[Scrape], windowed: bool = True, warnings: Sequence[str] = (),
               notes: Sequence[str] = ()) -> View:
    """The view of the last of ``scrapes`` (oldest first, at least one): rates against the one before
    it, latency over all of them when ``windowed`` and there are two or more."""
    last = scrapes[-1]
    prev = scrapes[-2] if len(scrapes) > 1 else None
    first = scrapes[0]
    now = last.runtime
    seconds = last.at - prev.at if prev is not None else 0.0

    def counter_rate(samples_of: str, name: str) -> float | None:
        if prev is None:
            return None
        new = getattr(last, samples_of)
        old = getattr(prev, samples_of)
        if new is None or old is None:
            return None
        return rate(total(new, name), total(old, name), seconds)

    about = info(now, "carbonforge_runtime_info")
    title = " ".join(part for part in (about.get("context_key", ""), f"v{about['version']}" if "version" in about
                                       else "") if part)
    ceiling_value = total(now, "carbonforge_engine_max_num_seqs")
    ceiling = int(ceiling_value) if ceiling_value is not None else None

    running = _per_rank(now, "carbonforge_requests_running", "dp_rank")
    waiting = _per_rank(now, "carbonforge_requests_waiting", "dp_rank")
    sched_now = _per_rank(now, "carbonforge_engine_scheduled_tokens_total", "dp_rank")
    sched_prev = _per_rank(prev.runtime if prev else None, "carbonforge_engine_scheduled_tokens_total", "dp_rank")
    drops = _per_rank(now, "carbonforge_trace_records_dropped_total", "dp_rank")
    kv = _per_rank(last.engine, "vllm:kv_cache_usage_perc", "engine")
    preempted = _per_rank(last.engine, "vllm:num_preemptions_total", "engine")
    ranks = sorted(set(running) | set(waiting) | set(kv), key=lambda r: (len(r), r))
    rows = tuple(RankRow(
        rank=rank, running=running.get(rank), waiting=waiting.get(rank), ceiling=ceiling,
        scheduled_tps=rate(sched_now.get(rank), sched_prev.get(rank), seconds) if prev else None,
        kv_use=kv.get(rank), preemptions=preempted.get(rank),
        trace_drops=drops.get(rank, 0.0) if rank in running or rank in waiting else None,
    ) for rank in ranks)

    output_tps = counter_rate("engine", "vllm:generation_tokens_total")
    if output_tps is None:
        output_tps = counter_rate("runtime", _OUTPUT_TOKENS)
    sched = [row.scheduled_tps for row in rows if row.scheduled_tps is not None]
    power = [value for _, value in now.get("carbonforge_gpu_power_watts", ())]
    use_window = windowed and len(scrapes) > 1
    return View(
        title=title,
        running=sum(running.values()) if running else None,
        waiting=sum(waiting.values()) if waiting else None,
        ceiling=ceiling * len(rows) if ceiling is not None and rows else ceiling,
        finished_per_s=counter_rate("runtime", _FINISHED),
        output_tps=output_tps,
        scheduled_tps=sum(sched) if sched else None,
        window_s=last.at - first.at if use_window else None,
        ttft=latency(first, last, _TTFT, use_window),
        e2e=latency(first, last, _E2E, use_window),
        ranks=rows,
        power_w=sum(power) if power else None,
        gpus=len(power),
        j_per_token=total(now, "carbonforge_energy_per_output_token_joules"),
        warnings=tuple(warnings)[-WARNINGS_SHOWN:],
        notes=tuple(notes),
    )


def keep_window(scrapes: Sequence[Scrape], window_s: float = WINDOW_S) -> list[Scrape]:
    """The scrapes the latency window needs: the newest, and those at most ``window_s`` older."""
    if not scrapes:
        return []
    newest = scrapes[-1].at
    return [scrape for scrape in scrapes if newest - scrape.at <= window_s + 1e-9]


# --- layout: the view as lines of at most WIDTH characters ----------------------------------------


def _num(value: float | None, digits: int = 1) -> str:
    if value is None:
        return "n/a"
    if digits == 0 or (float(value).is_integer() and abs(value) >= 100):
        return f"{value:.0f}"
    return f"{value:.{digits}f}"


def _per_s(value: float | None) -> str:
    return "n/a" if value is None else f"{_num(value)}/s"


def _seconds(value: float | None, last_bound: float | None = None) -> str:
    if value is None:
        return "-"
    if math.isinf(value):
        return f">{last_bound:g}s" if last_bound is not None else ">max"
    return f"{value * 1000:.0f}ms" if value < 1 else f"{value:.2f}s"


def _fraction(running: float | None, ceiling: int | None) -> str:
    text = _num(running, 0)
    return f"{text}/{ceiling}" if ceiling is not None and running is not None else text


#: A line and its style name (``title``, ``head``, ``warn``, ``note`` or ``""``).
Line = tuple[str, str]


def layout(view: View, source: str, clock: str, width: int = WIDTH, height: int = HEIGHT,
           last_bound: float | None = None) -> list[Line]:
    """The screen: at most ``height`` lines of at most ``width`` characters, each with a style name."""
    lines: list[Line] = [(f"carbonforge top  {view.title}  {clock}", "title"), (source, "note"), ("", "")]
    lines.append((f"Requests   running {_fraction(view.running, view.ceiling)}   waiting {_num(view.waiting, 0)}"
                  f"   finished {_per_s(view.finished_per_s)}", ""))
    lines.append((f"Tokens/s   output {_num(view.output_tps)}   scheduled {_num(view.scheduled_tps)}", ""))
    if view.power_w is not None:
        gpus = f"{view.gpus} GPU" + ("s" if view.gpus != 1 else "")
        per_token = "J/token n/a" if view.j_per_token is None else f"{view.j_per_token:.2f} J/token"
        lines.append((f"Energy     power {view.power_w:.0f} W ({gpus})   {per_token}", ""))
    else:
        lines.append(("Energy     not metered", ""))
    span = "since start" if view.window_s is None else f"last {view.window_s:.0f} s"
    lines.append(("", ""))
    lines.append((f"{'Latency, ' + span:<28}{'done':>6}{'p50':>10}{'p90':>10}{'p99':>10}", "head"))
    for name, hist in (("time to first token", view.ttft), ("end to end", view.e2e)):
        cells = "".join(f"{_seconds(p, last_bound):>10}" for p in hist.percentiles)
        lines.append((f"  {name:<26}{hist.count:>6}{cells}", ""))
    lines.append(("", ""))
    lines.append((f"{'Rank':<6}{'running':>10}{'waiting':>9}{'sched tok/s':>13}{'KV use':>9}{'preempted':>11}"
                  f"{'trace drops':>13}", "head"))
    tail: list[Line] = [("", ""), ("Last warnings (runtime.log)", "head")]
    tail += [(text, "warn") for text in view.warnings] or [("  none", "")]
    tail += [(text, "note") for text in view.notes]
    room = max(height - len(lines) - len(tail), 1)
    shown = view.ranks if len(view.ranks) <= room else view.ranks[:room - 1]
    for row in shown:
        kv = f"{row.kv_use * 100:.1f}%" if row.kv_use is not None else "n/a"
        lines.append((f"{row.rank:<6}{_fraction(row.running, row.ceiling):>10}{_num(row.waiting, 0):>9}"
                      f"{_num(row.scheduled_tps):>13}{kv:>9}{_num(row.preemptions, 0):>11}"
                      f"{_num(row.trace_drops, 0):>13}", ""))
    if len(shown) < len(view.ranks):
        lines.append((f"  ... {len(view.ranks) - len(shown)} more ranks", "note"))
    if not view.ranks:
        lines.append(("  no engine state yet", "note"))
    lines += tail
    return [(text[:width], style) for text, style in lines[:height]]


def last_finite_bound(scrape: Scrape) -> float | None:
    """The largest finite bucket bound of the latency histograms (what ``>X`` means on screen)."""
    bounds = [b for b, _ in buckets(scrape.runtime, _E2E) + buckets(scrape.runtime, _TTFT) if not math.isinf(b)]
    return max(bounds) if bounds else None
