"""What the README and the scripts promise about a checkout: tracing off by default, what the test
command installs and how long it takes, and the default log directory kept out of git."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from tests.support import REPO


def test_the_readme_says_tracing_is_off_by_default_and_how_to_turn_it_on() -> None:
    text = " ".join((REPO / "README.md").read_text().split())
    assert "Request tracing is off by default" in text
    assert "--request-trace standard --trace-file" in text


def test_the_test_script_says_what_it_installs_and_how_long_it_takes() -> None:
    text = (REPO / "scripts" / "test.sh").read_text()
    echoed = "\n".join(line for line in text.splitlines() if line.startswith("echo"))
    assert "vLLM CPU build" in echoed and "promtool" in echoed and "15 minutes" in echoed


@pytest.mark.skipif(shutil.which("git") is None or not (REPO / ".git").exists(), reason="needs a git checkout")
def test_the_default_serve_log_directory_is_ignored_by_git() -> None:
    assert 'CF_LOG_DIR:-$PWD/logs' in (REPO / "scripts" / "serve-default.sh").read_text()
    for path in ("logs/vllm.log", "logs/runtime.log"):
        done = subprocess.run(["git", "check-ignore", "-q", path], cwd=REPO, timeout=30)
        assert done.returncode == 0, f"{path} is not ignored by git"
