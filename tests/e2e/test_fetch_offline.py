"""End to end: the air-gapped workflow. ``fetch`` downloads a recipe's model from a hub double with
huggingface_hub's own code; the double is then stopped and the runtime serves the recipe from the
cache with ``HF_HUB_OFFLINE=1`` on the CPU engine, answering the OpenAI SDK.

One engine, on the cache it reads by default (``HF_HOME``). The other layout, ``fetch --to DIR`` read
through ``HUGGINGFACE_HUB_CACHE=DIR`` while the default cache stays empty, is checked with ``doctor``
in tests/unit/runtime/test_fetch_carried_cache.py: it differs only in where the cache is.
"""

from __future__ import annotations

from pathlib import Path

import openai
import pytest

from tests.support import RuntimeProcess, tiny_model_dir
from tests.support.hub_double import (
    FETCH_KEY,
    FETCH_REPO,
    FETCH_SERVED_NAME,
    HubDouble,
    fetch_env,
    run_runtime,
    snapshot_dir,
    tiny_repo_files,
    write_fetch_recipe,
)

#: Holds with a second engine beside it (scripts/test.sh runs these modules two at a time).
pytestmark = pytest.mark.parallel_safe

#: Variables of the caller that would point the engine at another cache or hub.
_CALLER_HUB_VARIABLES = ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_ENDPOINT", "HF_TOKEN", "TRANSFORMERS_CACHE")


@pytest.fixture(scope="module")
def recipes(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("fetch-recipes")
    write_fetch_recipe(directory)
    return directory


def _fetch(args: list[str], recipes: Path, hf_home: Path) -> tuple[str, str, str]:
    """Fetch from a double started for this call; returns the output, the commit and the double's
    address. The double is stopped before returning: nothing answers there afterwards."""
    with HubDouble() as hub:
        commit = hub.publish(FETCH_REPO, tiny_repo_files(tiny_model_dir()))
        done = run_runtime(["fetch", *args], fetch_env(hub.url, recipes, hf_home))
        assert done.returncode == 0, done.stdout + done.stderr
        assert any(seen.path.endswith("/model.safetensors") for seen in hub.downloads())
        endpoint = hub.url
    return done.stdout, commit, endpoint


def _serve_and_ask(recipes: Path, log_dir: Path, env: dict[str, str]) -> str:
    runtime = RuntimeProcess(["--context-key", FETCH_KEY], log_dir,
                             env={"CF_RECIPES_DIR": str(recipes), "HF_HUB_OFFLINE": "1", **env})
    for name in _CALLER_HUB_VARIABLES:
        if name not in env:
            runtime.env.pop(name, None)
    runtime.start()
    try:
        runtime.wait_ready()
        client = openai.OpenAI(base_url=runtime.base_url, api_key="unused", max_retries=0)
        answer = client.chat.completions.create(
            model=FETCH_SERVED_NAME, messages=[{"role": "user", "content": "Hello"}], max_tokens=4,
            extra_body={"ignore_eos": True})
        assert answer.model == FETCH_SERVED_NAME
        assert answer.usage is not None and answer.usage.completion_tokens == 4
        assert runtime.stop() == 0
    finally:
        if runtime.proc is not None and runtime.proc.poll() is None:
            runtime.kill()
    return runtime.output() + runtime.engine_log()


def test_fetch_then_serve_offline_from_the_default_cache(recipes: Path, tmp_path: Path) -> None:
    hf_home = tmp_path / "hf"
    output, commit, endpoint = _fetch([FETCH_KEY], recipes, hf_home)
    assert f"downloaded 6 of 6 files of {FETCH_REPO}" in output
    snapshot = snapshot_dir(hf_home / "hub", FETCH_REPO, commit)
    assert (snapshot / "model.safetensors").is_file()
    # The double is gone: an engine that asked the hub for anything would fail to start.
    logs = _serve_and_ask(recipes, tmp_path / "logs", {"HF_HOME": str(hf_home), "HF_ENDPOINT": endpoint})
    assert "ready: OpenAI API" in logs
    # Checked against the lock fetch wrote (sizes and times) before vLLM started.
    assert f"weights of {FETCH_REPO} at commit {commit} match their lock (6 files" in logs
