"""Differential check: the gate's idea of the served model is vLLM 0.32's own.

For argument lists built from flags that matter (``--model`` in every form, dotted JSON flags,
``--config``, underscores, abbreviations, positionals), whenever the gate names a model, vLLM's
real argument parser (the one ``python -m vllm.entrypoints.openai.api_server`` uses) must either
refuse the arguments or parse exactly that model.
"""

from __future__ import annotations

import argparse
import contextlib
import io
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from carbonforge_runtime.errors import LicenseError
from carbonforge_runtime.runtime.vllm_cli.served_model import resolve_model

pytest.importorskip("vllm")


@pytest.fixture(scope="module")
def vllm_model() -> Callable[[list[str]], str | None]:
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser(description="test"))

    def parse(args: list[str]) -> str | None:
        # The runtime turns a positional first argument into --model (build_override_plan).
        argv = ["--model", args[0], *args[1:]] if args and not args[0].startswith("-") else list(args)
        with contextlib.redirect_stderr(io.StringIO()):
            try:
                namespace: argparse.Namespace = parser.parse_args(argv)
            except (SystemExit, Exception):
                return None
        return str(namespace.model)

    return parse


@pytest.fixture(scope="module")
def configs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    base = tmp_path_factory.mktemp("vllm-configs")
    files = {
        "premium": "model: premium/model\n",
        "free": "model: free/model\ndtype: bfloat16\n",
        "none": "dtype: bfloat16\nenforce_eager: true\n",
        "list": "model: [premium/model, free/model]\n",
        "underscore": "max_model_len: 256\nmodel: free/model\n",
    }
    out = {}
    for name, text in files.items():
        path = Path(base, f"{name}.yaml")
        path.write_text(text)
        out[name] = str(path)
    return out


def ours(args: list[str]) -> str | None:
    try:
        return resolve_model(args).model
    except LicenseError:
        return None


FIXED = [
    ["premium/model"],
    ["free/model", "--model", "premium/model"],
    ["--model", "free/model", "--model=premium/model"],
    ["--model", "free/model", "--hf-overrides.x", "--model", "premium/model"],
    ["--hf-overrides.x", "--model", "premium/model"],
    ["--model", "free/model", "--hf-overrides.x=1"],
    ["--mod", "premium/model"],
    ["--MODEL", "premium/model"],
    ["--model.a", "premium/model"],
    ["--model_", "premium/model"],
    ["--dtype", "bfloat16", "premium/model"],
    ["--enforce-eager", "premium/model", "--model", "free/model"],
    ["--model", "free/model", "premium/model"],
    ["--model", "-premium/model"],
    ["--model=-premium/model"],
    ["--model", "free/model", "--", "--model", "premium/model"],
    ["-O3", "--model", "free/model"],
]


def test_fixed_cases_agree_with_vllm(vllm_model: Callable[[list[str]], str | None],
                                     configs: dict[str, str]) -> None:
    cases = [
        *FIXED,
        ["--config", configs["premium"]],
        ["--config", configs["premium"], "--model", "free/model"],
        ["--model", "free/model", "--config", configs["premium"]],
        ["free/model", "--config", configs["premium"]],
        ["--config", configs["list"]],
        ["--config", configs["underscore"], "--max_model_len", "128"],
        ["--config=" + configs["premium"], "--model", "free/model"],
    ]
    resolved = 0
    for args in cases:
        mine = ours(args)
        if mine is not None:
            resolved += 1
            assert vllm_model(args) in (None, mine), args
    assert resolved >= 8


TOKENS = ["--model", "--model=premium/model", "--model=free/model", "premium/model", "free/model",
          "--dtype", "bfloat16", "--enforce-eager", "--hf-overrides.x", "--hf-overrides.y=1",
          "--served-model-name", "--served_model_name", "name", "--max_model_len", "128", "--mod",
          "-O3", "--model.a", "--tokenizer", "--", "--Model", "-1"]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow])
@given(st.lists(st.sampled_from([*TOKENS, "CONFIG"]), max_size=8), st.sampled_from(
    ["premium", "free", "none", "list", "underscore"]))
def test_random_argument_lists_agree_with_vllm(vllm_model: Callable[[list[str]], str | None],
                                               configs: dict[str, str], tokens: list[str], config: str) -> None:
    args: list[str] = []
    for token in tokens:
        args += ["--config", configs[config]] if token == "CONFIG" else [token]
    mine = ours(args)
    if mine is not None:
        theirs = vllm_model(args)
        assert theirs in (None, mine), (args, mine, theirs)
