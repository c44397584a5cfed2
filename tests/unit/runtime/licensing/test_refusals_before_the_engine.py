"""The runtime as a process refuses the premium test recipe without a licence that entitles it, before
vLLM starts (so no engine is needed): exit code 4, the reason and the fix. The runtime runs through
tests/support/licensed_runtime.py, which trusts a key pair the vendor tool makes here; the licensed
serve is the end-to-end test tests/e2e/test_licence.py."""

from __future__ import annotations

import time
from pathlib import Path

from tests.support.licensed_runtime import PREMIUM_KEY, issue, new_vendor, premium_runtime


def test_refusals_exit_before_the_engine_starts(tmp_path: Path) -> None:
    vendor = new_vendor(tmp_path)
    later = time.strftime("%Y-%m-%d", time.gmtime(time.time() + 100 * 86400))
    cases = {
        "no license key provided": {},
        f"is not entitled to {PREMIUM_KEY}": {
            "CARBONFORGE_LICENSE_KEY": issue(vendor, "--days", "30", "--entitle", "cf-tiny:*:*:*")},
        "not valid until": {"CARBONFORGE_LICENSE_KEY": issue(vendor, "--days", "30", "--not-before", later)},
        "does not know": {"CARBONFORGE_LICENSE_KEY": issue(vendor, "--days", "30"), "CF_TEST_TRUSTED_KEYS": ""},
    }
    # The four runs at once: each is a fresh interpreter that exits early.
    runs = [premium_runtime(tmp_path / f"case{i}", vendor, **env).start() for i, env in enumerate(cases.values())]
    try:
        codes = [run.wait(timeout_s=60) for run in runs]
    finally:
        for run in runs:
            run.kill()
    for i, (phrase, run, code) in enumerate(zip(cases, runs, codes, strict=True)):
        out = run.output()
        assert code == 4, out
        assert phrase in out and "premium-plan" in out and "fix:" in out, out
        assert "Traceback" not in out
        assert not (tmp_path / f"case{i}" / "vllm.log").exists(), "the engine was started"


def test_a_clock_set_back_past_expiry_is_refused_before_the_engine_starts(tmp_path: Path) -> None:
    """The licence is valid by the host clock, but an earlier run saw a later time, past its expiry
    (its mark is in the log directory): the runtime refuses with exit 4 before vLLM starts."""
    import json

    vendor = new_vendor(tmp_path)
    log_dir = tmp_path / "logs"
    log_dir.mkdir()
    (log_dir / "licence-clock.json").write_text(json.dumps({"seen": time.time() + 60 * 86400}))
    run = premium_runtime(log_dir, vendor, CARBONFORGE_LICENSE_KEY=issue(vendor, "--days", "30")).start()
    try:
        code = run.wait(timeout_s=60)
    finally:
        run.kill()
    out = run.output()
    assert code == 4, out
    assert "behind the latest time this runtime has seen" in out and "correct the host clock" in out, out
    assert "Traceback" not in out
    assert not (log_dir / "vllm.log").exists(), "the engine was started"
