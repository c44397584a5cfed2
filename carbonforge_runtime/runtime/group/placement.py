"""A serving group across hosts: which place this host holds, and the vLLM command for that place.
Pure functions over the settings, the serve flags and the launch plan.

vLLM's own multiprocessing launcher runs the group: every host starts vLLM with the same model and
parallel sizes plus ``--nnodes N --node-rank I --master-addr LEADER --master-port P``. The leader
(rank 0) runs the API server and the engine; the other ranks run vLLM's serve command with
``--headless`` (no API server). The runtime learns its place from CF_NNODES, CF_NODE_RANK,
CF_MASTER_ADDR and CF_MASTER_PORT (or the serve flags of the same names), and from the variables
LeaderWorkerSet sets in every pod (LWS_GROUP_SIZE, LWS_WORKER_INDEX, LWS_LEADER_ADDRESS), so one pod
spec serves every rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from carbonforge_runtime.errors import UsageError
from carbonforge_runtime.recipes import Recipe
from carbonforge_runtime.recipes.keys import HardwareSpec
from carbonforge_runtime.runtime.vllm_cli.args import read
from carbonforge_runtime.settings import DEFAULT_GROUP_PORT, Settings, VarName

#: What a worker runs: vLLM's ``serve`` subcommand (the only entry point that runs ``--headless``)
#: through the engine package's entry, which works on the CPU build too (``engine/headless.py``).
WORKER_MODULE = "carbonforge_runtime.engine.headless"
HEADLESS_FLAG = "--headless"
#: The flags that place a host in a group: the runtime writes them, so a command line must not.
GROUP_FLAGS = ("--nnodes", "--node-rank", "--master-addr", "--master-port", HEADLESS_FLAG,
               "--distributed-timeout-seconds")
#: The variables that place a host in a group (the doctor reports the place when any is set).
GROUP_VARIABLES: tuple[VarName, ...] = ("CF_NNODES", "CF_NODE_RANK", "CF_MASTER_ADDR", "LWS_GROUP_SIZE",
                                        "LWS_WORKER_INDEX", "LWS_LEADER_ADDRESS")
#: What the API server alone uses: a headless worker is started without it.
API_ONLY_FLAGS = ("--middleware",)


@dataclass(frozen=True)
class GroupFlags:
    """The serve flags that place this host (``None``: not given)."""

    nnodes: int | None = None
    node_rank: int | None = None
    master_addr: str | None = None
    master_port: int | None = None


@dataclass(frozen=True)
class Group:
    """This host's place in a group of ``nnodes`` hosts (``nnodes`` > 1)."""

    nnodes: int
    rank: int
    master_addr: str
    master_port: int
    join_timeout_s: float
    #: Where each value came from, for the dry run and the doctor.
    sources: tuple[str, ...] = ()
    #: Port on the leader where the runtimes watch each other (:mod:`.group_watch`).
    watch_port: int = DEFAULT_GROUP_PORT

    @property
    def leader(self) -> bool:
        return self.rank == 0

    @property
    def role(self) -> str:
        return "leader" if self.leader else "worker"

    def describe(self) -> str:
        where = f" (from {', '.join(self.sources)})" if self.sources else ""
        return (f"{self.role}, rank {self.rank} of {self.nnodes} hosts; leader {self.master_addr}:{self.master_port}"
                f", watch port {self.watch_port}{where}")

    def vllm_flags(self) -> list[str]:
        """The flags that put vLLM in its place in the group."""
        flags = ["--nnodes", str(self.nnodes), "--node-rank", str(self.rank), "--master-addr", self.master_addr,
                 "--master-port", str(self.master_port),
                 "--distributed-timeout-seconds", str(max(1, round(self.join_timeout_s)))]
        return flags if self.leader else [*flags, HEADLESS_FLAG]


def _pick(flag: object, settings: Settings, names: Sequence[VarName], flag_name: str) -> tuple[object, str | None]:
    """The first value given: the serve flag, then each variable in turn; and where it came from."""
    if flag is not None:
        return flag, flag_name
    for name in names:
        if settings.is_set(name):
            return settings.value(name), name
    return None, None


def resolve_group(settings: Settings, flags: GroupFlags | None = None) -> Group | None:
    """This host's place, or ``None`` for a host that serves alone. Raises :class:`UsageError` for a
    place that is incomplete or impossible, naming the variable to set."""
    flags = flags or GroupFlags()
    nnodes, nnodes_from = _pick(flags.nnodes, settings, ("CF_NNODES", "LWS_GROUP_SIZE"), "--nnodes")
    rank, rank_from = _pick(flags.node_rank, settings, ("CF_NODE_RANK", "LWS_WORKER_INDEX"), "--node-rank")
    addr, addr_from = _pick(flags.master_addr, settings, ("CF_MASTER_ADDR", "LWS_LEADER_ADDRESS"), "--master-addr")
    port, port_from = _pick(flags.master_port, settings, ("CF_MASTER_PORT",), "--master-port")
    if nnodes is None or int(str(nnodes)) == 1:
        if rank is not None and int(str(rank)) > 0:
            raise UsageError(f"{rank_from}={rank} places this host in a group, but the group size is "
                             f"{'not set' if nnodes is None else 1}",
                             "set CF_NNODES to the number of hosts on every host of the group, or unset "
                             f"{rank_from} to serve on this host alone")
        return None
    size = int(str(nnodes))
    if rank is None:
        raise UsageError(f"{nnodes_from}={size} puts this host in a group, but its rank is not set",
                         "set CF_NODE_RANK (0 on the leader, 1 to N-1 on the workers) or pass --node-rank")
    place = int(str(rank))
    if place >= size:
        raise UsageError(f"{rank_from}={place} is outside the group of {size} hosts ({nnodes_from})",
                         f"give each host a rank from 0 (the leader) to {size - 1}")
    if not addr or not str(addr).strip():
        raise UsageError(f"{nnodes_from}={size} puts this host in a group, but the leader's address is not set",
                         "set CF_MASTER_ADDR to the leader's address (the same on every host), or pass "
                         "--master-addr")
    sources = tuple(dict.fromkeys(s for s in (nnodes_from, rank_from, addr_from, port_from) if s))
    meet = int(str(port if port is not None else settings.value("CF_MASTER_PORT")))
    return Group(size, place, str(addr).strip(), meet, float(settings.value("CF_JOIN_TIMEOUT_S")), sources,
                 int(settings.value("CF_GROUP_PORT")))


def check_recipe_fits(recipe: Recipe | None, group: Group | None) -> None:
    """A multi-host recipe needs a group of its size; a single-host recipe refuses one."""
    if recipe is None:
        return
    split = recipe.hosts
    if split is None and group is not None:
        raise UsageError(
            f"{recipe.key_text} is a single-host recipe, but this host is placed in a group of {group.nnodes} "
            f"({', '.join(group.sources)})",
            "serve a multi-host key (`carbonforge-runtime recipes list` shows keys such as "
            "qwen3.6-27b:fp8:agentic:2xh100x8), or unset CF_NNODES to serve on one host",
        )
    if split is not None and group is None:
        raise UsageError(
            f"{recipe.key_text} spans {split.nodes} hosts, but this host is not placed in a group",
            f"on every host set CF_NNODES={split.nodes}, CF_NODE_RANK (0 on the leader) and CF_MASTER_ADDR "
            "(the leader's address), or run the group under LeaderWorkerSet (docs/kubernetes.md)",
        )
    if split is not None and group is not None and group.nnodes != split.nodes:
        raise UsageError(
            f"{recipe.key_text} spans {split.nodes} hosts, but the group has {group.nnodes} "
            f"({', '.join(group.sources)})",
            f"run the recipe on a group of {split.nodes} hosts, or pick the key for your host count",
        )


def hardware_remedy(recipe: Recipe) -> str:
    """The fix for a host of a group whose GPUs differ from the recipe's (the doctor's check and the
    launch's refusal give the same one). Every host of a group runs the same share of the model, so
    each needs the GPUs of the recipe's host split."""
    spec = recipe.key.hardware
    per_host = recipe.hosts.gpus_per_node if recipe.hosts is not None else spec.count
    return (f"run every host of the group on {per_host} {_gpu_name(spec)} GPU(s), as {spec} says (on Kubernetes: "
            f"request nvidia.com/gpu: {per_host} and pin the pods to nodes of that GPU with a nodeSelector "
            "on nvidia.com/gpu.product), or serve the key whose hardware segment matches the group's hosts "
            "(`carbonforge-runtime recipes list`); a host of a group does not start on other GPUs, "
            "--strict-hardware or not")


def _gpu_name(spec: HardwareSpec) -> str:
    return spec.family.upper() + (f" {spec.memory_gb} GB" if spec.memory_gb else "")


def check_no_group_flags(args: Sequence[str]) -> None:
    """The runtime places the host; the same flags among the vLLM arguments would contradict it."""
    given = sorted({o.written.split("=", 1)[0] for o in read(args).occurrences if o.flag in GROUP_FLAGS})
    if given:
        raise UsageError(
            f"{', '.join(given)} among the vLLM arguments: the runtime places this host in its group itself",
            "remove them and set CF_NNODES, CF_NODE_RANK, CF_MASTER_ADDR, CF_MASTER_PORT and CF_JOIN_TIMEOUT_S "
            "(or run under LeaderWorkerSet, which sets the LWS_ variables)",
        )


def place_command(argv: Sequence[str], engine_module: str, group: Group) -> list[str]:
    """The vLLM command ``argv`` (``python -m ENGINE_MODULE ...``) for this host's place: the leader's
    gets the group flags; a worker's runs vLLM's serve command (model first) with ``--headless`` and
    without the API server's flags."""
    at = list(argv).index(engine_module)
    prefix, args = list(argv[:at]), list(argv[at + 1:])
    if group.leader:
        return [*prefix, engine_module, *args, *group.vllm_flags()]
    given = read(args)
    models = given.all("--model")
    model = list(models[0].values[:1]) if models else []  # `vllm serve` takes the model as its first argument
    kept = given.without([*API_ONLY_FLAGS, "--model"])
    return [*prefix, WORKER_MODULE, *model, *kept, *group.vllm_flags()]
