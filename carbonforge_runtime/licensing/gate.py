"""The premium gate, called by every serving mode before anything starts."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from carbonforge_runtime.errors import LicenseError
from carbonforge_runtime.recipes.model import Recipe
from carbonforge_runtime.settings import Settings


def gate_recipe(recipe: Recipe, settings: Settings, now: float) -> None:
    if not recipe.is_premium:
        return
    raise LicenseError(
        f"{recipe.key_text} is a premium recipe: no license key provided",
        "pass CARBONFORGE_LICENSE_KEY or mount the licence at /etc/carbonforge/license.key",
    )


def gate_override(model: str, args: Sequence[str], recipes: Mapping[str, Recipe], settings: Settings,
                  now: float) -> None:
    wanted = model.strip().lower()
    for recipe in recipes.values():
        if recipe.is_premium and recipe.model.repo.lower() == wanted:
            gate_recipe(recipe, settings, now)
