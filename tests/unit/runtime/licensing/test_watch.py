"""The licence over time, driven by an injected clock (no sleeping): the warnings 30, 7 and 1 days
ahead (each once), the expired file at expiry, and the clock's high-water mark against a clock set back."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from carbonforge_runtime.runtime.licensing import LicenseInvalid
from carbonforge_runtime.runtime.licensing.core import LicenseClaims
from carbonforge_runtime.runtime.licensing.watch import (
    CLOCK_FILE,
    EXPIRED,
    EXPIRED_FILE,
    OK,
    ROLLBACK_TOLERANCE_S,
    WARN,
    LicenceWatch,
    read_mark,
    standing,
    trusted_now,
    watch_licence,
)

DAY = 86400.0
START = 1_900_000_000.0
EXPIRES = START + 45 * DAY
CLAIMS = LicenseClaims(licence_id="lic-watch-1", licensee="Acme Test GmbH", plan="premium", issued_at=START - DAY,
                       not_before=START - DAY, expires_at=EXPIRES, key_id="test-1", entitlements=("*",))


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture()
def log(caplog: pytest.LogCaptureFixture) -> logging.Logger:
    caplog.set_level(logging.INFO, logger="cf-test-licence-watch")
    return logging.getLogger("cf-test-licence-watch")


def messages(caplog: pytest.LogCaptureFixture, phrase: str) -> list[str]:
    return [record.getMessage() for record in caplog.records if phrase in record.getMessage()]


def test_standing_ok_warn_expired() -> None:
    assert standing(CLAIMS, EXPIRES - 31 * DAY) == standing(CLAIMS, EXPIRES - 31 * DAY)
    assert standing(CLAIMS, EXPIRES - 31 * DAY).state == OK
    assert (standing(CLAIMS, EXPIRES - 30 * DAY).state, standing(CLAIMS, EXPIRES - 30 * DAY).warn_days) == (WARN, 30)
    assert standing(CLAIMS, EXPIRES - 6 * DAY).warn_days == 7
    assert standing(CLAIMS, EXPIRES - 3600).warn_days == 1
    assert standing(CLAIMS, EXPIRES).state == EXPIRED
    assert standing(CLAIMS, EXPIRES + 1).state == EXPIRED


def test_the_warnings_30_7_and_1_days_ahead_each_once(tmp_path: Path, log: logging.Logger,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock(START)
    watch = LicenceWatch(CLAIMS, tmp_path, log, clock)
    seen = []
    while clock.now < EXPIRES - 60:  # every minute would be 64800 checks: every 2 hours here
        seen.append(watch.check().warn_days)
        clock.now += 7200
    warnings = messages(caplog, "expires on")
    assert [w.split("(warning at ")[1].split(" ")[0] for w in warnings] == ["30", "7", "1"], warnings
    assert {30, 7, 1} <= set(seen)
    assert not (tmp_path / EXPIRED_FILE).exists()
    assert "renew the licence" in warnings[0]


def test_a_start_inside_the_warning_window_warns_once_for_the_nearest_threshold(
        tmp_path: Path, log: logging.Logger, caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock(EXPIRES - 5 * DAY)
    watch = LicenceWatch(CLAIMS, tmp_path, log, clock)
    for _ in range(10):
        watch.check()
        clock.now += 60
    assert len(messages(caplog, "expires on")) == 1 and "warning at 7 day" in messages(caplog, "expires on")[0]


def test_expiry_creates_the_file_the_api_server_watches(tmp_path: Path, log: logging.Logger,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / EXPIRED_FILE).write_text("left by an earlier run")
    clock = Clock(EXPIRES - 120)
    watch = LicenceWatch(CLAIMS, tmp_path, log, clock)
    assert not (tmp_path / EXPIRED_FILE).exists(), "a run starts without the file"
    assert watch.check().state == WARN and not (tmp_path / EXPIRED_FILE).exists()
    clock.now = EXPIRES
    assert watch.check().state == EXPIRED
    assert (tmp_path / EXPIRED_FILE).read_text().startswith("licence lic-watch-1 expired on")
    clock.now += 60
    watch.check()
    assert len(messages(caplog, "new requests are refused")) == 1


def test_free_serves_get_no_watch(tmp_path: Path, log: logging.Logger) -> None:
    (tmp_path / CLOCK_FILE).write_text("garbage")
    assert watch_licence(None, tmp_path, log) is None
    assert (tmp_path / CLOCK_FILE).read_text() == "garbage"


# --- the clock's high-water mark ----------------------------------------------------------------

def test_trusted_now() -> None:
    assert trusted_now(START, None) == (START, False)
    assert trusted_now(START - ROLLBACK_TOLERANCE_S + 1, START) == (START - ROLLBACK_TOLERANCE_S + 1, False)
    assert trusted_now(START - ROLLBACK_TOLERANCE_S - 1, START) == (START, True)


def test_the_mark_is_written_atomically_at_most_once_a_minute(tmp_path: Path, log: logging.Logger) -> None:
    clock = Clock(START)
    watch = LicenceWatch(CLAIMS, tmp_path, log, clock)
    watch.check()
    assert read_mark(tmp_path / CLOCK_FILE) == (START, None)
    clock.now += 30
    watch.check()
    assert read_mark(tmp_path / CLOCK_FILE) == (START, None)
    clock.now += 30
    watch.check()
    assert read_mark(tmp_path / CLOCK_FILE) == (START + 60, None)
    assert json.loads((tmp_path / CLOCK_FILE).read_text())["seen_utc"].endswith("UTC")
    assert [p.name for p in tmp_path.iterdir()] == [CLOCK_FILE]  # no temporary file left


def test_a_clock_set_back_does_not_revive_an_expired_licence(tmp_path: Path, log: logging.Logger,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock(EXPIRES + 10)  # a previous run saw the licence expire
    first = LicenceWatch(CLAIMS, tmp_path, log, clock)
    assert first.check().state == EXPIRED
    # The clock is set back 30 days and the runtime restarted: the gate's own check passes on that clock,
    # the watch refuses before anything is served.
    clock.now = EXPIRES - 30 * DAY
    with pytest.raises(LicenseInvalid) as info:
        watch_licence(CLAIMS, tmp_path, log, clock)
    assert info.value.reason == "expired" and "behind the latest time" in info.value.message
    assert "correct the host clock" in info.value.remedy


def test_a_clock_set_back_while_serving_is_reported_once_and_the_mark_is_used(
        tmp_path: Path, log: logging.Logger, caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock(EXPIRES - 600)
    watch = watch_licence(CLAIMS, tmp_path, log, clock)
    assert watch is not None
    clock.now = EXPIRES + 60
    assert watch.check().state == EXPIRED
    clock.now = EXPIRES - 10 * DAY
    for _ in range(3):
        assert watch.check().state == EXPIRED
        clock.now += 60
    assert len(messages(caplog, "behind the latest time")) == 1
    assert (tmp_path / EXPIRED_FILE).exists()


def test_a_small_step_back_is_tolerated(tmp_path: Path, log: logging.Logger,
                                        caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock(START)
    watch = LicenceWatch(CLAIMS, tmp_path, log, clock)
    watch.check()
    clock.now -= ROLLBACK_TOLERANCE_S / 2
    assert watch.check().seconds_left == EXPIRES - clock.now
    assert not messages(caplog, "behind the latest time")


def test_a_corrupt_mark_is_reported_and_started_afresh(tmp_path: Path, log: logging.Logger,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / CLOCK_FILE).write_text("{not json")
    watch = watch_licence(CLAIMS, tmp_path, log, Clock(START))
    assert watch is not None
    assert messages(caplog, "is not a clock mark written by this runtime")
    assert read_mark(tmp_path / CLOCK_FILE) == (START, None)


def test_an_unwritable_mark_does_not_stop_a_premium_serve(tmp_path: Path, log: logging.Logger,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    state = tmp_path / "not-a-directory"  # neither root nor anyone else can create a file below a file
    state.write_text("")
    clock = Clock(START)
    watch = watch_licence(CLAIMS, state, log, clock)
    assert watch is not None
    clock.now += 120
    assert watch.check().state == OK
    assert len(messages(caplog, "cannot write the clock mark")) == 1
    clock.now = START - 2 * ROLLBACK_TOLERANCE_S  # still guarded by the mark kept in memory
    assert watch.check().seconds_left == EXPIRES - (START + 120)


def test_the_thread_checks_and_stops(tmp_path: Path, log: logging.Logger, monkeypatch: pytest.MonkeyPatch) -> None:
    from carbonforge_runtime.runtime.licensing import watch as watch_module

    monkeypatch.setattr(watch_module, "CHECK_EVERY_S", 0.01)
    clock = Clock(EXPIRES + 1)
    watch = LicenceWatch(CLAIMS, tmp_path, log, clock).start()
    try:
        deadline = 200
        while not (tmp_path / EXPIRED_FILE).exists() and deadline:
            deadline -= 1
            threading_wait(0.01)
    finally:
        watch.close()
    assert (tmp_path / EXPIRED_FILE).exists()
    assert watch._thread is not None and not watch._thread.is_alive()


def threading_wait(seconds: float) -> None:
    import threading

    threading.Event().wait(seconds)
