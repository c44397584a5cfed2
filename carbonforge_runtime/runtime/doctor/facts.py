"""What the doctor knows about the host, as plain data.

Every outside fact (GPUs, files, sockets, packages, the licence, privileges) reaches the checks
through :class:`DoctorFacts`. :class:`Probes` is the question list the facts are read with:
:mod:`.probes` answers it from the machine, :mod:`.fake` from fixed data, and :mod:`.collect` asks it.
Nothing here touches the machine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from carbonforge_runtime import PINNED_VLLM_VERSION
from carbonforge_runtime.gpu.types import GpuSnapshot
from carbonforge_runtime.recipes import Recipe
from carbonforge_runtime.runtime.engine_env.compile_cache import Mount
from carbonforge_runtime.runtime.weights.lock import LockCheck
from carbonforge_runtime.settings import Settings

DOCTOR, PREFLIGHT = "doctor", "preflight"
#: vLLM's own default for --gpu-memory-utilization.
VLLM_DEFAULT_MEMORY_FRACTION = 0.9

@dataclass(frozen=True)
class DoctorRequest:
    """What to diagnose: the whole host (``doctor``) or a launch about to start (``preflight``)."""

    mode: str = DOCTOR
    context_key: str | None = None
    metrics: bool = False
    trace_file: str | None = None
    trace_endpoint: str | None = None
    #: The trace level the serve would run with (``doctor --request-trace``; None: not given, off).
    request_trace: str | None = None
    #: ``doctor --deep``: hash every weight file against the lock fetch wrote (else sizes and times).
    deep: bool = False


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
    #: Whether the recipe asked for needs a licence as the gate decides it (shipped recipes only:
    #: a local recipe serving a premium model does); None: decided by the recipe's own plan.
    premium: bool | None = None


@dataclass(frozen=True)
class OtelFacts:
    sdk_version: str | None
    exporter: bool


@dataclass(frozen=True)
class TracePolicyFacts:
    """What becomes of trace records: the level, where the trace files go (None: no file), and how long
    they are kept (CF_TRACE_RETENTION in seconds; None: forever)."""

    level: str
    #: Whether the level was given (``--request-trace``) rather than the default, off.
    level_given: bool = True
    files: str | None = None
    retention_s: float | None = None
    #: Why CF_TRACE_RETENTION cannot be used ("" when it is unset or valid), and its fix.
    retention_problem: str = ""
    retention_remedy: str = ""


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
    #: The snapshot against the lock fetch wrote (runtime/weights/lock.py); None: not looked at.
    lock: LockCheck | None = None


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
    #: Why the group secret cannot be used (none given, unreadable, too short), and the fix; "" when it can.
    secret_problem: str = ""
    secret_remedy: str = ""


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
    trace_policy: TracePolicyFacts | None = None
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


class Probes(Protocol):
    """The outside world as the doctor asks about it. :class:`~.probes.SystemProbes` is the real one,
    :class:`~.fake.FixedProbes` a fixed one."""

    def runtime(self) -> RuntimeFacts: ...

    def privileges(self) -> PrivilegeFacts: ...

    def shm_bytes(self) -> int | None: ...

    def license(self, settings: Settings, recipe: Recipe | None, now: float) -> LicenseFacts: ...

    def otel(self) -> OtelFacts: ...

    def directory(self, path: str) -> PathFacts: ...

    def find_weights(self, cache_dir: str, repo: str, revision: str | None) -> tuple[str | None, bool]: ...

    def weights_missing(self, cache_dir: str, repo: str, revision: str | None) -> tuple[str, ...]: ...

    def weights_lock(self, cache_dir: str, repo: str, revision: str | None, deep: bool) -> LockCheck | None: ...

    def engine(self) -> EngineFacts: ...

    def port(self, purpose: str, host: str, port: int, setting: str) -> PortFacts: ...

    def mount(self, path: str) -> MountFacts: ...

    def leader(self, host: str, port: int) -> tuple[str, str]: ...


__all__ = [
    "DOCTOR",
    "PREFLIGHT",
    "VLLM_DEFAULT_MEMORY_FRACTION",
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
    "TracePolicyFacts",
    "WeightsFacts",
]
