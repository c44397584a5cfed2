"""The README is the reference for flags and variables: keep it in step with the code."""

from __future__ import annotations

from carbonforge_runtime import cli
from carbonforge_runtime.settings import VARIABLES
from tests.support import REPO

README = (REPO / "README.md").read_text(encoding="utf-8")


def test_every_variable_is_documented() -> None:
    missing = [var.name for var in VARIABLES if f"`{var.name}`" not in README]
    assert not missing, f"variables missing from the README: {missing}"


def test_every_runtime_flag_is_documented() -> None:
    missing = [flag for flag in cli.RUNTIME_FLAGS if f"`{flag}" not in README]
    assert not missing, f"runtime flags missing from the README: {missing}"


def test_every_subcommand_is_mentioned() -> None:
    names = [c.name or c.callback.__name__ for c in cli.app.registered_commands]
    names += [g.name for g in cli.app.registered_groups]
    missing = [name for name in names if f"`{name}" not in README]
    assert not missing, f"subcommands missing from the README: {missing}"


def test_readme_commands_exist() -> None:
    for script in ("scripts/serve-default.sh", "scripts/test.sh"):
        assert f"bash {script}" in README
        assert (REPO / script).is_file()
    assert "bash scripts/test.sh" in (REPO / ".ci" / "run").read_text()
