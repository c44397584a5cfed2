"""End to end: a licence issued by the vendor tool lets the premium test recipe start on the CPU engine.

The runtime runs through tests/support/licensed_runtime.py, which trusts the test key pair in its
own process (the product has no way to add keys). The refusals, which exit before vLLM starts, are
tests/unit/runtime/licensing/test_refusals_before_the_engine.py; the vendor key pair and the
launcher are tests/support/licensed_runtime.py.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import openai
import pytest

from tests.support.licensed_runtime import PREMIUM_KEY, issue, new_vendor, premium_runtime

#: Holds with a second engine beside it (scripts/test.sh runs these modules two at a time).
pytestmark = pytest.mark.parallel_safe

SERVED = "carbonforge/tiny-premium"


@pytest.fixture(scope="module")
def vendor(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A fresh key pair made by the vendor tool (outside the repository) and its public half."""
    return new_vendor(tmp_path_factory.mktemp("vendor"))


@pytest.mark.engine
def test_licensed_premium_recipe_serves(tmp_path: Path, vendor: dict[str, str]) -> None:
    licence = issue(vendor, "--days", "30", "--entitle", "cf-tiny-premium:*:*:*")
    licence_file = tmp_path / "license.key"
    licence_file.write_text(licence + "\n")
    licence_file.chmod(0o600)
    run = premium_runtime(tmp_path, vendor, CF_LICENSE_FILE=str(licence_file)).start()
    try:
        run.wait_ready()
        out = run.output()
        assert f"licence: using the licence file {licence_file}" in out
        assert f"entitles {PREMIUM_KEY}" in out and "E2E Test Ltd" in out
        assert licence not in out and licence.split(".")[2] not in out
        # The licence watch runs: the clock's high-water mark is written, no expiry file yet.
        assert (tmp_path / "licence-clock.json").is_file() and not (tmp_path / "licence-expired").exists()
        client = openai.OpenAI(base_url=run.base_url, api_key="unused", timeout=120, max_retries=0)
        response = client.chat.completions.create(
            model=SERVED, messages=[{"role": "user", "content": "hello"}], max_tokens=5,
            extra_body={"ignore_eos": True})
        assert response.model == SERVED
        assert response.usage is not None and response.usage.completion_tokens == 5
        started = time.monotonic()
        assert run.stop(signal.SIGTERM, timeout_s=60) == 0, run.output()
        assert time.monotonic() - started < 45
    finally:
        run.kill()
