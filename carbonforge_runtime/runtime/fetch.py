"""``carbonforge-runtime fetch``: put the weights a recipe serves into the hub cache ahead of serving.

For each context key (or one ``--model REPO[@REVISION]``): the licence gate serving applies, then
the download of exactly the files the engine reads (:mod:`~carbonforge_runtime.runtime.weights.hub_cache`),
at the revision the recipe pins, into the cache the engine reads, or into ``--to DIR`` (a hub cache
directory to carry to an air-gapped host). Every file is then compared with the hub's listing and
the commit the revision resolved to (``main`` when none is pinned) is recorded with each file's sha256
in the weights lock (:mod:`~carbonforge_runtime.runtime.weights.lock`), which serving checks at every
start. The output ends with the ``docker run`` line that serves the result with no network.
"""

from __future__ import annotations

import shlex
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from carbonforge_runtime import files
from carbonforge_runtime.errors import CarbonForgeError, UsageError
from carbonforge_runtime.recipes import Recipe, load_recipes, recipe_dirs, resolve
from carbonforge_runtime.runtime.doctor.preflight import check_fetch_licence
from carbonforge_runtime.runtime.engine_env.compile_cache import IMAGE_DIR as COMPILE_CACHE_DIR
from carbonforge_runtime.runtime.engine_env.compile_cache import VOLUME_NAME as COMPILE_CACHE_VOLUME
from carbonforge_runtime.runtime.engine_env.privacy import hub_offline_choice, is_offline
from carbonforge_runtime.runtime.licensing.gate import premium_owners, recipe_owners
from carbonforge_runtime.runtime.planning.command import DEFAULT_OVERRIDE_DRAIN_S
from carbonforge_runtime.runtime.process.drain import stop_timeout_s
from carbonforge_runtime.runtime.weights.hub_cache import (
    FetchResult,
    download,
    format_bytes,
    hub_cache_dir,
    hub_listing,
    missing_summary,
    repo_folder,
    snapshot_state,
)
from carbonforge_runtime.runtime.weights.lock import (
    LockUnreadable,
    WeightsLock,
    blob_of,
    check_snapshot,
    fetch_command,
    mismatch_error,
    needs_hub,
    read_lock,
    relock_times,
    verify_fetched,
    write_lock,
)
from carbonforge_runtime.settings import DEFAULT_API_PORT, Settings

#: The image the README builds (``docker build -t carbonforge-runtime .``).
IMAGE = "carbonforge-runtime"
#: Where the image keeps the cache (HF_HOME in the Dockerfile) and the engine's hub/ inside it.
IMAGE_HF_HOME = "/var/cache/huggingface"
IMAGE_HUB = IMAGE_HF_HOME + "/hub"
#: The named volume of the docs and the compose example.
CACHE_VOLUME = "hf-cache"


@dataclass(frozen=True)
class FetchTarget:
    """One thing to fetch: a recipe's model, or a repository named by ``--model``."""

    repo: str
    revision: str | None
    recipe: Recipe | None = None

    @property
    def label(self) -> str:
        if self.recipe is not None:
            return self.recipe.key_text
        return self.repo + (f"@{self.revision}" if self.revision else "")


def parse_model(text: str) -> tuple[str, str | None]:
    """``REPO[@REVISION]`` as (repo, revision); refuses a path (a local directory needs no fetch)."""
    repo, _, revision = text.strip().partition("@")
    if not repo or repo.startswith(("/", ".", "~")) or Path(repo).expanduser().exists():
        raise UsageError(f"--model {text!r} is not a Hugging Face repository id",
                         "pass --model ORG/NAME[@REVISION]; a local model directory is served as it is, "
                         "nothing to fetch")
    if repo.count("/") > 1 or (revision == "" and text.strip().endswith("@")):
        raise UsageError(f"--model {text!r} is not of the form ORG/NAME[@REVISION]",
                         "pass --model ORG/NAME, or ORG/NAME@REVISION for a branch, tag or commit")
    return repo, revision or None


def fetch_targets(keys: Sequence[str], model: str | None, recipes: Mapping[str, Recipe],
                  default_key: str | None) -> list[FetchTarget]:
    """What the command line asks for; a built-in model has nothing to fetch and yields no target
    (its key is still checked)."""
    if keys and model:
        raise UsageError("fetch takes context keys or --model, not both",
                         "run fetch once for the keys and once for --model")
    if model:
        repo, revision = parse_model(model)
        return [FetchTarget(repo, revision)]
    wanted = list(keys) or ([default_key] if default_key else [])
    if not wanted:
        raise UsageError("fetch needs a context key or --model",
                         "pass the key of the recipe to serve (`carbonforge-runtime recipes list`), set "
                         "CF_CONTEXT_KEY, or pass --model ORG/NAME[@REVISION]")
    return [FetchTarget(recipe.model.repo, recipe.model.revision, recipe)
            for recipe in (resolve(key, recipes) for key in wanted)]


def _cache_dir(to: str | None, environ: Mapping[str, str]) -> tuple[Path, str]:
    """The cache to fill and how it was chosen (``--to``, or the variable the engine reads it from)."""
    if to:
        return Path(to).expanduser().resolve(), "--to"
    path, source = hub_cache_dir(environ)
    return Path(path), source


def _prepare_cache(cache_dir: Path) -> None:
    try:
        files.probe_writable(cache_dir)
    except OSError as exc:
        raise CarbonForgeError(
            f"the cache directory {cache_dir} cannot be written ({exc.strerror or exc})",
            "pass --to DIR with a writable directory, or mount a writable volume there "
            f"(-v {CACHE_VOLUME}:{IMAGE_HF_HOME})",
        ) from None


def mount_args(cache_dir: Path, source: str) -> list[str]:
    """The ``docker run`` options that give the container this cache as its hub/ directory."""
    if source == "--to":
        return ["-v", f"{cache_dir}:{IMAGE_HUB}", "-e", f"HUGGINGFACE_HUB_CACHE={IMAGE_HUB}"]
    if str(cache_dir) == IMAGE_HUB:
        # Fetched inside the image: the cache is the image's volume; the same volume serves it.
        return ["-v", f"{CACHE_VOLUME}:{IMAGE_HF_HOME}"]
    return ["-v", f"{cache_dir}:{IMAGE_HUB}"]


def _needs_licence(target: FetchTarget) -> bool:
    """Whether serving ``target`` needs a licence, as the gate decides it (shipped premium recipes only)."""
    if target.recipe is not None:
        return bool(recipe_owners(target.recipe))
    return bool(premium_owners(target.repo, {}))


def docker_run_line(target: FetchTarget, cache_dir: Path, source: str) -> str:
    """The exact command that serves ``target`` from this cache with no network."""
    args = ["docker", "run", "-d", "--name", "carbonforge"]
    recipe = target.recipe
    if recipe is None or not recipe.key.hardware.is_cpu:
        args += ["--gpus", "all"]
    if recipe is not None and not recipe.key.hardware.is_cpu and recipe.key.hardware.count > 1:
        args += ["--shm-size", "16g"]
    drain_s = recipe.drain_timeout_s if recipe is not None else DEFAULT_OVERRIDE_DRAIN_S
    args += ["-p", f"{DEFAULT_API_PORT}:{DEFAULT_API_PORT}", "--stop-timeout", str(stop_timeout_s(drain_s))]
    if recipe is not None:
        args += ["-e", f"CF_CONTEXT_KEY={recipe.key_text}"]
    args += ["-e", "HF_HUB_OFFLINE=1"]
    if _needs_licence(target):
        args += ["-e", "CARBONFORGE_LICENSE_KEY"]  # the value comes from the caller's environment
    args += [*mount_args(cache_dir, source), "-v", "carbonforge-logs:/var/log/carbonforge",
             "-v", f"{COMPILE_CACHE_VOLUME}:{COMPILE_CACHE_DIR}", IMAGE]
    if recipe is None:
        args += [target.repo, *(["--revision", target.revision] if target.revision else [])]
    return shlex.join(args)


def local_serve_line(target: FetchTarget, cache_dir: Path) -> str:
    """The same, for the runtime installed on this machine."""
    env = f"HF_HUB_OFFLINE=1 HUGGINGFACE_HUB_CACHE={shlex.quote(str(cache_dir))}"
    if target.recipe is not None:
        return f"{env} carbonforge-runtime --context-key {shlex.quote(target.recipe.key_text)}"
    revision = f" --revision {shlex.quote(target.revision)}" if target.revision else ""
    return f"{env} carbonforge-runtime {shlex.quote(target.repo)}{revision}"


def _report(result: FetchResult, elapsed_s: float) -> str:
    where = f"{result.repo} at {result.commit[:12]}"
    if not result.downloaded:
        return (f"nothing to download: all {len(result.files)} files of {where} "
                f"({format_bytes(result.total_bytes)}) are already in {result.cache_dir}")
    return (f"downloaded {len(result.downloaded)} of {len(result.files)} files of {where} "
            f"({format_bytes(result.downloaded_bytes)}) into {result.cache_dir} in {elapsed_s:.1f} s")


def lock_fetched(result: FetchResult, target: FetchTarget, environ: Mapping[str, str]) -> tuple[Path, bool]:
    """Compare every fetched file with the hub's listing and record the lock (the commit, each file's
    size, sha256 and time); returns the lock's path and whether the hub was asked (False: every file
    still matches the lock of the same commit). A mismatch deletes nothing: it raises, naming the file."""
    cache_dir = result.cache_dir
    try:
        previous = read_lock(cache_dir, result.repo, result.commit)
    except LockUnreadable:
        previous = None  # replaced by the one written below, after every file is compared with the hub
    names = sorted(result.files)
    asked = needs_hub(cache_dir, result.repo, result.commit, names, previous)
    listing = hub_listing(result.repo, result.commit, environ) if asked else None
    lock, problems = verify_fetched(cache_dir, result.repo, target.revision, result.commit, names, listing,
                                    previous)
    if problems:
        name, why = problems[0]
        more = f" (and {len(problems) - 1} more file(s))" if len(problems) > 1 else ""
        blob = blob_of(repo_folder(cache_dir, result.repo) / "snapshots" / result.commit / name)
        raise CarbonForgeError(
            f"{target.label}: the downloaded {name} of {result.repo} at {result.commit[:12]} does not match the "
            f"hub's listing: {why}{more}; nothing was deleted and no lock was written",
            f"delete {blob} and run fetch again; if it fails the same way, what answers at "
            f"{_endpoint(environ)} (a mirror, a proxy) serves other bytes than the hub lists: fetch through another",
        )
    endpoint = _endpoint(environ)
    lock = WeightsLock(lock.repo, lock.revision, lock.commit, lock.files, endpoint, lock.verified_at)
    return write_lock(cache_dir, lock), asked


def _endpoint(environ: Mapping[str, str]) -> str:
    return (environ.get("HF_ENDPOINT") or "").strip().rstrip("/") or "https://huggingface.co"


def _check_offline(target: FetchTarget, cache_dir: Path, environ: Mapping[str, str]) -> str:
    """With HF_HUB_OFFLINE on nothing can be downloaded: say whether the cache already has it all, and
    compare every file's sha256 with the lock fetch wrote (recording the files' times again when only
    those changed, as in a cache copied without them)."""
    state = snapshot_state(cache_dir, target.repo, target.revision)
    choice = hub_offline_choice(environ)
    switch = f"{choice[0]}={choice[1]}" if choice else "HF_HUB_OFFLINE=1"
    if state.complete:
        check = check_snapshot(cache_dir, target.repo, target.revision, deep=True)
        head = (f"{switch} is set, so nothing was downloaded; the snapshot of {target.label} in {cache_dir} "
                f"is complete ({len(state.expected)} files)")
        if check is None or check.status == "no-lock":
            return head + "; it has no lock (not fetched by this runtime): its files are not verified"
        if not check.ok:
            raise mismatch_error(check, fetch_command(target.recipe.key_text if target.recipe else target.label))
        try:
            relocked = relock_times(cache_dir, check)
        except OSError as exc:
            raise CarbonForgeError(
                f"the files of {target.label} match their lock, but {len(check.touched)} have new modification "
                f"times and the lock cannot be written again ({exc.strerror or exc})",
                f"run this fetch where {cache_dir} can be written, so that serving's quick check passes") from None
        again = (f"; {len(check.touched)} file(s) had new modification times with the same content: recorded "
                 "again") if relocked else ""
        return head + f" and matches its lock at {check.commit[:12]} (sha256 of {check.files} files){again}"
    what = (f"{target.repo} is not in {cache_dir}" if state.snapshot is None
            else f"the snapshot of {target.repo} in {cache_dir} lacks {missing_summary(state.missing)}")
    raise CarbonForgeError(f"{switch} is set, so fetch cannot download, and {what}",
                           f"run fetch without {switch.split('=')[0]} (it needs the hub), or run it on a machine "
                           "that reaches the hub and carry the cache directory over")


def fetch(keys: Sequence[str], model: str | None, to: str | None, settings: Settings,
          environ: Mapping[str, str], *, say: Callable[[str], None], terminal: bool,
          now: float | None = None) -> None:
    """Fetch what the command line names; raises a CarbonForgeError (with its fix) on any refusal."""
    recipes = load_recipes(recipe_dirs(settings.recipes_dir))
    default_key = str(settings.context_key) if settings.context_key else None
    targets = fetch_targets(keys, model, recipes, default_key)
    moment = time.time() if now is None else now
    for target in targets:  # every licence before any download
        check_fetch_licence(target.recipe, target.repo, recipes, settings, moment)
    cache_dir, source = _cache_dir(to, environ)
    served: list[FetchTarget] = []
    for target in targets:
        if target.recipe is not None and target.recipe.model.builtin:
            say(f"{target.label}: the built-in model {target.recipe.model.builtin} is generated on the serving "
                "machine at start; nothing to fetch")
            continue
        if is_offline(environ):
            say(f"{target.label}: " + _check_offline(target, cache_dir, environ))
        else:
            _prepare_cache(cache_dir)
            if target.revision:
                at = f" at {target.revision}"
            elif target.recipe is not None:
                at = " at main (the recipe pins no revision: the commit main names now is the one locked)"
            else:
                at = " at main (no revision given: the commit main names now is the one locked)"
            say(f"{target.label}: fetching {target.repo}{at} into {cache_dir} (from {source})")
            started = time.monotonic()
            result = download(target.repo, target.revision, cache_dir, environ, say=say, terminal=terminal)
            say(f"{target.label}: {_report(result, time.monotonic() - started)}")
            lock, asked = lock_fetched(result, target, environ)
            how = ("every file matches the hub's listing (sha256 or Git blob id)" if asked
                   else "every file still matches its lock")
            say(f"{target.label}: {how}; commit {result.commit} and each file's sha256 recorded in {lock}")
        served.append(target)
    if not served:
        return
    say("")
    say("to serve on this machine with no network:")
    for target in served:
        say("  " + local_serve_line(target, cache_dir))
    say("to serve in a container with no network (carry the directory to the host first):")
    for target in served:
        say("  " + docker_run_line(target, cache_dir, source))
