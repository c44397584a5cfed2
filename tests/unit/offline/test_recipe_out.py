"""``tune --write DIR`` keeps DIR servable: a key another file there defines, an existing file of the
same name (without --force), a link in its place or a directory that does not load now are refused
before anything is written; and a written recipe that would stop the directory loading is taken
back (the earlier file put back), so serve, and every command, still loads DIR."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from carbonforge_runtime.core.twin_data import SimError
from carbonforge_runtime.offline.sim.recipe_out import check_destination, place_recipe
from carbonforge_runtime.recipes import load_recipes, recipe_dirs, resolve
from carbonforge_runtime.recipes.loader import shipped_recipes_dir

KEY = "qwen3-32b:fp8:chat:a100-80x1"
FILE = "qwen3-32b--fp8--chat--a100-80x1.yaml"
OTHER_KEY = "cf-tiny:bf16:chat:cpu"


def shipped_text(file_name: str = FILE) -> str:
    return (shipped_recipes_dir() / file_name).read_text(encoding="utf-8")


def tuned_text() -> str:
    return "# tuned\n" + shipped_text().replace("description:", "description: tuned.", 1)


def loads(directory: Path) -> bool:
    load_recipes(recipe_dirs(str(directory)))
    return True


def test_a_new_recipe_is_written_and_resolves_as_serve_would_load_it(tmp_path: Path) -> None:
    directory = tmp_path / "recipes"  # missing: created
    path = place_recipe(directory, KEY, tuned_text(), force=False)
    assert path == directory / FILE and path.read_text() == tuned_text()
    recipe = resolve(KEY, load_recipes(recipe_dirs(str(directory))))
    assert recipe.source == path and recipe.replaces is not None
    assert sorted(os.listdir(directory)) == [FILE]


def test_a_key_another_file_defines_is_refused_and_the_directory_left_loading(tmp_path: Path) -> None:
    """The live directory holds my-chat.yaml for the key: a second file would break every command."""
    (tmp_path / "my-chat.yaml").write_text(shipped_text())
    with pytest.raises(SimError, match=r"already defined in .*my-chat\.yaml") as refused:
        place_recipe(tmp_path, KEY, tuned_text(), force=True)  # --force does not make a clash right
    assert "remove" in refused.value.remedy
    assert sorted(os.listdir(tmp_path)) == ["my-chat.yaml"] and loads(tmp_path)


def test_an_existing_file_is_kept_unless_forced(tmp_path: Path) -> None:
    (tmp_path / FILE).write_text(shipped_text())
    with pytest.raises(SimError, match="exists; it was left as it is") as refused:
        place_recipe(tmp_path, KEY, tuned_text(), force=False)
    assert "--force" in refused.value.remedy
    assert (tmp_path / FILE).read_text() == shipped_text()
    place_recipe(tmp_path, KEY, tuned_text(), force=True)
    assert (tmp_path / FILE).read_text() == tuned_text() and sorted(os.listdir(tmp_path)) == [FILE]


def test_a_link_in_place_of_the_file_is_refused_even_with_force(tmp_path: Path) -> None:
    victim = tmp_path / "elsewhere.txt"
    victim.write_text("keep\n")
    directory = tmp_path / "recipes"
    directory.mkdir()
    (directory / FILE).symlink_to(victim)
    with pytest.raises(SimError, match="symbolic link"):
        check_destination(directory, KEY, force=True)
    assert victim.read_text() == "keep\n" and (directory / FILE).is_symlink()


@pytest.mark.parametrize("where", ["shipped", "file"])
def test_the_shipped_directory_and_a_file_are_refused(tmp_path: Path, where: str) -> None:
    directory = shipped_recipes_dir() if where == "shipped" else tmp_path / "a-file"
    if where == "file":
        directory.write_text("")
    with pytest.raises(SimError, match=r"shipped recipes directory|is not a directory"):
        check_destination(directory, KEY, force=True)


def test_a_directory_that_does_not_load_now_is_refused(tmp_path: Path) -> None:
    (tmp_path / "broken.yaml").write_text("key: [unclosed\n")
    with pytest.raises(SimError, match=r"does not load as a recipes directory now .*broken\.yaml"):
        check_destination(tmp_path, KEY, force=False)
    assert sorted(os.listdir(tmp_path)) == ["broken.yaml"]


def test_a_written_recipe_that_breaks_the_directory_is_removed_again(tmp_path: Path) -> None:
    """The checks pass for KEY, but the text written defines a key another file there has (as a
    change made between the checks and the write would): the load afterwards fails, the file goes."""
    (tmp_path / "tiny.yaml").write_text(shipped_text("cf-tiny--bf16--chat--cpu.yaml"))
    with pytest.raises(SimError, match=r"would stop serve from loading .*also defined.*removed again"):
        place_recipe(tmp_path, KEY, shipped_text("cf-tiny--bf16--chat--cpu.yaml"), force=False)
    assert sorted(os.listdir(tmp_path)) == ["tiny.yaml"] and loads(tmp_path)


def test_a_forced_write_that_breaks_the_directory_puts_the_earlier_file_back(tmp_path: Path) -> None:
    (tmp_path / "tiny.yaml").write_text(shipped_text("cf-tiny--bf16--chat--cpu.yaml"))
    (tmp_path / FILE).write_text(shipped_text())
    with pytest.raises(SimError, match="put back as it was"):
        place_recipe(tmp_path, KEY, shipped_text("cf-tiny--bf16--chat--cpu.yaml"), force=True)
    assert (tmp_path / FILE).read_text() == shipped_text()
    assert sorted(os.listdir(tmp_path)) == sorted(["tiny.yaml", FILE]) and loads(tmp_path)
    assert resolve(OTHER_KEY, load_recipes(recipe_dirs(str(tmp_path)))).source == tmp_path / "tiny.yaml"
