"""How long trace files are kept: the rotation period a retention implies, the names of rotated
segments, and their age. Pure: the file sink (engine/trace_sinks.py) does the I/O.

With a retention, the trace file (each data-parallel rank's own file) is closed at the end of every
period and renamed to a sibling segment named after that boundary, in UTC:
``requests.jsonl`` -> ``requests.20261205T0800Z.jsonl`` (the records written before 08:00 since the
previous boundary). Every record is older than the stamp in its segment's name, so a segment whose
stamp is more than the retention ago holds nothing younger than the retention and is deleted. The
segment being written has no stamp and is never deleted.
"""

from __future__ import annotations

import calendar
import re
import time
from dataclasses import dataclass

MINUTE_S = 60
HOUR_S = 3600
DAY_S = 86400
#: The rotation periods, longest first; each divides a day, so boundaries fall on whole UTC hours or days.
PERIODS_S = (DAY_S, HOUR_S, MINUTE_S)
#: A retention holds at least this many periods, so a segment outlives the retention by at most a
#: twelfth of it (for a retention of 12 minutes or more).
PERIODS_PER_RETENTION = 12
#: The stamp of a segment: the UTC boundary at which it was closed.
STAMP_FORMAT = "%Y%m%dT%H%MZ"
_STAMP_RE = r"(\d{8}T\d{4}Z)(?:-(\d+))?"
#: The units CF_TRACE_RETENTION accepts, with their length.
UNITS_S = {"d": DAY_S, "h": HOUR_S, "m": MINUTE_S}


def rotation_period(retention_s: float) -> int:
    """The longest of a day, an hour or a minute that fits :data:`PERIODS_PER_RETENTION` times into
    the retention (a minute for any retention under 12 hours)."""
    for period in PERIODS_S:
        if period * PERIODS_PER_RETENTION <= retention_s:
            return period
    return MINUTE_S


def period_word(period_s: int) -> str:
    return {DAY_S: "daily", HOUR_S: "hourly", MINUTE_S: "every minute"}.get(period_s, f"every {period_s} s")


def format_duration(seconds: float) -> str:
    """``604800`` -> ``7d``, ``5400`` -> ``1h30m``, ``90`` -> ``1m30s``: whole units, largest first."""
    left = max(round(seconds), 0)
    parts = []
    for unit, size in (("d", DAY_S), ("h", HOUR_S), ("m", MINUTE_S), ("s", 1)):
        count, left = divmod(left, size)
        if count:
            parts.append(f"{count}{unit}")
    return "".join(parts) or "0s"


def boundary_after(t: float, period_s: int) -> float:
    """The end of the period that holds time ``t`` (Unix seconds)."""
    return (int(t // period_s) + 1) * period_s


def stamp(boundary: float) -> str:
    return time.strftime(STAMP_FORMAT, time.gmtime(boundary))


def _split(path: str) -> tuple[str, str, str]:
    """``/logs/requests.dp1.jsonl`` -> (``/logs/``, ``requests.dp1``, ``.jsonl``); the suffix is the
    last one, as for the rank files (``core.contract.rank_file``), and none for ``traces`` or its rank
    file ``traces.dp1``."""
    head, sep, name = path.rpartition("/")
    stem, dot, suffix = name.rpartition(".")
    if not (dot and stem) or re.fullmatch(r"dp\d+", suffix):  # ``traces.dp1``: the rank file of ``traces``
        return head + sep, name, ""
    return head + sep, stem, "." + suffix


def segment_path(path: str, boundary: float, copy: int = 1) -> str:
    """The segment of ``path`` closed at ``boundary``; ``copy`` > 1 only when that name is taken."""
    head, stem, suffix = _split(path)
    extra = f"-{copy}" if copy > 1 else ""
    return f"{head}{stem}.{stamp(boundary)}{extra}{suffix}"


@dataclass(frozen=True)
class Segment:
    name: str
    #: When it was closed (Unix seconds): every record in it is older.
    closed_at: float


class SegmentNames:
    """Recognises the segments of one trace file and of its data-parallel rank files: exactly
    ``<stem>[.dp<rank>].<YYYYMMDDTHHMMZ>[-<n>]<suffix>``, nothing else (not the files being written)."""

    def __init__(self, path: str) -> None:
        _, stem, suffix = _split(path)
        self._re = re.compile(rf"{re.escape(stem)}(?:\.dp\d+)?\.{_STAMP_RE}{re.escape(suffix)}")

    def match(self, name: str) -> Segment | None:
        found = self._re.fullmatch(name)
        if found is None:
            return None
        try:
            closed = time.strptime(found.group(1), STAMP_FORMAT)
        except ValueError:  # 20261399T9999Z: the shape, not a time; not ours
            return None
        return Segment(name, float(calendar.timegm(closed)))


__all__ = [
    "DAY_S",
    "HOUR_S",
    "MINUTE_S",
    "UNITS_S",
    "Segment",
    "SegmentNames",
    "boundary_after",
    "format_duration",
    "period_word",
    "rotation_period",
    "segment_path",
    "stamp",
]
