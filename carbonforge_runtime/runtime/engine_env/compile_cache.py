"""The engine's compile and kernel caches, kept together in one directory that can be a volume. Pure.

On its first boot the engine compiles: vLLM runs torch.compile over the model and keeps the result
under ``VLLM_CACHE_ROOT`` (``torch_compile_cache/<hash>/``, with its Inductor and Triton
artifacts beside it; its FlashInfer autotune and DeepGEMM caches also default to that root), and on
a GPU Triton, FlashInfer and the CUDA driver build kernels of their own. Each library has its own
default place (``~/.cache/vllm``, ``/tmp/torchinductor_<user>``, ``~/.triton/cache``,
``~/.cache/flashinfer``, ``~/.nv/ComputeCache``), several of which a container loses when it is
replaced. The runtime points all of them into subdirectories of one directory,
``CF_COMPILE_CACHE_DIR`` (``/var/cache/carbonforge`` in the image, which declares it a volume), so
that one mounted volume makes every later boot of the same recipe load what the first compiled
(vLLM then logs "Directly load AOT compilation from path ..."). The CPU build of vLLM 0.32 cannot
load that artifact, so the shipped CPU recipes turn AOT compilation off (``VLLM_USE_AOT_COMPILE=0``)
and a later boot takes every graph and kernel from Inductor's cache instead.

None of these locations enter vLLM's compile hash (``vllm/envs.py``: ``compile_factors`` ignores
``VLLM_CACHE_ROOT``; the others are not vLLM variables), so moving them does not invalidate a cache.
A variable the operator (or the recipe) already set keeps its value.

The doctor asks whether the directory is on a volume: :func:`parse_mountinfo`, :func:`mount_of`
and :func:`persistence` read ``/proc/self/mountinfo`` text that the caller supplies.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from carbonforge_runtime.runtime.engine_env.privacy import EnvLine

ROOT_VARIABLE = "CF_COMPILE_CACHE_DIR"
#: The directory the image uses (declared as a volume in the Dockerfile).
IMAGE_DIR = "/var/cache/carbonforge"
#: vLLM's switch that turns its torch.compile cache off (it reads ``bool(int(value))``).
DISABLE_VARIABLE = "VLLM_DISABLE_COMPILE_CACHE"
#: The name the docs, the compose example and the doctor's fix give the volume.
VOLUME_NAME = "carbonforge-compile"


@dataclass(frozen=True)
class CacheVariable:
    name: str
    subdirectory: str
    holds: str


#: Every cache the runtime points under the one directory, in the order the dry run lists them.
CACHE_VARIABLES: tuple[CacheVariable, ...] = (
    CacheVariable("VLLM_CACHE_ROOT", "vllm", "vLLM's torch.compile cache"),
    CacheVariable("TORCHINDUCTOR_CACHE_DIR", "torchinductor", "torch Inductor kernels"),
    CacheVariable("TRITON_CACHE_DIR", "triton", "compiled Triton kernels"),
    CacheVariable("FLASHINFER_WORKSPACE_BASE", "flashinfer", "FlashInfer JIT kernels (GPU)"),
    CacheVariable("CUDA_CACHE_PATH", "cuda", "the CUDA driver's JIT cache (GPU)"),
)


def _set(environ: Mapping[str, str], name: str) -> str | None:
    return (environ.get(name) or "").strip() or None


def resolve_root(value: str, environ: Mapping[str, str]) -> str:
    """``value`` (CF_COMPILE_CACHE_DIR or its default) as an absolute path; ``~`` is the ``HOME`` of
    ``environ`` (the engine's), so that the answer does not depend on the process asking."""
    if value == "~" or value.startswith("~/"):
        home = _set(environ, "HOME") or str(Path.home())
        value = home.rstrip("/") + value[1:]
    return str(PurePosixPath(value))


@dataclass
class CompileCacheEnv:
    """What the runtime sets in the engine's environment for its caches, and why."""

    root: str
    #: Set over the engine's environment as it is.
    env: dict[str, str] = field(default_factory=dict)
    lines: list[EnvLine] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def engine_cache_env(root: str, env: Mapping[str, str], operator: Mapping[str, str] | None = None) -> CompileCacheEnv:
    """The cache variables for an engine whose compile cache lives in ``root``. ``env`` is the
    environment it would inherit (the runtime's, with the recipe's variables); ``operator`` the
    runtime's own (``env`` by default). A variable set in either keeps its value."""
    operator = env if operator is None else operator
    out = CompileCacheEnv(root)
    for var in CACHE_VARIABLES:
        given = _set(operator, var.name)
        if given is not None:
            out.lines.append(EnvLine(var.name, given, f"environment, kept: {var.holds} stay there"))
            continue
        from_recipe = _set(env, var.name)
        if from_recipe is not None:
            out.lines.append(EnvLine(var.name, from_recipe, f"recipe, kept: {var.holds} stay there"))
            continue
        path = str(PurePosixPath(root) / var.subdirectory)
        out.env[var.name] = path
        out.lines.append(EnvLine(var.name, path, f"runtime: {var.holds}, under {ROOT_VARIABLE}"))
    disabled = _set(env, DISABLE_VARIABLE)
    if disabled is not None and disabled != "0":
        out.notes.append(f"{DISABLE_VARIABLE}={disabled}: vLLM keeps no torch.compile cache, so every start "
                         "compiles the model again; unset it to let later boots reuse the compiled graphs")
    return out


def cache_location(root: str, source: str, operator: Mapping[str, str]) -> tuple[str, str]:
    """(directory, the variable that names it) whose persistence decides whether a second boot
    compiles again: the operator's ``VLLM_CACHE_ROOT`` when set, else the runtime's directory."""
    given = _set(operator, "VLLM_CACHE_ROOT")
    if given is not None:
        return resolve_root(given, operator), "VLLM_CACHE_ROOT"
    return root, source


# --- is it on a volume? ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Mount:
    """One line of /proc/self/mountinfo: where it is mounted, the filesystem type, the source device
    and ``root``, the directory of that filesystem the mount shows (a volume's directory for a bind)."""

    mount_point: str
    fstype: str
    source: str = ""
    root: str = "/"


_ESCAPE = re.compile(r"\\([0-7]{3})")


def _unescape(text: str) -> str:
    """mountinfo writes space, tab, newline and backslash in paths as octal escapes (``\\040``)."""
    return _ESCAPE.sub(lambda match: chr(int(match.group(1), 8)), text)


def parse_mountinfo(text: str) -> list[Mount]:
    """The mounts in /proc/self/mountinfo text, in its order (a later mount hides an earlier one on
    the same point). Malformed lines are skipped."""
    mounts = []
    for line in text.splitlines():
        before, sep, after = line.partition(" - ")
        fields, tail = before.split(), after.split()
        if not sep or len(fields) < 5 or not tail:
            continue
        mounts.append(Mount(_unescape(fields[4]), tail[0], _unescape(tail[1]) if len(tail) > 1 else "",
                            _unescape(fields[3])))
    return mounts


def _contains(mount_point: str, path: str) -> bool:
    return mount_point == "/" or path == mount_point or path.startswith(mount_point.rstrip("/") + "/")


def mount_of(path: str, mounts: Sequence[Mount]) -> Mount | None:
    """The mount that holds the absolute, symlink-free ``path``: the deepest mount point above it,
    the last one listed where several share a point."""
    best: Mount | None = None
    for mount in mounts:
        if _contains(mount.mount_point, path) and (best is None or len(mount.mount_point) >= len(best.mount_point)):
            best = mount
    return best


#: Filesystems that live in memory: their content is gone at the next start.
MEMORY_FILESYSTEMS = frozenset({"tmpfs", "ramfs"})
#: The copy-on-write filesystems container engines give a container as its root.
ROOT_LAYER_FILESYSTEMS = frozenset({"overlay", "overlayfs", "fuse-overlayfs", "aufs"})
#: A Docker volume without a name: ``.../volumes/<64 hex digits>/_data``.
_ANONYMOUS_VOLUME = re.compile(r"/volumes/[0-9a-f]{64}/_data$")
_EMPTY_DIR = "kubernetes.io~empty-dir"

#: Verdicts of :func:`persistence`.
VOLUME, ROOT_LAYER, MEMORY, ANONYMOUS, EMPTY_DIR = "volume", "root layer", "memory", "anonymous volume", "emptyDir"


def persistence(mount: Mount) -> str:
    """What the mount holding the cache means for the next container: :data:`VOLUME` (it survives
    one being replaced), or why not: the container's own root filesystem, memory, an anonymous
    Docker volume (a new container gets a new, empty one), a Kubernetes emptyDir (lives with the pod)."""
    if mount.fstype in MEMORY_FILESYSTEMS:
        return MEMORY
    if mount.mount_point == "/":
        return ROOT_LAYER
    if _ANONYMOUS_VOLUME.search(mount.root):
        return ANONYMOUS
    if _EMPTY_DIR in mount.root:
        return EMPTY_DIR
    return VOLUME


def is_container_root(mounts: Sequence[Mount]) -> bool:
    """Whether the root filesystem is a container engine's layered one (overlay and the like)."""
    root = mount_of("/", [mount for mount in mounts if mount.mount_point == "/"])
    return root is not None and root.fstype in ROOT_LAYER_FILESYSTEMS


#: Files a container engine (Docker, Podman, containerd and CRI-O under Kubernetes) mounts into every
#: container it starts, each from a file of its own outside the container.
ENGINE_MOUNTED_FILES = frozenset({"/etc/hostname", "/etc/hosts", "/etc/resolv.conf"})


def is_container(mounts: Sequence[Mount]) -> bool:
    """Whether these are a container's mounts: a layered root filesystem, or the files a container engine
    mounts into each container. A marker file such as ``/.dockerenv`` alone is no proof: a host or VM whose
    root filesystem was made from a container image keeps it."""
    return is_container_root(mounts) or any(mount.mount_point in ENGINE_MOUNTED_FILES for mount in mounts)
