"""Probes that answer from fixed data: a whole host described in a few fields, for tests and examples.

Pair with :class:`carbonforge_runtime.gpu.fake.FakeGpuBackend` for the GPUs. The defaults describe a
healthy host: root, a large /dev/shm, a valid licence, OpenTelemetry installed, writable directories,
the pinned GPU build of vLLM, free ports.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from carbonforge_runtime import PINNED_VLLM_VERSION
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
from carbonforge_runtime.runtime.engine_env.compile_cache import VOLUME_NAME, Mount
from carbonforge_runtime.runtime.weights.lock import LockCheck
from carbonforge_runtime.settings import Settings

GIB = 1024**3
#: 2026-01-01 00:00 UTC: a fixed "now" so that reports do not change with the date.
FIXED_NOW = 1767225600.0
DAY_S = 86400.0


def valid_license(days_left: float = 200.0, now: float = FIXED_NOW) -> LicenseFacts:
    return LicenseFacts("valid", origin="CARBONFORGE_LICENSE_KEY", licence_id="lic-0001", licensee="Example Corp",
                        expires_at=now + days_left * DAY_S)


@dataclass
class FixedProbes:
    runtime_facts: RuntimeFacts = field(
        default_factory=lambda: RuntimeFacts("0.2.0", "3.11.9", "Linux 6.8.0 x86_64", 16, 128 * GIB))
    privilege_facts: PrivilegeFacts = field(default_factory=lambda: PrivilegeFacts(0, True))
    shm: int | None = 32 * GIB
    license_facts: LicenseFacts = field(default_factory=valid_license)
    #: Whether a valid licence covers a premium recipe (filled in per recipe, like the real probe).
    entitled: bool = True
    otel_facts: OtelFacts = field(default_factory=lambda: OtelFacts("1.25.0", True))
    #: Directory -> why it is not writable.
    unwritable: dict[str, str] = field(default_factory=dict)
    #: Directories that do not exist yet (they can be created unless also in ``unwritable``).
    missing_dirs: set[str] = field(default_factory=set)
    #: Hub cache directory -> snapshot path of the recipe's weights found there.
    weights_in: dict[str, str] = field(default_factory=dict)
    #: Hub cache directory -> files the engine reads that its snapshot lacks.
    weights_missing_in: dict[str, tuple[str, ...]] = field(default_factory=dict)
    #: Hub cache directory -> its snapshot against the lock fetch wrote.
    weights_locks: dict[str, LockCheck] = field(default_factory=dict)
    engine_facts: EngineFacts = field(default_factory=lambda: EngineFacts("vllm", PINNED_VLLM_VERSION, True))
    #: Port -> why it cannot be bound.
    busy_ports: dict[int, str] = field(default_factory=dict)
    #: Where every directory asked about is mounted; None: in a container, on a named Docker volume
    #: mounted at that directory.
    mount_facts: MountFacts | None = None
    #: What a TCP connection to the group's leader finds: ("open" | "refused" | "unreachable", detail).
    leader_reach: tuple[str, str] = ("open", "")

    def runtime(self) -> RuntimeFacts:
        return self.runtime_facts

    def privileges(self) -> PrivilegeFacts:
        return self.privilege_facts

    def shm_bytes(self) -> int | None:
        return self.shm

    def license(self, settings: Settings, recipe: Recipe | None, now: float) -> LicenseFacts:
        facts = self.license_facts
        if facts.state == "valid" and recipe is not None and recipe.is_premium and facts.entitled is None:
            return replace(facts, entitled=self.entitled)
        return facts

    def otel(self) -> OtelFacts:
        return self.otel_facts

    def directory(self, path: str) -> PathFacts:
        exists = path not in self.missing_dirs
        if path in self.unwritable:
            return PathFacts(path, exists, False, self.unwritable[path])
        return PathFacts(path, exists, True)

    def find_weights(self, cache_dir: str, repo: str, revision: str | None) -> tuple[str | None, bool]:
        snapshot = self.weights_in.get(cache_dir)
        return (snapshot, True) if snapshot else (None, False)

    def weights_missing(self, cache_dir: str, repo: str, revision: str | None) -> tuple[str, ...]:
        return self.weights_missing_in.get(cache_dir, ())

    def weights_lock(self, cache_dir: str, repo: str, revision: str | None, deep: bool) -> LockCheck | None:
        return self.weights_locks.get(cache_dir)

    def engine(self) -> EngineFacts:
        return self.engine_facts

    def port(self, purpose: str, host: str, port: int, setting: str) -> PortFacts:
        if port in self.busy_ports:
            return PortFacts(purpose, host, port, False, self.busy_ports[port], setting)
        return PortFacts(purpose, host, port, True, "", setting)

    def leader(self, host: str, port: int) -> tuple[str, str]:
        return self.leader_reach

    def mount(self, path: str) -> MountFacts:
        if self.mount_facts is not None:
            return self.mount_facts
        return MountFacts(True, named_volume(path))


def named_volume(path: str, name: str = VOLUME_NAME) -> Mount:
    """A named Docker volume mounted at ``path``, as /proc/self/mountinfo shows it."""
    return Mount(path, "ext4", "/dev/nvme0n1p1", f"/var/lib/docker/volumes/{name}/_data")
