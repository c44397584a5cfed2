"""The shipped recipes' ``benchmark.predicted`` blocks (written by benchmarks/recipes_twin.py): each
GPU recipe carries one, labelled as a prediction, for the scheduler it serves, with the step-time
model the twin uses for its hardware; CPU recipes carry none."""

from __future__ import annotations

import pytest

from carbonforge_runtime.core.step_models import resolve_model
from carbonforge_runtime.recipes.loader import load_recipes, shipped_recipes_dir

SHIPPED = load_recipes([shipped_recipes_dir()])
GPU = sorted(k for k, r in SHIPPED.items() if not r.key.hardware.is_cpu)
CPU = sorted(k for k, r in SHIPPED.items() if r.key.hardware.is_cpu)
FIGURES = ("e2e_mean_s", "e2e_p99_s", "ttft_mean_s", "ttft_p99_s", "throughput_rps")


def test_there_are_gpu_and_cpu_recipes() -> None:
    assert GPU and CPU


@pytest.mark.parametrize("key", GPU)
def test_a_gpu_recipe_carries_a_prediction_for_the_scheduler_it_serves(key: str) -> None:
    recipe = SHIPPED[key]
    block = recipe.benchmark.get("predicted")
    assert block, f"{key}: no benchmark.predicted block; run benchmarks/recipes_twin.py --write"
    assert block["measured"] is False
    chosen = block["chosen"]
    assert chosen["family"] == recipe.scheduler.family
    assert chosen["params"] == dict(recipe.scheduler.params)
    model = resolve_model(None, recipe.key.hardware.family, int(recipe.vllm.get("tensor_parallel_size", 1) or 1))
    assert (block["cost_model"]["name"], block["cost_model"]["version"]) == (model.name, model.version)
    assert block["cost_model"]["proxy"] is model.proxy
    assert block["window"]["whole_trace"] is True
    assert block["trace"]["served"] > 1000
    for figures in (chosen, block["baseline"]):
        assert all(figures[name] > 0 for name in FIGURES)
    assert block["baseline"]["candidate"] == "fcfs"


@pytest.mark.parametrize("key", CPU)
def test_a_cpu_recipe_carries_no_prediction(key: str) -> None:
    # No step-time model ships for a CPU: a figure here could only be invented.
    assert "predicted" not in SHIPPED[key].benchmark
