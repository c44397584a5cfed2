from __future__ import annotations

import logging
import sys

import pytest

from carbonforge_runtime.errors import HardwareMismatchError, OverrideError
from carbonforge_runtime.gpu.fake import FakeGpuBackend, host
from carbonforge_runtime.gpu.types import GpuSnapshot
from carbonforge_runtime.recipes import load_recipes, parse_hardware, shipped_recipes_dir
from carbonforge_runtime.recipes.hardware import hardware_mismatches
from carbonforge_runtime.runtime.planning.command import (
    ENGINE_MODULE,
    MIDDLEWARE,
    build_override_plan,
    build_recipe_plan,
)
from carbonforge_runtime.runtime.serve.launch import ServeOptions, prepare, serve
from carbonforge_runtime.settings import load_settings
from tests.support.vllm_command import flags as flags_in

RECIPES = load_recipes([shipped_recipes_dir()])


# ---- overrides -------------------------------------------------------------------------------

@pytest.mark.parametrize(
    ("env", "fragment"),
    [({"CF_GPU_MEMORY_UTILIZATION": "1.7"}, "outside (0, 1]"),
     ({"CF_GPU_MEMORY_UTILIZATION": "lots"}, "is not a number"),
     ({"CF_GPU_MEMORY_UTILIZATION": "0"}, "outside (0, 1]"),
     ({"CF_MAX_MODEL_LEN": "abc"}, "is not a whole number"),
     ({"CF_MAX_MODEL_LEN": "-5"}, "must be positive"),
     ({"CF_VLLM_EXTRA_ARGS": "--foo 'unclosed"}, "cannot be split"),
     ({"CF_PORT": "70000"}, "is not a TCP port"),
     ({"CF_DRY_RUN": "maybe"}, "is not a boolean")],
)
def test_invalid_overrides_fail_before_anything(env: dict[str, str], fragment: str) -> None:
    with pytest.raises(OverrideError) as info:
        load_settings(env)
    assert fragment in info.value.message
    assert next(iter(env)) in info.value.remedy


def test_overrides_replace_knobs_and_are_reported_as_departures() -> None:
    recipe = RECIPES["qwen3-32b:fp8:chat:a100-80x1"]
    settings = load_settings({"CF_MAX_MODEL_LEN": "8192", "CF_GPU_MEMORY_UTILIZATION": "0.6",
                              "CF_VLLM_EXTRA_ARGS": "--enforce-eager --max-num-seqs 4"})
    plan = build_recipe_plan(recipe, settings, ["--seed", "7"])
    knobs = {k.name: k for k in plan.knobs}
    assert (knobs["max_model_len"].value, knobs["max_model_len"].source) == (8192, "CF_MAX_MODEL_LEN")
    assert knobs["gpu_memory_utilization"].source == "CF_GPU_MEMORY_UTILIZATION"
    assert (knobs["max_num_seqs"].value, knobs["max_num_seqs"].source) == ("4", "CF_VLLM_EXTRA_ARGS")
    assert (knobs["enforce_eager"].value, knobs["enforce_eager"].source) == (True, "CF_VLLM_EXTRA_ARGS")
    assert knobs["seed"].source == "extra flag after --"
    assert knobs["max_num_batched_tokens"].source == "recipe"
    joined = "\n".join(plan.departures)
    assert "CF_MAX_MODEL_LEN departs from the benchmark: max_model_len 32768 (recipe) -> 8192" in joined
    assert "CF_GPU_MEMORY_UTILIZATION departs from the benchmark: gpu_memory_utilization 0.92 (recipe) -> 0.6" in joined
    assert "CF_VLLM_EXTRA_ARGS departs from the benchmark: adds --enforce-eager --max-num-seqs 4" in joined
    argv = plan.argv
    assert argv[argv.index("--max-model-len") + 1] == "8192"
    assert argv[argv.index("--gpu-memory-utilization") + 1] == "0.6"
    # extra flags come last so that they win in vLLM's parser
    assert argv[-5:] == ["--enforce-eager", "--max-num-seqs", "4", "--seed", "7"]


def test_override_warning_is_logged_at_serve(capsys: pytest.CaptureFixture[str]) -> None:
    settings = load_settings({"CF_GPU_MEMORY_UTILIZATION": "0.6"})
    options = ServeOptions(context_key="qwen2.5-0.5b:fp8:chat:l4x1", dry_run=True)
    logger = logging.getLogger("carbonforge")
    seen: list[logging.LogRecord] = []
    keep = logging.Handler(logging.WARNING)
    keep.emit = seen.append  # type: ignore[method-assign]
    logger.addHandler(keep)
    try:
        assert serve(options, settings, {}, FakeGpuBackend(host("l4"))) == 0
    finally:
        logger.removeHandler(keep)
    warnings = [r.getMessage() for r in seen]
    assert warnings == ["CF_GPU_MEMORY_UTILIZATION departs from the benchmark: "
                        "gpu_memory_utilization 0.9 (recipe) -> 0.6",
                        "the API on port 8000 takes requests from anyone who can reach it: set CF_API_KEY "
                        "(or CF_API_KEY_FILE) to require a key"]
    assert "gpu_memory_utilization  0.6         CF_GPU_MEMORY_UTILIZATION" in capsys.readouterr().out


# ---- the vLLM command for every shipped recipe ---------------------------------------------------

@pytest.mark.parametrize("key", sorted(RECIPES))
def test_command_for_each_shipped_recipe(key: str) -> None:
    recipe = RECIPES[key]
    plan = build_recipe_plan(recipe, load_settings({}), [], model_path="/m" if recipe.model.builtin else None)
    argv = plan.argv
    assert argv[:3] == [sys.executable, "-m", ENGINE_MODULE]
    flags = flags_in(argv[3:])
    assert flags["--model"] == ("/m" if recipe.model.builtin else recipe.model.repo)
    assert flags["--served-model-name"] == recipe.model.served_name
    assert flags["--port"] == "8000"
    assert flags["--shutdown-timeout"] == str(int(recipe.drain_timeout_s))
    for name, value in recipe.vllm.items():
        flag = "--" + name.replace("_", "-")
        if value is True:
            assert flag in argv
        elif value is False:
            assert "--no-" + name.replace("_", "-") in argv
        else:
            assert flags[flag] == str(value)
    assert plan.departures == []
    if not recipe.key.hardware.is_cpu:
        gpus = (recipe.vllm.get("tensor_parallel_size", 1) * recipe.vllm.get("pipeline_parallel_size", 1)
                * recipe.vllm.get("data_parallel_size", 1))
        assert gpus == recipe.key.hardware.count * recipe.key.hardware.hosts


def test_override_plan_adds_served_name_and_port() -> None:
    settings = load_settings({"CF_PORT": "8123", "CF_MAX_MODEL_LEN": "100"})
    plan = build_override_plan(["/models/x", "--max-model-len", "512"], settings, "/models/x")
    assert plan.argv[3:] == ["--model", "/models/x", "--max-model-len", "512", "--served-model-name", "/models/x",
                             "--port", "8123", "--host", "0.0.0.0", "--shutdown-timeout", "30",
                             "--scheduler-cls", "carbonforge_runtime.engine.scheduler.make_scheduler",
                             "--middleware", MIDDLEWARE]
    assert plan.port == 8123
    assert any("CF_MAX_MODEL_LEN is ignored" in note for note in plan.notes)
    given = build_override_plan(["--model", "m", "--served-model-name", "svc", "--port", "9001"], settings, "m")
    assert given.served_model_name == "svc" and given.port == 9001
    assert given.argv.count("--served-model-name") == 1 and given.argv.count("--port") == 1


# ---- hardware ------------------------------------------------------------------------------------

HOSTS = {
    "none": host(None),
    "l4": host("l4"),
    "a100-80": host("a100-80"),
    "2xh100": host("h100", 2),
}


@pytest.mark.parametrize(
    ("segment", "host_name", "problems"),
    [("l4x1", "l4", []),
     ("l4x1", "a100-80", ["tuned for L4, detected NVIDIA A100-SXM4-80GB"]),
     ("l4x1", "none", ["no GPU can be inspected: NVML could not be loaded"]),
     ("a100-80x1", "a100-80", []),
     ("a100-80x1", "l4", ["tuned for A100", "GPU 0 has 22 GiB, the recipe is tuned for 80 GB"]),
     ("a100-80x1", "2xh100", ["tuned for 1 GPU(s), 2 detected", "tuned for A100"]),
     ("h100x2", "2xh100", []),
     ("h100x4", "2xh100", ["needs 4 GPU(s), 2 detected"]),
     ("h100x2", "a100-80", ["needs 2 GPU(s), 1 detected", "tuned for H100"]),
     ("cpu", "none", [])],
)
def test_hardware_matching(segment: str, host_name: str, problems: list[str]) -> None:
    found = hardware_mismatches(parse_hardware(segment), HOSTS[host_name])
    assert len(found) == len(problems), found
    for fragment, line in zip(problems, found, strict=True):
        assert fragment in line


def test_strict_hardware_refuses_before_anything_starts() -> None:
    backend = FakeGpuBackend(host("l4"))
    options = ServeOptions(context_key="qwen3-32b:fp8:chat:a100-80x1", strict_hardware=True)
    with pytest.raises(HardwareMismatchError) as info:
        prepare(options, load_settings({}), {}, backend)
    assert "a100-80x1" in info.value.message and "--strict-hardware" in info.value.remedy
    no_driver = FakeGpuBackend(GpuSnapshot(False, "NVML could not be loaded: no NVIDIA driver"))
    with pytest.raises(HardwareMismatchError, match="no NVIDIA driver"):
        prepare(options, load_settings({}), {}, no_driver)
    # A dry run reports the same refusal with the plan instead of raising, and exits with its code.
    dry = prepare(ServeOptions(context_key=options.context_key, strict_hardware=True, dry_run=True),
                  load_settings({}), {}, backend)
    assert [type(exc) for exc in dry.verdicts.refusals] == [HardwareMismatchError]
    assert dry.verdicts.exit_code == 3
    assert "hardware:           REFUSED (--strict-hardware): a launch would not start" in dry.verdicts.describe()


def test_mismatch_without_strict_still_plans() -> None:
    options = ServeOptions(context_key="qwen3-32b:fp8:chat:a100-80x1", dry_run=True)
    prepared = prepare(options, load_settings({}), {}, FakeGpuBackend(host("l4")))
    assert prepared.hardware_problems and prepared.plan.recipe is not None


def test_cpu_recipe_never_consults_nvml() -> None:
    backend = FakeGpuBackend(host(None))
    prepare(ServeOptions(context_key="cf-tiny:bf16:chat:cpu", strict_hardware=True), load_settings({}), {}, backend)
    assert backend.calls == 0
