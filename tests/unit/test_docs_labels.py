"""docs/recipes.md and docs/sim.md say, for each shipped recipe, which label its figures carry, in
the words ``recipes show`` prints (issue 31, acceptance 5)."""

from __future__ import annotations

import pytest

from carbonforge_runtime.core.figure_labels import KINDS, benchmark_labels
from carbonforge_runtime.recipes.loader import load_recipes, shipped_recipes_dir
from tests.unit.test_docs import DOCS, _block, gen


@pytest.mark.parametrize(("page", "name"), [("recipes.md", "recipe-labels"), ("sim.md", "recipe-labels-sim")])
def test_every_shipped_recipe_has_its_label_in_the_docs(page: str, name: str) -> None:
    table = _block(page, name)
    assert table.strip() == gen.TABLES[name].render().strip(), "run: python scripts/gen_docs.py"
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    recipes = load_recipes([shipped_recipes_dir()])
    assert {row.split("|")[1].strip().strip("`") for row in rows} == set(recipes)
    for key, recipe in recipes.items():
        mine = [row for row in rows if row.startswith(f"| `{key}` |")]
        labels = benchmark_labels(recipe.benchmark)
        if not labels:
            assert len(mine) == 1 and "neither measured nor predicted" in mine[0]
            continue
        assert len(mine) == len(labels)
        for row, (part, label) in zip(mine, labels, strict=True):
            cells = [cell.strip() for cell in row.split("|")[1:-1]]
            assert cells[1] == f"{label.kind} (`benchmark.{part}`)" and cells[2] == label.text()
            assert label.kind in KINDS


def test_a_predicted_recipe_row_names_the_step_model_and_the_proxy() -> None:
    table = _block("recipes.md", "recipe-labels")
    row = next(line for line in table.splitlines() if line.startswith("| `qwen3-32b:fp8:chat:a100-80x1` |"))
    assert "predicted by the twin with step-time model a100-80-tp1 v1, a proxy" in row


def test_the_label_table_is_in_both_pages() -> None:
    for page in ("recipes.md", "sim.md"):
        assert "BEGIN GENERATED: recipe-labels" in (DOCS / page).read_text(encoding="utf-8")
