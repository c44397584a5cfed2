"""The licence over time: re-checked every minute while a premium model is served.

At start the gate (:mod:`.gate`) verifies the licence once; this module keeps checking it while the
engine serves:

* :func:`standing` decides from the claims and a time whether the licence is ``ok``, ``warn`` (30, 7
  or 1 days or less left) or ``expired``; each warning is logged once per run;
* at expiry the file named by ``CF_LICENCE_EXPIRED_FILE`` (in the API server's environment) is created;
  from then on the API server answers new requests 503 ``licence_expired`` while requests already
  running finish;
* the clock's high-water mark (:data:`CLOCK_FILE` in the log directory, the runtime's state volume)
  records the latest time seen, written atomically at most once a minute. A clock more than
  :data:`ROLLBACK_TOLERANCE_S` behind the mark is not trusted: the mark is used as "now" (so an expired
  licence stays expired) and one warning says so. The tolerance absorbs the small steps back an NTP
  correction or a resumed virtual machine makes; an hour is far more than those and far less than
  any licence term, so an honest correction never shortens a licence and a deliberate one gains at
  most an hour.

Free serves never start a watch, so the mark can neither stop nor slow them. For a premium serve a
mark that cannot be read (corrupt) is reported and started afresh from the current time, and one
that cannot be written is reported once while the running process keeps its own mark in memory:
refusing to serve a valid licence over a read-only volume would cost a paying operator more than the
mark protects, since deleting the file (which needs the same access) resets it anyway.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from carbonforge_runtime import files
from carbonforge_runtime.runtime.licensing.core import LicenseClaims, LicenseInvalid, format_time

#: Seconds between two checks while serving.
CHECK_EVERY_S = 60.0
#: Days before expiry at which one warning each is logged.
WARN_DAYS = (30, 7, 1)
#: How far the clock may fall behind the high-water mark before the mark is used instead.
ROLLBACK_TOLERANCE_S = 3600.0
#: The mark is written at most this often (seconds of time seen).
MARK_EVERY_S = 60.0
#: Created (in the log directory) when the licence has expired; the API server refuses new requests then.
EXPIRED_FILE = "licence-expired"
#: The clock's high-water mark (in the log directory).
CLOCK_FILE = "licence-clock.json"
#: Longest mark file read (it holds one small JSON object).
MAX_MARK_BYTES = 4096

OK = "ok"
WARN = "warn"
EXPIRED = "expired"

RENEW_REMEDY = ("renew the licence in the CarbonForge console and replace the key (CARBONFORGE_LICENSE_KEY or "
                "the licence file), then restart the runtime")


@dataclass(frozen=True)
class Standing:
    """The licence at one moment: ``state`` is ok, warn or expired; ``warn_days`` the smallest of
    :data:`WARN_DAYS` that ``seconds_left`` is within (None when none is)."""

    state: str
    seconds_left: float
    warn_days: int | None = None

    @property
    def days_left(self) -> float:
        return self.seconds_left / 86400.0


def standing(claims: LicenseClaims, now: float) -> Standing:
    """ok / warn N days / expired, from the claims and the time to judge by."""
    left = claims.expires_at - now
    if left <= 0:
        return Standing(EXPIRED, left)
    within = [days for days in WARN_DAYS if left <= days * 86400]
    if within:
        return Standing(WARN, left, min(within))
    return Standing(OK, left)


def trusted_now(now: float, mark: float | None) -> tuple[float, bool]:
    """The time to judge the licence by, and whether the clock was found set back: ``now``, unless it
    is more than :data:`ROLLBACK_TOLERANCE_S` behind the high-water ``mark``, then the mark."""
    if mark is not None and now < mark - ROLLBACK_TOLERANCE_S:
        return mark, True
    return now, False


def read_mark(path: Path) -> tuple[float | None, str | None]:
    """The recorded high-water mark (None when there is none) and why it could not be used, if so."""
    try:
        raw = files.read_regular(path, MAX_MARK_BYTES)
    except FileNotFoundError:
        return None, None
    except OSError as exc:
        return None, f"cannot be read ({exc.strerror or exc})"
    try:
        seen = json.loads(raw.decode("utf-8"))["seen"]
    except (ValueError, KeyError, TypeError):
        return None, "is not a clock mark written by this runtime"
    if isinstance(seen, bool) or not isinstance(seen, (int, float)) or not 0 <= seen < 2**33:
        return None, "holds no valid time"
    return float(seen), None


def write_mark(path: Path, seen: float) -> None:
    """Record ``seen`` as the high-water mark, atomically. Raises OSError."""
    text = json.dumps({"seen": round(seen, 3), "seen_utc": format_time(seen)}) + "\n"
    files.write_text_atomic(path, text)


class LicenceWatch:
    """The checks of one serve. :meth:`check` is one check (the thread of :meth:`start` calls it every
    :data:`CHECK_EVERY_S`); ``clock`` is the wall clock, injected by tests."""

    def __init__(self, claims: LicenseClaims, state_dir: Path, log: logging.Logger,
                 clock: Callable[[], float] = time.time) -> None:
        self.claims = claims
        self.expired_file = state_dir / EXPIRED_FILE
        self.mark_file = state_dir / CLOCK_FILE
        self.log = log
        self.clock = clock
        self.expired = False
        self._warned: set[int] = set()
        self._rollback_reported = False
        self._write_failed = False
        self._written: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.mark, problem = read_mark(self.mark_file)
        if problem:
            log.warning("licence: the clock mark %s %s: starting a new one from the current time",
                        self.mark_file, problem)
        with contextlib.suppress(FileNotFoundError, NotADirectoryError):
            self.expired_file.unlink()  # left by an earlier run: this one starts with a licence just verified

    def check(self) -> Standing:
        """One check: the time to judge by, the mark, the warnings, and the expired file at expiry."""
        now, set_back = trusted_now(self.clock(), self.mark)
        if set_back and not self._rollback_reported:
            self._rollback_reported = True
            self.log.warning(
                "licence: the host clock (%s) is more than %d minutes behind the latest time this runtime has "
                "seen (%s, recorded in %s); the licence is checked against that time instead. Correct the "
                "host clock (NTP)", format_time(self.clock()), ROLLBACK_TOLERANCE_S // 60, format_time(now),
                self.mark_file)
        self.mark = now if self.mark is None else max(self.mark, now)
        self._save_mark()
        result = standing(self.claims, now)
        if result.state == EXPIRED:
            self._expire()
        elif result.warn_days is not None and result.warn_days not in self._warned:
            self._warned.update(days for days in WARN_DAYS if days >= result.warn_days)
            self.log.warning("licence %s for %s expires on %s, in %.1f day(s) (warning at %d day(s) before): %s",
                             self.claims.licence_id, self.claims.licensee, format_time(self.claims.expires_at),
                             result.days_left, result.warn_days, RENEW_REMEDY)
        return result

    def _save_mark(self) -> None:
        assert self.mark is not None
        if self._written is not None and self.mark - self._written < MARK_EVERY_S:
            return
        try:
            write_mark(self.mark_file, self.mark)
        except OSError as exc:
            if not self._write_failed:
                self._write_failed = True
                self.log.warning("licence: cannot write the clock mark %s (%s): a clock set back while the runtime "
                                 "is stopped will not be noticed; make the log directory writable",
                                 self.mark_file, exc.strerror or exc)
            return
        self._written = self.mark

    def _expire(self) -> None:
        if self.expired:
            return
        self.expired = True
        self.log.error("licence %s for %s expired on %s: new requests are refused (503 licence_expired) while "
                       "requests already running finish; %s", self.claims.licence_id, self.claims.licensee,
                       format_time(self.claims.expires_at), RENEW_REMEDY)
        try:
            files.write_text_atomic(self.expired_file,
                                    f"licence {self.claims.licence_id} expired on "
                                    f"{format_time(self.claims.expires_at)}\n")
        except OSError as exc:
            self.expired = False  # tried again at the next check
            self.log.error("licence: cannot create %s (%s): the API server keeps taking requests until it can be "
                           "created; make the log directory writable", self.expired_file, exc.strerror or exc)

    def refuse_if_expired(self) -> None:
        """At start, after the gate: a licence the high-water mark says has expired is refused (exit 4)."""
        now, _ = trusted_now(self.clock(), self.mark)
        if standing(self.claims, now).state == EXPIRED:
            raise LicenseInvalid(
                "expired",
                f"the licence expired on {format_time(self.claims.expires_at)} (the host clock is behind the "
                f"latest time this runtime has seen, {format_time(self.mark or 0)}, recorded in {self.mark_file})",
                "correct the host clock (NTP); " + RENEW_REMEDY,
            )
        self.check()

    def start(self) -> LicenceWatch:
        self._thread = threading.Thread(target=self._loop, name="cf-licence-watch", daemon=True)
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(CHECK_EVERY_S):
            try:
                self.check()
            except Exception as exc:  # a failed check must not end the watch; the next one tries again
                self.log.error("licence: check failed (%s); trying again in %.0f s", exc, CHECK_EVERY_S)

    def close(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)


def watch_licence(claims: LicenseClaims | None, state_dir: Path, log: logging.Logger,
                  clock: Callable[[], float] = time.time) -> LicenceWatch | None:
    """The watch for a premium serve (None for a free one), after its first check; raises
    :class:`LicenseInvalid` when the clock's high-water mark shows the licence has expired."""
    if claims is None:
        return None
    watch = LicenceWatch(claims, state_dir, log, clock)
    watch.refuse_if_expired()
    return watch
