"""The weights lock end to end, against the local hub double (real HTTP, huggingface_hub's real download
code): fetch compares every file with the hub's listing and records the commit and each file's sha256;
serving refuses weights whose size or time changed since; ``doctor --deep`` finds a changed byte. The
runtime runs as a process; no engine is started (every serve here is refused before vLLM would start)."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

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

ENGINE_FILES = {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                "chat_template.jinja", "model.safetensors"}
PINNED_KEY = "cf-tiny-pinned:bf16:chat:cpu"
PINNED_REPO = "carbonforge-test/tiny-pinned"
MAIN_COMMIT = "1" * 40
V1_COMMIT = "2" * 40


@pytest.fixture(scope="module")
def hub() -> Iterator[HubDouble]:
    double = HubDouble().start()
    files = tiny_repo_files(tiny_model_dir())
    double.publish(FETCH_REPO, files)
    double.publish(PINNED_REPO, files, commit=MAIN_COMMIT, refs={"v1": V1_COMMIT})
    yield double
    double.stop()


@pytest.fixture
def recipes(tmp_path: Path) -> Path:
    directory = tmp_path / "recipes"
    write_fetch_recipe(directory)
    write_fetch_recipe(directory, key=PINNED_KEY, repo=PINNED_REPO, served_name="carbonforge/tiny-pinned",
                       revision="v1")
    return directory


def _env(hub: HubDouble | None, recipes: Path, tmp_path: Path, **extra: str) -> dict[str, str]:
    return fetch_env(hub.url if hub else None, recipes, tmp_path / "hf", CF_LOG_DIR=str(tmp_path / "logs"), **extra)


def _lock_file(cache: Path, repo: str, commit: str) -> Path:
    return cache / ("models--" + repo.replace("/", "--")) / "carbonforge-locks" / f"{commit}.json"


def _fetched(hub: HubDouble, recipes: Path, tmp_path: Path) -> tuple[Path, Path]:
    """A cache filled by fetch --to DIR, and the snapshot of the test recipe's model in it."""
    cache = tmp_path / "cache"
    done = run_runtime(["fetch", FETCH_KEY, "--to", str(cache)], _env(hub, recipes, tmp_path))
    assert done.returncode == 0, done.stdout + done.stderr
    return cache, snapshot_dir(cache, FETCH_REPO, hub.repos[FETCH_REPO].commit)


def _offline(recipes: Path, tmp_path: Path, cache: Path) -> dict[str, str]:
    # The hub address answers nothing: only the cache can hold the weights.
    return fetch_env(f"http://127.0.0.1:{free_port()}", recipes, tmp_path / "serving-home", HF_HUB_OFFLINE="1",
                     HUGGINGFACE_HUB_CACHE=str(cache), CF_LOG_DIR=str(tmp_path / "logs"), CF_PORT=str(free_port()),
                     CF_HOST="127.0.0.1")


def _lock_check(output: str) -> dict[str, str]:
    return next(check for check in json.loads(output)["checks"] if check["name"] == "storage.weights_lock")


def test_fetch_writes_a_lock_with_the_commit_and_every_files_sha256(hub: HubDouble, recipes: Path,
                                                                      tmp_path: Path) -> None:
    hub.clear()
    done = run_runtime(["fetch", FETCH_KEY], _env(hub, recipes, tmp_path))
    assert done.returncode == 0, done.stdout + done.stderr
    cache = tmp_path / "hf" / "hub"
    commit = hub.repos[FETCH_REPO].commit
    lock_file = _lock_file(cache, FETCH_REPO, commit)
    lock = json.loads(lock_file.read_text())
    assert lock["repo"] == FETCH_REPO and lock["commit"] == commit
    assert lock["revision"] is None and lock["resolved_ref"] == "main"  # no pin: main, resolved and recorded
    published = hub.repos[FETCH_REPO].files
    assert set(lock["files"]) == ENGINE_FILES
    for name, entry in lock["files"].items():
        assert entry["sha256"] == hashlib.sha256(published[name]).hexdigest(), name
        assert entry["size"] == len(published[name])
    assert lock["endpoint"] == hub.url
    # The hub's listing with the files' hashes was asked for at the resolved commit.
    assert any(seen.path == f"/api/models/{FETCH_REPO}/revision/{commit}" and "blobs=true" in seen.query.lower()
               for seen in hub.requests)
    assert f"commit {commit} and each file's sha256 recorded in {lock_file}" in done.stdout
    assert "every file matches the hub's listing" in done.stdout
    # The snapshot the engine reads holds the repository's files only.
    assert {p.name for p in snapshot_dir(cache, FETCH_REPO, commit).iterdir()} == ENGINE_FILES
    assert not list(lock_file.parent.glob(".lock-*"))  # written beside, then renamed

    hub.clear()
    again = run_runtime(["fetch", FETCH_KEY], _env(hub, recipes, tmp_path))
    assert again.returncode == 0, again.stdout + again.stderr
    assert "every file still matches its lock" in again.stdout
    assert not any("blobs=true" in seen.query.lower() for seen in hub.requests)  # nothing new to compare


def test_a_pinned_revision_is_fetched_locked_and_served(hub: HubDouble, recipes: Path, tmp_path: Path) -> None:
    done = run_runtime(["fetch", PINNED_KEY], _env(hub, recipes, tmp_path))
    assert done.returncode == 0, done.stdout + done.stderr
    cache = tmp_path / "hf" / "hub"
    folder = cache / "models--carbonforge-test--tiny-pinned"
    assert (folder / "refs" / "v1").read_text() == V1_COMMIT
    assert not (folder / "refs" / "main").exists()  # main (another commit) was never asked for
    lock = json.loads(_lock_file(cache, PINNED_REPO, V1_COMMIT).read_text())
    assert lock["revision"] == "v1" and lock["resolved_ref"] == "v1" and lock["commit"] == V1_COMMIT
    env = _offline(recipes, tmp_path, cache)
    dry = run_runtime(["--context-key", PINNED_KEY, "--dry-run"], env)
    assert "--revision v1" in dry.stdout, dry.stdout + dry.stderr
    doctor = run_runtime(["doctor", "--context-key", PINNED_KEY, "--json"], env)
    check = _lock_check(doctor.stdout)
    assert check["status"] == "OK" and f"{PINNED_REPO} at {V1_COMMIT[:12]}" in check["detail"], check


@pytest.mark.parametrize("altered", ["model.safetensors", "config.json"])
def test_a_download_that_differs_from_the_hub_listing_fails_and_deletes_nothing(hub: HubDouble, recipes: Path,
                                                                                tmp_path: Path, altered: str) -> None:
    """An LFS file (listed by sha256) and a small one (listed by Git blob id), each sent with one byte
    changed and the listed size, as a mirror or proxy in between could."""
    repo = f"carbonforge-test/altered-{altered.split('.')[0]}"
    files = {"config.json": b'{"model_type": "qwen2"}', "model.safetensors": b"\7" * 256}
    commit = hub.publish(repo, files)
    changed = bytearray(files[altered])
    changed[5] ^= 0xFF
    hub.alter_transfers(repo, altered, bytes(changed))
    done = run_runtime(["fetch", "--model", repo], _env(hub, recipes, tmp_path))
    assert done.returncode == 1, done.stdout + done.stderr
    error = done.stderr
    head = f"error: {repo}: the downloaded {altered} of {repo} at {commit[:12]} does not match the hub's listing"
    assert head in error
    assert ("sha256" if altered.endswith(".safetensors") else "Git blob id") in error
    assert "nothing was deleted and no lock was written" in error and "Traceback" not in error
    blob = (snapshot_dir(tmp_path / "hf" / "hub", repo, commit) / altered).resolve()
    assert f"fix: delete {blob} and run fetch again" in error
    assert blob.read_bytes() == bytes(changed)  # left where it is, for the operator to look at
    assert not _lock_file(tmp_path / "hf" / "hub", repo, commit).exists()


def test_doctor_deep_finds_a_changed_byte_that_keeps_size_and_time(hub: HubDouble, recipes: Path,
                                                                    tmp_path: Path) -> None:
    cache, snapshot = _fetched(hub, recipes, tmp_path)
    env = _offline(recipes, tmp_path, cache)
    deep = run_runtime(["doctor", "--context-key", FETCH_KEY, "--deep", "--json"], env)
    assert deep.returncode == 0, deep.stdout + deep.stderr
    check = _lock_check(deep.stdout)
    assert check["status"] == "OK" and "the sha256 of all 6 files" in check["detail"], check

    blob = (snapshot / "model.safetensors").resolve()
    before = blob.stat()
    with open(blob, "r+b") as handle:
        handle.seek(before.st_size // 2)
        byte = handle.read(1)
        handle.seek(before.st_size // 2)
        handle.write(bytes([byte[0] ^ 0x01]))
    os.utime(blob, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert blob.stat().st_size == before.st_size and blob.stat().st_mtime_ns == before.st_mtime_ns

    quick = run_runtime(["doctor", "--context-key", FETCH_KEY, "--json"], env)
    assert _lock_check(quick.stdout)["status"] == "OK"  # sizes and times alone cannot see it
    deep = run_runtime(["doctor", "--context-key", FETCH_KEY, "--deep", "--json"], env)
    assert deep.returncode == 1
    check = _lock_check(deep.stdout)
    assert check["status"] == "FAIL", check
    assert "model.safetensors has sha256" in check["detail"] and "the lock says" in check["detail"]
    assert f"carbonforge-runtime fetch {FETCH_KEY}" in check["remedy"]
    text = run_runtime(["doctor", "--context-key", FETCH_KEY, "--deep"], env)
    assert text.returncode == 1 and "model.safetensors has sha256" in text.stdout


@pytest.mark.parametrize("change", ["time", "size"])
def test_serve_start_refuses_weights_whose_size_or_time_changed(hub: HubDouble, recipes: Path, tmp_path: Path,
                                                                change: str) -> None:
    cache, snapshot = _fetched(hub, recipes, tmp_path)
    blob = (snapshot / "tokenizer.json").resolve()
    size = blob.stat().st_size
    if change == "time":
        os.utime(blob, ns=(blob.stat().st_atime_ns, blob.stat().st_mtime_ns + 5_000_000_000))
        why = "tokenizer.json was modified after fetch verified it"
    else:
        with open(blob, "ab") as handle:
            handle.write(b" ")
        why = f"tokenizer.json is {size + 1} bytes, the lock says {size}"
    env = _offline(recipes, tmp_path, cache)
    served = run_runtime(["--context-key", FETCH_KEY], env)
    assert served.returncode == 1, served.stdout + served.stderr
    commit = hub.repos[FETCH_REPO].commit
    assert (f"error: the weights of {FETCH_REPO} at {commit[:12]} do not match the lock fetch wrote: {why}"
            in served.stderr), served.stderr
    fix = next(line for line in served.stderr.splitlines() if line.startswith("  fix: "))
    assert f"run `carbonforge-runtime fetch {FETCH_KEY}` again where the hub is reachable" in fix
    # Only a time changed: the cache may have been copied without times, which fetch offline re-records.
    assert ("with HF_HUB_OFFLINE=1 here" in fix) == (change == "time"), fix
    assert "Traceback" not in served.stderr
    assert not (tmp_path / "logs" / "vllm.log").exists()  # vLLM was never started
    dry = run_runtime(["--context-key", FETCH_KEY, "--dry-run"], env)  # says so, and exits as the launch would
    assert dry.returncode == 1 and why in dry.stdout and "a launch would be refused (exit 1)" in dry.stdout, dry.stdout


def test_offline_fetch_records_new_times_when_the_content_still_matches(hub: HubDouble, recipes: Path,
                                                                       tmp_path: Path) -> None:
    """A cache copied without its files' times: fetch with HF_HUB_OFFLINE=1 hashes every file against the
    lock and records the new times, after which serving's quick check passes again."""
    cache, snapshot = _fetched(hub, recipes, tmp_path)
    for name in ("config.json", "model.safetensors"):
        blob = (snapshot / name).resolve()
        os.utime(blob, ns=(blob.stat().st_atime_ns, blob.stat().st_mtime_ns + 7_000_000_000))
    env = _offline(recipes, tmp_path, cache)
    assert _lock_check(run_runtime(["doctor", "--context-key", FETCH_KEY, "--json"], env).stdout)["status"] == "FAIL"
    deep = _lock_check(run_runtime(["doctor", "--context-key", FETCH_KEY, "--deep", "--json"], env).stdout)
    assert deep["status"] == "WARN" and "2 file(s) have new modification times" in deep["detail"]
    done = run_runtime(["fetch", FETCH_KEY], env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "matches its lock" in done.stdout and "2 file(s) had new modification times" in done.stdout
    assert _lock_check(run_runtime(["doctor", "--context-key", FETCH_KEY, "--json"], env).stdout)["status"] == "OK"

    with open((snapshot / "config.json").resolve(), "r+b") as handle:
        handle.write(b"[")  # same size, other content: never recorded as good
    refused = run_runtime(["fetch", FETCH_KEY], env)
    assert refused.returncode == 1 and "config.json has sha256" in refused.stderr, refused.stdout + refused.stderr


def test_weights_without_a_lock_are_served_with_one_warning(hub: HubDouble, recipes: Path, tmp_path: Path) -> None:
    cache, _snapshot = _fetched(hub, recipes, tmp_path)
    commit = hub.repos[FETCH_REPO].commit
    _lock_file(cache, FETCH_REPO, commit).unlink()  # as if the files had been put there by hand
    env = _offline(recipes, tmp_path, cache)
    check = _lock_check(run_runtime(["doctor", "--context-key", FETCH_KEY, "--json"], env).stdout)
    assert check["status"] == "WARN" and "have no lock" in check["detail"]
    # The launch goes past the check: here it stops at the next step, a log directory that is a file
    # (without the pre-flight, which would refuse that first).
    (tmp_path / "not-a-dir").write_text("")
    served = run_runtime(["--context-key", FETCH_KEY, "--skip-preflight"],
                         {**env, "CF_LOG_DIR": str(tmp_path / "not-a-dir")})
    output = served.stdout + served.stderr
    assert output.count("have no lock") == 1, output
    assert f"weights of {FETCH_REPO} at {commit[:12]} have no lock" in output
    assert "log directory" in served.stderr and served.returncode == 1


def test_fetch_again_compares_a_changed_file_with_the_hub_and_keeps_it(hub: HubDouble, recipes: Path,
                                                                       tmp_path: Path) -> None:
    """A file changed in the cache after the lock is not downloaded again by huggingface_hub (it is
    there): fetch hashes it, finds it differs from the hub's listing, and names it instead of locking it."""
    cache, snapshot = _fetched(hub, recipes, tmp_path)
    blob = (snapshot / "tokenizer_config.json").resolve()
    data = bytearray(blob.read_bytes())
    data[0] ^= 0x20
    blob.write_bytes(bytes(data))
    lock_before = _lock_file(cache, FETCH_REPO, hub.repos[FETCH_REPO].commit).read_bytes()
    done = run_runtime(["fetch", FETCH_KEY, "--to", str(cache)], _env(hub, recipes, tmp_path))
    assert done.returncode == 1, done.stdout + done.stderr
    assert "the downloaded tokenizer_config.json" in done.stderr and "Git blob id" in done.stderr
    assert f"fix: delete {blob} and run fetch again" in done.stderr
    assert blob.read_bytes() == bytes(data)
    assert _lock_file(cache, FETCH_REPO, hub.repos[FETCH_REPO].commit).read_bytes() == lock_before
    blob.unlink()  # the fix: the next fetch downloads it again and matches the hub
    again = run_runtime(["fetch", FETCH_KEY, "--to", str(cache)], _env(hub, recipes, tmp_path))
    assert again.returncode == 0, again.stdout + again.stderr
    assert "every file matches the hub's listing" in again.stdout
