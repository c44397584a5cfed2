"""The hub cache module's decisions: which files the engine reads, when a snapshot is complete, and
what fetch prints to serve the result. Pure logic and files in a temporary directory."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from carbonforge_runtime.errors import UsageError
from carbonforge_runtime.recipes import load_recipes, recipe_dirs, resolve
from carbonforge_runtime.runtime.fetch import (
    FetchTarget,
    docker_run_line,
    fetch_targets,
    mount_args,
    parse_model,
)
from carbonforge_runtime.runtime.weights.hub_cache import (
    NO_WEIGHTS,
    engine_files,
    missing_summary,
    progress_line,
    ref_commit,
    served_snapshot,
    snapshot_state,
)
from tests.support.hub_double import write_fetch_recipe

COMMIT = "0123456789abcdef0123456789abcdef01234567"
SHARDS = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]


def _index(shards: list[str]) -> dict[str, object]:
    return {"metadata": {}, "weight_map": {f"layer.{i}.weight": shard for i, shard in enumerate(shards * 2)}}


def test_every_safetensors_file_and_the_metadata_are_fetched() -> None:
    listing = ["config.json", "model.safetensors.index.json", *SHARDS, "consolidated.safetensors",
               "original/consolidated.00.pth", "README.md", ".gitattributes", "tokenizer.json",
               "tokenizer_config.json", "generation_config.json", "chat_template.jinja", "modeling_custom.py",
               "additional_chat_templates/tool_use.jinja", "sub/config.json", "sub/helper.py", "pytorch_model.bin"]
    # consolidated.safetensors too: offline, vLLM asks the library for every *.safetensors of the listing.
    assert engine_files(listing) == sorted([
        "additional_chat_templates/tool_use.jinja", "chat_template.jinja", "config.json", "consolidated.safetensors",
        "generation_config.json", "model.safetensors.index.json", "modeling_custom.py", "tokenizer.json",
        "tokenizer_config.json", *SHARDS])


def test_pytorch_weights_only_without_safetensors() -> None:
    assert engine_files(["config.json", "model.safetensors", "pytorch_model.bin"]) == ["config.json",
                                                                                       "model.safetensors"]
    listing = ["config.json", "pytorch_model.bin", "training_args.bin", "optimizer.pt", "vocab.json", "merges.txt"]
    assert engine_files(listing) == ["config.json", "merges.txt", "pytorch_model.bin", "training_args.bin",
                                     "vocab.json"]
    assert engine_files(["config.json", "model.pt"]) == ["config.json", "model.pt"]


def _snapshot(cache: Path, files: dict[str, str], *, ref: str | None = "main", commit: str = COMMIT) -> Path:
    snapshot = cache / "models--org--m" / "snapshots" / commit
    for name, text in files.items():
        (snapshot / name).parent.mkdir(parents=True, exist_ok=True)
        (snapshot / name).write_text(text)
    if ref:
        (cache / "models--org--m" / "refs").mkdir(parents=True, exist_ok=True)
        (cache / "models--org--m" / "refs" / ref).write_text(commit)
    return snapshot


def test_a_missing_shard_named_by_the_index_makes_the_snapshot_incomplete(tmp_path: Path) -> None:
    files = {"config.json": "{}", "model.safetensors.index.json": json.dumps(_index(SHARDS)), SHARDS[0]: "x"}
    snapshot = _snapshot(tmp_path, files)
    state = snapshot_state(tmp_path, "org/m", None)
    assert state.snapshot == snapshot and state.commit == COMMIT and state.source == "snapshot"
    assert state.missing == (SHARDS[1],) and not state.complete
    assert served_snapshot(tmp_path, "org/m", None) is None  # the runtime does not serve it offline
    (snapshot / SHARDS[1]).write_text("y")
    assert snapshot_state(tmp_path, "org/m", None).complete
    assert served_snapshot(tmp_path, "org/m", None) == snapshot


def test_a_link_whose_blob_is_gone_counts_as_missing(tmp_path: Path) -> None:
    snapshot = _snapshot(tmp_path, {"config.json": "{}"})
    blob = tmp_path / "models--org--m" / "blobs" / "abc"
    blob.parent.mkdir(parents=True)
    blob.write_text("weights")
    (snapshot / "model.safetensors").symlink_to(blob)
    assert snapshot_state(tmp_path, "org/m", None).complete
    blob.unlink()
    assert snapshot_state(tmp_path, "org/m", None).missing == (NO_WEIGHTS,)


def test_revisions_resolve_through_refs_or_the_snapshot_name(tmp_path: Path) -> None:
    _snapshot(tmp_path, {"config.json": "{}", "model.safetensors": "w"}, ref="v1")
    assert ref_commit(tmp_path, "org/m", "v1") == COMMIT
    assert ref_commit(tmp_path, "org/m", COMMIT) == COMMIT
    assert ref_commit(tmp_path, "org/m", None) is None  # no refs/main
    assert snapshot_state(tmp_path, "org/m", None).snapshot is None
    assert snapshot_state(tmp_path, "org/m", "v1").complete
    assert snapshot_state(tmp_path, "org/m", "v2").snapshot is None


def test_progress_and_missing_lines() -> None:
    assert progress_line(500_000_000, 2_000_000_000, 50_000_000) == (
        "downloaded 500.0 MB of 2.0 GB (25%), 50.0 MB/s, about 30 s left")
    assert progress_line(0, 0, 0) == "downloaded 0 B of 0 B, 0 B/s"
    assert missing_summary(["a", "b", "c", "d", "e"]) == "a, b, c (and 2 more)"


@pytest.mark.parametrize(("text", "expected"), [
    ("Qwen/Qwen2.5-0.5B-Instruct", ("Qwen/Qwen2.5-0.5B-Instruct", None)),
    ("Qwen/Qwen2.5-0.5B-Instruct@v1.0", ("Qwen/Qwen2.5-0.5B-Instruct", "v1.0")),
    (f"org/m@{COMMIT}", ("org/m", COMMIT)),
])
def test_model_argument(text: str, expected: tuple[str, str | None]) -> None:
    assert parse_model(text) == expected


@pytest.mark.parametrize("text", ["/models/qwen", "./qwen", "a/b/c", "org/m@"])
def test_model_argument_mistakes(text: str) -> None:
    with pytest.raises(UsageError):
        parse_model(text)


def test_targets_and_the_docker_run_line(tmp_path: Path) -> None:
    write_fetch_recipe(tmp_path / "recipes", revision="v1")
    recipes = load_recipes(recipe_dirs(str(tmp_path / "recipes")))
    [target] = fetch_targets([], None, recipes, "cf-tiny-fetch:bf16:chat:cpu")
    assert (target.repo, target.revision) == ("carbonforge-test/tiny-fetch", "v1")
    line = docker_run_line(target, Path("/data/hub"), "HF_HOME")
    assert "--gpus" not in line and "-e CF_CONTEXT_KEY=cf-tiny-fetch:bf16:chat:cpu -e HF_HUB_OFFLINE=1" in line
    assert line.endswith("-v /data/hub:/var/cache/huggingface/hub -v carbonforge-logs:/var/log/carbonforge "
                         "-v carbonforge-compile:/var/cache/carbonforge carbonforge-runtime")
    # Fetched in the image itself: the image's volume.
    assert mount_args(Path("/var/cache/huggingface/hub"), "HF_HOME") == ["-v", "hf-cache:/var/cache/huggingface"]
    gpu = resolve("qwen3-100b:fp8:chat:h100x2", load_recipes(recipe_dirs(None)))
    gpu_line = docker_run_line(FetchTarget(gpu.model.repo, gpu.model.revision, gpu), Path("/d"), "--to")
    assert "--gpus all --shm-size 16g" in gpu_line and "-e CARBONFORGE_LICENSE_KEY " in gpu_line
    override = docker_run_line(FetchTarget("org/m", "v2"), Path("/d"), "--to")
    assert override.endswith("carbonforge-runtime org/m --revision v2") and "CF_CONTEXT_KEY" not in override


def test_plain_progress_counts_finished_files_and_partial_blobs(tmp_path: Path) -> None:
    from carbonforge_runtime.runtime.weights.hub_cache import _DiskProgress

    storage = tmp_path / "models--org--m"
    snapshot = storage / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    (storage / "blobs").mkdir()
    (snapshot / "config.json").write_bytes(b"x" * 100)
    (storage / "blobs" / "abc.1234.incomplete").write_bytes(b"y" * 250)
    lines: list[str] = []
    progress = _DiskProgress(storage, snapshot, {"config.json": 100, "model.safetensors": 900}, lines.append,
                             every_s=0.01)
    assert progress.done_bytes() == 350
    with progress:
        for _ in range(500):
            if lines:
                break
            threading.Event().wait(0.01)
    assert lines and lines[0].startswith("downloaded 350 B of 1.0 kB (35%), ")
    assert all("\r" not in line for line in lines)


def test_the_weights_check_names_the_missing_file_and_the_fetch_command() -> None:
    from carbonforge_runtime.runtime.doctor.checks import storage_checks
    from carbonforge_runtime.runtime.doctor.facts import DoctorFacts, RecipeFacts, WeightsFacts

    recipe = resolve("qwen3-32b:fp8:chat:a100-80x1", load_recipes(recipe_dirs(None)))
    weights = WeightsFacts(recipe.model.repo, "hub", True, "/models/hub", "HUGGINGFACE_HUB_CACHE",
                           snapshot="/models/hub/models--x/snapshots/c", has_weight_files=True,
                           missing=(SHARDS[1],))
    facts = DoctorFacts(recipe=RecipeFacts(recipe.key_text, recipe), weights=weights)
    [check] = [c for c in storage_checks(facts) if c.name == "storage.weights"]
    assert check.status == "FAIL" and f"{SHARDS[1]} missing" in check.detail
    assert f"`carbonforge-runtime fetch {recipe.key_text}`" in check.remedy and "HUGGINGFACE_HUB_CACHE" in check.remedy
    online = DoctorFacts(weights=WeightsFacts("org/m", "hub", False, "/c", "default", snapshot="/c/s",
                                              has_weight_files=True, missing=("a", "b", "c", "d"), revision="v1"))
    [check] = [c for c in storage_checks(online) if c.name == "storage.weights"]
    assert check.status == "WARN" and "a, b, c (and 1 more) missing" in check.detail
    assert "`carbonforge-runtime fetch --model org/m@v1`" in check.remedy
