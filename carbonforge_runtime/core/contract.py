"""The engine contract: everything the runtime tells the code it loads inside vLLM's engine.

One frozen, versioned tree of plain dataclasses. The runtime builds it (the ordering, the trace
and the step-log parts in the launch plan, the metrics feed and the energy meter when it starts
them), serialises it once into :data:`CONTRACT_ENV` on the vLLM process, and the engine-core
process, which inherits the variable, parses it once when the scheduler is constructed. Each part except the ordering is
optional: ``None`` means the runtime asked for nothing of that kind.

Why an environment variable: ``--additional-config`` would also reach the engine, but it changes
vLLM's compile-cache key and forces a recompile.

A parse refuses a version other than :data:`CONTRACT_VERSION` and any unknown or ill-typed field
with :class:`ContractError`, which names the fix: the runtime and the engine must come from the
same installation. Pure: no vLLM import, no I/O.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, TypeVar

from carbonforge_runtime.core.figure_labels import LATE_SHARE_LIMIT
from carbonforge_runtime.core.redaction import redact_url
from carbonforge_runtime.errors import UsageError

#: The variable that carries the contract. Internal: set by the runtime, never by hand.
CONTRACT_ENV = "CF_SCHEDULER_CONFIG"
#: Bumped on every change to the tree below that an older engine side could misread.
CONTRACT_VERSION = 1
#: The value of vLLM's ``--scheduler-cls``: a factory that picks the synchronous or asynchronous base.
SCHEDULER_CLS = "carbonforge_runtime.engine.scheduler.make_scheduler"
DEFAULT_FAMILY = "fcfs"
#: What the scheduler logs (in vllm.log, followed by its engine-core pid) once that core has shut its
#: executor down and written every trace record: the runtime may then end the core at once
#: (:mod:`~carbonforge_runtime.runtime.process.shutdown_watch`).
CORE_DONE_MARKER = "[shutdown] CarbonForge scheduler: records written, executor down; engine core pid"

PROTOCOL_GRPC = "grpc"
PROTOCOL_HTTP = "http/protobuf"
PROTOCOLS = (PROTOCOL_GRPC, PROTOCOL_HTTP)

#: What ``fix`` says on every refusal of a contract.
_SAME_INSTALL = (
    f"run the runtime and the engine from the same carbonforge-runtime installation, and let the runtime set "
    f"{CONTRACT_ENV} (never set it by hand)"
)


class ContractError(UsageError):
    """The engine contract cannot be read: another version, or a malformed value."""


@dataclass(frozen=True)
class Ordering:
    """Which ordering family the engine's scheduler runs, with the recipe's parameters."""

    family: str = DEFAULT_FAMILY
    params: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class OtlpTarget:
    endpoint: str  # normalised URL: http(s)://host:port[/v1/traces for HTTP]
    protocol: str  # "grpc" or "http/protobuf"


@dataclass(frozen=True)
class TraceConfig:
    """Where trace records go, how much they carry, and the writer's limits."""

    level: str  # "standard" or "full"
    file: str | None = None  # absolute path of the JSONL file
    otlp: OtlpTarget | None = None
    #: Records waiting between the engine loop and the writer thread; beyond this they are dropped.
    queue_capacity: int = 100_000
    #: Records one sink may hold while it retries; beyond this they are dropped.
    sink_capacity: int = 100_000
    #: Records per sink write (one JSONL append, one OTLP export request).
    batch_max: int = 512
    #: Attempts of one batch before it is dropped and counted.
    retry_attempts: int = 3
    backoff_initial_s: float = 0.5
    backoff_max_s: float = 10.0
    #: How often drops are reported (a warning in the engine log) while they happen.
    report_interval_s: float = 10.0
    #: Time allowed at engine shutdown to write what is still queued.
    flush_timeout_s: float = 4.0
    #: Timeout of one OTLP export call (the exporter retries inside it).
    export_timeout_s: float = 2.0
    #: Engine cores of a data-parallel deployment; above 1 each rank writes its own file
    #: (:func:`rank_file`), so no two processes append to one file.
    data_parallel_size: int = 1
    #: CF_TRACE_RETENTION in seconds: the file rotates and old segments are deleted
    #: (:mod:`~carbonforge_runtime.core.trace_retention`); None keeps it forever.
    retention_s: float | None = None

    @property
    def full(self) -> bool:
        return self.level == "full"

    def file_of_rank(self, rank: int) -> str | None:
        """The file data-parallel rank ``rank`` writes: :attr:`file` itself without data parallel."""
        if self.file is None or self.data_parallel_size <= 1:
            return self.file
        return rank_file(self.file, rank)

    @property
    def file_shown(self) -> str | None:
        """The file as a person should read it: with data parallel, the pattern of the rank files."""
        if self.file is None or self.data_parallel_size <= 1:
            return self.file
        return rank_file(self.file, "<rank>")


def rank_file(path: str, rank: int | str) -> str:
    """``/logs/requests.jsonl`` -> ``/logs/requests.dp1.jsonl`` (the rank before the last suffix)."""
    head, sep, name = path.rpartition("/")
    stem, dot, suffix = name.rpartition(".")
    named = f"{stem}.dp{rank}.{suffix}" if dot and stem else f"{name}.dp{rank}"
    return f"{head}{sep}{named}"


@dataclass(frozen=True)
class MetricsFeed:
    """The runtime's metrics receiver: a Unix datagram socket the engine sends records and counters to."""

    socket: str


@dataclass(frozen=True)
class EnergyMetering:
    """Energy per request: which GPUs' energy counters the engine samples (UUIDs; empty means all it
    sees), and the scripted fake NVML to read instead of the driver, if any."""

    gpus: tuple[str, ...] = ()
    fake_nvml: str | None = None


@dataclass(frozen=True)
class StepLogConfig:
    """The engine's step log: one JSON line per engine step (tokens scheduled, KV read, wall time),
    the input of ``sim-calibrate``. Off unless the runtime asks (``--step-log``)."""

    file: str  # absolute path of the JSONL file
    #: Steps waiting between the engine loop and the writer thread; beyond this they are dropped.
    #: Each holds the step's SchedulerOutput until the thread reads it (normally within 0.1 s).
    queue_capacity: int = 10_000
    #: Lines the file sink may hold while it retries (minutes of steps); beyond this they are dropped.
    sink_capacity: int = 50_000
    #: Lines per append.
    batch_max: int = 4096
    #: How often drops are reported (a warning in the engine log) while they happen.
    report_interval_s: float = 10.0
    #: Time allowed at engine shutdown to write what is still queued.
    flush_timeout_s: float = 4.0


@dataclass(frozen=True)
class Emulation:
    """The paced engine (``serve --emulate``): every engine step lasts what the step-time model says
    its batch costs on the modelled GPU, times ``slowdown``. The coefficients are the model's, in
    milliseconds (:class:`~carbonforge_runtime.core.twin_data.StepCostModel`)."""

    model: str  # the step-time model's name
    floor_ms: float
    per_batched_token_ms: float
    per_kv_token_read_ms: float
    attention_ms: float
    overhead_ms: float
    version: int = 1
    proxy: bool = False
    slowdown: float = 1.0
    #: Above this share of late steps the run is reported as not faithful.
    late_share_warning: float = LATE_SHARE_LIMIT


#: The words that mark a paced engine's shutdown summary and its not-faithful warning in the engine
#: log: the engine writes them (engine/pacing.py), the runtime finds them there (planning/emulate.py).
EMULATION_SUMMARY_MARK = "steps ran late"
EMULATION_NOT_FAITHFUL_MARK = "emulated run NOT FAITHFUL"


@dataclass(frozen=True)
class EngineContract:
    ordering: Ordering = field(default_factory=Ordering)
    tracing: TraceConfig | None = None
    metrics_feed: MetricsFeed | None = None
    energy_meter: EnergyMetering | None = None
    step_log: StepLogConfig | None = None
    emulation: Emulation | None = None

    @property
    def builds_records(self) -> bool:
        """Records are built when a trace sink or the metrics feed consumes them."""
        return self.tracing is not None or self.metrics_feed is not None

    def to_json(self) -> str:
        data = {"version": CONTRACT_VERSION, **_to_plain(self)}
        return json.dumps(data, sort_keys=True)

    def env(self) -> dict[str, str]:
        return {CONTRACT_ENV: self.to_json()}

    @classmethod
    def from_json(cls, text: str) -> EngineContract:
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise ContractError(f"{CONTRACT_ENV} is not JSON ({exc})", _SAME_INSTALL) from None
        if not isinstance(data, dict):
            raise ContractError(f"{CONTRACT_ENV} is not a JSON object", _SAME_INSTALL)
        version = data.pop("version", None)
        if version != CONTRACT_VERSION:
            raise ContractError(
                f"engine contract version mismatch: the runtime sent version {version!r}, this engine side "
                f"reads version {CONTRACT_VERSION}",
                _SAME_INSTALL,
            )
        return _from_plain(cls, data, "")

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> EngineContract:
        """The contract in ``environ``; the default (FCFS, nothing else) when the variable is absent,
        as when vLLM loads the scheduler without the runtime."""
        text = environ.get(CONTRACT_ENV)
        return cls.from_json(text) if text else cls()


def full_level_banner_lines(config: TraceConfig) -> list[str]:
    """The warning printed (runtime log and engine log) when the full level records text."""
    sinks = []
    if config.file_shown:
        sinks.append(config.file_shown)
    if config.otlp:
        sinks.append(f"{redact_url(config.otlp.endpoint)} (OTLP {config.otlp.protocol})")
    return [
        "REQUEST TRACE LEVEL full: raw prompt and output text of every request is being written",
        f"to {' and '.join(sinks)}.",
        "Use it only with sinks you control and on traffic you may record; use standard in production.",
    ]


# ---- (de)serialisation: one generic walk over the dataclass tree ---------------------------------

_PARTS: dict[str, type] = {
    "ordering": Ordering,
    "tracing": TraceConfig,
    "otlp": OtlpTarget,
    "metrics_feed": MetricsFeed,
    "energy_meter": EnergyMetering,
    "step_log": StepLogConfig,
    "emulation": Emulation,
}
_T = TypeVar("_T")


def _to_plain(obj: Any) -> Any:
    if obj is None or isinstance(obj, (str, int, float, bool)):
        return obj
    if isinstance(obj, Mapping):
        return {str(k): _to_plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_to_plain(v) for v in obj]
    return {f.name: _to_plain(getattr(obj, f.name)) for f in fields(obj)}


def _from_plain(cls: type[_T], data: Any, where: str) -> _T:
    if not isinstance(data, dict):
        raise ContractError(f"engine contract: {where or 'the top level'} is not an object", _SAME_INSTALL)
    known = {f.name: f for f in fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ContractError(f"engine contract: unknown field(s) {', '.join(unknown)} in {where or 'the top level'}",
                            _SAME_INSTALL)
    kwargs: dict[str, Any] = {}
    for name, value in data.items():
        path = f"{where}.{name}" if where else name
        part = _PARTS.get(name)
        if part is not None:
            kwargs[name] = None if value is None else _from_plain(part, value, path)
        elif name == "params":
            if not isinstance(value, dict):
                raise ContractError(f"engine contract: {path} is not an object", _SAME_INSTALL)
            kwargs[name] = value
        elif name == "gpus":
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise ContractError(f"engine contract: {path} is not a list of GPU UUIDs", _SAME_INSTALL)
            kwargs[name] = tuple(value)
        else:
            kwargs[name] = _scalar(known[name], value, path)
    try:
        return cls(**kwargs)
    except TypeError as exc:  # a required field is missing
        raise ContractError(f"engine contract: {where or 'the top level'}: {exc}", _SAME_INSTALL) from None


def _scalar(spec: Any, value: Any, path: str) -> Any:
    """Check a leaf against its annotation (``str``, ``bool``, ``int``, ``float``, optionally ``| None``)."""
    annotation = str(spec.type)
    if value is None:
        if "None" in annotation:
            return None
        raise ContractError(f"engine contract: {path} may not be null", _SAME_INSTALL)
    if annotation.startswith("str") and isinstance(value, str):
        return value
    if annotation.startswith("bool") and isinstance(value, bool):
        return value
    if annotation.startswith("int") and isinstance(value, int) and not isinstance(value, bool):
        return value
    if annotation.startswith("float") and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    raise ContractError(f"engine contract: {path} has the wrong type ({type(value).__name__}, wanted {annotation})",
                        _SAME_INSTALL)
