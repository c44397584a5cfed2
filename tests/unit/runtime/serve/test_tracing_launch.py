"""Tracing flags at launch: validation before anything starts, and what reaches the engine."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from carbonforge_runtime.cli import main as cli
from carbonforge_runtime.core.contract import CONTRACT_ENV, SCHEDULER_CLS
from carbonforge_runtime.errors import CarbonForgeError, UsageError
from carbonforge_runtime.gpu.fake import FakeGpuBackend, host
from carbonforge_runtime.runtime.planning.command import LaunchPlan
from carbonforge_runtime.runtime.planning.trace_options import TraceConfig
from carbonforge_runtime.runtime.serve.launch import ServeOptions, _create_trace_file, describe_prepared, prepare
from carbonforge_runtime.settings import load_settings
from tests.support import REPO, TINY_KEY
from tests.support.vllm_command import flags as flags_in
from tests.unit.runtime.conftest import Lines


def prepared(options: ServeOptions, environ: dict[str, str] | None = None):  # type: ignore[no-untyped-def]
    env = dict(environ or {})
    return prepare(options, load_settings(env), env, FakeGpuBackend(host("l4")))


def engine_config(plan: LaunchPlan) -> dict[str, Any]:
    """The engine contract as the engine process would receive it."""
    data: dict[str, Any] = json.loads(plan.engine_env()[CONTRACT_ENV])
    return data


def test_recipe_mode_loads_the_shim_with_family_and_trace(tmp_path: Path, runtime_log: Lines) -> None:
    trace = tmp_path / "t.jsonl"
    ready = prepared(ServeOptions(context_key=TINY_KEY, request_trace="standard", trace_file=str(trace)))
    plan = ready.plan
    assert flags_in(plan.argv)["--scheduler-cls"] == SCHEDULER_CLS
    config = engine_config(plan)
    assert config["ordering"]["family"] == "fcfs"
    assert isinstance(config["tracing"], dict)
    assert config["tracing"]["level"] == "standard" and config["tracing"]["file"] == str(trace)
    assert not trace.exists()  # preparing creates nothing; serve() creates the file before launch
    assert "request trace:      standard -> file " + str(trace) in describe_prepared(ready, ServeOptions(), {})
    assert [line for line in runtime_log.lines if "trace" in line.lower()] == [
        f"request trace: standard -> file {trace}"]


def test_override_mode_traces_with_the_fcfs_family(tmp_path: Path) -> None:
    ready = prepared(ServeOptions(request_trace="full", trace_file=str(tmp_path / "t.jsonl"),
                                  trace_endpoint="http://collector:4318", trace_format="otlp",
                                  vllm_args=["/models/tiny", "--dtype", "bfloat16"]))
    assert ready.plan.mode == "override"
    assert flags_in(ready.plan.argv)["--scheduler-cls"] == SCHEDULER_CLS
    config = engine_config(ready.plan)
    assert config["ordering"]["family"] == "fcfs"
    assert config["tracing"]["otlp"] == {"endpoint": "http://collector:4318/v1/traces", "protocol": "http/protobuf"}


def test_sink_without_level_fails_before_launch(tmp_path: Path) -> None:
    with pytest.raises(UsageError) as info:
        prepared(ServeOptions(context_key=TINY_KEY, trace_file=str(tmp_path / "t.jsonl")))
    assert "--request-trace is off" in info.value.message
    result = CliRunner().invoke(cli.app, ["serve", "--context-key", TINY_KEY, "--trace-endpoint", "http://c:4317",
                                          "--trace-format", "otlp"], env={"CF_LOG_DIR": str(tmp_path / "logs")})
    assert result.exit_code == 2, result.output
    assert "error: --trace-endpoint given but --request-trace is off" in result.output
    assert "fix: add --request-trace standard" in result.output
    assert not (tmp_path / "logs").exists()  # nothing was launched


def test_level_without_sink_warns_once_and_traces_nothing(runtime_log: Lines) -> None:
    ready = prepared(ServeOptions(context_key=TINY_KEY, request_trace="full"))
    warnings = [line for line in runtime_log.lines if "no sink" in line]
    assert len(warnings) == 1 and "tracing stays off" in warnings[0]
    assert engine_config(ready.plan)["tracing"] is None
    assert not [line for line in runtime_log.lines if "REQUEST TRACE LEVEL full" in line]


def test_full_level_logs_a_prominent_warning(tmp_path: Path, runtime_log: Lines) -> None:
    prepared(ServeOptions(context_key=TINY_KEY, request_trace="full", trace_file=str(tmp_path / "t.jsonl")))
    banner = next(line for line in runtime_log.lines if "REQUEST TRACE LEVEL full" in line)
    assert banner.count("!" * 20) >= 2 and str(tmp_path / "t.jsonl") in banner


def test_unknown_family_fails_before_launch(tmp_path: Path) -> None:
    recipe = (REPO / "recipes" / "cf-tiny--bf16--chat--cpu.yaml").read_text()
    recipe = recipe.replace("key: cf-tiny:bf16:chat:cpu", "key: cf-tiny-odd:bf16:chat:cpu")
    recipe = recipe.replace("family: fcfs", "family: no-such-family")
    (tmp_path / "cf-tiny-odd--bf16--chat--cpu.yaml").write_text(recipe)
    with pytest.raises(CarbonForgeError) as info:
        prepared(ServeOptions(context_key="cf-tiny-odd:bf16:chat:cpu"), {"CF_RECIPES_DIR": str(tmp_path)})
    assert "no-such-family" in info.value.message and "fcfs" in info.value.remedy


def test_another_scheduler_class_replaces_ours(tmp_path: Path) -> None:
    args = ["/models/tiny", "--scheduler-cls", "my.Scheduler"]
    ready = prepared(ServeOptions(vllm_args=args))
    assert flags_in(ready.plan.argv)["--scheduler-cls"] == "my.Scheduler"
    assert ready.plan.argv.count("--scheduler-cls") == 1 and ready.plan.contract is None
    assert CONTRACT_ENV not in ready.plan.engine_env()
    assert any("not loaded" in note for note in ready.plan.notes)
    with pytest.raises(UsageError, match="replaces it"):
        prepared(ServeOptions(vllm_args=args, request_trace="standard", trace_file=str(tmp_path / "t")))


def test_trace_file_is_created_before_launch_owner_only_at_full(tmp_path: Path) -> None:
    full = tmp_path / "logs" / "full.jsonl"
    _create_trace_file(TraceConfig(level="full", file=str(full)))
    assert stat.S_IMODE(os.stat(full).st_mode) == 0o600
    blocked = tmp_path / "dir.jsonl"
    blocked.mkdir()
    with pytest.raises(CarbonForgeError) as info:
        _create_trace_file(TraceConfig(level="standard", file=str(blocked)))
    assert "cannot create the trace file" in info.value.message and "--trace-file" in info.value.remedy


@pytest.mark.timeout(10)  # without the check, this open would block forever
def test_a_fifo_as_trace_file_is_refused_at_once(tmp_path: Path) -> None:
    fifo = tmp_path / "trace.jsonl"
    os.mkfifo(fifo)
    with pytest.raises(CarbonForgeError) as refused:  # no reader: an open for writing would block forever
        _create_trace_file(TraceConfig(level="standard", file=str(fifo)))
    assert "a FIFO, not a regular file" in refused.value.message and "--trace-file" in refused.value.remedy


@pytest.mark.parametrize("dp_args", [["--data-parallel-size", "2"], ["-dp", "2"], ["--data_parallel_size=2"],
                                     ["-dp=2"]])
def test_data_parallel_gives_each_rank_its_own_trace_file(dp_args: list[str], tmp_path: Path,
                                                           runtime_log: Lines) -> None:
    trace = tmp_path / "traces" / "requests.jsonl"
    ready = prepared(ServeOptions(request_trace="full", trace_file=str(trace),
                                  vllm_args=["/models/tiny", "--dtype", "bfloat16", *dp_args]))
    config = engine_config(ready.plan)
    assert config["tracing"]["data_parallel_size"] == 2 and config["tracing"]["file"] == str(trace)
    pattern = str(tmp_path / "traces" / "requests.dp<rank>.jsonl")
    assert f"request trace:      full -> file {pattern}" in describe_prepared(ready, ServeOptions(), {})
    assert any(f"each rank writes its own file: {pattern}" in line and f"trace summarize {trace.parent}" in line
               for line in runtime_log.lines), runtime_log.lines
    # before launch only the directory is made and checked: each rank creates its own file
    _create_trace_file(ready.trace)
    assert trace.parent.is_dir() and list(trace.parent.iterdir()) == []


def test_a_recipe_with_data_parallel_traces_per_rank(tmp_path: Path) -> None:
    from carbonforge_runtime.core.contract import rank_file

    key = "qwen3.6-27b:fp8:agentic:h100x8"
    ready = prepare(ServeOptions(context_key=key, request_trace="standard", trace_file=str(tmp_path / "t.jsonl"),
                                 skip_preflight=True, dry_run=True),
                    load_settings({}), {}, FakeGpuBackend(host("h100", count=8)))
    assert engine_config(ready.plan)["tracing"]["data_parallel_size"] == 4
    assert ready.trace is not None and ready.trace.file_of_rank(3) == str(tmp_path / "t.dp3.jsonl")
    assert rank_file("/v/requests", 1) == "/v/requests.dp1" and rank_file("/v/.t", 0) == "/v/.t.dp0"
    assert rank_file("a.b/c.jsonl.gz", 2) == "a.b/c.jsonl.dp2.gz"


def test_without_data_parallel_one_file_as_before(tmp_path: Path) -> None:
    ready = prepared(ServeOptions(request_trace="standard", trace_file=str(tmp_path / "t.jsonl"),
                                  vllm_args=["/models/tiny", "--data-parallel-size", "1", "-tp", "2"]))
    assert engine_config(ready.plan)["tracing"]["data_parallel_size"] == 1
    assert ready.trace is not None and ready.trace.file_of_rank(0) == str(tmp_path / "t.jsonl")
