"""Step 1 of serving, the plan: pure, built for every shipped recipe, and the one the launch runs."""

from __future__ import annotations

import builtins
import os
import shlex
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from carbonforge_runtime.core.contract import EngineContract
from carbonforge_runtime.gpu.fake import FakeGpuBackend, host
from carbonforge_runtime.recipes import Recipe, load_recipes, recipe_dirs
from carbonforge_runtime.runtime.planning.plan import ServeOptions, build_plan, command_line, describe_plan
from carbonforge_runtime.runtime.process import supervisor
from carbonforge_runtime.runtime.serve.launch import serve
from carbonforge_runtime.settings import load_settings
from tests.support import group_env, wait_until

SHIPPED: dict[str, Recipe] = load_recipes(recipe_dirs(None))


class Touched(AssertionError):
    pass


@pytest.fixture
def no_io(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Any file, process, socket or GPU access fails the test while the plan is built."""

    def refuse(what: str) -> Any:
        def fail(*args: object, **kwargs: object) -> None:
            raise Touched(f"build_plan touched {what}: {args[:1]}")
        return fail

    monkeypatch.setattr(builtins, "open", refuse("a file"))
    monkeypatch.setattr(os, "open", refuse("a file"))
    monkeypatch.setattr(Path, "open", refuse("a file"))
    monkeypatch.setattr(subprocess, "Popen", refuse("a process"))
    monkeypatch.setattr(socket, "socket", refuse("a socket"))
    monkeypatch.setattr(FakeGpuBackend, "snapshot", refuse("the GPUs"))
    yield


@pytest.mark.parametrize("key", sorted(SHIPPED))
def test_every_shipped_recipe_plans_without_io(key: str, no_io: None) -> None:
    recipe = SHIPPED[key]
    settings = load_settings({"CF_TINY_MODEL_DIR": "/models/tiny", **group_env(recipe)})
    plan = build_plan(ServeOptions(context_key=key), settings, SHIPPED, {"PATH": "/usr/bin"})
    launch = plan.launch
    assert launch.recipe is recipe and launch.mode == "recipe"
    assert launch.argv[launch.argv.index("--served-model-name") + 1] == recipe.model.served_name
    assert launch.contract is not None and launch.contract.ordering.family == recipe.scheduler.family
    assert dict(launch.contract.ordering.params) == dict(recipe.scheduler.params)
    engine = EngineContract.from_environ(launch.engine_env())
    assert engine == launch.contract  # what the engine will parse is what the plan holds
    for name in recipe.vllm:
        flag = name.replace("_", "-")
        assert f"--{flag}" in launch.argv or f"--no-{flag}" in launch.argv, name
    assert plan.trace is None and launch.env["PATH"] == "/usr/bin"


def test_an_override_plans_without_io(no_io: None) -> None:
    options = ServeOptions(vllm_args=["Qwen/Qwen2.5-0.5B-Instruct", "--max-num-seqs", "8"],
                           request_trace="standard", trace_file="/var/log/carbonforge/t.jsonl")
    plan = build_plan(options, load_settings({}), SHIPPED, {})
    assert plan.launch.mode == "override" and plan.override_model == "Qwen/Qwen2.5-0.5B-Instruct"
    assert plan.launch.contract is not None and plan.launch.contract.tracing == plan.trace
    assert plan.trace is not None and plan.trace.file == "/var/log/carbonforge/t.jsonl"


class Launched(Exception):
    pass


def test_the_dry_run_prints_the_plan_that_serving_launches(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str],
                                                           tiny_model: str) -> None:
    env = {"CF_LOG_DIR": str(tmp_path / "logs"), "CF_TINY_MODEL_DIR": tiny_model, "CF_PORT": "18123"}
    settings = load_settings(env)
    options = dict(context_key="cf-tiny:bf16:chat:cpu", request_trace="standard",
                   trace_file=str(tmp_path / "t.jsonl"), skip_preflight=True)
    assert serve(ServeOptions(**options, dry_run=True), settings, env, FakeGpuBackend(host(None))) == 0
    printed = capsys.readouterr().out.splitlines()
    dry_command = printed[printed.index("vLLM command:") + 1].strip()
    assert "licence:            not needed (free plan)" in printed  # the checks' verdicts come with the plan
    assert not [line for line in printed if line.startswith("pre-flight:")]  # skipped, so no verdict

    started: list[supervisor.EngineProcess] = []

    def capture(engine: supervisor.EngineProcess, **kwargs: object) -> supervisor.ExitReport:
        started.append(engine)
        raise Launched

    monkeypatch.setattr(supervisor, "supervise", capture)
    with pytest.raises(Launched):
        serve(ServeOptions(**options), settings, env, FakeGpuBackend(host(None)))
    assert len(started) == 1
    assert shlex.join(started[0].argv) == dry_command
    launched = EngineContract.from_environ(started[0].env)
    assert launched.ordering.family == "fcfs" and launched.tracing is not None
    assert launched.tracing.file == str(tmp_path / "t.jsonl")
    plan = build_plan(ServeOptions(**options), settings, SHIPPED, env)
    assert command_line(plan) == dry_command


def test_the_licence_key_stays_out_of_the_engine_environment() -> None:
    environ = {"CARBONFORGE_LICENSE_KEY": "secret-licence-text", "HF_TOKEN": "hf_x", "PATH": "/usr/bin"}
    for options in (ServeOptions(context_key="cf-tiny:bf16:chat:cpu"), ServeOptions(vllm_args=["/models/m"])):
        plan = build_plan(options, load_settings(environ), SHIPPED, environ)
        engine_env = plan.launch.engine_env()
        assert "CARBONFORGE_LICENSE_KEY" not in engine_env
        assert "secret-licence-text" not in "".join(engine_env.values())
        assert engine_env["HF_TOKEN"] == "hf_x" and engine_env["PATH"] == "/usr/bin"  # what vLLM needs stays


def test_the_engine_sees_only_what_a_serving_engine_reads_plus_what_the_operator_passes() -> None:
    environ = {"PATH": "/usr/bin", "HOME": "/root", "VLLM_LOGGING_LEVEL": "DEBUG", "NCCL_DEBUG": "INFO",
               "CUDA_VISIBLE_DEVICES": "0", "OTEL_EXPORTER_OTLP_HEADERS": "x=1", "https_proxy": "http://p:3128",
               "AWS_ACCESS_KEY_ID": "weights-bucket", "CF_RECIPES_DIR": "/r", "CF_API_KEY": "k1",
               "DATABASE_PASSWORD": "hunter2", "GITHUB_TOKEN": "ghp_x", "MY_TEAM_FLAG": "on", "MY_TEAM_MODE": "a",
               "CF_ENGINE_ENV_PASS": "MY_TEAM_*, OTHER"}
    plan = build_plan(ServeOptions(vllm_args=["/models/m"]), load_settings(environ), SHIPPED, environ)
    engine_env = plan.launch.engine_env()
    for kept in ("PATH", "HOME", "VLLM_LOGGING_LEVEL", "NCCL_DEBUG", "CUDA_VISIBLE_DEVICES",
                 "OTEL_EXPORTER_OTLP_HEADERS", "https_proxy", "AWS_ACCESS_KEY_ID", "MY_TEAM_FLAG", "MY_TEAM_MODE"):
        assert engine_env[kept] == environ[kept], kept
    for withheld in ("CF_RECIPES_DIR", "CF_API_KEY", "DATABASE_PASSWORD", "GITHUB_TOKEN", "CF_ENGINE_ENV_PASS"):
        assert withheld not in engine_env, withheld
    assert "hunter2" not in "".join(engine_env.values())
    shown = "\n".join(describe_plan(plan, ServeOptions(vllm_args=["/models/m"]), environ))
    withheld = "CF_API_KEY, CF_ENGINE_ENV_PASS, CF_RECIPES_DIR, DATABASE_PASSWORD, GITHUB_TOKEN"
    assert f"withheld from vLLM: {withheld}" in shown
    assert "hunter2" not in shown and "ghp_x" not in shown


def test_an_api_key_in_the_extra_arguments_never_reaches_argv_or_the_dry_run(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    environ = {"CF_VLLM_EXTRA_ARGS": "--api-key sekrit-key-1 --max-num-seqs 4", "CF_TINY_MODEL_DIR": "/m",
               "CF_LOG_DIR": str(tmp_path)}
    settings = load_settings(environ)
    options = ServeOptions(context_key="cf-tiny:bf16:chat:cpu", dry_run=True, skip_preflight=True,
                           vllm_args=["--api-key=sekrit-key-2"])
    plan = build_plan(options, settings, SHIPPED, environ)
    assert not [arg for arg in plan.launch.argv if "sekrit" in arg]
    assert plan.launch.engine_env()["VLLM_API_KEY"] in ("sekrit-key-1", "sekrit-key-2")
    assert "--max-num-seqs" in plan.launch.argv
    assert serve(options, settings, environ, FakeGpuBackend(host(None))) == 0
    printed = capsys.readouterr()
    assert "sekrit" not in printed.out + printed.err
    override = build_plan(ServeOptions(vllm_args=["/m", "--api-key", "sekrit-3"],
                                       request_trace="standard", trace_file="/tmp/t.jsonl",
                                       trace_endpoint="https://user:tok3n@collector:4318", trace_format="otlp"),
                          settings, SHIPPED, {})
    assert "sekrit-3" not in " ".join(override.launch.argv)
    assert override.launch.engine_env()["VLLM_API_KEY"] == "sekrit-3"
    assert not [m for m in override.messages if "tok3n" in m.text or "sekrit" in m.text]


def test_the_engine_log_shows_the_command_with_secrets_redacted(tmp_path: Path) -> None:
    import sys

    log = tmp_path / "vllm.log"
    engine = supervisor.EngineProcess([sys.executable, "-c", "pass", "--api-key", "sekrit-4"], {}, log)
    engine.start()
    wait_until(lambda: engine.poll() is not None, 30, every_s=0.05)
    text = log.read_text()
    assert "--api-key <redacted>" in text and "sekrit-4" not in text
