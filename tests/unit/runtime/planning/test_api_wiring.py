"""How the plan wires the API: the request-contract middleware, the recipe's parsers, the effort
mapping handed to the API server, and API keys (kept off every command line)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from carbonforge_runtime.core.api_contract import API_CONTRACT_VARIABLE, ApiContract
from carbonforge_runtime.errors import UsageError
from carbonforge_runtime.recipes import Recipe, load_recipes, recipe_dirs
from carbonforge_runtime.runtime.planning.command import MIDDLEWARE
from carbonforge_runtime.runtime.planning.plan import ServeOptions, build_plan, command_line, describe_plan
from carbonforge_runtime.runtime.serve.api_key import read_api_key
from carbonforge_runtime.settings import load_settings
from tests.support import group_env
from tests.support.vllm_command import flags as flags_in

SHIPPED: dict[str, Recipe] = load_recipes(recipe_dirs(None))
OPEN_WARNING = "takes requests from anyone who can reach it"


def plan_for(key: str | None = None, vllm_args: list[str] | None = None, api_key: str | None = None,
             environ: dict[str, str] | None = None):  # type: ignore[no-untyped-def]
    options = ServeOptions(context_key=key, vllm_args=vllm_args or [])
    environ = environ or (group_env(SHIPPED[key]) if key in SHIPPED else {})
    return build_plan(options, load_settings(environ), SHIPPED, environ, api_key=api_key)


def served_contract(plan) -> ApiContract:  # type: ignore[no-untyped-def]
    return ApiContract.from_json(plan.launch.env[API_CONTRACT_VARIABLE])


@pytest.mark.parametrize("key", sorted(SHIPPED))
def test_every_recipe_loads_the_middleware_and_its_parsers(key: str) -> None:
    plan = plan_for(key)
    given = flags_in(plan.launch.argv)
    api = SHIPPED[key].api
    assert api is not None
    assert given["--middleware"] == MIDDLEWARE
    assert given.get("--reasoning-parser") == api.reasoning_parser
    assert given.get("--tool-call-parser") == api.tool_call_parser
    assert ("--enable-auto-tool-choice" in given) == (api.tool_call_parser is not None)
    contract = served_contract(plan)
    assert contract == plan.launch.api
    assert contract.reasoning == (api.reasoning_parser is not None)
    assert contract.tools == (api.tool_call_parser is not None)


def test_the_effort_budgets_travel_to_the_api_server() -> None:
    contract = served_contract(plan_for("qwen3-32b:fp8:chat:a100-80x1"))
    assert dict(contract.thinking_budget) == {"low": 1024, "medium": 4096, "xhigh": None}
    lines = describe_plan(plan_for("qwen3-32b:fp8:chat:a100-80x1"), ServeOptions(), {})
    assert "reasoning parser:   qwen3" in lines
    assert "tool-call parser:   hermes, auto tool choice" in lines
    assert "thinking budget:    low 1024 tokens, medium 4096 tokens, xhigh no cap; enable_thinking false: none" \
        in lines
    coder = describe_plan(plan_for("qwen3-coder-32b:fp8:coding:a100-80x1"), ServeOptions(), {})
    assert "reasoning parser:   none (the model does not reason)" in coder


def test_parsers_given_after_the_double_dash_win() -> None:
    plan = plan_for("qwen3-32b:fp8:chat:a100-80x1", ["--tool-call-parser", "pythonic", "--reasoning-parser", "hf"])
    assert plan.launch.argv.count("--tool-call-parser") == 1 and plan.launch.argv.count("--reasoning-parser") == 1
    assert flags_in(plan.launch.argv)["--tool-call-parser"] == "pythonic"
    contract = served_contract(plan)
    assert contract.tools and contract.reasoning and not contract.thinking_budget  # budgets were the recipe's


def test_the_full_override_gets_the_middleware_and_a_contract_from_its_flags() -> None:
    plain = served_contract(plan_for(vllm_args=["/models/m"]))
    assert plain == ApiContract()
    plan = plan_for(vllm_args=["/models/m", "--reasoning-parser", "qwen3", "--tool-call-parser", "hermes"])
    assert flags_in(plan.launch.argv)["--middleware"] == MIDDLEWARE
    assert served_contract(plan) == ApiContract(reasoning=True, tools=True)


def test_an_api_key_reaches_vllm_through_its_environment_only() -> None:
    plan = plan_for("cf-tiny:bf16:chat:cpu", api_key="k-secret-1",
                    environ={"CF_API_KEY": "k-secret-1", "CF_API_KEY_FILE": "/run/secrets/k"})
    env = plan.launch.env
    assert env["VLLM_API_KEY"] == "k-secret-1"
    assert "CF_API_KEY" not in env and "CF_API_KEY_FILE" not in env
    assert "k-secret-1" not in " ".join(plan.launch.argv) and "k-secret-1" not in command_line(plan)
    assert not [m for m in plan.messages if OPEN_WARNING in m.text]
    lines = describe_plan(plan, ServeOptions(), {})
    assert "API keys:           required (Authorization: Bearer)" in lines
    assert not any("k-secret-1" in line for line in lines)


def test_an_open_api_is_said_once() -> None:
    plan = plan_for("cf-tiny:bf16:chat:cpu")
    warnings = [m for m in plan.messages if OPEN_WARNING in m.text]
    assert len(warnings) == 1 and warnings[0].level == "warning" and "CF_API_KEY" in warnings[0].text
    # vLLM's own --api-key counts as a key (it is moved to VLLM_API_KEY)
    keyed = plan_for("cf-tiny:bf16:chat:cpu", ["--api-key", "abc"])
    assert keyed.launch.env["VLLM_API_KEY"] == "abc" and not [m for m in keyed.messages if OPEN_WARNING in m.text]


def key_settings(tmp_path: Path, text: str | bytes | None, **extra: str):  # type: ignore[no-untyped-def]
    path = tmp_path / "key"
    if isinstance(text, str):
        path.write_text(text)
    elif isinstance(text, bytes):
        path.write_bytes(text)
    return load_settings({"CF_API_KEY_FILE": str(path), **extra})


def test_the_key_file(tmp_path: Path) -> None:
    assert read_api_key(load_settings({})) is None
    assert read_api_key(key_settings(tmp_path, "s3cret\n")) == "s3cret"
    assert read_api_key(key_settings(tmp_path, "from-file", CF_API_KEY="from-env")) == "from-env"


@pytest.mark.parametrize(("content", "problem"), [
    (None, "cannot be read"), ("", "holds no key"), ("two words", "holds no key"),
    (b"\xff\xfe", "is not UTF-8"), ("x" * 5000, "too large"),
])
def test_bad_key_files_name_the_variable(tmp_path: Path, content: str | bytes | None, problem: str) -> None:
    with pytest.raises(UsageError) as caught:
        read_api_key(key_settings(tmp_path, content))
    assert "CF_API_KEY_FILE=" in caught.value.message and problem in caught.value.message
    assert "x" * 20 not in caught.value.render()


def test_a_fifo_or_directory_as_key_file_is_refused_at_once(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "key")
    with pytest.raises(UsageError, match="not a regular file"):
        read_api_key(load_settings({"CF_API_KEY_FILE": str(tmp_path / "key")}))
    with pytest.raises(UsageError):
        read_api_key(load_settings({"CF_API_KEY_FILE": str(tmp_path)}))
