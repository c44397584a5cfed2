"""A premium model named only as the speculative draft model is gated like the main model."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from carbonforge_runtime.errors import LicenseError
from carbonforge_runtime.gpu.fake import FakeGpuBackend, host
from carbonforge_runtime.recipes import Recipe, load_recipes, recipe_dirs
from carbonforge_runtime.runtime.licensing import LicenseInvalid
from carbonforge_runtime.runtime.licensing.gate import CANNOT_GATE_DRAFT, draft_models, gate_draft_models
from carbonforge_runtime.runtime.serve.launch import ServeOptions, prepare
from carbonforge_runtime.settings import load_settings
from tests.support import TINY_KEY
from tests.support.licensed_runtime import Signer

PREMIUM = "Qwen/Qwen3-Coder-Next-FP8"  # model of the shipped premium recipe qwen3-coder-next:fp8:coding:h100x4
PREMIUM_KEY = "qwen3-coder-next:fp8:coding:h100x4"
SIGNER = Signer("draft-test-1")
SPEC = json.dumps({"model": PREMIUM, "num_speculative_tokens": 3})


@pytest.fixture(scope="module")
def recipes() -> dict[str, Recipe]:
    return load_recipes(recipe_dirs(None))


@pytest.mark.parametrize("args", [
    ["--speculative-config", SPEC],
    ["--speculative-config=" + SPEC],
    ["--speculative_config", SPEC],
    ["-sc", SPEC],
    ["-sc=" + SPEC],
    ["--speculative-config.model", PREMIUM],
    ["--speculative-config.model=" + PREMIUM],
    ["--speculative_config.model", json.dumps(PREMIUM)],
    ["-sc.model", PREMIUM],
    ["--spec-model", PREMIUM],
    ["--spec_model=" + PREMIUM],
    ["--dtype", "bfloat16", "--speculative-config.num_speculative_tokens", "3", "--spec-model", PREMIUM],
])
def test_every_form_vllm_accepts_names_the_draft(args: list[str]) -> None:
    assert draft_models(["--model", "m", *args]) == [PREMIUM]


def test_a_config_file_names_the_draft(tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text(f"model: m\nspeculative_config:\n  model: {PREMIUM}\n  num_speculative_tokens: 2\n")
    assert draft_models(["--config", str(config)]) == [PREMIUM]
    config.write_text(f"model: m\nspec-model: {PREMIUM}\n")
    assert draft_models(["--config", str(config)]) == [PREMIUM]


@pytest.mark.parametrize("args", [
    ["--speculative-config", json.dumps({"method": "ngram", "num_speculative_tokens": 3})],
    ["--speculative-config", "None"],
    ["--spec-method", "ngram", "--spec-tokens", "3"],
    ["--seed", "1"],
])
def test_no_draft_model(args: list[str]) -> None:
    assert draft_models(["--model", "m", *args]) == []


@pytest.mark.parametrize("args", [["--speculative", SPEC], ["--speculative-conf.model", PREMIUM],
                                  ["--spec-mod", PREMIUM], ["-sc" + SPEC]])
def test_abbreviations_are_refused_not_guessed(args: list[str]) -> None:
    with pytest.raises(LicenseError) as info:
        draft_models(["--model", "m", *args])
    assert info.value.message.startswith(CANNOT_GATE_DRAFT)


def test_a_premium_draft_needs_a_licence_in_recipe_mode(tmp_path: Path) -> None:
    env = {"CF_LICENSE_FILE": str(tmp_path / "none"), "CF_TINY_MODEL_DIR": "/models/tiny"}
    options = ServeOptions(context_key=TINY_KEY, vllm_args=["--speculative-config", SPEC])
    with pytest.raises(LicenseInvalid) as info:
        prepare(options, load_settings(env), env, FakeGpuBackend(host(None)))
    assert f"speculative draft model {PREMIUM!r} belongs to premium-plan recipe(s) {PREMIUM_KEY}" in info.value.message
    assert "no license key provided" in info.value.message


def test_a_premium_draft_needs_a_licence_in_the_full_override(tmp_path: Path) -> None:
    env = {"CF_LICENSE_FILE": str(tmp_path / "none")}
    options = ServeOptions(vllm_args=["/models/free-model", "--speculative-config.model", PREMIUM])
    with pytest.raises(LicenseInvalid, match="speculative draft model"):
        prepare(options, load_settings(env), env, FakeGpuBackend(host(None)))


def test_an_entitled_licence_lets_the_draft_through(recipes: dict[str, Recipe]) -> None:
    now = time.time()
    args = ["--model", "/models/free-model", "--spec-model", PREMIUM]
    granted = load_settings({"CARBONFORGE_LICENSE_KEY": SIGNER.issue((PREMIUM_KEY,))})
    claims = gate_draft_models(args, recipes, granted, now, keys=lambda: SIGNER.table)
    assert claims is not None and PREMIUM_KEY in claims.entitlements
    other = load_settings({"CARBONFORGE_LICENSE_KEY": SIGNER.issue(("qwen3-100b:fp8:chat:h100x2",))})
    with pytest.raises(LicenseInvalid, match="not entitled"):
        gate_draft_models(args, recipes, other, now, keys=lambda: SIGNER.table)
    free = ["--model", "m", "--spec-model", "Qwen/Qwen3-32B-FP8"]
    assert gate_draft_models(free, recipes, load_settings({}), now) is None  # a free draft needs nothing
