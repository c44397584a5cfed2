"""``trace plot``: latency, queue wait and request rate over time, as a PNG.

matplotlib is an optional extra (``pip install 'carbonforge-runtime[plot]'``); it is imported
only here, only when a plot is asked for.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from carbonforge_runtime.errors import CarbonForgeError
from carbonforge_runtime.files import write_atomic
from carbonforge_runtime.offline.trace_tools.summarize import Percentiles, Summary, WindowStats, fmt_window, utc

#: Figure size in pixels (width, height).
WIDTH_PX, HEIGHT_PX = 1200, 900
_DPI = 100
#: Most windows one plot draws (a wider window is asked for beyond that).
MAX_WINDOWS = 20_000


class PlotUnavailable(CarbonForgeError):
    """matplotlib is not installed."""


def load_pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise PlotUnavailable(
            "trace plot needs matplotlib, which is not installed",
            "pip install 'carbonforge-runtime[plot]' (or pip install matplotlib) and run the command again",
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _time_unit(span_s: float) -> tuple[str, float]:
    if span_s <= 120:
        return "seconds", 1.0
    if span_s <= 2 * 3600:
        return "minutes", 60.0
    return "hours", 3600.0


def _steps(values: list[float | None]) -> list[float]:
    """One value per window, repeated once at the end so the last window is drawn to its end."""
    clean = [math.nan if value is None else value for value in values]
    return [*clean, clean[-1]]


def _pick(slots: list[WindowStats | None], read: Callable[[WindowStats], float | None]) -> list[float | None]:
    return [None if slot is None else read(slot) for slot in slots]


def _band(axis: Any, edges: list[float], slots: list[WindowStats | None],
          read: Callable[[WindowStats], Percentiles], color: str, label: str) -> None:
    p50 = _steps(_pick(slots, lambda w: read(w).p50))
    p90 = _steps(_pick(slots, lambda w: read(w).p90))
    p99 = _steps(_pick(slots, lambda w: read(w).p99))
    axis.fill_between(edges, p50, p99, step="post", color=color, alpha=0.18, linewidth=0, label=f"{label} p50-p99")
    axis.fill_between(edges, p50, p90, step="post", color=color, alpha=0.30, linewidth=0, label=f"{label} p50-p90")
    axis.step(edges, p50, where="post", color=color, linewidth=1.6, label=f"{label} p50")


def render_png(summary: Summary, out: Path, title: str) -> None:
    """Three stacked panels sharing the time axis: latency, queue wait, request rate.

    Each window is drawn over its own time extent; windows without requests are left blank
    (rate zero) and queue-dominated windows are shaded.
    """
    plt = load_pyplot()
    windows = summary.windows
    origin = windows[0].start
    spanned = (windows[-1].start - origin) / summary.window_s
    count = round(spanned) + 1 if math.isfinite(spanned) else MAX_WINDOWS + 1
    if count > MAX_WINDOWS:
        raise CarbonForgeError(
            f"the trace spans {f'{count:,}' if math.isfinite(spanned) else 'countless'} windows of "
            f"{fmt_window(summary.window_s)}, too many to draw",
            f"pass a larger --window (at most {MAX_WINDOWS:,} windows are drawn), e.g. --window 1h",
        )
    slots: list[WindowStats | None] = [None] * count
    for window in windows:
        slots[round((window.start - origin) / summary.window_s)] = window
    unit_name, unit_s = _time_unit(windows[-1].end - origin)
    edges = [k * summary.window_s / unit_s for k in range(count + 1)]
    figure, (latency_axis, queue_axis, rate_axis) = plt.subplots(
        3, 1, sharex=True, figsize=(WIDTH_PX / _DPI, HEIGHT_PX / _DPI), dpi=_DPI,
        gridspec_kw={"height_ratios": [3, 3, 2]},
    )
    for window in windows:
        if window.stats.verdict.code == "queue-dominated":
            for axis in (latency_axis, queue_axis, rate_axis):
                axis.axvspan((window.start - origin) / unit_s, (window.end - origin) / unit_s,
                             color="orange", alpha=0.12, linewidth=0)
    _band(latency_axis, edges, slots, lambda w: w.stats.e2e_s, "tab:blue", "end-to-end")
    latency_axis.step(edges, _steps(_pick(slots, lambda w: w.stats.engine_s.p50)), where="post", color="tab:green",
                      linewidth=1.2, linestyle="--", label="engine time p50")
    latency_axis.set_ylabel("latency (s)")
    latency_axis.legend(loc="upper left", fontsize=8, ncol=2)

    _band(queue_axis, edges, slots, lambda w: w.stats.queue_wait_s, "tab:red", "queue wait")
    if any(w.stats.verdict.code == "queue-dominated" for w in windows):
        queue_axis.axvspan(0, 0, color="orange", alpha=0.25, label="queue-dominated window")
    queue_axis.set_ylabel("queue wait (s)")
    queue_axis.legend(loc="upper left", fontsize=8, ncol=2)

    rates = [0.0 if slot is None else slot.requests_per_s for slot in slots]
    rate_axis.step(edges, _steps(list(rates)), where="post", color="tab:purple",
                   linewidth=1.4, label="requests/s")
    rate_axis.set_ylabel("requests/s")
    rate_axis.set_xlabel(f"{unit_name} since {utc(origin)} UTC ({fmt_window(summary.window_s)} windows, "
                         "by arrival)")
    rate_axis.legend(loc="upper left", fontsize=8)

    for axis in (latency_axis, queue_axis, rate_axis):
        axis.grid(True, alpha=0.3)
        axis.set_ylim(bottom=0)
    rate_axis.set_xlim(edges[0], edges[-1])
    figure.suptitle(title, fontsize=11)
    figure.tight_layout()
    try:
        write_atomic(out, lambda handle: figure.savefig(handle, format="png", dpi=_DPI), binary=True)
    except OSError as exc:
        raise CarbonForgeError(f"cannot write {out} ({exc.strerror or exc})", "choose a writable path for -o") from None
    finally:
        plt.close(figure)
