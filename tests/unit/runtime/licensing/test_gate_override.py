"""The override mode's gate: which model vLLM would serve, and every way to disguise it."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from carbonforge_runtime.cli import main as cli
from carbonforge_runtime.errors import LicenseError
from carbonforge_runtime.gpu.fake import FakeGpuBackend, host
from carbonforge_runtime.recipes import Recipe, load_recipes, recipe_dirs
from carbonforge_runtime.runtime.licensing import LicenseInvalid, keys
from carbonforge_runtime.runtime.licensing.gate import gate_override, premium_owners
from carbonforge_runtime.runtime.vllm_cli.served_model import CANNOT_GATE, model_matches, resolve_model
from carbonforge_runtime.settings import load_settings
from tests.support import TEST_RECIPES
from tests.support.licensed_runtime import Signer

PREMIUM = "Qwen/Qwen3-Coder-Next-FP8"  # model of the shipped premium recipe qwen3-coder-next:fp8:coding:h100x4
PREMIUM_KEY = "qwen3-coder-next:fp8:coding:h100x4"
FREE = "Qwen/Qwen3-32B-FP8"
SIGNER = Signer("gate-test-1")


@pytest.fixture(scope="module")
def recipes() -> dict[str, Recipe]:
    return load_recipes(recipe_dirs(str(TEST_RECIPES)))


def served(args: list[str]) -> str:
    return resolve_model(args).model


def refused(args: list[str]) -> str:
    with pytest.raises(LicenseError) as info:
        resolve_model(args)
    assert info.value.message.startswith(CANNOT_GATE)
    assert info.value.remedy
    return info.value.message


# --- resolution ---------------------------------------------------------------------------------

@pytest.mark.parametrize(("args", "model"), [
    ([PREMIUM, "--dtype", "bfloat16"], PREMIUM),
    (["--model", PREMIUM], PREMIUM),
    (["--model=" + PREMIUM], PREMIUM),
    (["--dtype", "bfloat16", "--enforce-eager", "--model", PREMIUM, "--port", "8001"], PREMIUM),
    (["--model", PREMIUM, "--model=" + PREMIUM], PREMIUM),
    ([PREMIUM, "--model", PREMIUM.lower() + "/"], PREMIUM.lower() + "/"),
    (["--served_model_name", "free", "--model", PREMIUM], PREMIUM),
    (["--model=a=b"], "a=b"),
    # A dotted JSON flag consumes the next argument, even one that looks like a flag (as vLLM does).
    (["--model", FREE, "--hf-overrides.x", "--model", PREMIUM], FREE),
    (["--model", FREE, "--hf-overrides.x=1", "--max_model_len", "128"], FREE),
])
def test_model_resolution(args: list[str], model: str) -> None:
    assert served(args) == model


@pytest.mark.parametrize("args", [
    [],
    ["--dtype", "bfloat16"],
    ["--model"],
    ["--model", "--dtype", "bfloat16"],
    ["--model="],
    ["--model", "   "],
    [""],
    [FREE, "--model", PREMIUM],                       # positional and flag at once, different models
    ["--model", FREE, "--model=" + PREMIUM],           # repeated --model, different models
    ["--mod", PREMIUM],                                # argparse abbreviation
    ["--mode=" + PREMIUM],
    ["--MODEL", PREMIUM],                              # case
    ["--Model=" + PREMIUM],
    ["--model.name", PREMIUM],                         # dotted JSON form
    ["--model", FREE, "--", "--model", PREMIUM],       # bare -- inside vLLM's arguments
    ["--config=conf.yaml", "--model", FREE],           # vLLM ignores --config=FILE
    ["--config", "a.yaml", "--config", "b.yaml"],
    ["--config"],
    ["--config", "/nonexistent/cf-test-config.yaml"],
    ["--config", "settings.json", "--model", FREE],
])
def test_ambiguous_or_missing_model_is_refused(args: list[str]) -> None:
    refused(args)


def test_no_model_message_is_the_documented_one(recipes: dict[str, Recipe]) -> None:
    message = refused(["--dtype", "bfloat16"])
    assert message == f"{CANNOT_GATE}: no model in the vLLM arguments"


def _write(path: Path, text: str) -> str:
    path.write_text(text, encoding="utf-8")
    return str(path)


def test_config_file_model_is_read(tmp_path: Path) -> None:
    config = _write(tmp_path / "serve.yaml", f"model: {PREMIUM}\ndtype: bfloat16\nenforce_eager: true\n")
    choice = resolve_model(["--config", config, "--port", "8001"])
    assert (choice.model, choice.origin) == (PREMIUM, f"--config {config}")
    assert served(["--config", config, "--model", PREMIUM]) == PREMIUM
    refused(["--config", config, "--model", FREE])                 # config and command line disagree
    refused([FREE, "--config", config])
    nothing = _write(tmp_path / "nothing.yml", "dtype: bfloat16\n")
    assert served(["--config", nothing, "--model", FREE]) == FREE
    refused(["--config", nothing])
    refused(["--config", _write(tmp_path / "caps.yaml", f"MODEL: {PREMIUM}\n")])
    refused(["--config", _write(tmp_path / "list.yaml", "- model\n")])
    refused(["--config", _write(tmp_path / "bad.yaml", "model: [unclosed\n")])
    refused(["--config", _write(tmp_path / "empty.yaml", "model: ''\n")])


# --- identity: is this model premium? -----------------------------------------------------------

@pytest.mark.parametrize("spelling", [
    PREMIUM, PREMIUM.lower(), PREMIUM.upper(), f"  {PREMIUM} ", f"{PREMIUM}/", f"{PREMIUM}//",
    f"https://huggingface.co/{PREMIUM}", f"hf.co/{PREMIUM}", "mirror-org/Qwen3-Coder-Next-FP8",
    "/models/Qwen3-Coder-Next-FP8", "/models/Qwen/Qwen3-Coder-Next-FP8/", "./Qwen3-Coder-Next-FP8",
    "/var/cache/huggingface/hub/models--Qwen--Qwen3-Coder-Next-FP8/snapshots/0123abcd",
])
def test_spellings_of_a_premium_model_are_premium(spelling: str, recipes: dict[str, Recipe]) -> None:
    assert [r.key_text for r in premium_owners(spelling, recipes)] == [PREMIUM_KEY]


def test_local_directories_are_identified(tmp_path: Path, recipes: dict[str, Recipe]) -> None:
    weights = tmp_path / "Qwen3-Coder-Next-FP8"
    weights.mkdir()
    innocent = tmp_path / "innocent-link"
    innocent.symlink_to(weights)
    assert premium_owners(str(innocent), recipes)                      # symlink: its target's name counts
    declared = tmp_path / "plain-dir"
    declared.mkdir()
    (declared / "config.json").write_text(json.dumps({"_name_or_path": PREMIUM}))
    assert premium_owners(str(declared), recipes)                      # config.json says what it is
    assert premium_owners(str(declared) + "/", recipes)
    free = tmp_path / "my-finetune"
    free.mkdir()
    (free / "config.json").write_text(json.dumps({"_name_or_path": FREE}))
    assert not premium_owners(str(free), recipes)


@pytest.mark.parametrize("model", [FREE, "Qwen/Qwen2.5-0.5B-Instruct", "carbonforge/tiny-chat", "gpt2",
                                   "/models/Qwen3-Coder-Next-FP8-base-rewrite/x/y"])
def test_free_models_are_not_premium(model: str, recipes: dict[str, Recipe]) -> None:
    assert not premium_owners(model, recipes)


def test_model_matches_is_not_fooled_by_prefixes() -> None:
    assert not model_matches("Qwen/Qwen3-Coder-Next", PREMIUM)
    assert not model_matches("", PREMIUM)
    assert model_matches("QWEN/QWEN3-CODER-NEXT-FP8", PREMIUM)


# --- the gate itself -----------------------------------------------------------------------------

def _settings(licence: str | None = None, **extra: str):  # type: ignore[no-untyped-def]
    env = {"CF_LICENSE_FILE": "/nonexistent/cf-test/license.key", **extra}
    if licence:
        env["CARBONFORGE_LICENSE_KEY"] = licence
    return load_settings(env)


def _gate(args: list[str], recipes: dict[str, Recipe], licence: str | None = None):  # type: ignore[no-untyped-def]
    return gate_override(served(args), args, recipes, _settings(licence), time.time(), keys=lambda: SIGNER.table)


def test_gate_lets_free_models_through_without_a_licence(recipes: dict[str, Recipe]) -> None:
    assert _gate([FREE, "--dtype", "bfloat16"], recipes) is None


@pytest.mark.parametrize("args", [
    [PREMIUM],
    ["--model", PREMIUM.lower()],
    [f" {PREMIUM}/ ", "--dtype", "bfloat16"],
    ["--dtype", "bfloat16", "--model=" + f"https://huggingface.co/{PREMIUM}"],
    ["--model", PREMIUM, "--model", PREMIUM + "/"],
    ["--model", "/var/cache/huggingface/hub/models--Qwen--Qwen3-Coder-Next-FP8/snapshots/ab12"],
])
def test_gate_refuses_premium_models_without_a_licence(args: list[str], recipes: dict[str, Recipe]) -> None:
    with pytest.raises(LicenseInvalid) as info:
        _gate(args, recipes)
    err = info.value
    assert err.reason == "missing" and err.exit_code == 4
    assert "no license key provided" in err.message and "premium-plan" in err.message and PREMIUM_KEY in err.message
    assert "CARBONFORGE_LICENSE_KEY" in err.remedy


def test_gate_with_a_licence(recipes: dict[str, Recipe]) -> None:
    now = int(time.time())
    entitled = SIGNER.issue(entitlements=("qwen3-coder-next:*:*:*",), issued_at=now)
    by_model = SIGNER.issue(entitlements=(f"model={PREMIUM.lower()}",), issued_at=now)
    other = SIGNER.issue(entitlements=("qwen3.6-27b:*:*:*",), issued_at=now)
    expired = SIGNER.issue(issued_at=now - 40 * 86400, days=30)
    assert _gate([PREMIUM], recipes, entitled) is not None
    assert _gate([PREMIUM.upper() + "/"], recipes, by_model) is not None
    with pytest.raises(LicenseInvalid) as info:
        _gate([PREMIUM], recipes, other)
    assert info.value.reason == "not-entitled" and "qwen3.6-27b:*:*:*" in info.value.message
    with pytest.raises(LicenseInvalid) as info:
        _gate([PREMIUM], recipes, expired)
    assert info.value.reason == "expired" and "expired on" in info.value.message


def test_gate_resolves_the_arguments_itself(recipes: dict[str, Recipe]) -> None:
    with pytest.raises(LicenseInvalid):
        gate_override(FREE, ["--model", PREMIUM], recipes, _settings(), time.time(), keys=lambda: SIGNER.table)


# --- through the command line (no engine: refused before vLLM, or a dry run) ----------------------

runner = CliRunner()


@pytest.fixture()
def trusted_test_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(keys.EMBEDDED_PUBLIC_KEYS, SIGNER.key_id, SIGNER.public_text)
    monkeypatch.setattr(cli, "gpu_backend", lambda: FakeGpuBackend(host("l4")))


def run_cli(args: list[str], **env: str):  # type: ignore[no-untyped-def]
    full_env = {"CF_RECIPES_DIR": str(TEST_RECIPES), "CF_LICENSE_FILE": "/nonexistent/cf-test/license.key",
                "CARBONFORGE_LICENSE_KEY": "", "CF_LOG_DIR": os.environ.get("TMPDIR", "/tmp"), **env}
    return runner.invoke(cli.app, cli._dispatch(args, full_env), env=full_env)


def test_cli_override_mode_refusals(trusted_test_key: None) -> None:
    result = run_cli(["--dry-run", "--", "--model=" + PREMIUM.lower(), "--dtype", "bfloat16"])
    assert result.exit_code == 4, result.output
    assert "no license key provided" in result.output and "Traceback" not in result.output
    result = run_cli(["--dry-run", "--", "--dtype", "bfloat16"])
    assert result.exit_code == 4
    assert CANNOT_GATE in result.output and "first argument after --" in result.output
    result = run_cli(["--dry-run", "--", FREE, "--model", PREMIUM])
    assert result.exit_code == 4 and "more than one model" in result.output


def test_cli_override_mode_with_an_entitling_licence(trusted_test_key: None) -> None:
    licence = SIGNER.issue(entitlements=(PREMIUM_KEY,), issued_at=int(time.time()))
    result = run_cli(["--dry-run", "--", PREMIUM, "--dtype", "bfloat16"], CARBONFORGE_LICENSE_KEY=licence)
    assert result.exit_code == 0, result.output
    assert "--model Qwen/Qwen3-Coder-Next-FP8" in result.output


def test_recipe_mode_extra_arguments_cannot_swap_the_model(trusted_test_key: None) -> None:
    for extra in (["--", "--model", PREMIUM], ["--", "--model=" + PREMIUM]):
        result = run_cli(["--dry-run", "--context-key", "cf-tiny:bf16:chat:cpu", *extra])
        assert result.exit_code == 2, result.output
        assert "replace the model of cf-tiny:bf16:chat:cpu" in result.output
    result = run_cli(["--dry-run", "--context-key", "cf-tiny:bf16:chat:cpu"],
                     CF_VLLM_EXTRA_ARGS=f"--model {PREMIUM}")
    assert result.exit_code == 2 and "replace the model" in result.output
    result = run_cli(["--dry-run", "--context-key", "cf-tiny:bf16:chat:cpu", "--", "--max-num-seqs", "4"])
    assert result.exit_code == 0, result.output


def test_recipe_mode_gate(trusted_test_key: None) -> None:
    key = "cf-tiny-premium:bf16:chat:cpu"
    result = run_cli(["--dry-run", "--context-key", key])
    assert result.exit_code == 4
    assert f"{key} is a premium-plan recipe: no license key provided" in result.output
    now = int(time.time())
    cases = {
        "expired on": SIGNER.issue(issued_at=now - 40 * 86400, days=30),
        "not valid until": SIGNER.issue(issued_at=now, not_before=now + 2 * 86400),
        "signature does not match": Signer(SIGNER.key_id).issue(issued_at=now),
        f"is not entitled to {key}": SIGNER.issue(entitlements=("cf-tiny:*:*:*",), issued_at=now),
    }
    for phrase, licence in cases.items():
        result = run_cli(["--dry-run", "--context-key", key], CARBONFORGE_LICENSE_KEY=licence)
        assert result.exit_code == 4, (phrase, result.output)
        assert phrase in result.output and "premium-plan" in result.output and "fix:" in result.output
        assert "Traceback" not in result.output
    result = run_cli(["--dry-run", "--context-key", key],
                     CARBONFORGE_LICENSE_KEY=SIGNER.issue(entitlements=(key,), issued_at=now))
    assert result.exit_code == 0, result.output

