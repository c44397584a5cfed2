from __future__ import annotations

import subprocess
import sys

import pytest
from typer.testing import CliRunner

from carbonforge_runtime.cli import main as cli
from carbonforge_runtime.gpu.fake import FakeGpuBackend, host

runner = CliRunner()


@pytest.fixture(autouse=True)
def _fake_l4(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cli, "gpu_backend", lambda: FakeGpuBackend(host("l4")))


def invoke(*args: str, env: dict[str, str] | None = None):
    return runner.invoke(cli.app, list(args), env=env)


def test_recipes_list_shows_key_plan_model_hardware() -> None:
    result = invoke("recipes", "list")
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0].split() == ["KEY", "PLAN", "MODEL", "HARDWARE"]
    row = next(line for line in lines if line.startswith("qwen3-100b:fp8:chat:h100x2"))
    assert row.split()[1:3] == ["premium", "Qwen/Qwen3-Next-80B-A3B-Instruct-FP8"]
    assert row.split()[-1] == "h100x2"
    assert "(unverified)" in row


def test_recipes_show_prints_recipe_and_exact_command() -> None:
    result = invoke("recipes", "show", "qwen2.5-0.5b:fp8:chat:l4x1")
    assert result.exit_code == 0, result.output
    assert "key: qwen2.5-0.5b:fp8:chat:l4x1" in result.output
    command = result.output.split("# vLLM command\n", 1)[1].strip()
    assert command.startswith(sys.executable)
    assert "--model Qwen/Qwen2.5-0.5B-Instruct --served-model-name Qwen/Qwen2.5-0.5B-Instruct" in command
    assert "--quantization fp8" in command


def test_recipes_show_unknown_key_is_a_usage_error() -> None:
    result = invoke("recipes", "show", "qwen3-32b:fp8:chat:a100-40x1")
    assert result.exit_code == 2
    assert "closest known: qwen3-32b:fp8:chat:a100-80x1" in result.output
    assert "Traceback" not in result.output


def test_dry_run_shows_every_knob_with_its_source() -> None:
    result = invoke("serve", "--context-key", "qwen2.5-0.5b:fp8:chat:l4x1", "--dry-run", "--", "--max-num-seqs", "8",
                    env={"CF_MAX_MODEL_LEN": "4096", "CF_VLLM_EXTRA_ARGS": "--enforce-eager"})
    assert result.exit_code == 0, result.output
    out = result.output
    assert "max_model_len           4096        CF_MAX_MODEL_LEN" in out
    assert "max_num_seqs            8           extra flag after --" in out
    assert "enforce_eager           True        CF_VLLM_EXTRA_ARGS" in out
    assert "gpu_memory_utilization  0.9         recipe" in out
    assert "vLLM command:" in out and "--max-model-len 4096" in out


def test_bad_inputs_exit_2_without_traceback() -> None:
    for args, env, fragment in [
        (["serve", "--context-key", "a:b", "--dry-run"], {}, "has 2 segment(s)"),
        (["serve", "--context-key", "qwen3-32b:fp8:batch:a100-80x1", "--dry-run"], {}, "unknown workload"),
        (["serve", "--context-key", "qwen3-32b:fp8:chat:a100-80x1", "--dry-run"],
         {"CF_GPU_MEMORY_UTILIZATION": "1.7"}, "outside (0, 1]"),
        (["serve", "--context-key", "qwen3-32b:fp8:chat:a100-80x1", "--dry-run"],
         {"CF_MAX_MODEL_LEN": "abc"}, "not a whole number"),
    ]:
        result = invoke(*args, env=env)
        assert result.exit_code == 2, (args, result.output)
        assert fragment in result.output
        assert "Traceback" not in result.output
        assert result.exception is None or isinstance(result.exception, SystemExit)


def test_version_and_help_on_every_command() -> None:
    result = invoke("--version")
    assert result.exit_code == 0 and "carbonforge-runtime 0.2.0" in result.output
    commands = [[]] + [[c.name or c.callback.__name__] for c in cli.app.registered_commands] + [
        [g.name] for g in cli.app.registered_groups]
    commands += [["recipes", "list"], ["recipes", "show"]]
    for command in commands:
        result = invoke(*command, "--help")
        assert result.exit_code == 0, (command, result.output)
        assert "Usage:" in result.output


@pytest.mark.parametrize(
    ("args", "env", "expected"),
    [([], {}, ["doctor"]),
     ([], {"CF_CONTEXT_KEY": "k:q:chat:l4x1"}, ["serve", "--context-key", "k:q:chat:l4x1"]),
     (["--context-key", "k", "--", "--seed", "1"], {}, ["serve", "--context-key", "k", "--", "--seed", "1"]),
     (["--request-trace", "standard", "--", "m"], {}, ["serve", "--request-trace", "standard", "--", "m"]),
     (["--", "m", "--seed", "1"], {"CF_CONTEXT_KEY": "x"}, ["serve", "--", "m", "--seed", "1"]),
     (["Qwen/Qwen2.5-0.5B-Instruct", "--max-model-len", "100"], {},
      ["serve", "--", "Qwen/Qwen2.5-0.5B-Instruct", "--max-model-len", "100"]),
     (["--model", "m"], {}, ["serve", "--", "--model", "m"]),
     (["recipes", "list"], {"CF_CONTEXT_KEY": "x"}, ["recipes", "list"]),
     (["--dry-run", "--context-key=k"], {}, ["serve", "--dry-run", "--context-key=k"])],
)
def test_launch_mode_dispatch(args: list[str], env: dict[str, str], expected: list[str]) -> None:
    assert cli._dispatch(args, env) == expected


def test_context_key_variable_ignored_once_arguments_are_given() -> None:
    env = {"CF_CONTEXT_KEY": "qwen3-32b:fp8:chat:a100-80x1", "CF_LOG_DIR": "/tmp"}
    done = subprocess.run([sys.executable, "-m", "carbonforge_runtime", "--dry-run", "--", "/models/m"],
                          capture_output=True, text=True, env={**env, "PATH": "/usr/bin:/bin"}, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("CF_CONTEXT_KEY is ignored") == 1
    assert "mode:               override" in done.stdout
    assert "--model /models/m" in done.stdout


def test_the_serve_flags_are_declared_once() -> None:
    """ServeOptions is filled from the serve command's parameters by name, and the flags that make a
    container command line a serve command line are read from the same command."""
    import dataclasses

    import typer.main

    from carbonforge_runtime.runtime.planning.plan import ServeOptions

    serve_command = typer.main.get_command(cli.app).commands["serve"]  # type: ignore[attr-defined]
    params = {p.name for p in serve_command.params if p.param_type_name == "option"}
    assert {f.name for f in dataclasses.fields(ServeOptions)} == params | {"vllm_args"}
    flags = {opt for p in serve_command.params if p.param_type_name == "option" for opt in p.opts}
    assert set(cli.RUNTIME_FLAGS) == flags
