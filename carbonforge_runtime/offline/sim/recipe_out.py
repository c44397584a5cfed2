"""Where ``tune --write DIR`` puts the tuned recipe, and the checks that keep ``DIR`` servable.

``DIR`` may be the directory a running deployment serves from (``CF_RECIPES_DIR``), so a recipe is
written there only if the directory still loads the way ``serve`` loads it afterwards: the shipped
recipes first, then ``DIR``, where a key may be defined by one file only. Before the search (so a
refusal costs nothing) and again just before writing, :func:`check_destination` refuses a directory
that does not load now, a key another file there already defines, an existing file of the same
name (unless ``force``) and a symbolic link in its place. :func:`place_recipe` then writes the file
atomically and loads the directory again; if it no longer loads, what was written is taken back
(the earlier file put back, with ``force``) and the command fails naming the cause.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from carbonforge_runtime.core.twin_data import SimError
from carbonforge_runtime.errors import CarbonForgeError
from carbonforge_runtime.files import write_atomic, write_text_atomic
from carbonforge_runtime.offline.sim.tune import recipe_file_name
from carbonforge_runtime.recipes.loader import load_recipes, recipe_dirs, resolve, shipped_recipes_dir


def check_destination(directory: Path, key_text: str, force: bool) -> Path:
    """The file ``key_text``'s tuned recipe would be written to in ``directory``; raises
    :class:`SimError` with the fix when writing it there would break the directory or replace a
    file without ``force``. A missing directory is fine (it is created)."""
    target = directory / recipe_file_name(key_text)
    if not directory.exists():
        return target
    if not directory.is_dir():
        raise SimError(f"--write {directory} is not a directory", "pass --write DIR (created if missing)")
    if directory.resolve() == shipped_recipes_dir().resolve():
        raise SimError(f"--write {directory} is the shipped recipes directory",
                       "write the tuned recipe to a directory of your own and serve it with CF_RECIPES_DIR")
    if target.is_symlink():
        raise SimError(f"{target} is a symbolic link; it was left as it is",
                       "remove the link, or pass --write another directory")
    try:
        recipes = load_recipes(recipe_dirs(str(directory)))
    except CarbonForgeError as exc:
        raise SimError(f"--write {directory} does not load as a recipes directory now ({exc.message})",
                       "fix or remove that file first, or pass --write a directory of your own") from None
    defined = recipes.get(key_text)
    if (defined is not None and defined.source.parent.resolve() == directory.resolve()
            and defined.source.name != target.name):
        raise SimError(f"key {key_text} is already defined in {defined.source}: a second recipe for it in "
                       f"{directory} would stop serve (and every command) from loading the directory",
                       f"pass --write another directory, or remove {defined.source} first")
    if target.exists() and not force:
        raise SimError(f"{target} exists; it was left as it is",
                       "pass --force to replace it, or --write another directory")
    return target


def place_recipe(directory: Path, key_text: str, text: str, force: bool) -> Path:
    """Write ``text`` (a checked recipe for ``key_text``) into ``directory`` and prove that the
    directory still loads, as serve would load it, with ``key_text`` resolving to the new file.
    Returns the file; raises :class:`SimError` with nothing left changed otherwise."""
    target = check_destination(directory, key_text, force)
    previous = target.read_bytes() if target.is_file() else None
    write_text_atomic(target, text)
    try:
        recipe = resolve(key_text, load_recipes(recipe_dirs(str(directory))))
        if recipe.source.resolve() != target.resolve():
            raise SimError(f"{key_text} resolves to {recipe.source}, not to the tuned recipe",
                           f"remove {recipe.source}")
    except CarbonForgeError as exc:
        _take_back(target, previous)
        what = "put back as it was" if previous is not None else "removed again"
        raise SimError(f"the tuned recipe {target} would stop serve from loading {directory} ({exc.message}); "
                       f"it was {what}", "pass --write another directory, or fix the directory first") from None
    return target


def _take_back(target: Path, previous: bytes | None) -> None:
    if previous is None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(target)
    else:
        write_atomic(target, lambda handle: handle.write(previous), binary=True)
