"""The runtime's reader of vLLM command lines, held to vLLM 0.32's own parser.

The hand-written cases pin the spellings operators use; the property test builds random command
lines from those spellings and, whenever vLLM's real parser (the one the API server module uses)
accepts one, demands that the reader finds the same value for every option the runtime reads.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from carbonforge_runtime.runtime.vllm_cli.args import normalise, read

REPO = Path(__file__).resolve().parents[4]


@pytest.mark.parametrize("args", [
    ["--shutdown-timeout", "5"], ["--shutdown_timeout", "5"], ["--shutdown-timeout=5"], ["--shutdown_timeout=5"],
    ["--shutdown-t", "5"], ["--shutdown-timeout", "100", "--shutdown_timeout", "5"],
    ["--shutdown_timeout=100", "--shutdown-timeout", "5"],
])
def test_every_spelling_of_a_flag_is_one_option_and_the_last_wins(args: list[str]) -> None:
    assert read(args).value("--shutdown-timeout") == "5"


def test_short_forms_negations_and_joined_values() -> None:
    args = read(["-dp", "2", "-qfp8", "--no_enable_prefix_caching", "-O3", "-tp=4", "--enable-expert-parallel"])
    assert args.value("--data-parallel-size") == "2"
    assert args.value("--quantization") == "fp8"
    assert args.switch("--enable-prefix-caching") is False
    assert args.switch("--enable-expert-parallel") is True
    assert args.value("--optimization-level") == "3"
    assert args.value("--tensor-parallel-size") == "4"
    assert args.switch("--enforce-eager") is None


def test_values_are_counted_as_the_option_declares() -> None:
    args = read(["--served-model-name", "a", "b", "--enforce-eager", "--middleware", "x.A", "--middleware=y.B",
                 "--compilation-config.level", "3", "--port", "9000"])
    assert args.values("--served-model-name") == ["a", "b"]
    assert args.values("--middleware") == ["x.A", "y.B"]  # appends: every occurrence counts
    assert args.value("--port") == "9000"
    assert args.given("--compilation-config") and args.value("--compilation-config") is None


def test_without_removes_each_occurrence_whole() -> None:
    args = ["--model", "m", "--port=1", "--host", "h", "--served_model_name", "a", "b", "--enforce-eager"]
    assert read(args).without(["--port", "--served-model-name"]) == ["--model", "m", "--host", "h", "--enforce-eager"]


def test_normalise_is_vllms_spelling_fix() -> None:
    assert normalise("--max_num_seqs=a_b") == "--max-num-seqs=a_b"
    assert normalise("--hf_overrides.some_field") == "--hf-overrides.some_field"
    assert normalise("model_name") == "model_name"


def test_the_flag_table_is_the_installed_vllms() -> None:
    pytest.importorskip("vllm")
    result = subprocess.run([sys.executable, str(REPO / "scripts" / "gen_vllm_flags.py"), "--check"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr


# --- the property test against vLLM's parser -----------------------------------------------------

TOKENS = [
    "--shutdown-timeout", "--shutdown_timeout", "--shutdown-t", "--shutdown-timeout=7", "--shutdown_timeout=9", "5",
    "12", "--scheduler-cls", "--scheduler_cls", "--scheduler_cls=a.B", "x.Y", "-dp", "-dp=2",
    "--data-parallel-size", "--data_parallel_size=3", "2", "-d", "--port", "--port=8123", "8100", "--host",
    "0.0.0.0", "--served-model-name", "--served_model_name", "a", "b", "--enable-prefix-caching",
    "--no-enable-prefix-caching", "--no_enable_prefix_caching", "--enable-prefix", "--enforce-eager",
    "--compilation-config.mode", "--compilation-config.mode=3", "-O3", "-O", "-qfp8", "-q", "fp8", "-1",
    "--unknown-flag", "--max-num-seqs", "--max_num_seqs=8", "--model", "m/x", "--model=m/y", "--middleware",
    "mw.A", "--hf-token", "--",
]

#: (vLLM's attribute, the runtime's option, how the reader's answer is compared)
READ: list[tuple[str, str, str]] = [
    ("shutdown_timeout", "--shutdown-timeout", "int"), ("scheduler_cls", "--scheduler-cls", "str"),
    ("data_parallel_size", "--data-parallel-size", "int"), ("port", "--port", "int"), ("host", "--host", "str"),
    ("served_model_name", "--served-model-name", "list"), ("enable_prefix_caching", "--enable-prefix-caching", "bool"),
    ("max_num_seqs", "--max-num-seqs", "int"), ("quantization", "--quantization", "str"),
    ("middleware", "--middleware", "list"), ("model", "--model", "str"),
]


@pytest.fixture(scope="module")
def vllm_parse() -> Callable[[list[str]], argparse.Namespace | None]:
    pytest.importorskip("vllm")
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    def parse(args: list[str]) -> argparse.Namespace | None:
        parser = make_arg_parser(FlexibleArgumentParser(description="test"))
        with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
            try:
                return parser.parse_args(args)
            except (SystemExit, Exception):
                return None

    return parse


def reader_says(args: list[str], flag: str, how: str, default: Any) -> Any:
    parsed = read(args)
    if how == "bool":
        switch = parsed.switch(flag)
        return default if switch is None else switch
    if how == "list":
        values = parsed.values(flag)
        return default if values is None else values
    value = parsed.value(flag)
    if value is None:
        return default
    return int(value) if how == "int" else value


def assert_agrees(vllm_parse: Callable[[list[str]], argparse.Namespace | None], args: list[str]) -> bool:
    namespace = vllm_parse(args)
    if namespace is None:
        return False
    defaults = vllm_parse([])
    assert defaults is not None
    for attribute, flag, how in READ:
        theirs = getattr(namespace, attribute)
        mine = reader_says(args, flag, how, getattr(defaults, attribute))
        assert mine == theirs, (args, flag, mine, theirs)
    return True


def test_fixed_command_lines_agree_with_vllm(vllm_parse: Callable[[list[str]], argparse.Namespace | None]) -> None:
    cases = [
        ["--model", "m", "--shutdown_timeout", "5", "--shutdown-timeout", "30"],
        ["--model", "m", "--shutdown-timeout", "30", "--shutdown_timeout=5"],
        ["--model", "m", "--scheduler_cls", "x.Y", "--scheduler-cls", "a.B", "--scheduler_cls", "x.Y"],
        ["--model", "m", "-dp", "2", "--data_parallel_size=4", "--served_model_name", "a", "b", "--port=8001"],
        ["--model", "m", "-qfp8", "--no_enable_prefix_caching", "--middleware", "a.B", "--middleware", "c.D"],
        ["--model", "m", "--shutdown-t", "3", "--compilation-config.mode", "3", "-O3"],
    ]
    assert all(assert_agrees(vllm_parse, case) for case in cases)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow])
@given(st.lists(st.sampled_from(TOKENS), max_size=10))
def test_random_command_lines_agree_with_vllm(vllm_parse: Callable[[list[str]], argparse.Namespace | None],
                                              tokens: list[str]) -> None:
    assert_agrees(vllm_parse, tokens)


def test_many_generated_command_lines_are_accepted_by_vllm_and_agree(
        vllm_parse: Callable[[list[str]], argparse.Namespace | None]) -> None:
    # A seeded sample, so that the comparison is known to cover command lines vLLM accepts.
    import random

    rng = random.Random(30)
    accepted = 0
    for _ in range(400):
        tokens = ["--model", "m", *rng.choices(TOKENS, k=rng.randint(0, 8))]
        accepted += assert_agrees(vllm_parse, tokens)
    assert accepted >= 60, accepted


# --- what the plan announces and enforces is what vLLM runs with ----------------------------------

def _plan(mode: str, extra: list[str]):  # type: ignore[no-untyped-def]
    from carbonforge_runtime.recipes import load_recipes, shipped_recipes_dir
    from carbonforge_runtime.runtime.planning.plan import ServeOptions, build_plan
    from carbonforge_runtime.settings import load_settings

    recipes = load_recipes([shipped_recipes_dir()])
    if mode == "recipe":
        options = ServeOptions(context_key="cf-tiny:bf16:chat:cpu", vllm_args=extra)
    else:
        options = ServeOptions(vllm_args=["org/model", *extra])
    return build_plan(options, load_settings({}), recipes, {})


DRAIN_SPELLINGS = [["--shutdown-timeout", "5"], ["--shutdown_timeout", "5"], ["--shutdown-timeout=5"],
                   ["--shutdown_timeout=5"], ["--shutdown-t", "5"],
                   ["--shutdown-timeout", "100", "--shutdown_timeout=5"]]


@pytest.mark.parametrize("mode", ["recipe", "override"])
@pytest.mark.parametrize("spelling", DRAIN_SPELLINGS, ids=" ".join)
def test_the_drain_announced_and_enforced_is_the_one_vllm_runs(
        vllm_parse: Callable[[list[str]], argparse.Namespace | None], mode: str, spelling: list[str]) -> None:
    from carbonforge_runtime.runtime.planning.command import engine_args
    from carbonforge_runtime.runtime.planning.plan import ServeOptions, describe_plan
    from carbonforge_runtime.runtime.process.drain import stop_bound_s

    plan = _plan(mode, spelling)
    namespace = vllm_parse(engine_args(plan.launch.argv))
    assert namespace is not None
    assert namespace.shutdown_timeout == 5
    assert plan.launch.drain_timeout_s == 5  # what serve hands the supervisor
    assert stop_bound_s(plan.launch.drain_timeout_s) == 5 + stop_bound_s(0)
    lines = describe_plan(plan, ServeOptions(), {})
    assert any(line.startswith("drain time:") and " 5 s " in line for line in lines), lines
    # The runtime adds no drain of its own when the operator gave one.
    given = read(engine_args(plan.launch.argv)).all("--shutdown-timeout")
    assert len(given) == len(read(spelling).all("--shutdown-timeout"))


@pytest.mark.parametrize("mode", ["recipe", "override"])
@pytest.mark.parametrize("spelling", [["--scheduler_cls", "x.Y"], ["--scheduler-cls=x.Y"], ["--scheduler_cls=x.Y"]],
                         ids=" ".join)
def test_the_users_scheduler_class_wins_in_any_spelling(
        vllm_parse: Callable[[list[str]], argparse.Namespace | None], mode: str, spelling: list[str]) -> None:
    from carbonforge_runtime.core.contract import SCHEDULER_CLS
    from carbonforge_runtime.runtime.planning.command import engine_args

    plan = _plan(mode, spelling)
    namespace = vllm_parse(engine_args(plan.launch.argv))
    assert namespace is not None and namespace.scheduler_cls == "x.Y"
    assert SCHEDULER_CLS not in plan.launch.argv
    assert plan.launch.contract is None
    assert any("x.Y given: the CarbonForge scheduler is not loaded" in note for note in plan.launch.notes)
    if mode == "recipe":
        from carbonforge_runtime.runtime.planning.plan import ServeOptions, describe_plan

        lines = describe_plan(plan, ServeOptions(), {})
        assert "scheduler:          x.Y (--scheduler-cls; the recipe's fcfs is not loaded)" in lines, lines


@pytest.mark.parametrize("mode", ["recipe", "override"])
def test_a_repeated_flag_is_read_as_vllm_reads_it(
        vllm_parse: Callable[[list[str]], argparse.Namespace | None], mode: str) -> None:
    from carbonforge_runtime.runtime.planning.command import engine_args

    extra = ["--port", "8001", "--port=8002", "--served_model_name", "a", "--served-model-name", "b",
             "-dp", "1", "--data_parallel_size=1", "--max_num_seqs", "3", "--max-num-seqs=2"]
    plan = _plan(mode, extra)
    namespace = vllm_parse(engine_args(plan.launch.argv))
    assert namespace is not None
    assert (plan.launch.port, namespace.port) == (8002, 8002)
    assert (plan.launch.served_model_name, namespace.served_model_name) == ("b", ["b"])
    assert namespace.max_num_seqs == 2
    if mode == "recipe":
        knob = next(k for k in plan.launch.knobs if k.name == "max_num_seqs")
        assert (knob.value, knob.source) == ("2", "extra flag after --")


@pytest.mark.parametrize("args", [["--node_rank", "1"], ["-r", "1"], ["--nnodes=2"], ["-n2"], ["--master_addr", "h"]])
def test_group_flags_are_refused_in_every_spelling(args: list[str]) -> None:
    from carbonforge_runtime.errors import UsageError
    from carbonforge_runtime.runtime.group.placement import check_no_group_flags

    with pytest.raises(UsageError, match="the runtime places this host in its group itself"):
        check_no_group_flags(["--enforce-eager", *args])
