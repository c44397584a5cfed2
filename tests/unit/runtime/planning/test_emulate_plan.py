"""``serve --emulate`` planned: the recipe served by the built-in model on the CPU, its knobs, family, API
and served name kept, the KV cache of the modelled GPU, the pacing in the engine contract, no licence;
and every misuse refused with the fix (exit 2)."""

from __future__ import annotations

from typing import Any

import pytest
from typer.testing import CliRunner

from carbonforge_runtime.cli import main as cli
from carbonforge_runtime.core.contract import EngineContract
from carbonforge_runtime.core.step_models import shipped_models
from carbonforge_runtime.errors import UsageError
from carbonforge_runtime.gpu.fake import FakeGpuBackend, host
from carbonforge_runtime.recipes import Recipe, load_recipes, recipe_dirs
from carbonforge_runtime.runtime.planning.command import BUILTIN_STRUCTURED_OUTPUTS
from carbonforge_runtime.runtime.planning.emulate import (
    EmulateOptions,
    cpu_block_size,
    emulated_recipe,
    emulation_report,
    kv_blocks,
)
from carbonforge_runtime.runtime.planning.plan import ServeOptions, build_plan
from carbonforge_runtime.runtime.vllm_cli.args import read
from carbonforge_runtime.settings import load_settings

SHIPPED: dict[str, Recipe] = load_recipes(recipe_dirs(None))
KEY = "qwen3-32b:fp8:chat:a100-80x1"
A100 = shipped_models()["a100-80-tp1"]
runner = CliRunner()


def plan_of(options: ServeOptions, emulate: EmulateOptions | None) -> Any:
    settings = load_settings({"CF_TINY_MODEL_DIR": "/models/tiny"})
    return build_plan(options, settings, SHIPPED, {"PATH": "/usr/bin"}, emulate=emulate)


def test_the_recipe_is_served_by_the_stand_in_with_the_gpus_kv_cache() -> None:
    original = SHIPPED[KEY]
    plan = plan_of(ServeOptions(context_key=KEY, emulate=True, emulate_slowdown=2.0), EmulateOptions(A100, 2.0))
    launch = plan.launch
    args = read(launch.argv)
    assert launch.model == "/models/tiny" and launch.served_model_name == original.model.served_name
    assert launch.recipe is not None and launch.recipe.key.hardware.is_cpu and launch.recipe.plan == "free"
    assert args.value("--max-model-len") == "32768" and args.value("--max-num-seqs") == "64"
    assert args.value("--max-num-batched-tokens") == "8192"
    assert args.value("--hf-overrides") == '{"max_position_embeddings":32768}'
    assert args.value("--block-size") == "32"
    assert int(args.value("--num-gpu-blocks-override") or 0) * 32 == 137024  # A100 model: 137,000 tokens
    assert args.value("--structured-outputs-config") == BUILTIN_STRUCTURED_OUTPUTS
    assert args.value("--tool-call-parser") == "hermes" and args.value("--reasoning-parser") == "qwen3"
    for gpu_only in ("--tensor-parallel-size", "--gpu-memory-utilization"):
        assert not args.given(gpu_only)
    engine = EngineContract.from_environ(launch.engine_env())
    assert engine.emulation is not None and engine.emulation.slowdown == 2.0
    emulation = engine.emulation
    assert emulation.floor_ms == A100.floor_ms
    assert (emulation.model, emulation.version, emulation.proxy) == ("a100-80-tp1", 1, True)
    assert engine.ordering.family == original.scheduler.family
    assert any("no licence needed" in m.text for m in plan.messages)


def test_emulated_recipe_keeps_the_serving_sections_and_drops_the_gpu_ones() -> None:
    premium = next(r for r in SHIPPED.values() if r.is_premium and r.hosts is None)
    served, notes = emulated_recipe(premium, EmulateOptions(A100))
    assert served.plan == "free" and served.hosts is None and served.model.builtin == "tiny-chat"
    assert served.api == premium.api and served.scheduler == premium.scheduler
    assert served.drain_timeout_s == premium.drain_timeout_s
    assert "tensor_parallel_size" not in served.vllm and served.vllm["dtype"] == "bfloat16"
    assert any("not passed to vLLM" in note for note in notes)
    assert (cpu_block_size(16), cpu_block_size(32), cpu_block_size(48)) == (32, 32, 64)
    assert kv_blocks(A100, 32) == 4282


def test_a_premium_recipe_needs_no_licence_in_the_dry_run(tmp_path: Any) -> None:
    premium = next(r for r in SHIPPED.values() if r.is_premium and r.hosts is None)
    result = runner.invoke(cli.app, ["serve", "--context-key", premium.key_text, "--emulate", "--cost-model",
                                     "h100-tp2", "--dry-run"], env={"CF_LOG_DIR": str(tmp_path)})
    assert result.exit_code == 0, result.output
    assert "licence need:       none: --emulate serves no premium weights" in result.output
    assert "licence:            not needed (free plan)" in result.output
    assert f"emulate:            {premium.key_text} paced" in result.output


@pytest.mark.parametrize("args, fragment", [
    (["--emulate", "--", "some/model"], "--emulate serves a recipe"),
    (["--context-key", KEY, "--cost-model", "a100-80-tp1"], "add --emulate, or drop --cost-model"),
    (["--context-key", KEY, "--emulate-slowdown", "2"], "add --emulate, or drop --emulate-slowdown"),
    (["--context-key", KEY, "--emulate", "--cost-model", "b200-tp9"], "no step-time model named 'b200-tp9'"),
    (["--context-key", KEY, "--emulate", "--cost-model", "/nowhere/model.yaml"], "does not exist"),
    (["--context-key", KEY, "--emulate", "--emulate-slowdown", "0"], "--emulate-slowdown 0 is out of range"),
    (["--context-key", "cf-tiny:bf16:chat:cpu", "--emulate"], "no shipped step-time model for this hardware"),
    (["--context-key", KEY, "--emulate", "--", "--scheduler-cls", "my.Scheduler"], "drop --emulate"),
])
def test_misuse_is_one_line_with_the_fix_and_exit_2(args: list[str], fragment: str, tmp_path: Any,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cli, "gpu_backend", lambda: FakeGpuBackend(host("l4")))
    result = runner.invoke(cli.app, ["serve", *args, "--dry-run"], env={"CF_LOG_DIR": str(tmp_path)})
    assert result.exit_code == 2, result.output
    assert fragment in result.output and "fix:" in result.output
    assert "Traceback" not in result.output


def test_the_engines_verdict_is_found_in_its_log() -> None:
    summary = ("emulated: the real engine paced to step-time model a100-80-tp1 v1, a proxy; 2.00% of 300 steps late "
               "(over 1%: not faithful); slowdown 1; 6 of 300 steps ran late, worst 3.10x its modelled time")
    warning = "emulated run NOT FAITHFUL: 6 of 300 steps (2.0%, over 1%) took longer ..."
    tail = ["(EngineCore pid=7) WARNING 12-05 11:46:25 [pacing.py:170] " + warning.replace("300", "200"),
            "(EngineCore pid=7) INFO 12-05 11:47:07 [pacing.py:185] " + summary,
            "(EngineCore pid=7) WARNING 12-05 11:47:07 [pacing.py:187] " + warning,
            "(APIServer pid=6) INFO 12-05 11:47:08 [launcher.py:1] Shutting down"]
    assert emulation_report(tail) == [("info", summary), ("warning", warning)]
    assert emulation_report(tail[-1:]) == []


def test_build_plan_refuses_emulate_without_its_model() -> None:
    with pytest.raises(UsageError, match="needs its step-time model"):
        plan_of(ServeOptions(context_key=KEY, emulate=True), None)
