"""Premium status comes from the shipped recipes only: a local recipe (CF_RECIPES_DIR) that copies a
premium recipe with ``plan: free``, a new key naming a premium model, a licence pattern matching a custom
key, or a premium model under a neutral name (a local directory, a renamed hub mirror) are each refused
with exit code 4 and the fix, in recipe mode, override mode and ``fetch``, before anything starts."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from carbonforge_runtime.cli import main as cli
from carbonforge_runtime.gpu.fake import FakeGpuBackend, host
from carbonforge_runtime.recipes import load_recipes, shipped_recipes_dir
from carbonforge_runtime.runtime.licensing import keys
from tests.support.licensed_runtime import Signer

SHIPPED_KEY = "qwen3-coder-next:fp8:coding:h100x4"
PREMIUM = "Qwen/Qwen3-Coder-Next-FP8"
OTHER_PREMIUM_KEY = "qwen3-100b:fp8:chat:h100x2"
SIGNER = Signer("local-recipes-test-1")
runner = CliRunner()


@pytest.fixture(autouse=True)
def trusted_test_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(keys.EMBEDDED_PUBLIC_KEYS, SIGNER.key_id, SIGNER.public_text)
    monkeypatch.setattr(cli, "gpu_backend", lambda: FakeGpuBackend(host("h100", count=4)))


def local_recipe(directory: Path, key: str = SHIPPED_KEY, plan: str = "free", repo: str = PREMIUM) -> Path:
    """A copy of the shipped premium recipe, with the key, plan and model given."""
    directory.mkdir(parents=True, exist_ok=True)
    data = yaml.safe_load((shipped_recipes_dir() / f"{SHIPPED_KEY.replace(':', '--')}.yaml").read_text())
    data.update(key=key, plan=plan)
    data["model"].update(repo=repo, served_name=repo)
    data["vllm"]["max_num_seqs"] = 8  # a tuned knob, which a local recipe may change
    (directory / f"{key.replace(':', '--')}.yaml").write_text(yaml.safe_dump(data))
    return directory


def run_cli(args: list[str], recipes: Path | None, **env: str):  # type: ignore[no-untyped-def]
    full_env = {"CF_LICENSE_FILE": "/nonexistent/cf-test/license.key", "CARBONFORGE_LICENSE_KEY": "",
                "CF_LOG_DIR": os.environ.get("TMPDIR", "/tmp"), "HF_HUB_OFFLINE": "1", **env}
    if recipes is not None:
        full_env["CF_RECIPES_DIR"] = str(recipes)
    return runner.invoke(cli.app, cli._dispatch(args, full_env), env=full_env)


def refused(result, *phrases: str) -> None:  # type: ignore[no-untyped-def]
    assert result.exit_code == 4, result.output
    for phrase in phrases:
        assert phrase in result.output, (phrase, result.output)
    assert "fix:" in result.output and "Traceback" not in result.output


def licence(*entitlements: str) -> str:
    return SIGNER.issue(entitlements=entitlements, issued_at=int(time.time()))


# --- a local recipe cannot make a premium model free --------------------------------------------

def test_a_free_copy_of_a_premium_recipe_is_refused_in_recipe_mode(tmp_path: Path) -> None:
    recipes = local_recipe(tmp_path / "recipes")
    refused(run_cli(["--dry-run", "--context-key", SHIPPED_KEY], recipes),
            "a local recipe cannot make it free", "no license key provided")


def test_a_new_key_naming_a_premium_model_is_refused_in_recipe_mode(tmp_path: Path) -> None:
    recipes = local_recipe(tmp_path / "recipes", key="my-coder:fp8:coding:h100x4")
    refused(run_cli(["--dry-run", "--context-key", "my-coder:fp8:coding:h100x4"], recipes),
            f"the model of premium-plan recipe(s) {SHIPPED_KEY}", "no license key provided")


def test_a_free_copy_does_not_make_the_model_free_in_override_mode(tmp_path: Path) -> None:
    recipes = local_recipe(tmp_path / "recipes")
    refused(run_cli(["--dry-run", "--", PREMIUM, "--dtype", "bfloat16"], recipes),
            f"belongs to premium-plan recipe(s) {SHIPPED_KEY}", "no license key provided")


def test_a_free_copy_is_refused_by_fetch(tmp_path: Path) -> None:
    recipes = local_recipe(tmp_path / "recipes")
    hub = tmp_path / "hub"
    refused(run_cli(["fetch", SHIPPED_KEY, "--to", str(hub)], recipes), "a local recipe cannot make it free")
    refused(run_cli(["fetch", "--model", PREMIUM, "--to", str(hub)], recipes), "premium-plan recipe(s)")
    renamed = local_recipe(tmp_path / "renamed", key="my-coder:fp8:coding:h100x4")
    refused(run_cli(["fetch", "my-coder:fp8:coding:h100x4", "--to", str(hub)], renamed), "premium-plan recipe(s)")
    assert not hub.exists() or not any(hub.iterdir()), "something was downloaded"


# --- what a licence covers -----------------------------------------------------------------------

def test_a_pattern_matching_only_a_custom_key_does_not_cover_a_premium_model(tmp_path: Path) -> None:
    recipes = local_recipe(tmp_path / "recipes", key="mine:fp8:coding:h100x4", plan="premium")
    for args in (["--dry-run", "--context-key", "mine:fp8:coding:h100x4"],
                 ["fetch", "mine:fp8:coding:h100x4", "--to", str(tmp_path / "hub")]):
        refused(run_cli(args, recipes, CARBONFORGE_LICENSE_KEY=licence("mine:*:*:*")),
                f"is not entitled to {SHIPPED_KEY}", "it covers: mine:*:*:*")


def test_a_licence_for_the_shipped_key_covers_a_local_recipe_of_its_model(tmp_path: Path) -> None:
    recipes = local_recipe(tmp_path / "recipes", key="mine:fp8:coding:h100x4")
    for entitlement in ("qwen3-coder-next:*:*:*", f"model={PREMIUM}", "*"):
        result = run_cli(["--dry-run", "--context-key", "mine:fp8:coding:h100x4"], recipes,
                         CARBONFORGE_LICENSE_KEY=licence(entitlement))
        assert result.exit_code == 0, (entitlement, result.output)
        assert "licence:            granted" in result.output and "--max-num-seqs 8" in result.output
    # A licence for another premium recipe does not cover this model.
    refused(run_cli(["--dry-run", "--context-key", "mine:fp8:coding:h100x4"], recipes,
                    CARBONFORGE_LICENSE_KEY=licence(OTHER_PREMIUM_KEY)), f"is not entitled to {SHIPPED_KEY}")


def test_a_shipped_recipe_still_needs_its_own_key() -> None:
    refused(run_cli(["--dry-run", "--context-key", SHIPPED_KEY], None,
                    CARBONFORGE_LICENSE_KEY=licence(OTHER_PREMIUM_KEY)), f"is not entitled to {SHIPPED_KEY}")
    result = run_cli(["--dry-run", "--context-key", SHIPPED_KEY], None,
                     CARBONFORGE_LICENSE_KEY=licence("qwen3-coder-next:fp8:*:*"))
    assert result.exit_code == 0, result.output


def test_a_local_recipe_may_ask_for_a_licence_for_a_free_model(tmp_path: Path) -> None:
    """``plan: premium`` on a model no shipped recipe makes premium is honoured (it only adds a gate)."""
    recipes = local_recipe(tmp_path / "recipes", key="own:fp8:coding:h100x4", plan="premium",
                           repo="example/own-model")
    refused(run_cli(["--dry-run", "--context-key", "own:fp8:coding:h100x4"], recipes),
            "own:fp8:coding:h100x4 is a premium-plan recipe")
    result = run_cli(["--dry-run", "--context-key", "own:fp8:coding:h100x4"], recipes,
                     CARBONFORGE_LICENSE_KEY=licence("own:*:*:*"))
    assert result.exit_code == 0, result.output


# --- a premium model under a neutral name: its shape -----------------------------------------------

def premium_config(**changes: object) -> dict[str, object]:
    from carbonforge_runtime.runtime.licensing.premium import premium_shapes

    shape = premium_shapes()[PREMIUM.lower()]
    assert shape is not None
    return {"model_type": "qwen3_next", "torch_dtype": "bfloat16", **shape, **changes}


def test_a_local_copy_without_its_name_is_premium_by_its_shape(tmp_path: Path) -> None:
    weights = tmp_path / "models" / "neutral"
    weights.mkdir(parents=True)
    (weights / "config.json").write_text(json.dumps(premium_config()))
    refused(run_cli(["--dry-run", "--", str(weights), "--dtype", "bfloat16"], None),
            f"belongs to premium-plan recipe(s) {SHIPPED_KEY}")
    recipes = local_recipe(tmp_path / "recipes", key="mine:fp8:coding:h100x4", repo=str(weights))
    refused(run_cli(["--dry-run", "--context-key", "mine:fp8:coding:h100x4"], recipes), "premium-plan recipe(s)")
    # One size different: another model, free.
    (weights / "config.json").write_text(json.dumps(premium_config(num_hidden_layers=24)))
    result = run_cli(["--dry-run", "--", str(weights), "--dtype", "bfloat16"], None)
    assert result.exit_code == 0, result.output


def test_a_renamed_mirror_in_the_hub_cache_is_premium_by_its_shape(tmp_path: Path) -> None:
    cache = tmp_path / "hf-cache"
    snapshot = cache / "models--someorg--renamed" / "snapshots" / ("a" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps(premium_config()))
    (cache / "models--someorg--renamed" / "refs").mkdir()
    (cache / "models--someorg--renamed" / "refs" / "main").write_text("a" * 40)
    refused(run_cli(["--dry-run", "--", "someorg/renamed"], None, HF_HUB_CACHE=str(cache)),
            f"belongs to premium-plan recipe(s) {SHIPPED_KEY}")
    refused(run_cli(["fetch", "--model", "someorg/renamed"], None, HF_HUB_CACHE=str(cache)), "premium-plan")


# --- the shape table -----------------------------------------------------------------------------

def test_every_shipped_premium_model_has_an_entry_in_the_shape_table() -> None:
    from carbonforge_runtime.runtime.licensing.gate import shipped_recipes
    from carbonforge_runtime.runtime.licensing.premium import config_matches, premium_shapes

    shapes = premium_shapes()
    data = json.loads((shipped_recipes_dir() / "premium-shapes.json").read_text())
    premium = {recipe.model.repo.lower() for recipe in shipped_recipes() if recipe.is_premium}
    assert premium and premium <= set(shapes), premium - set(shapes)
    for repo, shape in shapes.items():
        assert repo in premium, f"{repo} is in the shape table but no shipped premium recipe serves it"
        if shape is not None:
            assert set(shape) <= set(data["fields"]) and {"architectures", "hidden_size"} <= set(shape)
            assert config_matches(shape, shape)


def test_the_premium_status_of_every_shipped_recipe_is_its_own() -> None:
    from carbonforge_runtime.runtime.licensing.gate import recipe_owners, shipped_recipes

    shipped = shipped_recipes()
    for recipe in shipped:
        assert recipe_owners(recipe) == ([recipe] if recipe.is_premium else []), recipe.key_text
    assert load_recipes([shipped_recipes_dir()]).keys() == {recipe.key_text for recipe in shipped}


# --- the doctor agrees with the gate ---------------------------------------------------------------

def test_the_doctor_fails_a_local_free_copy_without_a_licence(tmp_path: Path) -> None:
    from carbonforge_runtime.runtime.doctor.probes import SystemProbes
    from carbonforge_runtime.settings import load_settings

    recipes = local_recipe(tmp_path / "recipes")
    copy = load_recipes([shipped_recipes_dir(), recipes])[SHIPPED_KEY]
    assert copy.plan == "free"
    env = {"CF_LICENSE_FILE": str(tmp_path / "none.key")}
    facts = SystemProbes().license(load_settings(env), copy, time.time())
    assert facts.state == "unreadable" and facts.missing and facts.premium is True
    result = run_cli(["doctor", "--context-key", SHIPPED_KEY], recipes)
    line = next(line for line in result.output.splitlines() if "license.key does not exist" in line)
    assert line.strip().startswith("FAIL"), result.output  # a WARN for a free recipe
    mine = local_recipe(tmp_path / "mine", key="mine:fp8:coding:h100x4", plan="premium")
    granted = SystemProbes().license(load_settings({**env, "CARBONFORGE_LICENSE_KEY": licence("mine:*:*:*")}),
                                     load_recipes([mine])["mine:fp8:coding:h100x4"], time.time())
    assert (granted.state, granted.entitled) == ("valid", False)


def test_the_docker_line_fetch_prints_passes_the_licence_for_a_premium_model(tmp_path: Path) -> None:
    from carbonforge_runtime.runtime.fetch import FetchTarget, docker_run_line

    copy = load_recipes([shipped_recipes_dir(), local_recipe(tmp_path / "recipes")])[SHIPPED_KEY]
    cache = tmp_path / "hub"
    for target in (FetchTarget(PREMIUM, None, copy), FetchTarget(PREMIUM, None)):
        assert "-e CARBONFORGE_LICENSE_KEY " in docker_run_line(target, cache, "--to")
    assert "CARBONFORGE_LICENSE_KEY" not in docker_run_line(FetchTarget("Qwen/Qwen3-32B-FP8", None), cache, "--to")


def test_the_shape_table_is_checked_against_cached_configs(tmp_path: Path) -> None:
    import subprocess
    import sys

    from carbonforge_runtime.runtime.licensing.premium import premium_shapes

    script = Path(__file__).resolve().parents[4] / "scripts" / "premium_shapes.py"
    cache = tmp_path / "hub"
    snapshot = cache / "models--Qwen--Qwen3-Coder-Next-FP8" / "snapshots" / ("b" * 40)
    snapshot.mkdir(parents=True)
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs" / "main").write_text("b" * 40)
    shape = premium_shapes()[PREMIUM.lower()]
    assert shape is not None

    def check(config: dict[str, object]) -> subprocess.CompletedProcess[str]:
        (snapshot / "config.json").write_text(json.dumps(config))
        return subprocess.run([sys.executable, str(script), "--check"], capture_output=True, text=True,
                              timeout=60, check=False, env={**os.environ, "HF_HUB_CACHE": str(cache)})

    agrees = check({"model_type": "qwen3_next", **shape})
    assert agrees.returncode == 0, agrees.stdout + agrees.stderr
    differs = check({**shape, "num_hidden_layers": 47})
    assert differs.returncode == 1 and f"{PREMIUM}: the table says" in differs.stdout
