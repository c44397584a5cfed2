"""``fetch --to DIR`` on one host, then the serving host's view of DIR through HUGGINGFACE_HUB_CACHE
while its own cache stays empty: ``doctor`` (the check a serve makes of the same layout) finds the
weights there, offline. Serving from a fetched cache on the real engine is the end-to-end test
tests/e2e/test_fetch_offline.py; this layout differs from that one only in where the cache is."""

from __future__ import annotations

import json
from pathlib import Path

from tests.support import free_port, tiny_model_dir
from tests.support.hub_double import (
    FETCH_KEY,
    FETCH_REPO,
    HubDouble,
    fetch_env,
    run_runtime,
    snapshot_dir,
    tiny_repo_files,
    write_fetch_recipe,
)


def test_fetch_to_a_directory_then_doctor_finds_it_through_huggingface_hub_cache(tmp_path: Path) -> None:
    recipes = tmp_path / "recipes"
    write_fetch_recipe(recipes)
    carried = tmp_path / "carried"
    with HubDouble() as hub:
        commit = hub.publish(FETCH_REPO, tiny_repo_files(tiny_model_dir()))
        done = run_runtime(["fetch", FETCH_KEY, "--to", str(carried)], fetch_env(hub.url, recipes,
                                                                                  tmp_path / "fetch-home"))
        assert done.returncode == 0, done.stdout + done.stderr
        assert any(seen.path.endswith("/model.safetensors") for seen in hub.downloads())
    assert f"HUGGINGFACE_HUB_CACHE={carried}" in done.stdout
    empty_home = tmp_path / "serving-home"  # the serving host's own cache has nothing
    empty_home.mkdir()
    # The double is gone and the hub address answers nothing: only the carried directory can hold the weights.
    env = fetch_env(f"http://127.0.0.1:{free_port()}", recipes, empty_home, HUGGINGFACE_HUB_CACHE=str(carried),
                    HF_HUB_OFFLINE="1")
    doctor = run_runtime(["doctor", "--context-key", FETCH_KEY, "--json"], env)
    assert doctor.returncode == 0, doctor.stdout + doctor.stderr
    checks = {check["name"]: check for check in json.loads(doctor.stdout)["checks"]}
    snapshot = snapshot_dir(carried, FETCH_REPO, commit)
    assert checks["storage.weights"]["status"] == "OK", checks["storage.weights"]
    assert checks["storage.weights"]["detail"] == f"weights for {FETCH_REPO} are in the cache ({snapshot})"
    assert checks["storage.offline"]["status"] == "OK", checks["storage.offline"]
    assert (snapshot / "config.json").is_file()
    assert not (empty_home / "hub" / "models--carbonforge-test--tiny-fetch").exists()
