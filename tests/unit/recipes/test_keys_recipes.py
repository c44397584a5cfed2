from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from carbonforge_runtime.errors import ContextKeyError, RecipeError
from carbonforge_runtime.recipes import load_recipes, parse_context_key, resolve, shipped_recipes_dir
from carbonforge_runtime.recipes.keys import HardwareSpec, parse_hardware
from carbonforge_runtime.recipes.loader import load_recipe_file

DOC_KEYS = {
    "qwen3-32b:fp8:chat:a100-80x1": "free",
    "qwen3-coder-32b:fp8:coding:a100-80x1": "free",
    "qwen2.5-0.5b:fp8:chat:l4x1": "free",
    "qwen3-100b:fp8:chat:h100x2": "premium",
    "qwen3-coder-next:fp8:coding:h100x4": "premium",
    "qwen3.6-27b:fp8:agentic:h100x8": "premium",
}


def test_parse_full_key() -> None:
    key = parse_context_key("qwen3-32b:fp8:chat:a100-80x1")
    assert (key.model, key.quant, key.workload) == ("qwen3-32b", "fp8", "chat")
    assert key.hardware == HardwareSpec("a100", 80, 1)
    assert str(key) == "qwen3-32b:fp8:chat:a100-80x1"


@pytest.mark.parametrize(
    ("text", "expected"),
    [("l4x1", HardwareSpec("l4", None, 1)), ("h100x8", HardwareSpec("h100", None, 8)),
     ("a100-40x2", HardwareSpec("a100", 40, 2)), ("rtx4090x1", HardwareSpec("rtx4090", None, 1)),
     ("CPU", HardwareSpec("cpu", None, 1))],
)
def test_parse_hardware(text: str, expected: HardwareSpec) -> None:
    assert parse_hardware(text) == expected


def test_key_is_normalised_for_case_and_spaces() -> None:
    assert str(parse_context_key(" Qwen3-32B : FP8 : chat : A100-80x1 ")) == "qwen3-32b:fp8:chat:a100-80x1"


@pytest.mark.parametrize(
    ("text", "fragment"),
    [("qwen3-32b:fp8:chat", "has 3 segment(s), expected 4"),
     ("a:b:c:d:e", "has 5 segment(s)"),
     ("qwen3-32b:fp8:batch:a100-80x1", "unknown workload 'batch'"),
     ("qwen3-32b:fp8:chat:a100", "hardware segment 'a100'"),
     ("qwen3-32b:fp8:chat:h100x0", "declares 0 GPUs"),
     (":fp8:chat:l4x1", "model segment")],
)
def test_bad_keys_are_one_line_errors(text: str, fragment: str) -> None:
    with pytest.raises(ContextKeyError) as info:
        parse_context_key(text)
    assert fragment in info.value.message
    assert "\n" not in info.value.message
    assert info.value.exit_code == 2
    assert info.value.remedy


def test_every_shipped_recipe_loads_and_docs_keys_have_their_plans() -> None:
    recipes = load_recipes([shipped_recipes_dir()])
    for key, plan in DOC_KEYS.items():
        assert recipes[key].plan == plan
    cpu = [r for r in recipes.values() if r.key.hardware.is_cpu]
    assert any(r.model.builtin == "tiny-chat" for r in cpu)
    for recipe in recipes.values():
        assert recipe.model.served_name
        assert recipe.drain_timeout_s > 0


def test_unknown_key_lists_closest() -> None:
    recipes = load_recipes([shipped_recipes_dir()])
    with pytest.raises(ContextKeyError) as info:
        resolve("qwen3-32b:fp8:chat:a100-40x1", recipes)
    assert "qwen3-32b:fp8:chat:a100-80x1" in info.value.message


def _write(tmp_path: Path, data: dict, name: str = "r.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return path


def _valid() -> dict:
    return yaml.safe_load((shipped_recipes_dir() / "qwen3-32b--fp8--chat--a100-80x1.yaml").read_text())


@pytest.mark.parametrize(
    ("mutate", "field"),
    [(lambda d: d.pop("plan"), "'plan' is missing"),
     (lambda d: d.update(plan="gold"), "'plan' must be one of"),
     (lambda d: d["vllm"].update(gpu_memory_utilization=1.5), "'vllm.gpu_memory_utilization' must be in (0, 1]"),
     (lambda d: d["vllm"].update(max_num_seqs="many"), "'vllm.max_num_seqs' must be int"),
     (lambda d: d["vllm"].update(enable_prefix_caching=1), "'vllm.enable_prefix_caching' must be bool"),
     (lambda d: d["vllm"].update(max_model_len=True), "'vllm.max_model_len' must be int, got a boolean"),
     (lambda d: d["vllm"].update(tensor_parallel_size=2), "but the key declares 1 GPU(s)"),
     (lambda d: d["vllm"].update(swap_size=4), "'vllm.swap_size' is not a known field"),
     (lambda d: d.update(key="qwen3-32b:fp8:chat"), "'key' is not a valid context key"),
     (lambda d: d["model"].pop("repo"), "'model.repo' is missing"),
     (lambda d: d.update(hardware={"family": "h100", "count": 1}), "'hardware.family' disagrees"),
     (lambda d: d.update(drain_timeout_s=0), "'drain_timeout_s' must be a positive whole number"),
     (lambda d: d.update(drain_timeout_s=2.5), "'drain_timeout_s' must be a positive whole number of seconds, "
                                               "got 2.5"),
     (lambda d: d["api"].update(reasoning_parser="qwen-3"), "'api.reasoning_parser' names 'qwen-3', which vLLM 0.32 "
                                                            "does not register (closest: qwen3"),
     (lambda d: d["api"].update(tool_call_parser="hermez"), "valid names: apertus, cohere_command3"),
     (lambda d: d["api"].pop("tool_call_parser"), "'api.tool_call_parser' is missing"),
     (lambda d: d["api"].update(thinking_budget={"high": 5}), "'api.thinking_budget.high' is not a known field"),
     (lambda d: d["api"].update(thinking_budget={"low": 0}), "'api.thinking_budget.low' must be a positive number"),
     (lambda d: d.update(api={"reasoning_parser": None, "tool_call_parser": None, "thinking_budget": {"low": 9}}),
      "'api.thinking_budget' caps thinking, but reasoning_parser is null"),
     (lambda d: d["api"].update(stream=True), "'api.stream' is not a known field")],
)
def test_recipe_validation_names_file_and_field(tmp_path: Path, mutate, field: str) -> None:
    data = _valid()
    mutate(data)
    path = _write(tmp_path, data)
    with pytest.raises(RecipeError) as info:
        load_recipe_file(path)
    assert str(path) in info.value.message
    assert field in info.value.message


def test_invalid_yaml_and_duplicate_keys(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("key: [unclosed\n")
    with pytest.raises(RecipeError, match="not valid YAML"):
        load_recipe_file(bad)
    bad.unlink()
    _write(tmp_path, _valid(), "a.yaml")
    _write(tmp_path, _valid(), "b.yaml")
    with pytest.raises(RecipeError, match="also defined in"):
        load_recipes([tmp_path])


def test_yaml_aliases_and_oversized_files_are_refused_at_load(tmp_path: Path) -> None:
    bomb = tmp_path / "bomb.yaml"
    lines = ['a: &a ["x", "x", "x", "x", "x", "x", "x", "x", "x"]']
    lines += [f"{chr(98 + i)}: &{chr(98 + i)} [*{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}]"
              for i in range(9)]
    bomb.write_text("\n".join(lines) + "\n")
    with pytest.raises(RecipeError, match="aliases") as info:
        load_recipe_file(bomb)
    assert str(bomb) in info.value.message
    huge = tmp_path / "huge.yaml"
    huge.write_text("# " + "x" * (300 * 1024) + "\n")
    with pytest.raises(RecipeError, match="too large for a recipe"):
        load_recipe_file(huge)


def test_fcfs_refuses_parameters_it_does_not_take(tmp_path: Path) -> None:
    from carbonforge_runtime.core.ordering.registry import make_family
    from carbonforge_runtime.errors import UsageError

    assert make_family("fcfs", {}).name == "fcfs"
    with pytest.raises(UsageError, match="takes no parameters, got aging_rate") as info:
        make_family("fcfs", {"aging_rate": 3})
    assert "scheduler.params" in info.value.remedy


@pytest.mark.parametrize(("scheduler", "problem"), [
    ({"family": "fcfs", "params": {"aging_rate": 3}}, "'scheduler.params': scheduler family 'fcfs' takes no "
                                                      "parameters, got aging_rate"),
    ({"family": "trace", "params": {"x": 1}}, "'scheduler.params': scheduler family 'trace' takes no parameters"),
    ({"family": "ltr", "params": {"aging_rate": 3, "warp_factor": 9}},
     "'scheduler.params': scheduler family 'ltr' has no parameter(s) warp_factor"),
    ({"family": "hybrid", "params": {"model": 7}}, "'scheduler.params': scheduler family 'hybrid': parameter model "
                                                   "must be the path of a model file"),
    ({"family": "affinity", "params": {"max_queue": 0}}, "'scheduler.params': scheduler family 'affinity': parameter "
                                                         "max_queue must be at least 1"),
    ({"family": "ltr", "params": {"aging_rate": 10**400}}, "'scheduler.params': scheduler family 'ltr': parameter "
                                                           "aging_rate must be a finite number"),
    ({"family": "fifo", "params": {}}, "'scheduler.family': unknown scheduler family 'fifo'"),
])
def test_scheduler_parameters_are_refused_at_load_naming_file_and_field(tmp_path: Path, scheduler: dict,
                                                                        problem: str) -> None:
    from typer.testing import CliRunner

    from carbonforge_runtime.cli import main as cli

    data = _valid()
    data["scheduler"] = scheduler
    path = _write(tmp_path, data)
    with pytest.raises(RecipeError) as info:
        load_recipe_file(path)
    assert info.value.message.startswith(f"{path}: field ") and problem in info.value.message, info.value.message
    for args in (["recipes", "list"], ["recipes", "show", data["key"]]):
        shown = CliRunner().invoke(cli.app, args, env={"CF_RECIPES_DIR": str(tmp_path)})
        assert shown.exit_code == 2 and problem in shown.output and "Traceback" not in shown.output, shown.output


def test_a_ranker_model_is_checked_at_load_but_read_at_launch(tmp_path: Path) -> None:
    """The model file a recipe names may not exist where the recipe is listed: loading does not read it."""
    data = _valid()
    data["scheduler"] = {"family": "hybrid", "params": {"model": str(tmp_path / "not-yet.json"), "learn": False}}
    assert load_recipe_file(_write(tmp_path, data)).scheduler.params["learn"] is False


def test_extra_directory_wins_over_shipped(tmp_path: Path) -> None:
    data = _valid()
    data["vllm"]["max_num_seqs"] = 3
    _write(tmp_path, data)
    recipes = load_recipes([shipped_recipes_dir(), tmp_path])
    assert recipes["qwen3-32b:fp8:chat:a100-80x1"].vllm["max_num_seqs"] == 3


def test_every_shipped_recipe_says_how_the_api_treats_its_model() -> None:
    recipes = load_recipes([shipped_recipes_dir()])
    for recipe in recipes.values():
        assert recipe.api is not None, recipe.key_text
    # Qwen3 chat and Qwen3 Coder call tools in different formats.
    assert recipes["qwen3-32b:fp8:chat:a100-80x1"].api.tool_call_parser == "hermes"  # type: ignore[union-attr]
    assert recipes["qwen3-coder-32b:fp8:coding:a100-80x1"].api.tool_call_parser == "qwen3_coder"  # type: ignore[union-attr]
    assert recipes["qwen3-coder-32b:fp8:coding:a100-80x1"].api.reasoning_parser is None  # type: ignore[union-attr]


def test_a_shipped_recipe_without_an_api_section_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from carbonforge_runtime.recipes import loader

    data = _valid()
    del data["api"]
    _write(tmp_path, data)
    assert load_recipes([tmp_path])["qwen3-32b:fp8:chat:a100-80x1"].api is None  # a user's directory may omit it
    monkeypatch.setattr(loader, "shipped_recipes_dir", lambda: tmp_path)
    with pytest.raises(RecipeError, match="field 'api' is missing"):
        load_recipes([tmp_path])


def test_the_parser_names_are_the_installed_engines() -> None:
    from vllm.reasoning import ReasoningParserManager
    from vllm.tool_parsers import ToolParserManager

    from carbonforge_runtime.recipes.vllm_parsers import REASONING_PARSERS, TOOL_CALL_PARSERS

    assert set(ReasoningParserManager.list_registered()) == REASONING_PARSERS
    assert set(ToolParserManager.list_registered()) == TOOL_CALL_PARSERS
