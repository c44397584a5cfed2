"""Loading recipe files and resolving a context key to one recipe."""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping
from pathlib import Path

import yaml

from carbonforge_runtime.errors import ContextKeyError, RecipeError
from carbonforge_runtime.recipes.keys import parse_context_key
from carbonforge_runtime.recipes.model import Recipe, recipe_from_mapping


def shipped_recipes_dir() -> Path:
    """The recipes that ship with the package (the wheel copy, else the source checkout's)."""
    here = Path(__file__).resolve().parent.parent
    packaged = here / "_shipped_recipes"
    if packaged.is_dir():
        return packaged
    return here.parent / "recipes"


def load_recipe_file(path: Path) -> Recipe:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise RecipeError(f"{path}: cannot be read ({exc.strerror})", "check the file's permissions") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise RecipeError(f"{path}: not valid YAML ({exc})", "fix the YAML syntax") from None
    return recipe_from_mapping(data, path)


def load_recipes(directories: Iterable[Path]) -> dict[str, Recipe]:
    """Load every ``*.yaml`` in the directories, in order; a later directory wins on the same key."""
    recipes: dict[str, Recipe] = {}
    for directory in directories:
        if not directory.is_dir():
            raise RecipeError(f"recipes directory {directory} does not exist", "point CF_RECIPES_DIR at a directory")
        seen: dict[str, Path] = {}
        shipped = directory.resolve() == shipped_recipes_dir().resolve()
        for path in sorted(directory.glob("*.y*ml")):
            recipe = load_recipe_file(path)
            if shipped:
                _refuse_benchmark_only_family(recipe, path)
            key = recipe.key_text
            if key in seen:
                raise RecipeError(
                    f"{path}: key {key} is also defined in {seen[key]}", "keep one recipe file per context key"
                )
            seen[key] = path
            recipes[key] = recipe
    return recipes


def _refuse_benchmark_only_family(recipe: Recipe, path: Path) -> None:
    """A shipped recipe must not name a benchmark-only scheduler family (``oracle``)."""
    from carbonforge_runtime.core.ordering.families import BENCHMARK_ONLY

    if recipe.scheduler.family in BENCHMARK_ONLY:
        raise RecipeError(
            f"{path}: field 'scheduler.family' is {recipe.scheduler.family!r}, a benchmark-only family "
            "that needs each request's true output length",
            "pick a shipped family (fcfs, ltr-promptlen, affinity, ltr or hybrid); "
            "see the README's request ordering section",
        )


def recipe_dirs(extra_dir: str | None) -> list[Path]:
    dirs = [shipped_recipes_dir()]
    if extra_dir:
        dirs.append(Path(extra_dir))
    return dirs


def resolve(key_text: str, recipes: Mapping[str, Recipe]) -> Recipe:
    key = parse_context_key(key_text)
    normalised = str(key)
    if normalised in recipes:
        return recipes[normalised]
    close = difflib.get_close_matches(normalised, list(recipes), n=3, cutoff=0.5)
    hint = f"closest known: {', '.join(close)}" if close else "no similar key is known"
    raise ContextKeyError(
        f"no recipe for context key {normalised!r} ({hint})",
        "pick a key from `carbonforge-runtime recipes list`",
    )
