"""Step-time models shipped as data: one per GPU and tensor-parallel size of the shipped recipes,
each with its provenance; refusals of malformed model files."""

from __future__ import annotations

from pathlib import Path

import pytest

from carbonforge_runtime.core.step_models import load_model_file, resolve_model, shipped_models
from carbonforge_runtime.core.twin_data import SimError, admission_delay_s, step_time_s
from carbonforge_runtime.recipes import load_recipes, recipe_dirs

GOOD = """name: mine
version: 2
gpu: h100
tensor_parallel_size: 1
coefficients_ms: {floor: 20, per_batched_token: 0.1, per_kv_token_read: 0.0001, attention: 0.000001, overhead: 1}
kv_capacity_tokens: 40000
provenance: fitted on our own steps
"""


def test_every_shipped_gpu_recipe_has_a_model_and_every_model_says_where_it_comes_from() -> None:
    models = shipped_models()
    used = set()
    for recipe in load_recipes(recipe_dirs(None)).values():
        hardware = recipe.key.hardware
        if hardware.is_cpu:
            continue
        tp = int(recipe.vllm.get("tensor_parallel_size", 1))
        model = resolve_model(None, hardware.family, tp)
        assert (model.gpu, model.tensor_parallel_size) == (hardware.family, tp)
        used.add(model.name)
    assert used == set(models)  # no model without a recipe that uses it
    for model in models.values():
        assert model.provenance and model.version >= 1 and model.kv_capacity_tokens > 0
        assert model.proxy and model.scaling_rule  # none was profiled on the model it serves
        assert 0 < step_time_s(model, 1, 0, 0) < step_time_s(model, 8192, 100_000, 1e7)


def test_a_model_file_of_ones_own_is_read_and_named_models_are_found(tmp_path: Path) -> None:
    path = tmp_path / "mine.yaml"
    path.write_text(GOOD)
    model = resolve_model(str(path), None, 1)
    assert (model.name, model.version, model.floor_ms, model.proxy) == ("mine", 2, 20.0, False)
    assert resolve_model("h100-tp2", "a100", 1).name == "h100-tp2"
    with pytest.raises(SimError, match="no shipped step-time model for cpu"):
        resolve_model(None, "cpu", 1)


def test_the_admission_delay_is_an_optional_section_and_zero_without_it(tmp_path: Path) -> None:
    path = tmp_path / "mine.yaml"
    path.write_text(GOOD)
    old = load_model_file(path)  # a file written before the section existed
    assert (old.admission_base_ms, old.admission_per_prompt_token_ms, old.has_admission_delay) == (0.0, 0.0, False)
    assert "admission_delay_ms" not in old.to_json()
    assert all(not m.has_admission_delay for m in shipped_models().values())
    path.write_text(GOOD + "admission_delay_ms: {base: 2.5, per_prompt_token: 0.0004}\n")
    model = load_model_file(path)
    assert (model.admission_base_ms, model.admission_per_prompt_token_ms) == (2.5, 0.0004)
    assert model.to_json()["admission_delay_ms"] == {"base": 2.5, "per_prompt_token": 0.0004}
    assert admission_delay_s(model, 1000) == pytest.approx(0.0029)
    without = model.without_admission_delay()
    assert not without.has_admission_delay and without.to_json() == old.to_json()


@pytest.mark.parametrize(("text", "message"), [
    ("- a list\n", "not a YAML mapping"),
    (GOOD + "extra: 1\n", "unknown field"),
    (GOOD.replace("version: 2\n", ""), "missing field"),
    (GOOD.replace("floor: 20", "floor: -1"), "coefficients_ms.floor"),
    (GOOD.replace("overhead: 1}", "overhead: 1, more: 2}"), "exactly"),
    (GOOD.replace("kv_capacity_tokens: 40000", "kv_capacity_tokens: 8"), "kv_capacity_tokens"),
    (GOOD + "proxy: true\n", "scaling_rule"),
    ("a: &x 1\nb: *x\n", "aliases"),
    ("name: [unclosed\n", "not valid YAML"),
    ("x" * 70_000, "too large"),
    (GOOD + "admission_delay_ms: {base: 2}\n", "admission_delay_ms must have exactly base, per_prompt_token"),
    (GOOD + "admission_delay_ms: 3\n", "admission_delay_ms must have exactly"),
    (GOOD + "admission_delay_ms: {base: -1, per_prompt_token: 0}\n", "admission_delay_ms.base"),
    (GOOD + "admission_delay_ms: {base: 1, per_prompt_token: .nan}\n", "admission_delay_ms.per_prompt_token"),
])
def test_malformed_model_files_are_refused(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "m.yaml"
    path.write_text(text)
    with pytest.raises(SimError, match=message):
        load_model_file(path)
