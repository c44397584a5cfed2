"""Context keys, the recipe model, and recipe loading."""

from carbonforge_runtime.recipes.keys import ContextKey, HardwareSpec, parse_context_key, parse_hardware
from carbonforge_runtime.recipes.loader import load_recipes, recipe_dirs, resolve, shipped_recipes_dir
from carbonforge_runtime.recipes.model import Recipe

__all__ = [
    "ContextKey",
    "HardwareSpec",
    "Recipe",
    "load_recipes",
    "parse_context_key",
    "parse_hardware",
    "recipe_dirs",
    "resolve",
    "shipped_recipes_dir",
]
