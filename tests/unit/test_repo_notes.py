"""What the README and the scripts promise about a checkout: tracing off by default, what the test
command installs and how long it takes, and the default log directory kept out of git."""

from __future__ import annotations

import math
import re
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
    assert "vLLM CPU build" in echoed and "promtool" in echoed
    assert re.search(r"takes about \d+ minutes", echoed), echoed  # the measured time, stated in the header


def test_the_setup_script_shows_each_package_and_says_how_long_a_first_install_takes() -> None:
    """Both README commands start with scripts/setup.sh: a first install runs for minutes, so pip is
    not quieted, each package is named as it is collected, and the expected time is said first."""
    text = (REPO / "scripts" / "setup.sh").read_text()
    install = next(line for line in text.splitlines() if "pip install" in line and "-e " in line)
    assert " -q" not in install, install
    assert "s/^Collecting /setup: collecting /" in text
    echoed = "\n".join(line for line in text.splitlines() if line.startswith("echo"))
    assert re.search(r"takes \d+-\d+ minutes", echoed), echoed


@pytest.mark.skipif(shutil.which("git") is None or not (REPO / ".git").exists(), reason="needs a git checkout")
def test_the_default_serve_log_directory_is_ignored_by_git() -> None:
    assert 'CF_LOG_DIR:-$PWD/logs' in (REPO / "scripts" / "serve-default.sh").read_text()
    for path in ("logs/vllm.log", "logs/runtime.log"):
        done = subprocess.run(["git", "check-ignore", "-q", path], cwd=REPO, timeout=30)
        assert done.returncode == 0, f"{path} is not ignored by git"


def _shipped_drain_s(key: str) -> float:
    from carbonforge_runtime.recipes import load_recipes, recipe_dirs, resolve

    return resolve(key, load_recipes(recipe_dirs(None))).drain_timeout_s


def test_every_documented_docker_run_gives_the_recipe_time_to_drain() -> None:
    """A stop timeout shorter than the drain (Docker's default is 10 s) SIGKILLs every drain."""
    import re

    from carbonforge_runtime.runtime.process.drain import stop_timeout_s

    found = 0
    for path in (REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))):
        text = path.read_text().replace("\\\n", " ")
        for command in re.findall(r"docker run [^\n]*--stop-timeout[^\n]*", text):
            timeout = int(re.search(r"--stop-timeout (\d+)", command).group(1))  # type: ignore[union-attr]
            key = re.search(r"CF_CONTEXT_KEY=\"?([\w.:-]+)", command)
            drain = _shipped_drain_s(key.group(1)) if key else 30.0
            assert timeout >= stop_timeout_s(drain), f"{path.name}: {command[:100]}... drains {drain:g} s"
            found += 1
    assert found >= 2


def test_the_compose_example_gives_its_recipe_time_to_drain() -> None:
    import yaml

    from carbonforge_runtime.runtime.process.drain import stop_timeout_s

    service = yaml.safe_load((REPO / "docker" / "compose.yaml").read_text())["services"]["carbonforge"]
    key = service["command"][service["command"].index("--context-key") + 1]
    grace = str(service["stop_grace_period"])
    seconds = int(grace[:-1]) * (60 if grace.endswith("m") else 1)
    assert seconds >= stop_timeout_s(_shipped_drain_s(key))


def test_the_fetch_line_gives_the_recipe_time_to_drain() -> None:
    from pathlib import Path

    from carbonforge_runtime.recipes import load_recipes, recipe_dirs
    from carbonforge_runtime.runtime.fetch import FetchTarget, docker_run_line

    recipes = [r for r in load_recipes(recipe_dirs(None)).values() if not r.model.builtin]
    assert {r.drain_timeout_s for r in recipes} >= {30.0, 120.0}
    for recipe in recipes:
        line = docker_run_line(FetchTarget(recipe.model.repo, recipe.model.revision, recipe), Path("/srv/w"), "--to")
        assert f"--stop-timeout {math.ceil((recipe.drain_timeout_s + 20) / 10) * 10} " in line, line


def test_the_operations_page_gives_the_stop_figures_of_the_code() -> None:
    from carbonforge_runtime.runtime.process.drain import KILL_WAIT_S, RUNTIME_EXIT_MARGIN_S, SHUTDOWN_GRACE_S

    text = " ".join((REPO / "docs" / "operations.md").read_text().split())
    assert f"stopped within N+{SHUTDOWN_GRACE_S:g} s at the latest" in text
    assert f"for the drain time plus {SHUTDOWN_GRACE_S - KILL_WAIT_S:g} s" in text  # then SIGKILL
    assert f"The last {KILL_WAIT_S:g} s are for the killed processes to leave" in text
    assert f"the drain time plus {SHUTDOWN_GRACE_S:g} s after the signal" in text
    assert f"drain time plus {SHUTDOWN_GRACE_S + RUNTIME_EXIT_MARGIN_S:g} s to stop" in text
