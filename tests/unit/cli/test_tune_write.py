"""``tune --write DIR`` refuses, before the search and in one line with the fix, a DIR it would break
(another file there defines the key: every command would then fail with "key ... is also defined")
or a file it would overwrite without --force; nothing is written, and DIR still loads."""

from __future__ import annotations

import os
from pathlib import Path

from typer.testing import CliRunner

from carbonforge_runtime.cli import main as cli
from carbonforge_runtime.recipes import load_recipes, recipe_dirs
from carbonforge_runtime.recipes.loader import shipped_recipes_dir
from tests.support import synthetic_mooncake

KEY = "qwen3-32b:fp8:chat:a100-80x1"
FILE = "qwen3-32b--fp8--chat--a100-80x1.yaml"
runner = CliRunner()


def tune(tmp_path: Path, directory: Path, *extra: str) -> tuple[int, str, Path]:
    trace = synthetic_mooncake(tmp_path / "t.jsonl", 5, seed=7, per_second=2.0, prompt=(100, 200), output=(4, 8))
    out = tmp_path / "r.json"
    result = runner.invoke(cli.app, ["tune", str(trace), "--context-key", KEY, "--goal", "mean_e2e", "--budget", "1",
                                     "-o", str(out), "--write", str(directory), "-q", *extra])
    return result.exit_code, result.output, out


def test_a_directory_where_another_file_defines_the_key_is_refused_before_the_search(tmp_path: Path) -> None:
    live = tmp_path / "live"
    live.mkdir()
    mine = (shipped_recipes_dir() / FILE).read_text()
    (live / "my-chat.yaml").write_text(mine)
    code, output, out = tune(tmp_path, live, "--force")
    assert code == 2, output
    assert f"key {KEY} is already defined in {live / 'my-chat.yaml'}" in output and "fix:" in output
    assert "Traceback" not in output and "tune: candidate" not in output
    assert sorted(os.listdir(live)) == ["my-chat.yaml"] and (live / "my-chat.yaml").read_text() == mine
    assert not out.exists()
    load_recipes(recipe_dirs(str(live)))  # still loads, as a restarted container would


def test_an_existing_recipe_file_is_not_overwritten_without_force(tmp_path: Path) -> None:
    live = tmp_path / "live"
    live.mkdir()
    (live / FILE).write_text("# mine\n" + (shipped_recipes_dir() / FILE).read_text())
    before = (live / FILE).read_bytes()
    code, output, out = tune(tmp_path, live)
    assert code == 2, output
    assert f"{live / FILE} exists" in output and "--force" in output
    assert (live / FILE).read_bytes() == before and not out.exists()
