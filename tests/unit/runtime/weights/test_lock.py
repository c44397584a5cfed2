"""The weights lock on its own: the digests the hub lists, the lock file, and a snapshot checked against
it quickly (sizes and times) and deeply (sha256). A real hub-cache layout is built on disk; no hub."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from pathlib import Path

import pytest

from carbonforge_runtime.gpu.fake import FakeGpuBackend, host
from carbonforge_runtime.runtime.doctor import FAIL, OK, WARN, DoctorRequest, diagnose
from carbonforge_runtime.runtime.doctor.fake import FIXED_NOW, FixedProbes
from carbonforge_runtime.runtime.weights.hub_cache import HubEntry
from carbonforge_runtime.runtime.weights.lock import (
    MISMATCH,
    NO_LOCK,
    UNREADABLE,
    LockCheck,
    check_snapshot,
    file_digests,
    hub_mismatch,
    lock_path,
    read_lock,
    relock_times,
    verify_fetched,
    write_lock,
)

REPO = "org/model"
COMMIT = "a" * 40
FILES = {"config.json": b'{"model_type": "qwen2"}', "model.safetensors": b"\3" * 4096}


def _cache(tmp_path: Path, files: dict[str, bytes] = FILES) -> Path:
    """A hub cache as huggingface_hub lays it out: blobs, a snapshot of links, refs/main."""
    cache = tmp_path / "hub"
    folder = cache / "models--org--model"
    (folder / "blobs").mkdir(parents=True)
    (folder / "snapshots" / COMMIT).mkdir(parents=True)
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text(COMMIT)
    for name, data in files.items():
        blob = folder / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (folder / "snapshots" / COMMIT / name).symlink_to(os.path.relpath(blob, folder / "snapshots" / COMMIT))
    return cache


def _listing(files: dict[str, bytes] = FILES) -> dict[str, HubEntry]:
    out = {}
    for name, data in files.items():
        oid = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
        lfs = hashlib.sha256(data).hexdigest() if name.endswith(".safetensors") else None
        out[name] = HubEntry(name, len(data), oid, lfs)
    return out


def _locked(tmp_path: Path) -> Path:
    cache = _cache(tmp_path)
    lock, problems = verify_fetched(cache, REPO, None, COMMIT, FILES, _listing(), None)
    assert problems == []
    write_lock(cache, lock)
    return cache


def test_the_git_blob_id_is_gits_own(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"hello\n")
    expected = subprocess.run(["git", "hash-object", str(path)], capture_output=True, text=True, check=True)
    assert file_digests(path).git_oid == expected.stdout.strip()
    assert file_digests(path).sha256 == hashlib.sha256(b"hello\n").hexdigest()


def test_each_kind_of_file_is_compared_with_what_the_hub_lists_for_it(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"x" * 10)
    got = file_digests(path)
    good = HubEntry("f", 10, got.git_oid, None)
    assert hub_mismatch("f", good, got) is None
    assert hub_mismatch("f", HubEntry("f", 10, "0" * 40, got.sha256), got) is None  # LFS: the sha256 decides
    bad_lfs = hub_mismatch("f", HubEntry("f", 10, got.git_oid, "0" * 64), got)
    assert bad_lfs is not None and bad_lfs.startswith("f has sha256")
    bad_oid = hub_mismatch("f", HubEntry("f", 10, "0" * 40, None), got)
    assert bad_oid is not None and "Git blob id" in bad_oid
    assert hub_mismatch("f", HubEntry("f", 11, got.git_oid, None), got) == "f is 10 bytes, the hub lists 11"
    assert hub_mismatch("f", None, got) == "f is not in the hub's listing of that commit"
    assert hub_mismatch("f", HubEntry("f", 10), got) == "the hub's listing gives no hash for f"


def test_the_lock_records_the_commit_and_every_files_sha256(tmp_path: Path) -> None:
    cache = _locked(tmp_path)
    data = json.loads(lock_path(cache, REPO, COMMIT).read_text())
    assert data["commit"] == COMMIT and data["revision"] is None and data["resolved_ref"] == "main"
    assert {name: entry["sha256"] for name, entry in data["files"].items()} == {
        name: hashlib.sha256(content).hexdigest() for name, content in FILES.items()}
    lock = read_lock(cache, REPO, COMMIT)
    assert lock is not None and lock.total_bytes == sum(len(d) for d in FILES.values())
    assert not list(lock_path(cache, REPO, COMMIT).parent.glob(".lock-*"))


def test_a_file_that_differs_from_the_listing_is_named_and_kept(tmp_path: Path) -> None:
    cache = _cache(tmp_path)
    listing = _listing({**FILES, "model.safetensors": b"\4" * 4096})
    _lock, problems = verify_fetched(cache, REPO, None, COMMIT, FILES, listing, None)
    assert [name for name, _why in problems] == ["model.safetensors"]
    assert (cache / "models--org--model" / "snapshots" / COMMIT / "model.safetensors").read_bytes() == FILES[
        "model.safetensors"]


def test_the_quick_check_sees_size_and_time_and_the_deep_one_content(tmp_path: Path) -> None:
    cache = _locked(tmp_path)
    quick = check_snapshot(cache, REPO, None)
    assert quick is not None and quick.ok and quick.files == 2 and not quick.deep
    blob = (cache / "models--org--model" / "snapshots" / COMMIT / "model.safetensors").resolve()
    before = blob.stat()
    blob.write_bytes(b"\5" * 4096)  # same size, other bytes, same time
    os.utime(blob, ns=(before.st_atime_ns, before.st_mtime_ns))
    check = check_snapshot(cache, REPO, None)
    assert check is not None and check.ok
    deep = check_snapshot(cache, REPO, None, deep=True)
    assert deep is not None and deep.status == MISMATCH
    assert deep.problems[0].startswith("model.safetensors has sha256")
    os.utime(blob, ns=(before.st_atime_ns, before.st_mtime_ns + 1))
    moved = check_snapshot(cache, REPO, None)
    assert moved is not None and moved.status == MISMATCH and "modification time" in moved.problems[0]
    blob.write_bytes(b"\5" * 4095)
    smaller = check_snapshot(cache, REPO, None)
    assert smaller is not None and smaller.problems == ("model.safetensors is 4095 bytes, the lock says 4096",)


def test_new_times_of_intact_files_are_recorded_again_only_after_a_deep_check(tmp_path: Path) -> None:
    cache = _locked(tmp_path)
    blob = (cache / "models--org--model" / "snapshots" / COMMIT / "config.json").resolve()
    os.utime(blob, ns=(blob.stat().st_atime_ns, blob.stat().st_mtime_ns + 10**9))
    deep = check_snapshot(cache, REPO, None, deep=True)
    assert deep is not None and deep.ok and deep.touched == ("config.json",)
    quick = check_snapshot(cache, REPO, None)
    assert quick is not None and relock_times(cache, quick) is None  # a quick check proves no content
    assert relock_times(cache, deep) == lock_path(cache, REPO, COMMIT)
    again = check_snapshot(cache, REPO, None)
    assert again is not None and again.ok


def test_no_lock_and_an_unreadable_lock(tmp_path: Path) -> None:
    cache = _cache(tmp_path)
    check = check_snapshot(cache, REPO, None)
    assert check is not None and check.status == NO_LOCK
    assert check_snapshot(cache, "org/absent", None) is None
    path = lock_path(cache, REPO, COMMIT)
    path.parent.mkdir()
    path.write_text("{not json")
    broken = check_snapshot(cache, REPO, None)
    assert broken is not None and broken.status == UNREADABLE and str(path) in broken.problems[0]


def test_a_pinned_revision_reads_the_lock_of_the_commit_its_ref_names(tmp_path: Path) -> None:
    cache = _cache(tmp_path)
    (cache / "models--org--model" / "refs" / "v1").write_text(COMMIT)
    lock, _ = verify_fetched(cache, REPO, "v1", COMMIT, FILES, _listing(), None)
    write_lock(cache, lock)
    check = check_snapshot(cache, REPO, "v1")
    assert check is not None and check.ok and check.commit == COMMIT
    stored = read_lock(cache, REPO, COMMIT)
    assert stored is not None and stored.revision == "v1"


@pytest.mark.parametrize(("status", "deep", "expected"), [
    (NO_LOCK, False, WARN), ("ok", False, OK), ("ok", True, OK), (MISMATCH, True, FAIL), (UNREADABLE, False, FAIL)])
def test_the_doctor_reports_the_lock(status: str, deep: bool, expected: str) -> None:
    problems = ("model.safetensors has sha256 00…, the lock says 11…",) if status in (MISMATCH, UNREADABLE) else ()
    lock = LockCheck("Qwen/Qwen2.5-0.5B-Instruct", None, COMMIT, "/models/hub/s", status, "/models/hub/l.json",
                     deep, problems, 3, 1000)
    probes = FixedProbes(weights_in={"/models/hub": "/models/hub/s"}, weights_locks={"/models/hub": lock})
    checks = diagnose(DoctorRequest(context_key="qwen2.5-0.5b:fp8:chat:l4x1", deep=deep),
                      {"HOME": "/home/cf", "HUGGINGFACE_HUB_CACHE": "/models/hub"}, FakeGpuBackend(host("l4")),
                      probes=probes, now=FIXED_NOW)
    found = [check for check in checks if check.name == "storage.weights_lock"]
    assert len(found) == 1 and found[0].status == expected, found
    if expected == FAIL:
        assert "model.safetensors" in found[0].detail and "fetch qwen2.5-0.5b:fp8:chat:l4x1" in found[0].remedy
