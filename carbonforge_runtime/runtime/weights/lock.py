"""The weights lock: what ``fetch`` verified, recorded beside the snapshot, and the checks against it.

``fetch`` resolves the recipe's revision (``main`` when the recipe pins none) to a commit, downloads
the files the engine reads, compares each with the hub's listing (the sha256 of a Git LFS file, the
Git blob id of a small one) and then writes one lock per commit, in the repository's cache folder::

    <cache>/models--ORG--NAME/carbonforge-locks/<commit>.json

The lock names the repository, the revision asked for, the commit it resolved to, and for every
file its size, sha256 and modification time (of the blob the snapshot links to). It sits outside
``snapshots/`` so that the snapshot the engine reads holds exactly the repository's files, and it
travels with the cache (``fetch --to DIR``).

Two checks read it: :func:`check_snapshot` with ``deep=False`` (sizes and modification times, a stat
per file: every serve start) and with ``deep=True`` (every file hashed again: ``doctor --deep``).
Nothing here talks to the hub: :func:`~.hub_cache.hub_listing` asks it, and ``fetch``
(:mod:`carbonforge_runtime.runtime.fetch`) hands the listing over as :class:`HubEntry` values.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from carbonforge_runtime.errors import CarbonForgeError
from carbonforge_runtime.files import write_text_atomic
from carbonforge_runtime.runtime.weights.hub_cache import HubEntry, ref_commit, repo_folder

LOCK_DIR = "carbonforge-locks"
FORMAT = 1
#: Bytes read at a time while hashing.
CHUNK = 1 << 20
#: Lock files over this size are refused unread (a real one is a few kB).
MAX_LOCK_BYTES = 4 << 20

OK, NO_LOCK, MISMATCH, UNREADABLE = "ok", "no-lock", "mismatch", "unreadable"
TIME_CHANGED = "(its modification time changed)"


# --- the lock's content -------------------------------------------------------------------------


@dataclass(frozen=True)
class LockedFile:
    path: str
    size: int
    sha256: str
    mtime_ns: int


@dataclass(frozen=True)
class WeightsLock:
    repo: str
    #: The revision fetch was asked for (the recipe's ``model.revision``, ``REPO@REVISION``); None:
    #: the default branch.
    revision: str | None
    commit: str
    files: tuple[LockedFile, ...]
    #: Where the files came from (the hub's address) and when they were verified (Unix time).
    endpoint: str = ""
    verified_at: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "repo": self.repo,
            "revision": self.revision,
            "resolved_ref": self.revision or "main",
            "commit": self.commit,
            "endpoint": self.endpoint,
            "verified_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.verified_at)),
            "files": {f.path: {"size": f.size, "sha256": f.sha256, "mtime_ns": f.mtime_ns} for f in self.files},
        }

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)


class LockUnreadable(ValueError):
    """A lock file that exists but cannot be read or is not one."""


def lock_path(cache_dir: Path, repo: str, commit: str) -> Path:
    return repo_folder(cache_dir, repo) / LOCK_DIR / f"{commit}.json"


def parse_lock(text: str, where: str) -> WeightsLock:
    try:
        data = json.loads(text)
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise LockUnreadable(f"{where} is not a weights lock of format {FORMAT}")
        files = tuple(LockedFile(str(name), int(entry["size"]), str(entry["sha256"]), int(entry["mtime_ns"]))
                      for name, entry in sorted(dict(data["files"]).items()))
        revision = data.get("revision")
        return WeightsLock(str(data["repo"]), None if revision is None else str(revision), str(data["commit"]),
                           files, str(data.get("endpoint") or ""))
    except LockUnreadable:
        raise
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise LockUnreadable(f"{where} is not a valid weights lock ({type(exc).__name__}: {exc})") from None


def read_lock(cache_dir: Path, repo: str, commit: str) -> WeightsLock | None:
    """The lock of ``repo`` at ``commit``; None when there is none. Raises :class:`LockUnreadable`."""
    path = lock_path(cache_dir, repo, commit)
    try:
        with open(path, "rb") as handle:
            raw = handle.read(MAX_LOCK_BYTES + 1)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise LockUnreadable(f"{path} cannot be read ({exc.strerror or exc})") from None
    if len(raw) > MAX_LOCK_BYTES:
        raise LockUnreadable(f"{path} is over {MAX_LOCK_BYTES} bytes: not a weights lock")
    return parse_lock(raw.decode("utf-8", errors="replace"), str(path))


def write_lock(cache_dir: Path, lock: WeightsLock) -> Path:
    """Replace the lock of ``lock.commit`` atomically (:func:`carbonforge_runtime.files.write_atomic`; mode 0644)."""
    target = lock_path(cache_dir, lock.repo, lock.commit)
    write_text_atomic(target, json.dumps(lock.as_dict(), indent=1, sort_keys=True) + "\n", mode=0o644)
    return target


# --- hashing and the hub's listing --------------------------------------------------------------


@dataclass(frozen=True)
class Digests:
    size: int
    sha256: str
    #: Git's blob id: sha1 over ``blob <size>\0`` and the content (what the hub lists for a small file).
    git_oid: str
    mtime_ns: int


def file_digests(path: Path) -> Digests:
    """Both digests of ``path`` (links followed) in one read. Raises OSError."""
    with open(path, "rb") as handle:
        info = os.fstat(handle.fileno())
        sha256 = hashlib.sha256()
        sha1 = hashlib.sha1(b"blob %d\0" % info.st_size, usedforsecurity=False)
        while chunk := handle.read(CHUNK):
            sha256.update(chunk)
            sha1.update(chunk)
    return Digests(info.st_size, sha256.hexdigest(), sha1.hexdigest(), info.st_mtime_ns)


def hub_mismatch(name: str, entry: HubEntry | None, got: Digests) -> str | None:
    """Why the downloaded ``name`` is not the hub's file (None: it is)."""
    if entry is None:
        return f"{name} is not in the hub's listing of that commit"
    if entry.size is not None and entry.size != got.size:
        return f"{name} is {got.size} bytes, the hub lists {entry.size}"
    if entry.lfs_sha256:
        if entry.lfs_sha256.lower() != got.sha256:
            return f"{name} has sha256 {got.sha256[:16]}…, the hub lists {entry.lfs_sha256[:16]}…"
        return None
    if entry.git_oid:
        if entry.git_oid.lower() != got.git_oid:
            return f"{name} has Git blob id {got.git_oid[:16]}…, the hub lists {entry.git_oid[:16]}…"
        return None
    return f"the hub's listing gives no hash for {name}"


def stat_matches(path: Path, locked: LockedFile) -> bool:
    try:
        info = path.stat()
    except OSError:
        return False
    return info.st_size == locked.size and info.st_mtime_ns == locked.mtime_ns


# --- checking a snapshot against its lock -------------------------------------------------------


@dataclass(frozen=True)
class LockCheck:
    """A snapshot against its lock. ``status``: ok, no-lock, mismatch or unreadable; ``problems`` name
    the files (first the first one found); ``deep``: sha256 compared, not only sizes and times."""

    repo: str
    revision: str | None
    commit: str
    snapshot: str
    status: str
    lock_file: str
    deep: bool = False
    problems: tuple[str, ...] = ()
    files: int = 0
    total_bytes: int = 0
    #: Files whose content matches (deep) although their modification time changed since the lock.
    touched: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return self.status == OK


def _file_problem(snapshot: Path, locked: LockedFile, deep: bool) -> tuple[str | None, bool]:
    """(why ``locked`` no longer holds, whether only its time changed with the content intact)."""
    path = snapshot / locked.path
    try:
        info = path.stat()
    except FileNotFoundError:
        return f"{locked.path} is missing from the snapshot", False
    except OSError as exc:
        return f"{locked.path} cannot be read ({exc.strerror or exc})", False
    if info.st_size != locked.size:
        return f"{locked.path} is {info.st_size} bytes, the lock says {locked.size}", False
    if deep:
        try:
            got = file_digests(path).sha256
        except OSError as exc:
            return f"{locked.path} cannot be read ({exc.strerror or exc})", False
        if got != locked.sha256:
            return f"{locked.path} has sha256 {got[:16]}…, the lock says {locked.sha256[:16]}…", False
        return None, info.st_mtime_ns != locked.mtime_ns
    if info.st_mtime_ns != locked.mtime_ns:
        return f"{locked.path} was modified after fetch verified it {TIME_CHANGED}", False
    return None, False


def check_snapshot(cache_dir: Path, repo: str, revision: str | None, *, deep: bool = False) -> LockCheck | None:
    """The snapshot the engine would load offline (``refs/<revision or main>``, or the commit) against
    its lock; None when that snapshot is not in the cache."""
    commit = ref_commit(cache_dir, repo, revision)
    if commit is None:
        return None
    snapshot = repo_folder(cache_dir, repo) / "snapshots" / commit
    if not snapshot.is_dir():
        return None
    where = lock_path(cache_dir, repo, commit)
    base = LockCheck(repo, revision, commit, str(snapshot), NO_LOCK, str(where), deep)
    try:
        lock = read_lock(cache_dir, repo, commit)
    except LockUnreadable as exc:
        return _replace(base, status=UNREADABLE, problems=(str(exc),))
    if lock is None:
        return base
    problems: list[str] = []
    touched: list[str] = []
    for locked in lock.files:
        problem, only_time = _file_problem(snapshot, locked, deep)
        if problem:
            problems.append(problem)
        elif only_time:
            touched.append(locked.path)
    if lock.repo != repo or lock.commit != commit:
        problems.insert(0, f"{where} locks {lock.repo} at {lock.commit}, not {repo} at {commit}")
    return _replace(base, status=MISMATCH if problems else OK, problems=tuple(problems), files=len(lock.files),
                    total_bytes=lock.total_bytes, touched=tuple(touched))


def _replace(check: LockCheck, **changes: Any) -> LockCheck:
    return replace(check, **changes)


def relock_times(cache_dir: Path, check: LockCheck) -> Path | None:
    """After a deep check that found every file's content intact: record the files' present times
    (a cache copied without them), so that the quick check at serve start passes again."""
    if check.status != OK or not check.deep or not check.touched:
        return None
    lock = read_lock(cache_dir, check.repo, check.commit)
    if lock is None:
        return None
    snapshot = Path(check.snapshot)
    files = tuple(LockedFile(f.path, f.size, f.sha256, (snapshot / f.path).stat().st_mtime_ns) for f in lock.files)
    return write_lock(cache_dir, WeightsLock(lock.repo, lock.revision, lock.commit, files, lock.endpoint,
                                             time.time()))


def fetch_command(what: str) -> str:
    """The fetch command line for a context key or a ``REPO[@REVISION]``."""
    return f"carbonforge-runtime fetch {what}" if ":" in what else f"carbonforge-runtime fetch --model {what}"


class WeightsMismatch(CarbonForgeError):
    """Cached weights that no longer match the lock fetch wrote: the launch is refused."""


def mismatch_error(check: LockCheck, fetch: str) -> WeightsMismatch:
    """The refusal for weights that no longer match their lock (or whose lock cannot be read): one line
    naming the first file, and the fetch that checks them against the hub again."""
    first = check.problems[0] if check.problems else "the lock does not match"
    more = f" (and {len(check.problems) - 1} more)" if len(check.problems) > 1 else ""
    fix = (f"run `{fetch}` again where the hub is reachable (it compares every file with the hub and names the "
           "one to delete), or carry a freshly fetched cache over")
    if check.problems and all(problem.endswith(TIME_CHANGED) for problem in check.problems):
        fix = (f"if the cache was copied without its files' times, run `{fetch}` with HF_HUB_OFFLINE=1 here: it "
               "hashes every file against the lock and records the new times when the content is intact; "
               "otherwise " + fix)
    return WeightsMismatch(
        f"the weights of {check.repo} at {check.commit[:12]} do not match the lock fetch wrote: {first}{more}", fix)


# --- what fetch records -------------------------------------------------------------------------


def verify_fetched(cache_dir: Path, repo: str, revision: str | None, commit: str, names: Iterable[str],
                   listing: Mapping[str, HubEntry] | None,
                   previous: WeightsLock | None) -> tuple[WeightsLock, list[tuple[str, str]]]:
    """Every file of the fetched snapshot against the hub's ``listing`` (None: the hub was not asked,
    every file still matches ``previous``), as the lock to write and the mismatches as (file, why)
    (empty: write it).

    A file that still has the size and time the previous lock of this commit recorded keeps its
    recorded sha256 without being read again; every other file is hashed and compared with the hub."""
    snapshot = _snapshot(cache_dir, repo, commit)
    old = {f.path: f for f in previous.files} if previous is not None and previous.commit == commit else {}
    files: list[LockedFile] = []
    problems: list[tuple[str, str]] = []
    for name in sorted(names):
        path = snapshot / name
        known = old.get(name)
        if known is not None and stat_matches(path, known):
            files.append(known)
            continue
        try:
            got = file_digests(path)
        except OSError as exc:
            problems.append((name, f"{name} cannot be read after the download ({exc.strerror or exc})"))
            continue
        problem = hub_mismatch(name, (listing or {}).get(name), got)
        if problem:
            problems.append((name, problem))
        files.append(LockedFile(name, got.size, got.sha256, got.mtime_ns))
    return WeightsLock(repo, revision, commit, tuple(files), verified_at=time.time()), problems


def needs_hub(cache_dir: Path, repo: str, commit: str, names: Iterable[str], previous: WeightsLock | None) -> bool:
    """Whether any file must be compared with the hub (it is new, or changed since ``previous``)."""
    if previous is None or previous.commit != commit:
        return True
    snapshot = _snapshot(cache_dir, repo, commit)
    old = {f.path: f for f in previous.files}
    return any(name not in old or not stat_matches(snapshot / name, old[name]) for name in names)


def _snapshot(cache_dir: Path, repo: str, commit: str) -> Path:
    return repo_folder(cache_dir, repo) / "snapshots" / commit


def blob_of(path: Path) -> Path:
    """Where a snapshot's file really is (huggingface_hub links it into ``blobs/``)."""
    try:
        return path.resolve(strict=True)
    except OSError:
        return path
