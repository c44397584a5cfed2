"""Loading recipe files and resolving a context key to one recipe."""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import yaml

from carbonforge_runtime import files
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


#: A recipe is a page of YAML; anything far larger is not one.
MAX_RECIPE_BYTES = 256 * 1024


class _BoundedLoader(yaml.SafeLoader):
    """The safe loader, refusing aliases (a recipe needs none; an alias bomb would exhaust memory)."""

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise yaml.constructor.ConstructorError(
                None, None, "YAML aliases (*name) are not allowed in a recipe", event.start_mark)
        return super().compose_node(parent, index)


def load_recipe_file(path: Path) -> Recipe:
    try:
        raw = files.read_regular(path, MAX_RECIPE_BYTES)
        if len(raw) > MAX_RECIPE_BYTES:
            raise RecipeError(f"{path}: over {MAX_RECIPE_BYTES} bytes is too large for a recipe",
                              "a recipe is one small YAML document: check that the right file is named")
        text = raw.decode("utf-8")
    except files.NotRegularFile as exc:
        raise RecipeError(f"{path}: is {exc.strerror}", "recipes are YAML files (*.yaml)") from None
    except OSError as exc:
        raise RecipeError(f"{path}: cannot be read ({exc.strerror})", "check the file's permissions") from None
    except UnicodeDecodeError:
        raise RecipeError(f"{path}: is not UTF-8 text", "save the recipe as UTF-8 YAML") from None
    try:
        data = yaml.load(text, Loader=_BoundedLoader)
    except yaml.YAMLError as exc:
        raise RecipeError(f"{path}: not valid YAML ({exc})", "fix the YAML syntax (recipes use no anchors or "
                          "aliases)") from None
    except ValueError as exc:  # a scalar YAML cannot convert, e.g. an integer of thousands of digits
        raise RecipeError(f"{path}: not valid YAML ({str(exc)[:120]})", "fix the value") from None
    except RecursionError:
        raise RecipeError(f"{path}: nested too deeply to be a recipe", "a recipe is a shallow YAML mapping: "
                          "check that the right file is named") from None
    return recipe_from_mapping(data, path)


def load_recipes(directories: Iterable[Path]) -> dict[str, Recipe]:
    """Load every ``*.yaml`` in the directories, in order; a later directory wins on the same key
    (a local recipe replacing a shipped one records it in ``replaces``, so the launch can say how
    it departs from it)."""
    recipes: dict[str, Recipe] = {}
    shipped_dir = shipped_recipes_dir().resolve()
    for directory in directories:
        if not directory.is_dir():
            raise RecipeError(f"recipes directory {directory} does not exist", "point CF_RECIPES_DIR at a directory")
        seen: dict[str, Path] = {}
        shipped = directory.resolve() == shipped_dir
        for path in sorted(directory.glob("*.y*ml")):
            recipe = load_recipe_file(path)
            if shipped:
                _refuse_benchmark_only_family(recipe, path)
                _require_api_section(recipe, path)
            key = recipe.key_text
            if key in seen:
                raise RecipeError(
                    f"{path}: key {key} is also defined in {seen[key]}", "keep one recipe file per context key"
                )
            seen[key] = path
            earlier = recipes.get(key)
            if earlier is not None and not shipped:
                original = earlier.replaces or (earlier if earlier.source.parent.resolve() == shipped_dir else None)
                recipe = replace(recipe, replaces=original)
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


def _require_api_section(recipe: Recipe, path: Path) -> None:
    """A shipped recipe says how the API treats its model: parsers named, or null for none."""
    if recipe.api is None:
        raise RecipeError(
            f"{path}: field 'api' is missing",
            "add an api section with reasoning_parser and tool_call_parser (a vLLM parser name, or null "
            "when the model does not reason or call tools)",
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
