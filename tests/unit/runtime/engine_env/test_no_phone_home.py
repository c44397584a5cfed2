"""No phone-home: the engine never reports usage, and serves weights already on the machine offline."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from carbonforge_runtime.gpu.fake import FakeGpuBackend, host
from carbonforge_runtime.recipes import Recipe, load_recipes, recipe_dirs
from carbonforge_runtime.runtime.doctor.probes import weights_on_host
from carbonforge_runtime.runtime.engine_env.privacy import (
    USAGE_STATS_OFF,
    asks_for_reporting,
    engine_privacy_env,
    is_offline,
)
from carbonforge_runtime.runtime.planning.plan import (
    BUILTIN_WEIGHTS,
    ServeOptions,
    build_plan,
    describe_plan,
    model_source,
)
from carbonforge_runtime.runtime.process import supervisor
from carbonforge_runtime.runtime.serve.launch import serve
from carbonforge_runtime.runtime.weights.hub_cache import served_snapshot
from carbonforge_runtime.settings import load_settings

SHIPPED: dict[str, Recipe] = load_recipes(recipe_dirs(None))
TINY = "cf-tiny:bf16:chat:cpu"
HUB_KEY = "qwen2.5-0.5b:bf16:chat:cpu"
OFF = {"VLLM_NO_USAGE_STATS": "1", "VLLM_DO_NOT_TRACK": "1", "DO_NOT_TRACK": "1"}


def _plan_env(options: ServeOptions, environ: dict[str, str], present: str | None = None) -> dict[str, str]:
    plan = build_plan(options, load_settings(environ), SHIPPED, environ, weights_present=present)
    return plan.launch.engine_env()


# ---- the pure decision -------------------------------------------------------------------------------


def test_vllm_honours_exactly_these_switches() -> None:
    """The names and the value "1" are the ones vllm/envs.py compares against."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("vLLM is not installed")
    envs = (Path(next(iter(spec.submodule_search_locations))) / "envs.py").read_text(encoding="utf-8")
    for name in USAGE_STATS_OFF:
        assert f'"{name}"' in envs
    assert 'os.environ.get("VLLM_NO_USAGE_STATS", "0") == "1"' in envs


@pytest.mark.parametrize("environ, asks", [
    ({}, []),
    ({"VLLM_NO_USAGE_STATS": "0"}, [("VLLM_NO_USAGE_STATS", "0")]),
    ({"DO_NOT_TRACK": "false", "VLLM_DO_NOT_TRACK": "1"}, [("DO_NOT_TRACK", "false")]),
    ({"DO_NOT_TRACK": "true"}, []),  # meant "off": the runtime's 1 does it
    ({"VLLM_NO_USAGE_STATS": ""}, []),  # empty is unset for vLLM
])
def test_which_values_ask_for_reporting(environ: dict[str, str], asks: list[tuple[str, str]]) -> None:
    assert asks_for_reporting(environ) == asks


def test_reporting_is_off_even_when_the_environment_turns_it_on() -> None:
    environ = {"VLLM_NO_USAGE_STATS": "0", "DO_NOT_TRACK": "0", "VLLM_DO_NOT_TRACK": "0"}
    decision = engine_privacy_env(environ, "org/m", None)
    assert decision.env.items() >= OFF.items()
    assert len(decision.warnings) == 1
    assert "VLLM_NO_USAGE_STATS=0, VLLM_DO_NOT_TRACK=0, DO_NOT_TRACK=0" in decision.warnings[0]
    assert "runs with VLLM_NO_USAGE_STATS=1, VLLM_DO_NOT_TRACK=1, DO_NOT_TRACK=1" in decision.warnings[0]


def test_offline_switches_follow_the_weights() -> None:
    cached = engine_privacy_env({}, "org/m", "in the Hugging Face cache /c")
    assert cached.env["HF_HUB_OFFLINE"] == "1" and cached.env["TRANSFORMERS_OFFLINE"] == "1"
    missing = engine_privacy_env({}, "org/m", None)
    assert "HF_HUB_OFFLINE" not in missing.env and "TRANSFORMERS_OFFLINE" not in missing.env
    assert any("downloads them" in note for note in missing.notes)


@pytest.mark.parametrize("name, value, offline", [
    ("HF_HUB_OFFLINE", "0", False), ("HF_HUB_OFFLINE", "1", True), ("TRANSFORMERS_OFFLINE", "0", False),
    ("HF_HUB_OFFLINE", "yes", True),
])
def test_the_operators_offline_choice_is_kept(name: str, value: str, offline: bool) -> None:
    decision = engine_privacy_env({name: value}, "org/m", "local model directory /m")
    assert "HF_HUB_OFFLINE" not in decision.env and "TRANSFORMERS_OFFLINE" not in decision.env
    assert is_offline({name: value}) is offline
    # Kept against the runtime's advice: said once, with the fix.
    assert [w for w in decision.warnings if f"unset {name}" in w] == ([] if offline else [decision.warnings[0]])


def test_modelscope_is_named_as_a_hub_the_engine_would_reach() -> None:
    decision = engine_privacy_env({"VLLM_USE_MODELSCOPE": "True"}, "org/m", "in the Hugging Face cache /c")
    assert [w for w in decision.warnings if "ModelScope" in w and "unset it" in w]


# ---- the plan, the dry run and the launch -------------------------------------------------------------


@pytest.mark.parametrize("options", [ServeOptions(context_key=TINY), ServeOptions(context_key=HUB_KEY),
                                     ServeOptions(vllm_args=["/models/m"])])
def test_every_engine_runs_without_usage_reporting(options: ServeOptions) -> None:
    env = _plan_env(options, {"PATH": "/usr/bin", "VLLM_NO_USAGE_STATS": "0", "CF_TINY_MODEL_DIR": "/t"})
    assert {name: env[name] for name in OFF} == OFF


def test_the_built_in_model_is_served_offline_without_being_told() -> None:
    env = _plan_env(ServeOptions(context_key=TINY), {"CF_TINY_MODEL_DIR": "/t"})
    assert env["HF_HUB_OFFLINE"] == "1" and env["TRANSFORMERS_OFFLINE"] == "1"


def test_a_hub_model_is_offline_only_when_its_weights_are_present() -> None:
    assert "HF_HUB_OFFLINE" not in _plan_env(ServeOptions(context_key=HUB_KEY), {})
    env = _plan_env(ServeOptions(context_key=HUB_KEY), {}, present="in the Hugging Face cache /c")
    assert env["HF_HUB_OFFLINE"] == "1" and env["TRANSFORMERS_OFFLINE"] == "1"
    kept = _plan_env(ServeOptions(context_key=HUB_KEY), {"HF_HUB_OFFLINE": "0"}, present="cached")
    assert kept["HF_HUB_OFFLINE"] == "0" and "TRANSFORMERS_OFFLINE" not in kept


def test_the_plan_logs_an_override_and_a_kept_online_choice() -> None:
    environ = {"DO_NOT_TRACK": "0", "HF_HUB_OFFLINE": "0"}
    plan = build_plan(ServeOptions(context_key=HUB_KEY), load_settings(environ), SHIPPED, environ,
                      weights_present="in the Hugging Face cache /c")
    warnings = [m.text for m in plan.messages if m.level == "warning"]
    assert any("DO_NOT_TRACK=0" in w and "DO_NOT_TRACK=1 instead" in w for w in warnings)
    assert any(w.startswith("HF_HUB_OFFLINE=0 lets the engine contact the Hugging Face Hub") for w in warnings)


def test_the_dry_run_lists_the_switches_and_why() -> None:
    environ = {"VLLM_NO_USAGE_STATS": "0", "CF_TINY_MODEL_DIR": "/t"}
    options = ServeOptions(context_key=TINY)
    plan = build_plan(options, load_settings(environ), SHIPPED, environ)
    lines = describe_plan(plan, options, environ)
    assert "engine environment: VLLM_NO_USAGE_STATS=1  (runtime, replaces VLLM_NO_USAGE_STATS=0 from the " \
           "environment)" in lines
    assert "engine environment: DO_NOT_TRACK=1  (runtime: vLLM usage statistics off)" in lines
    assert f"engine environment: HF_HUB_OFFLINE=1  (runtime: nothing to download ({BUILTIN_WEIGHTS}))" in lines
    # The recipe also names HF_HUB_OFFLINE: one line for it, not two.
    assert len([line for line in lines if line.startswith("engine environment: HF_HUB_OFFLINE")]) == 1
    online = build_plan(ServeOptions(context_key=HUB_KEY), load_settings({}), SHIPPED, {})
    described = describe_plan(online, ServeOptions(context_key=HUB_KEY), {})
    assert [line for line in described if line.startswith("engine environment: HF_HUB_OFFLINE unset  (not set: ")]


def _hub_cache(root: Path, repo: str, weights: bool = True, ref: str | None = "main") -> Path:
    folder = root / ("models--" + repo.replace("/", "--"))
    snapshot = folder / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    if weights:
        (snapshot / "model.safetensors").write_bytes(b"\0")
    if ref:
        (folder / "refs").mkdir()
        (folder / "refs" / ref).write_text("abc123")
    return snapshot


def test_weights_on_host_reads_the_cache_the_engine_will_use(tmp_path: Path) -> None:
    repo = "Qwen/Qwen2.5-0.5B-Instruct"
    cache = tmp_path / "hf" / "hub"
    assert weights_on_host(repo, None, False, {"HF_HOME": str(tmp_path / "hf")}) is None
    _hub_cache(cache, repo)
    assert weights_on_host(repo, None, False, {"HF_HOME": str(tmp_path / "hf")}) == f"in the Hugging Face cache {cache}"
    assert weights_on_host(repo, None, False, {"HUGGINGFACE_HUB_CACHE": str(cache)}) is not None
    assert weights_on_host(repo, "abc123", False, {"HUGGINGFACE_HUB_CACHE": str(cache)}) is not None
    assert weights_on_host(repo, "v2", False, {"HUGGINGFACE_HUB_CACHE": str(cache)}) is None  # another revision
    assert weights_on_host(repo, None, False, {"HOME": str(tmp_path / "nobody")}) is None
    assert weights_on_host(str(tmp_path), None, False, {}) == f"local model directory {tmp_path}"
    assert weights_on_host(str(tmp_path / "absent"), None, False, {}) is None
    assert weights_on_host("carbonforge/tiny-chat", None, True, {}) == BUILTIN_WEIGHTS


def test_an_incomplete_or_unreferenced_snapshot_does_not_count(tmp_path: Path) -> None:
    _hub_cache(tmp_path / "a", "org/m", weights=False)
    assert served_snapshot(tmp_path / "a", "org/m", None) is None  # config.json only: offline would fail
    _hub_cache(tmp_path / "b", "org/m", ref=None)
    assert served_snapshot(tmp_path / "b", "org/m", None) is None  # no refs/main for an offline lookup
    assert served_snapshot(tmp_path / "b", "org/m", "abc123") is not None


def test_model_source_names_what_the_plan_serves() -> None:
    tiny = model_source(ServeOptions(context_key=TINY), SHIPPED)
    assert tiny is not None and tiny.builtin
    override = model_source(ServeOptions(vllm_args=["org/m", "--revision", "r1"]), SHIPPED)
    assert override is not None and (override.model, override.revision, override.builtin) == ("org/m", "r1", False)
    assert model_source(ServeOptions(context_key="no-such:key:x:cpu"), SHIPPED) is None  # build_plan explains
    assert model_source(ServeOptions(), SHIPPED) is None


class Launched(Exception):
    pass


def test_serving_a_cached_hub_model_launches_it_offline(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _hub_cache(tmp_path / "hub", "org/cached-model")
    environ = {"CF_LOG_DIR": str(tmp_path / "logs"), "HUGGINGFACE_HUB_CACHE": str(tmp_path / "hub"),
               "DO_NOT_TRACK": "0"}
    started: list[supervisor.EngineProcess] = []

    def capture(engine: supervisor.EngineProcess, **kwargs: object) -> supervisor.ExitReport:
        started.append(engine)
        raise Launched

    monkeypatch.setattr(supervisor, "supervise", capture)
    options = ServeOptions(vllm_args=["org/cached-model"], skip_preflight=True)
    with pytest.raises(Launched):
        serve(options, load_settings(environ), environ, FakeGpuBackend(host(None)))
    env = started[0].env
    assert env["HF_HUB_OFFLINE"] == "1" and env["TRANSFORMERS_OFFLINE"] == "1"
    assert {name: env[name] for name in OFF} == OFF


# ---- vLLM's own address -------------------------------------------------------------------------------


def test_a_single_host_engine_gets_the_loopback_address() -> None:
    """Without it, vLLM finds its address by a connect() towards 8.8.8.8 (no packet, but a public target)."""
    assert _plan_env(ServeOptions(context_key=TINY), {"CF_TINY_MODEL_DIR": "/t"})["VLLM_HOST_IP"] == "127.0.0.1"
    assert _plan_env(ServeOptions(vllm_args=["/m"]), {"VLLM_HOST_IP": "10.1.2.3"})["VLLM_HOST_IP"] == "10.1.2.3"


@pytest.mark.parametrize("env", [{"CF_NNODES": "2", "CF_NODE_RANK": "0", "CF_MASTER_ADDR": "10.0.0.1"},
                                 {"LWS_GROUP_SIZE": "2", "LWS_WORKER_INDEX": "1", "LWS_LEADER_ADDRESS": "10.0.0.1"}])
def test_a_host_of_a_group_looks_its_address_up_itself(env: dict[str, str]) -> None:
    options = ServeOptions(vllm_args=["/m"])
    plan = build_plan(options, load_settings(env), SHIPPED, env)
    assert "VLLM_HOST_IP" not in plan.launch.engine_env()
    assert "engine environment: VLLM_HOST_IP unset  (not set: --nnodes 2 involves other hosts, so vLLM looks up " \
           "its routable address)" in describe_plan(plan, options, env)


@pytest.mark.parametrize("args, flag", [
    (["--distributed-executor-backend", "ray"], "--distributed-executor-backend ray"),
    (["--data-parallel-address", "10.0.0.1"], "--data-parallel-address"),
    (["--kv-transfer-config", "{}"], "--kv-transfer-config"),
])
def test_a_multi_host_engine_looks_its_address_up_itself(args: list[str], flag: str) -> None:
    options = ServeOptions(vllm_args=["/m", *args])
    plan = build_plan(options, load_settings({}), SHIPPED, {})
    assert "VLLM_HOST_IP" not in plan.launch.engine_env()
    assert f"engine environment: VLLM_HOST_IP unset  (not set: {flag} involves other hosts, so vLLM looks up " \
           "its routable address)" in describe_plan(plan, options, {})
