"""The Hugging Face hub cache: where it is, which files of a repository the engine reads, whether a
snapshot holds all of them, and the download that fills it.

The cache is huggingface_hub's own ``hub/`` layout, the one vLLM reads::

    <cache>/models--ORG--NAME/refs/<branch or tag>          the commit a name points at
    <cache>/models--ORG--NAME/snapshots/<commit>/<file>     links to blobs/
    <cache>/models--ORG--NAME/trees/<commit>.json           the repository's file listing at that commit

Which files the engine needs (:func:`engine_files`): the configuration, the tokenizer and chat
template files, any custom code at the top level, the weight index, and the weights of the kind
vLLM's default loader picks: every ``*.safetensors`` file, and the PyTorch ``*.bin`` (then ``*.pt``)
files only when the repository has no safetensors file at all.

A snapshot is complete (:func:`snapshot_state`) when every one of those files is there. The list of
expected files comes from the file listing the download cached beside the snapshot when there is
one (huggingface_hub checks an offline snapshot against the same listing); otherwise from the
snapshot itself (its config, and the shards its index names).

The download (:func:`download`) is huggingface_hub's ``snapshot_download``: resumption of a cut
transfer, the ``HF_TOKEN``, ``HF_ENDPOINT`` and the cache layout are the library's. Nothing here
starts the engine or imports vLLM; huggingface_hub is imported only by the download.
"""

from __future__ import annotations

import fnmatch
import glob
import json
import os
import re
import threading
import time
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from carbonforge_runtime.errors import CarbonForgeError

SAFE_INDEX = "model.safetensors.index.json"
BIN_INDEX = "pytorch_model.bin.index.json"
#: Top-level files the engine (vLLM, transformers' config and tokenizer loaders) reads when present.
METADATA_FILES = frozenset({
    "config.json", "generation_config.json", "params.json",
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "vocab.json", "merges.txt", "vocab.txt", "tokenizer.model", "spiece.model", "tekken.json",
    "chat_template.jinja", "chat_template.json",
    "preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json",
    "quantize_config.json", "quant_config.json", "hf_quant_config.json",
    SAFE_INDEX, BIN_INDEX,
})
#: Patterns over the whole path for the other files the engine reads (custom code, templates).
METADATA_PATTERNS = ("additional_chat_templates/*", "*.tiktoken")
#: The weight files vLLM's default loader looks for, in its order: the first pattern with a match wins.
WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.pt")
#: PyTorch checkpoints that are not weights (vLLM's loader skips them too).
NOT_WEIGHTS = frozenset({"training_args.bin", "optimizer.bin", "optimizer.pt", "scheduler.pt", "scaler.pt"})
#: Stands for the weights in the missing files of a snapshot that has none (and no listing to name them).
NO_WEIGHTS = "weight files (*.safetensors or *.bin)"
#: What the first phase of a download fetches: enough to know the commit, the listing and the shards.
FIRST_PHASE = ("config.json",)
_COMMIT = re.compile(r"^[0-9a-f]{40}$")
#: Seconds between two plain progress lines.
PROGRESS_EVERY_S = 5.0


# --- where the cache is -------------------------------------------------------------------------


def hub_cache_dir(env: Mapping[str, str]) -> tuple[str, str]:
    """The hub cache directory the engine will use, and the variable that chose it (Hugging Face's order)."""
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        value = env.get(name, "").strip()
        if value:
            return str(Path(value).expanduser()), name
    home = env.get("HF_HOME", "").strip()
    if home:
        return str(Path(home).expanduser() / "hub"), "HF_HOME"
    xdg = env.get("XDG_CACHE_HOME", "").strip()
    if xdg:
        return str(Path(xdg).expanduser() / "huggingface" / "hub"), "XDG_CACHE_HOME"
    user_home = env.get("HOME", "").strip() or str(Path.home())
    return str(Path(user_home) / ".cache" / "huggingface" / "hub"), "default"


def repo_folder(cache_dir: Path, repo: str) -> Path:
    """The cache folder of a model repository (``models--ORG--NAME``)."""
    return cache_dir / ("models--" + repo.replace("/", "--"))


def is_commit(revision: str | None) -> bool:
    return bool(revision) and _COMMIT.fullmatch(str(revision)) is not None


def ref_commit(cache_dir: Path, repo: str, revision: str | None) -> str | None:
    """The commit ``revision`` (default ``main``) names in the cache: itself for a commit id (or any
    revision that is a snapshot's name), else what ``refs/<revision>`` holds; None when unknown."""
    folder = repo_folder(cache_dir, repo)
    if revision and (is_commit(revision) or (folder / "snapshots" / revision).is_dir()):
        return revision
    try:
        ref = folder / "refs" / (revision or "main")
        return (ref.read_text(encoding="utf-8").strip() or None) if ref.is_file() else None
    except OSError:
        return None


# --- which files the engine reads ---------------------------------------------------------------


def _top_level(path: str) -> bool:
    return "/" not in path


def index_shards(index: Mapping[str, Any]) -> list[str]:
    """The shard files a ``*.index.json`` maps the tensors to."""
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, Mapping):
        return []
    return sorted({str(name) for name in weight_map.values()})


def engine_files(listing: Collection[str]) -> list[str]:
    """The files of a repository (``listing``: its paths) that serving it offline reads or asks for,
    sorted: the metadata files, and the weights in vLLM's order of preference: every ``*.safetensors``
    file, else every ``*.bin`` file, else every ``*.pt`` file (patterns over the whole path).

    All files of the chosen kind, not only the shards the index names: offline, vLLM 0.32 asks
    huggingface_hub for the snapshot with ``allow_patterns="*.safetensors"``, and the library refuses
    a snapshot that lacks any file of the repository's cached listing matching that pattern."""
    wanted = {path for path in listing if path in METADATA_FILES
              or any(fnmatch.fnmatchcase(path, pattern) for pattern in METADATA_PATTERNS)
              or (_top_level(path) and path.endswith(".py"))}
    for pattern in WEIGHT_PATTERNS:
        weights = {path for path in listing if fnmatch.fnmatchcase(path, pattern)}
        if weights:
            wanted.update(weights)
            break
    return sorted(wanted)


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _snapshot_files(snapshot: Path) -> set[str]:
    """Every file in a snapshot that can be read (a link whose blob is gone does not count)."""
    found: set[str] = set()
    if not snapshot.is_dir():
        return found
    for root, _dirs, files in os.walk(snapshot):
        for name in files:
            path = Path(root) / name
            if path.is_file():
                found.add(path.relative_to(snapshot).as_posix())
    return found


def cached_listing(cache_dir: Path, repo: str, commit: str) -> dict[str, int] | None:
    """The repository's files at ``commit`` with their sizes, from the listing huggingface_hub cached
    beside the snapshot when it downloaded it; None when there is none (or the library is missing)."""
    try:
        from huggingface_hub import get_cached_repo_tree
        from huggingface_hub.errors import CachedRepoTreeNotFoundError
    except ImportError:
        return None
    try:
        files = get_cached_repo_tree(repo, revision=commit, cache_dir=str(cache_dir))
    except (CachedRepoTreeNotFoundError, OSError, ValueError):
        return None
    return {entry.path: int(entry.size or 0) for entry in files}


# --- is a snapshot complete ---------------------------------------------------------------------


@dataclass(frozen=True)
class SnapshotState:
    """What the cache holds of one repository at one revision.

    ``snapshot`` is None when the revision is not in the cache at all. ``expected`` is what the engine
    will read, ``missing`` what of it is absent; ``source`` says where ``expected`` came from: the
    cached file listing (``listing``) or the snapshot's own config and index (``snapshot``)."""

    repo: str
    revision: str | None
    cache_dir: Path
    commit: str | None = None
    snapshot: Path | None = None
    expected: tuple[str, ...] = ()
    missing: tuple[str, ...] = ()
    source: str = ""

    @property
    def complete(self) -> bool:
        return self.snapshot is not None and not self.missing


def expected_from_snapshot(snapshot: Path, present: Collection[str]) -> tuple[list[str], list[str]]:
    """Without a file listing: what the snapshot itself says the engine needs (its config, the shards
    of its index, or at least one weight file), as (expected, missing)."""
    expected = ["config.json"] if "params.json" not in present else ["params.json"]
    for index_name in (SAFE_INDEX, BIN_INDEX):
        if index_name in present:
            index = _read_json(snapshot / index_name) or {}
            expected += [index_name, *index_shards(index)]
            break
    else:
        weights = sorted(name for name in present if _top_level(name)
                         and name.endswith((".safetensors", ".bin", ".pt")) and name not in NOT_WEIGHTS)
        expected += weights or [NO_WEIGHTS]
    missing = [name for name in expected if name not in present]
    return expected, missing


def snapshot_state(cache_dir: Path, repo: str, revision: str | None) -> SnapshotState:
    """Whether the snapshot the engine would load offline (``refs/<revision or main>``, or the commit
    itself) holds every file the engine reads. Reads only the disk."""
    commit = ref_commit(cache_dir, repo, revision)
    base = SnapshotState(repo, revision, cache_dir, commit)
    if commit is None:
        return base
    snapshot = repo_folder(cache_dir, repo) / "snapshots" / commit
    if not snapshot.is_dir():
        return base
    present = _snapshot_files(snapshot)
    listing = cached_listing(cache_dir, repo, commit)
    if listing is not None:
        expected = engine_files(listing)
        missing = [name for name in expected if name not in present]
        source = "listing"
    else:
        expected, missing = expected_from_snapshot(snapshot, present)
        source = "snapshot"
    return SnapshotState(repo, revision, cache_dir, commit, snapshot, tuple(expected), tuple(missing), source)


def served_snapshot(cache_dir: Path, repo: str, revision: str | None) -> Path | None:
    """The snapshot an offline engine would load, when it is complete (see :func:`snapshot_state`);
    None when the revision is not cached or a file the engine reads is missing."""
    state = snapshot_state(cache_dir, repo, revision)
    return state.snapshot if state.complete else None


def snapshot_has_weights(snapshot: Path) -> bool:
    patterns = ("*.safetensors", "*.bin", "*.pt", "*.gguf")
    return any(next(snapshot.glob(pattern), None) is not None for pattern in patterns)


def find_hub_snapshot(cache_dir: Path, repo: str, revision: str | None) -> Path | None:
    """The snapshot directory of ``repo`` in a hub cache (``models--ORG--NAME/snapshots/<commit>/``)
    that has a config.json, following ``refs/<revision or main>`` first; None when absent. Looser than
    :func:`snapshot_state`: without a revision it also finds a snapshot no ref points at."""
    folder = repo_folder(cache_dir, repo)
    snapshots = folder / "snapshots"
    if not snapshots.is_dir():
        return None
    wanted = revision or "main"
    candidates: list[Path] = []
    commit = ref_commit(cache_dir, repo, wanted)
    if commit is not None:
        candidates.append(snapshots / commit)
    candidates.append(snapshots / wanted)
    if revision is None:
        try:
            others = sorted(snapshots.iterdir(), key=lambda p: p.stat().st_mtime, reverse=True)
        except OSError:
            others = []
        candidates.extend(others)
    for candidate in candidates:
        if (candidate / "config.json").is_file():
            return candidate
    return None


# --- the download -------------------------------------------------------------------------------


@dataclass
class FetchResult:
    repo: str
    revision: str | None
    cache_dir: Path
    commit: str
    snapshot: Path
    #: Every file the engine reads, with its size (from the hub's listing).
    files: dict[str, int] = field(default_factory=dict)
    #: The files this run downloaded (empty: everything was already there).
    downloaded: list[str] = field(default_factory=list)

    @property
    def downloaded_bytes(self) -> int:
        return sum(self.files.get(name, 0) for name in self.downloaded)

    @property
    def total_bytes(self) -> int:
        return sum(self.files.values())


def format_bytes(count: float) -> str:
    value = float(count)
    for unit in ("B", "kB", "MB", "GB"):
        if value < 1000 or unit == "GB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    return f"{value:.1f} TB"  # pragma: no cover - the loop returns


def _format_duration(seconds: float) -> str:
    seconds = max(0, int(seconds))
    if seconds < 60:
        return f"{seconds} s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes} min {seconds:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"


def progress_line(done: int, total: int, rate: float) -> str:
    """One plain progress line: bytes done of total, rate, time left."""
    share = f" ({100 * done / total:.0f}%)" if total else ""
    left = f", about {_format_duration((total - done) / rate)} left" if rate > 0 and total > done else ""
    return f"downloaded {format_bytes(done)} of {format_bytes(total)}{share}, {format_bytes(rate)}/s{left}"


class _DiskProgress:
    """Plain progress lines for a log (no terminal): every few seconds, the bytes on disk so far (the
    finished files plus huggingface_hub's partial ``*.incomplete`` blobs) against the total."""

    def __init__(self, storage: Path, snapshot: Path, files: Mapping[str, int], say: Callable[[str], None],
                 every_s: float = PROGRESS_EVERY_S) -> None:
        self.storage = storage
        self.snapshot = snapshot
        self.files = dict(files)
        self.total = sum(self.files.values())
        self.say = say
        self.every_s = every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cf-fetch-progress", daemon=True)
        self._started = time.monotonic()
        self._last_done = -1

    def done_bytes(self) -> int:
        done = sum(size for name, size in self.files.items() if (self.snapshot / name).is_file())
        try:
            partial = sum(entry.stat().st_size for entry in (self.storage / "blobs").glob("*.incomplete"))
        except OSError:
            partial = 0
        return min(done + partial, self.total) if self.total else done + partial

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            done = self.done_bytes()
            if done == self._last_done:
                continue
            self._last_done = done
            elapsed = time.monotonic() - self._started
            self.say(progress_line(done, self.total, done / elapsed if elapsed > 0 else 0.0))

    def __enter__(self) -> _DiskProgress:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=2)


def _quiet_bars() -> type:
    """huggingface_hub's progress bar class, switched off (a log gets the plain lines instead)."""
    from huggingface_hub.utils.tqdm import tqdm as hub_tqdm

    class QuietBars(hub_tqdm):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)

    return QuietBars


def _hub_error(exc: BaseException, repo: str, revision: str | None, endpoint: str) -> CarbonForgeError:
    """A download failure as one line and its fix (never the token)."""
    from huggingface_hub import errors as hf_errors

    where = f"{repo}@{revision}" if revision else repo
    first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    token_fix = ("set HF_TOKEN (in the environment, e.g. docker run -e HF_TOKEN) to a Hugging Face token "
                 "that has access to it")
    if isinstance(exc, hf_errors.GatedRepoError):
        return CarbonForgeError(f"{repo} is gated on {endpoint}: access was refused", token_fix)
    if isinstance(exc, hf_errors.RevisionNotFoundError):
        return CarbonForgeError(f"{endpoint} has no revision {revision!r} of {repo}",
                                "check the revision (the recipe's model.revision, or REPO@REVISION after --model)")
    if isinstance(exc, hf_errors.RepositoryNotFoundError):
        return CarbonForgeError(f"{repo} was not found on {endpoint} (or it is private)",
                                f"check the repository name; for a private one, {token_fix}")
    if isinstance(exc, hf_errors.HfHubHTTPError):
        status = getattr(getattr(exc, "response", None), "status_code", None)
        if status in (401, 403):
            return CarbonForgeError(f"{endpoint} refused {where} (HTTP {status})", token_fix)
        return CarbonForgeError(f"the hub at {endpoint} answered an error for {where} ({first_line})",
                                "try again later (fetch resumes where it stopped: files already there are kept)")
    if isinstance(exc, OSError) and getattr(exc, "errno", None) == 28:
        return CarbonForgeError(f"no space left while downloading {where}",
                                "free disk space where the cache is, or pass --to DIR on a larger disk")
    return CarbonForgeError(
        f"cannot download {where} from {endpoint} ({type(exc).__name__}: {first_line})",
        "run fetch on a machine that reaches the hub (or set HF_ENDPOINT to a mirror), then carry the cache "
        "directory to this host",
    )


def download(repo: str, revision: str | None, cache_dir: Path, env: Mapping[str, str], *,
             say: Callable[[str], None], terminal: bool) -> FetchResult:
    """Download the files the engine reads for ``repo`` at ``revision`` (default ``main``) into the
    hub cache ``cache_dir``, with huggingface_hub's ``snapshot_download``.

    Two passes: the first resolves the revision to a commit, caches the repository's file listing and
    fetches the config; the second fetches exactly :func:`engine_files` of that listing. Files
    already in the snapshot are not downloaded again. ``terminal``: huggingface_hub's progress bars;
    otherwise plain lines through ``say`` every few seconds."""
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise CarbonForgeError("fetch needs the huggingface_hub package, which is not installed",
                               "install it into the runtime's environment (vLLM depends on it; the image ships "
                               "it)") from None
    endpoint = (env.get("HF_ENDPOINT") or "").strip().rstrip("/") or None
    shown_endpoint = endpoint or "https://huggingface.co"
    token = (env.get("HF_TOKEN") or "").strip() or None
    cache_dir = Path(cache_dir).expanduser().resolve()
    storage = repo_folder(cache_dir, repo)
    old_commit = ref_commit(cache_dir, repo, revision)
    before = _snapshot_files(storage / "snapshots" / old_commit) if old_commit else set()
    common: dict[str, Any] = {"cache_dir": str(cache_dir), "token": token, "endpoint": endpoint}
    if not terminal:
        common["tqdm_class"] = _quiet_bars()
    try:
        first = Path(snapshot_download(repo, revision=revision, allow_patterns=list(FIRST_PHASE), **common))
        commit = first.name
        listing = cached_listing(cache_dir, repo, commit)
        if listing is None:  # a huggingface_hub that keeps no listing beside the snapshot: ask the hub
            from huggingface_hub import HfApi
            from huggingface_hub.hf_api import RepoFile

            tree = HfApi(endpoint=endpoint, token=token).list_repo_tree(repo, revision=commit, recursive=True)
            listing = {entry.path: int(entry.size or 0) for entry in tree if isinstance(entry, RepoFile)}
        needed = engine_files(listing)
        files = {name: listing.get(name, 0) for name in needed}
        unchanged = commit == old_commit
        downloaded = [name for name in needed if not (unchanged and name in before)]
        later = [name for name in downloaded if name not in FIRST_PHASE]
        if later:
            say(f"fetching {len(later)} more file(s) of {repo} at {commit[:12]} "
                f"({format_bytes(sum(files[name] for name in later))}) into {cache_dir}")
            patterns = [glob.escape(name) for name in needed]
            if terminal:
                snapshot_download(repo, revision=commit, allow_patterns=patterns, **common)
            else:
                with _DiskProgress(storage, first, {name: files[name] for name in later}, say):
                    snapshot_download(repo, revision=commit, allow_patterns=patterns, **common)
    except CarbonForgeError:
        raise
    except Exception as exc:  # huggingface_hub's and the network's errors, as one line and a fix
        raise _hub_error(exc, repo, revision, shown_endpoint) from None
    return FetchResult(repo, revision, cache_dir, commit, first, files, downloaded)


@dataclass(frozen=True)
class HubEntry:
    """One file as the hub lists it at a commit: its size, its Git blob id, and for a Git LFS file the
    sha256 of its content (``model_info(files_metadata=True)``'s siblings)."""

    path: str
    size: int | None = None
    git_oid: str | None = None
    lfs_sha256: str | None = None


def hub_listing(repo: str, commit: str, env: Mapping[str, str]) -> dict[str, HubEntry]:
    """Every file of ``repo`` at ``commit`` as the hub lists it, with its hashes (one API request;
    ``HF_ENDPOINT`` and ``HF_TOKEN`` from ``env``). Raises a CarbonForgeError with the fix."""
    try:
        from huggingface_hub import HfApi
    except ImportError:
        raise CarbonForgeError("fetch needs the huggingface_hub package, which is not installed",
                               "install it into the runtime's environment (vLLM depends on it; the image ships "
                               "it)") from None
    endpoint = (env.get("HF_ENDPOINT") or "").strip().rstrip("/") or None
    token = (env.get("HF_TOKEN") or "").strip() or None
    try:
        info = HfApi(endpoint=endpoint, token=token).model_info(repo, revision=commit, files_metadata=True)
    except Exception as exc:  # huggingface_hub's and the network's errors, as one line and a fix
        raise _hub_error(exc, repo, commit, endpoint or "https://huggingface.co") from None
    entries: dict[str, HubEntry] = {}
    for sibling in info.siblings or []:
        lfs = sibling.lfs
        entries[sibling.rfilename] = HubEntry(sibling.rfilename, sibling.size, sibling.blob_id,
                                              lfs.sha256 if lfs is not None else None)
    return entries


def missing_summary(missing: Iterable[str], limit: int = 3) -> str:
    """``a, b, c (and 2 more)``."""
    names = list(missing)
    text = ", ".join(names[:limit])
    return text + (f" (and {len(names) - limit} more)" if len(names) > limit else "")
