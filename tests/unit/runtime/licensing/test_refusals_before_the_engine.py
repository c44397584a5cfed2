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
