"""A recipe's measured figures name the host they were measured on, or the recipe does not load."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from carbonforge_runtime.errors import RecipeError
from carbonforge_runtime.recipes.loader import shipped_recipes_dir
from carbonforge_runtime.recipes.model import recipe_from_mapping

SHIPPED = shipped_recipes_dir() / "qwen3-32b--fp8--chat--a100-80x1.yaml"
HOST = {"gpu": "NVIDIA A100-SXM4-80GB", "gpu_count": 1, "driver": "550.54.15", "vllm": "0.32.0"}


def with_benchmark(**fields: Any) -> dict[str, Any]:
    data = yaml.safe_load(SHIPPED.read_text(encoding="utf-8"))
    data["benchmark"].update(fields)
    return dict(data)


def test_measured_figures_with_their_host_load() -> None:
    recipe = recipe_from_mapping(with_benchmark(measured_on=HOST, date="2026-12-05", figures={"e2e_mean_s": 3.1}),
                                 Path("r.yaml"))
    assert recipe.benchmark["measured_on"] == HOST


@pytest.mark.parametrize(("fields", "problem"), [
    ({"figures": {"e2e_mean_s": 3.1}}, "does not name the host"),
    ({"measured_on": {**HOST, "cpu": "x"}, "figures": {"a": 1}}, "'benchmark.measured_on.cpu' is not a known field"),
    ({"measured_on": {**HOST, "gpu": " "}, "figures": {"a": 1}}, "must name the GPU"),
    ({"measured_on": {"driver": "550"}, "figures": {"a": 1}}, "'benchmark.measured_on.gpu' is missing"),
    ({"measured_on": {**HOST, "gpu_count": "two"}, "figures": {"a": 1}}, "must be int"),
    ({"measured_on": 7}, "must be str/dict"),
])
def test_figures_that_do_not_say_where_they_were_measured_are_refused(fields: dict[str, Any], problem: str) -> None:
    with pytest.raises(RecipeError, match=problem):
        recipe_from_mapping(with_benchmark(**fields), Path("r.yaml"))
