"""``recipes show`` says where a recipe's benchmark figures come from (issue 31, acceptance 5)."""

from __future__ import annotations

import datetime
from pathlib import Path

import yaml
from typer.testing import CliRunner

from carbonforge_runtime.cli import main as cli
from carbonforge_runtime.recipes.loader import shipped_recipes_dir

runner = CliRunner()
KEY = "qwen3-32b:fp8:chat:a100-80x1"


def labels(output: str) -> list[str]:
    """The lines under ``# where the benchmark figures come from``."""
    tail = output.split("# where the benchmark figures come from\n", 1)[1]
    return [line[2:] for line in tail.split("\n\n", 1)[0].splitlines()]


def test_a_predicted_recipe_names_its_step_model_and_that_it_is_a_proxy() -> None:
    result = runner.invoke(cli.app, ["recipes", "show", KEY])
    assert result.exit_code == 0, result.output
    assert labels(result.output) == [
        "benchmark.predicted: predicted by the twin with step-time model a100-80-tp1 v1, a proxy"]


def test_a_recipe_without_figures_says_so() -> None:
    result = runner.invoke(cli.app, ["recipes", "show", "cf-tiny:bf16:chat:cpu"])
    assert result.exit_code == 0, result.output
    assert labels(result.output) == ["benchmark figures: none (neither measured nor predicted)"]


def test_a_measured_recipe_names_the_host_and_date(tmp_path: Path) -> None:
    shipped = shipped_recipes_dir() / "qwen3-32b--fp8--chat--a100-80x1.yaml"
    data = yaml.safe_load(shipped.read_text(encoding="utf-8"))
    data["benchmark"].update({
        "measured_on": {"gpu": "NVIDIA A100-SXM4-80GB", "gpu_count": 1, "driver": "550.54.15", "vllm": "0.32.0"},
        "date": datetime.date(2026, 12, 5),
        "figures": {"e2e_mean_s": 3.2, "ttft_mean_s": 0.4, "throughput_rps": 1.6},
    })
    (tmp_path / shipped.name).write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    result = runner.invoke(cli.app, ["recipes", "show", KEY], env={"CF_RECIPES_DIR": str(tmp_path)})
    assert result.exit_code == 0, result.output
    assert labels(result.output) == [
        "benchmark.figures: measured on 1 x NVIDIA A100-SXM4-80GB, driver 550.54.15, vLLM 0.32.0, 2026-12-05",
        "benchmark.predicted: predicted by the twin with step-time model a100-80-tp1 v1, a proxy",
    ]
