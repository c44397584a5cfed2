"""What serving does with the command line: the endpoint the extra flags name, the dry run's verdicts,
and the runtime's own log file."""

from __future__ import annotations

import logging
import logging.handlers
import re
from pathlib import Path
from typing import Any

import pytest

from carbonforge_runtime import log as cflog
from carbonforge_runtime.errors import UsageError
from carbonforge_runtime.gpu.fake import FakeGpuBackend, host
from carbonforge_runtime.recipes import Recipe, load_recipes, recipe_dirs
from carbonforge_runtime.runtime.planning.command import effective_endpoint
from carbonforge_runtime.runtime.planning.plan import ServeOptions, build_plan
from carbonforge_runtime.runtime.process import supervisor
from carbonforge_runtime.runtime.serve.launch import serve
from carbonforge_runtime.settings import load_settings
from tests.support import TINY_KEY
from tests.unit.runtime.conftest import Lines

SHIPPED: dict[str, Recipe] = load_recipes(recipe_dirs(None))
PREMIUM_KEY = "qwen3-100b:fp8:chat:h100x2"


# ---- 1. --port, --host, --served-model-name among the extra flags -------------------------------

def test_the_plan_takes_port_host_and_name_from_the_extra_flags() -> None:
    settings = load_settings({"CF_PORT": "8000", "CF_HOST": "0.0.0.0",
                              "CF_VLLM_EXTRA_ARGS": "--port=9200 --served_model_name env-name"})
    plan = build_plan(ServeOptions(context_key=TINY_KEY), settings, SHIPPED, {}).launch
    assert (plan.port, plan.host, plan.served_model_name) == (9200, "0.0.0.0", "env-name")
    # After --, they come last on vLLM's command line, so they win over CF_VLLM_EXTRA_ARGS too.
    options = ServeOptions(context_key=TINY_KEY, vllm_args=["--port", "9300", "--host", "127.0.0.2",
                                                            "--served-model-name", "alias", "second"])
    plan = build_plan(options, settings, SHIPPED, {}).launch
    assert (plan.port, plan.host, plan.served_model_name) == (9300, "127.0.0.2", "alias")
    argv = plan.argv
    assert argv[len(argv) - 1 - argv[::-1].index("--port") + 1] == "9300"  # the last --port is ours to report


@pytest.mark.parametrize("args", [["--port", "http"], ["--port=0"], ["--port"], ["--served-model-name"],
                                  ["--host"]])
def test_an_endpoint_flag_without_a_usable_value_is_a_usage_error(args: list[str]) -> None:
    with pytest.raises(UsageError):
        effective_endpoint(args, "name", "0.0.0.0", 8000)


def test_the_health_wait_and_the_ready_line_use_the_port_given_after_the_double_dash(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, tiny_model: str) -> None:
    env = {"CF_LOG_DIR": str(tmp_path), "CF_TINY_MODEL_DIR": tiny_model, "CF_PORT": "18000", "CF_HOST": "127.0.0.1"}
    seen: dict[str, Any] = {}

    def capture(engine: supervisor.EngineProcess, **kwargs: Any) -> supervisor.ExitReport:
        seen.update(kwargs)
        return supervisor.ExitReport("stopped", 0, 0)

    monkeypatch.setattr(supervisor, "supervise", capture)
    options = ServeOptions(context_key=TINY_KEY, skip_preflight=True,
                           vllm_args=["--port", "18123", "--served-model-name", "tiny-alias"])
    assert serve(options, load_settings(env), env, FakeGpuBackend(host(None))) == 0
    assert seen["ready_url"] == "http://127.0.0.1:18123/health"
    assert seen["api_port"] == 18123


# ---- 11. the dry run of a launch that would be refused --------------------------------------------

def test_a_dry_run_of_a_premium_key_without_licence_prints_the_plan_and_the_refusal(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], runtime_log: Lines) -> None:
    env = {"CF_LICENSE_FILE": str(tmp_path / "no-licence.key"), "CF_LOG_DIR": str(tmp_path / "logs")}
    options = ServeOptions(context_key=PREMIUM_KEY, dry_run=True, skip_preflight=True)
    code = serve(options, load_settings(env), env, FakeGpuBackend(host("l4")))
    assert code == 4  # the licence's exit code (docs/exit-codes.md), as a real launch would exit
    out = capsys.readouterr().out
    assert f"context key:        {PREMIUM_KEY}" in out and "vLLM command:" in out
    assert "licence:            REFUSED: " in out and "no license key provided" in out
    assert "                    fix: pass the licence key in CARBONFORGE_LICENSE_KEY" in out
    assert "verdict:            a launch would be refused (exit 4); nothing would start" in out
    banner = "\n".join(line for line in runtime_log.lines if "HARDWARE MISMATCH" in line)
    assert "Dry run: a launch would serve anyway" in banner and "Serving anyway" not in banner
    assert not (tmp_path / "logs").exists()  # a dry run writes nothing


def test_a_dry_run_with_strict_hardware_says_the_launch_would_refuse(
        capsys: pytest.CaptureFixture[str], runtime_log: Lines) -> None:
    options = ServeOptions(context_key="qwen3-32b:fp8:chat:a100-80x1", dry_run=True, skip_preflight=True,
                           strict_hardware=True)
    assert serve(options, load_settings({}), {}, FakeGpuBackend(host("l4"))) == 3
    assert "hardware:           REFUSED (--strict-hardware)" in capsys.readouterr().out
    banner = "\n".join(line for line in runtime_log.lines if "HARDWARE MISMATCH" in line)
    assert "with --strict-hardware a launch would refuse to start" in banner


# ---- 7. runtime.log --------------------------------------------------------------------------------

def test_the_runtime_log_goes_to_runtime_log_beside_vllm_log_without_secrets(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, tiny_model: str, runtime_log: Lines) -> None:
    env = {"CF_LOG_DIR": str(tmp_path), "CF_TINY_MODEL_DIR": tiny_model,
           "CF_VLLM_EXTRA_ARGS": "--api-key sekrit-env-key --max-num-seqs 4"}
    handlers: list[logging.Handler] = []

    def capture(engine: supervisor.EngineProcess, **kwargs: Any) -> supervisor.ExitReport:
        handlers.extend(h for h in cflog.get_logger().handlers if isinstance(h, logging.FileHandler))
        kwargs["log"].info("engine double: ready line would follow")
        return supervisor.ExitReport("stopped", 0, 0)

    monkeypatch.setattr(supervisor, "supervise", capture)
    options = ServeOptions(context_key=TINY_KEY, skip_preflight=True, vllm_args=["--api-key=sekrit-arg-key"])
    assert serve(options, load_settings(env), env, FakeGpuBackend(host(None))) == 0
    text = (tmp_path / "runtime.log").read_text()
    # What was logged while the launch was prepared is there too, not only what came after.
    assert "CF_VLLM_EXTRA_ARGS departs from the benchmark: adds --max-num-seqs 4" in text
    assert re.search(rf"starting vLLM for {re.escape(TINY_KEY)} \(recipe /\S+\.yaml\); engine log: "
                     + re.escape(str(tmp_path / "vllm.log")), text)
    assert "engine double: ready line would follow" in text
    assert "sekrit" not in text
    [handler] = handlers
    assert isinstance(handler, logging.handlers.RotatingFileHandler)
    assert (handler.maxBytes, handler.backupCount) == (10 * 1024 * 1024, 3)
    assert handler not in cflog.get_logger().handlers  # detached when serving ends


def test_runtime_log_rotates_by_size(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cflog, "RUNTIME_LOG_MAX_BYTES", 2000)
    logger = cflog.get_logger()
    old = logger.level
    logger.setLevel(logging.INFO)
    log_file = cflog.RuntimeLogFile()
    try:
        log_file.open(tmp_path)
        for i in range(200):
            logger.info("line %d %s", i, "x" * 40)
    finally:
        log_file.close()
        logger.setLevel(old)
    names = sorted(path.name for path in tmp_path.iterdir())
    assert names == ["runtime.log", "runtime.log.1", "runtime.log.2", "runtime.log.3"]
    assert all(path.stat().st_size <= 2000 for path in tmp_path.iterdir())


def test_a_refused_launch_writes_no_runtime_log(tmp_path: Path) -> None:
    env = {"CF_LOG_DIR": str(tmp_path / "logs"), "CF_LICENSE_FILE": str(tmp_path / "none")}
    with pytest.raises(Exception, match="no license key provided"):
        serve(ServeOptions(context_key=PREMIUM_KEY, skip_preflight=True), load_settings(env), env,
              FakeGpuBackend(host("h100", 2)))
    assert not (tmp_path / "logs").exists()
