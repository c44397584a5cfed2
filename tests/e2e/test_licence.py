"""End to end: a licence issued by the vendor tool lets the premium test recipe start on the CPU engine.

The runtime runs through tests/support/licensed_runtime.py, which trusts the test key pair in its
own process (the product has no way to add keys). Refusals are checked first: they exit before
vLLM starts, so they cost no engine.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest

from tests.support import REPO, TEST_RECIPES, RuntimeProcess

TOOL = [sys.executable, str(REPO / "scripts" / "cf-license")]
LAUNCHER = [sys.executable, str(REPO / "tests" / "support" / "licensed_runtime.py")]
PREMIUM_KEY = "cf-tiny-premium:bf16:chat:cpu"
SERVED = "carbonforge/tiny-premium"


def tool(*args: str) -> str:
    result = subprocess.run([*TOOL, *args], capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    return result.stdout


@pytest.fixture(scope="module")
def vendor(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A fresh key pair made by the vendor tool (outside the repository) and its public half."""
    key_file = tmp_path_factory.mktemp("vendor") / "e2e-key.json"
    tool("keygen", "--key-id", "e2e-test-1", "--out", str(key_file))
    public = json.loads(key_file.read_text())["public_key"]
    return {"key_file": str(key_file), "trusted": f"e2e-test-1={public}"}


def issue(vendor: dict[str, str], *extra: str) -> str:
    return tool("issue", "--key", vendor["key_file"], "--licensee", "E2E Test Ltd", *extra).strip()


def runtime(tmp_path: Path, vendor: dict[str, str], **env: str) -> RuntimeProcess:
    base = {"CF_RECIPES_DIR": str(TEST_RECIPES), "CF_TEST_TRUSTED_KEYS": vendor["trusted"],
            "CF_LICENSE_FILE": str(tmp_path / "no-licence-here.key")}
    return RuntimeProcess(["--context-key", PREMIUM_KEY], tmp_path, env={**base, **env}, python=LAUNCHER)


def test_refusals_exit_before_the_engine_starts(tmp_path: Path, vendor: dict[str, str]) -> None:
    later = time.strftime("%Y-%m-%d", time.gmtime(time.time() + 100 * 86400))
    cases = {
        "no license key provided": {},
        f"is not entitled to {PREMIUM_KEY}": {
            "CARBONFORGE_LICENSE_KEY": issue(vendor, "--days", "30", "--entitle", "cf-tiny:*:*:*")},
        "not valid until": {"CARBONFORGE_LICENSE_KEY": issue(vendor, "--days", "30", "--not-before", later)},
        "does not know": {"CARBONFORGE_LICENSE_KEY": issue(vendor, "--days", "30"), "CF_TEST_TRUSTED_KEYS": ""},
    }
    for i, (phrase, env) in enumerate(cases.items()):
        run = runtime(tmp_path / f"case{i}", vendor, **env).start()
        try:
            code = run.wait(timeout_s=60)
        finally:
            run.kill()
        out = run.output()
        assert code == 4, out
        assert phrase in out and "premium-plan" in out and "fix:" in out, out
        assert "Traceback" not in out
        assert not (tmp_path / f"case{i}" / "vllm.log").exists(), "the engine was started"


@pytest.mark.engine
def test_licensed_premium_recipe_serves(tmp_path: Path, vendor: dict[str, str]) -> None:
    licence = issue(vendor, "--days", "30", "--entitle", "cf-tiny-premium:*:*:*")
    licence_file = tmp_path / "license.key"
    licence_file.write_text(licence + "\n")
    licence_file.chmod(0o600)
    run = runtime(tmp_path, vendor, CF_LICENSE_FILE=str(licence_file)).start()
    try:
        run.wait_ready()
        out = run.output()
        assert f"licence: using the licence file {licence_file}" in out
        assert f"entitles {PREMIUM_KEY}" in out and "E2E Test Ltd" in out
        assert licence not in out and licence.split(".")[2] not in out
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
