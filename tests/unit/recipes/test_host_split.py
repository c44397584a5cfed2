"""Multi-host recipes: the key's hardware segment names the hosts, the ``hosts`` section says how the
parallel sizes span them, and the loader says what does not add up."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from carbonforge_runtime.errors import RecipeError
from carbonforge_runtime.recipes import load_recipes, parse_context_key, shipped_recipes_dir
from carbonforge_runtime.recipes.keys import HardwareSpec, parse_hardware
from carbonforge_runtime.recipes.loader import load_recipe_file
from carbonforge_runtime.recipes.model import HostSplit, split_problems

SHIPPED = shipped_recipes_dir() / "qwen3.6-27b--fp8--agentic--2xh100x8.yaml"


def test_the_hardware_segment_names_the_hosts() -> None:
    assert parse_hardware("2xh100x8") == HardwareSpec("h100", None, 8, 2)
    assert parse_hardware("3xa100-80x4") == HardwareSpec("a100", 80, 4, 3)
    assert parse_hardware("2xrtx4090x1") == HardwareSpec("rtx4090", None, 1, 2)
    assert str(parse_hardware("2xh100x8")) == "2xh100x8" and str(parse_hardware("1xh100x8")) == "h100x8"
    assert parse_hardware("h100x8").hosts == 1 and not parse_hardware("h100x8").multi_host
    assert str(parse_context_key("Qwen3.6-27B:FP8:agentic:2xH100x8")) == "qwen3.6-27b:fp8:agentic:2xh100x8"


def test_the_shipped_multi_host_recipe_loads_with_its_split() -> None:
    recipes = load_recipes([shipped_recipes_dir()])
    recipe = recipes["qwen3.6-27b:fp8:agentic:2xh100x8"]
    assert recipe.hosts == HostSplit(2, 8, "data") and recipe.is_premium
    assert recipe.hosts.describe(recipe.vllm) == (
        "2 hosts x 8 GPUs; data parallel across hosts (tensor 2 x pipeline 1 x data 8 = 16 GPUs)")
    # every other shipped recipe serves on one host
    assert all(r.hosts is None for key, r in recipes.items() if key != recipe.key_text)


def _variant(tmp_path: Path, change: Any) -> Path:
    data = yaml.safe_load(SHIPPED.read_text())
    change(data)
    path = tmp_path / "variant.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.parametrize(("change", "field", "problem"), [
    (lambda d: d.pop("hosts"), "hosts", "is missing: the key's hardware segment 2xh100x8 names 2 hosts"),
    (lambda d: d["hosts"].update(nodes=3), "hosts.nodes", "is 3, but the key's hardware segment 2xh100x8 names 2"),
    (lambda d: d["hosts"].update(gpus_per_node=4), "hosts.gpus_per_node", "names 8 GPUs per host"),
    (lambda d: d["hosts"].update(across="expert"), "hosts.across", "must be one of tensor, pipeline, data"),
    (lambda d: d["vllm"].update(data_parallel_size=4), "hosts.across",
     "tensor 2 x pipeline 1 x data 4 = 8 GPUs, but 2 hosts x 8 GPUs = 16"),
    (lambda d: d["vllm"].update(tensor_parallel_size=16, data_parallel_size=1), "hosts.across",
     "data parallel across 2 hosts needs data_parallel_size a multiple of 2"),
    (lambda d: d["hosts"].update(across="tensor"), "hosts.across",
     "tensor parallel across 2 hosts needs data_parallel_size 1, pipeline_parallel_size 1 and tensor_parallel_size 16"),
    (lambda d: d["hosts"].update(across="pipeline"), "hosts.across", "pipeline parallel across 2 hosts needs"),
    (lambda d: d["hosts"].update(extra=1), "hosts.extra", "is not a known field"),
    (lambda d: d.update(key="qwen3.6-27b:fp8:agentic:h100x8"), "hosts.nodes", "names one host"),
])
def test_a_split_that_does_not_add_up_is_refused_with_the_field(tmp_path: Path, change: Any, field: str,
                                                                problem: str) -> None:
    with pytest.raises(RecipeError) as refused:
        load_recipe_file(_variant(tmp_path, change))
    assert f"field '{field}'" in refused.value.message and problem in refused.value.message, refused.value.message


@pytest.mark.parametrize(("split", "sizes"), [
    (HostSplit(2, 8, "tensor"), (16, 1, 1)),
    (HostSplit(2, 8, "pipeline"), (8, 2, 1)),
    (HostSplit(4, 8, "pipeline"), (4, 8, 1)),
    (HostSplit(2, 8, "data"), (8, 1, 2)),
    (HostSplit(2, 8, "data"), (2, 2, 4)),
])
def test_splits_that_give_every_host_its_gpus_pass(split: HostSplit, sizes: tuple[int, int, int]) -> None:
    assert split_problems(split, *sizes) == []


def test_a_valid_tensor_split_loads(tmp_path: Path) -> None:
    def tensor(data: dict[str, Any]) -> None:
        data["hosts"]["across"] = "tensor"
        data["vllm"].update(tensor_parallel_size=16, data_parallel_size=1)

    assert load_recipe_file(_variant(tmp_path, tensor)).hosts == HostSplit(2, 8, "tensor")
