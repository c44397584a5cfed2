"""Every environment variable the runtime reads, declared once with its meaning and parser.

Each variable is one :class:`Var` attribute of :class:`Settings`: read on a ``Settings`` it gives
the typed value (``settings.port``), and the declarations, in order, make the table
:data:`VARIABLES` that :func:`load_settings`, the doctor and the generated docs/environment.md read.

Nothing else in the package reads ``os.environ`` for these names: callers receive a
:class:`Settings` built by :func:`load_settings` from a mapping (tests pass their own).
"""

from __future__ import annotations

import math
import shlex
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, Literal, TypeVar, cast, overload

from carbonforge_runtime.errors import OverrideError


def _positive_int(name: str, raw: str) -> int:
    try:
        value = int(raw.strip())
    except ValueError:
        raise OverrideError(
            f"{name}={raw!r} is not a whole number",
            f"set {name} to a positive integer number of tokens (e.g. {name}=8192) or unset it",
        ) from None
    if value <= 0:
        raise OverrideError(f"{name}={raw!r} must be positive", f"set {name} to a positive integer or unset it")
    return value


def _positive_bytes(name: str, raw: str) -> int:
    try:
        value = int(raw.strip())
    except ValueError:
        value = 0
    if value <= 0:
        raise OverrideError(f"{name}={raw!r} is not a positive whole number of bytes",
                            f"set {name} to a size in bytes (e.g. {name}=16777216 for 16 MiB) or unset it")
    return value


def _index(name: str, raw: str) -> int:
    try:
        value = int(raw.strip())
    except ValueError:
        value = -1
    if value < 0:
        raise OverrideError(f"{name}={raw!r} is not a whole number >= 0", f"set {name} to 0 (the leader), 1, 2, ...")
    return value


def _fraction(name: str, raw: str) -> float:
    try:
        value = float(raw.strip())
    except ValueError:
        raise OverrideError(
            f"{name}={raw!r} is not a number",
            f"set {name} to a fraction of GPU memory between 0 and 1 (e.g. {name}=0.6) or unset it",
        ) from None
    if not 0.0 < value <= 1.0:
        raise OverrideError(
            f"{name}={raw!r} is outside (0, 1]",
            f"set {name} to a fraction of GPU memory between 0 and 1 (e.g. {name}=0.6) or unset it",
        )
    return value


def _shell_words(name: str, raw: str) -> list[str]:
    try:
        return shlex.split(raw)
    except ValueError as exc:
        raise OverrideError(
            f"{name} cannot be split into arguments: {exc}",
            f"check the quoting in {name} (it is split like a shell command line)",
        ) from None


def _flag(name: str, raw: str) -> bool:
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("", "0", "false", "no", "off"):
        return False
    raise OverrideError(f"{name}={raw!r} is not a boolean", f"set {name} to 1 or 0")


#: The words huggingface_hub takes for true (``constants._is_true``), compared in upper case.
_HF_TRUE_WORDS = frozenset({"1", "ON", "YES", "TRUE"})


def _hf_flag(name: str, raw: str) -> bool:
    """A boolean read the way huggingface_hub reads its own variables: true for 1, on, yes or true in
    any case, false for anything else (never an error, since the hub library accepts every value)."""
    return raw.upper() in _HF_TRUE_WORDS


def _text(name: str, raw: str) -> str:
    return raw.strip()


def _port(name: str, raw: str) -> int:
    value = _positive_int(name, raw)
    if value > 65535:
        raise OverrideError(f"{name}={raw!r} is not a TCP port", f"set {name} to a port between 1 and 65535")
    return value


def _directory(name: str, raw: str) -> str:
    value = raw.strip()
    if not (value.startswith("/") or value == "~" or value.startswith("~/")):
        raise OverrideError(f"{name}={raw!r} is not an absolute path",
                            f"set {name} to an absolute directory (e.g. {name}=/var/cache/carbonforge) or unset it")
    return value


#: The forms CF_TRACE_RETENTION accepts, for its error message and docs.
RETENTION_FORMS = "a whole number of days, hours or minutes: 7d, 12h, 30m"
_RETENTION_UNITS_S = {"d": 86400, "h": 3600, "m": 60}


def _retention(name: str, raw: str) -> float:
    """``7d`` -> 604800.0: how long trace files are kept, at least a minute."""
    text = raw.strip().lower()
    count, unit = text[:-1], text[-1:]
    if unit not in _RETENTION_UNITS_S or not count.isascii() or not count.isdigit() or int(count) <= 0:
        raise OverrideError(f"{name}={raw!r} is not a retention",
                            f"set {name} to {RETENTION_FORMS} (e.g. {name}=7d), or unset it to keep trace files "
                            "forever")
    return float(int(count) * _RETENTION_UNITS_S[unit])


def _seconds(name: str, raw: str) -> float:
    try:
        value = float(raw.strip())
    except ValueError:
        value = -1.0
    if not (value > 0 and math.isfinite(value)):  # nan and inf would remove the deadline
        raise OverrideError(f"{name}={raw!r} is not a positive number of seconds", f"set {name} to e.g. 600")
    return value


#: Defaults that other modules also need (the image's published port, a group's watch port, the
#: manifests' checks): named once here, used by the declarations below and by those modules.
DEFAULT_API_PORT = 8000
DEFAULT_METRICS_PORT = 9105
DEFAULT_MASTER_PORT = 29501
DEFAULT_GROUP_PORT = 29499
DEFAULT_READY_TIMEOUT_S = 3600.0
#: The API's request body limit. 16 MiB: the longest context of the shipped recipes (131,072 tokens)
#: at 6 bytes a token of escaped JSON is under 1 MiB; the rest leaves room for images and tools
#: (nginx's default is 1 MB; vLLM sets none).
DEFAULT_MAX_REQUEST_BYTES = 16 * 1024 * 1024

#: The declared names, for type checking: an undeclared name passed to :meth:`Settings.value`,
#: :meth:`Settings.is_set` or typed ``VarName`` fails mypy. Python's type system cannot derive a
#: Literal from the declarations in :class:`Settings`, so the names are listed here as well: mypy
#: refuses a declaration whose name is missing from this list, and tests/unit/test_settings.py a name
#: listed here that nothing declares.
VarName = Literal[
    "CF_CONTEXT_KEY", "CARBONFORGE_LICENSE_KEY", "CF_LICENSE_FILE", "CF_DRY_RUN", "CF_MAX_MODEL_LEN",
    "CF_GPU_MEMORY_UTILIZATION", "CF_VLLM_EXTRA_ARGS", "CF_RECIPES_DIR", "CF_LOG_DIR", "CF_PORT", "CF_HOST",
    "CF_METRICS_PORT", "CF_METRICS_HOST", "CF_FAKE_NVML", "CF_READY_TIMEOUT_S", "CF_TINY_MODEL_DIR",
    "CF_COMPILE_CACHE_DIR",
    "HF_TOKEN", "HF_HUB_OFFLINE", "HUGGINGFACE_HUB_CACHE", "CF_API_KEY", "CF_API_KEY_FILE", "CF_API_KEYS_FILE",
    "CF_NNODES",
    "CF_MAX_REQUEST_BYTES",
    "CF_NODE_RANK", "CF_MASTER_ADDR", "CF_MASTER_PORT", "CF_GROUP_PORT", "CF_GROUP_SECRET", "CF_GROUP_SECRET_FILE",
    "CF_JOIN_TIMEOUT_S", "LWS_GROUP_SIZE",
    "LWS_WORKER_INDEX", "LWS_LEADER_ADDRESS", "CF_ENGINE_ENV_PASS", "CF_TRACE_RETENTION",
]

T = TypeVar("T")


# What an attribute of Settings returns, from the parsed value or the default.


def _optional_text(value: Any) -> str | None:
    return cast("str | None", value)


def _optional_int(value: Any) -> int | None:
    return cast("int | None", value)


def _optional_float(value: Any) -> float | None:
    return cast("float | None", value)


def _text_or_none(value: Any) -> str | None:
    return cast("str | None", value) or None


def _words(value: Any) -> list[str]:
    return list(value or [])


def _expanded_path(value: Any) -> Path:
    return Path(str(value)).expanduser()


class Var(Generic[T]):
    """One environment variable, declared once as an attribute of :class:`Settings`: its name,
    meaning, parser and default (the table :data:`VARIABLES` and the docs are built from these), and,
    read on a :class:`Settings`, its typed value (``read`` turns the parsed value or the default into it)."""

    __slots__ = ("default", "departs_from_benchmark", "doc", "name", "parse", "read")

    def __init__(self, name: VarName, doc: str, parse: Callable[[str, str], Any], default: Any = None, *,
                 read: Callable[[Any], T], departs_from_benchmark: bool = False) -> None:
        self.name: VarName = name
        self.doc = doc
        self.parse = parse
        self.default = default
        self.read = read
        #: True for the CF_* knobs that change the benchmarked configuration.
        self.departs_from_benchmark = departs_from_benchmark

    def __repr__(self) -> str:
        return f"Var({self.name!r})"

    @overload
    def __get__(self, obj: None, owner: type[Any] | None = None) -> Var[T]: ...

    @overload
    def __get__(self, obj: Settings, owner: type[Any] | None = None) -> T: ...

    def __get__(self, obj: Settings | None, owner: type[Any] | None = None) -> Var[T] | T:
        if obj is None:
            return self
        return self.read(obj.value(self.name))


@dataclass(frozen=True)
class Settings:
    """Parsed values of the variables declared below (in this order in :data:`VARIABLES` and the docs),
    each read through its typed attribute; ``raw`` keeps the text for provenance messages."""

    values: Mapping[str, Any]
    raw: Mapping[str, str] = field(default_factory=dict)

    def value(self, name: VarName) -> Any:
        """The parsed value of ``name``, or its default (for code that loops over names)."""
        return self.values.get(name, _BY_NAME[name].default)

    def is_set(self, name: VarName) -> bool:
        return name in self.values

    # One declaration per variable: the attribute is its typed accessor (``settings.port``), the
    # declaration its row in VARIABLES and in docs/environment.md, in this order.
    context_key = Var("CF_CONTEXT_KEY",
                      "Recipe to serve, as <model>:<quant>:<workload>:<hardware>; unset runs the doctor",
                      _text, read=_optional_text)
    license_key = Var("CARBONFORGE_LICENSE_KEY", "Licence key text; takes precedence over the licence file",
                      _text, read=_optional_text)
    license_file = Var("CF_LICENSE_FILE", "Path of the licence file",
                       _text, "/etc/carbonforge/license.key", read=_expanded_path)
    dry_run = Var("CF_DRY_RUN", "Observe-only: the energy controller logs what it would do and changes nothing",
                  _flag, False, read=bool)
    max_model_len = Var("CF_MAX_MODEL_LEN", "Override the recipe's context length (--max-model-len)",
                        _positive_int, read=_optional_int, departs_from_benchmark=True)
    gpu_memory_utilization = Var("CF_GPU_MEMORY_UTILIZATION",
                                 "Override the recipe's GPU memory fraction (--gpu-memory-utilization)",
                                 _fraction, read=_optional_float, departs_from_benchmark=True)
    vllm_extra_args = Var("CF_VLLM_EXTRA_ARGS", "Extra vLLM flags appended to the recipe's, split like a shell line",
                          _shell_words, read=_words, departs_from_benchmark=True)
    recipes_dir = Var("CF_RECIPES_DIR",
                      "An extra directory of recipe YAML files (they win over shipped ones on the same key)",
                      _text, read=_optional_text)
    log_dir = Var("CF_LOG_DIR", "Where vllm.log, the runtime's own runtime.log and default trace files go",
                  _text, "/var/log/carbonforge", read=_expanded_path)
    port = Var("CF_PORT", "Port of the OpenAI-compatible API",
               _port, DEFAULT_API_PORT, read=int)
    host = Var("CF_HOST", "Address the API binds to",
               _text, "0.0.0.0", read=str)
    metrics_port = Var("CF_METRICS_PORT",
                       "Port of the Prometheus metrics endpoint (with --metrics; on CF_METRICS_HOST)",
                       _port, DEFAULT_METRICS_PORT, read=int)
    metrics_host = Var("CF_METRICS_HOST",
                       "Address the Prometheus metrics endpoint binds to; unset: the API's address (CF_HOST). The "
                       "endpoint has no authentication: bind it to 127.0.0.1 or a private address, or let only "
                       "Prometheus reach the port",
                       _text, read=_text_or_none)
    fake_nvml = Var("CF_FAKE_NVML", "Testing only: path of a JSON script that replaces NVML with a simulated GPU",
                    _text, read=_text_or_none)
    ready_timeout_s = Var("CF_READY_TIMEOUT_S", "Deadline for the engine to become ready (weights download included)",
                          _seconds, DEFAULT_READY_TIMEOUT_S, read=float)
    tiny_model_dir = Var("CF_TINY_MODEL_DIR", "Where the built-in tiny CPU model is generated",
                         _text, str(Path.home() / ".cache" / "carbonforge" / "tiny-chat"), read=_expanded_path)
    #: Read as given (``~`` unexpanded: it stands for the engine's HOME).
    compile_cache_dir = Var("CF_COMPILE_CACHE_DIR",
                            "Where the engine keeps its compile and kernel caches (vLLM, torch Inductor, Triton, "
                            "FlashInfer, CUDA); on a volume, later boots skip compiling",
                            _directory, "~/.cache/carbonforge/compile", read=str)
    hf_token = Var("HF_TOKEN", "Hugging Face token for gated models (passed to the engine untouched)",
                   _text, read=_optional_text)
    hf_hub_offline = Var("HF_HUB_OFFLINE",
                         "1, on, yes or true (any case) = never contact the Hugging Face hub; other values mean "
                         "online, as in huggingface_hub (passed to the engine untouched)",
                         _hf_flag, False, read=bool)
    hub_cache = Var("HUGGINGFACE_HUB_CACHE",
                    "Directory of the Hugging Face hub cache (passed to the engine untouched)",
                    _text, read=_optional_text)
    api_key = Var("CF_API_KEY",
                  "API key clients must send as `Authorization: Bearer <key>`; unset leaves the API open",
                  _text, read=_text_or_none)
    api_key_file = Var("CF_API_KEY_FILE",
                       "File holding the API key (e.g. a read-only secret mount); CF_API_KEY wins",
                       _text, read=_text_or_none)
    api_keys_file = Var("CF_API_KEYS_FILE",
                        "YAML file of named API keys (each a tenant: the SHA-256 of its secret, scopes, optional "
                        "requests per minute, in-flight limit, priority, share and expiry; `carbonforge-runtime "
                        "keys new` makes an entry), re-read when it changes; beside it, CF_API_KEY stays valid "
                        "with every scope and no limit",
                        _text, read=_text_or_none)
    max_request_bytes = Var("CF_MAX_REQUEST_BYTES",
                            "Largest request body the API reads, in bytes; a larger one is answered 413 "
                            "`request_too_large` before it is read in full",
                            _positive_bytes, DEFAULT_MAX_REQUEST_BYTES, read=int)
    nnodes = Var("CF_NNODES", "Hosts in this serving group (a multi-host recipe); unset or 1: one host",
                 _positive_int, read=_optional_int)
    node_rank = Var("CF_NODE_RANK", "This host's place in the group: 0 is the leader (API server), 1.. are workers",
                    _index, read=_optional_int)
    master_addr = Var("CF_MASTER_ADDR", "Address of the group's leader, reachable from every host",
                      _text, read=_optional_text)
    master_port = Var("CF_MASTER_PORT", "Port on the leader where the hosts of a group meet (vLLM's --master-port)",
                      _port, DEFAULT_MASTER_PORT, read=int)
    group_port = Var("CF_GROUP_PORT",
                     "Port on the leader where the runtimes of a group watch each other, so that the group stops "
                     "as one when a host is gone; it listens on the leader's address and admits only hosts that "
                     "prove the group secret (CF_GROUP_SECRET_FILE)",
                     _port, DEFAULT_GROUP_PORT, read=int)
    group_secret = Var("CF_GROUP_SECRET",
                       "The secret every host of a group shares, at least 16 characters; a group of more than one "
                       "host refuses to start without it (CF_GROUP_SECRET_FILE is the safer way to give it)",
                       _text, read=_text_or_none)
    group_secret_file = Var("CF_GROUP_SECRET_FILE",
                            "File holding the group secret (e.g. a mounted Kubernetes Secret), the same on every "
                            "host of the group; CF_GROUP_SECRET wins",
                            _text, read=_text_or_none)
    join_timeout_s = Var("CF_JOIN_TIMEOUT_S",
                         "How long the hosts of a group wait for each other at start and for a collective operation "
                         "(vLLM's --distributed-timeout-seconds); raise it (e.g. 1800) for large models that hosts "
                         "download and load slowly",
                         _seconds, 300.0, read=float)
    lws_group_size = Var("LWS_GROUP_SIZE", "Set by LeaderWorkerSet: hosts in the group (read when CF_NNODES is unset)",
                         _positive_int, read=_optional_int)
    lws_worker_index = Var("LWS_WORKER_INDEX",
                           "Set by LeaderWorkerSet: this pod's index, 0 for the leader (read when CF_NODE_RANK is "
                           "unset)",
                           _index, read=_optional_int)
    lws_leader_address = Var("LWS_LEADER_ADDRESS",
                             "Set by LeaderWorkerSet: the leader pod's address (read when CF_MASTER_ADDR is unset)",
                             _text, read=_optional_text)
    trace_retention_s = Var("CF_TRACE_RETENTION",
                            "How long trace files are kept (e.g. 7d, 12h, 30m): the file given to --trace-file "
                            "rotates into time-stamped segments, and a segment is deleted once its newest record "
                            "is older than this; unset: kept forever",
                            _retention, read=_optional_float)
    engine_env_pass = Var("CF_ENGINE_ENV_PASS",
                          "More environment variables vLLM may see, comma-separated (`NAME*` for a prefix); by "
                          "default it sees only the variable families a serving engine reads",
                          _text, read=_text_or_none)


#: Every declared variable, in declaration order: the table that load_settings, the doctor and the
#: generated docs read.
VARIABLES: tuple[Var[Any], ...] = tuple(var for var in vars(Settings).values() if isinstance(var, Var))

_BY_NAME: dict[str, Var[Any]] = {var.name: var for var in VARIABLES}


def load_settings(environ: Mapping[str, str]) -> Settings:
    """Parse every declared variable present (and non-empty) in ``environ``.

    Invalid values raise :class:`OverrideError` before anything starts.
    """
    values: dict[str, Any] = {}
    raw: dict[str, str] = {}
    for var in VARIABLES:
        text = environ.get(var.name)
        if text is None or text.strip() == "":
            continue
        values[var.name] = var.parse(var.name, text)
        raw[var.name] = text
    return Settings(values=values, raw=raw)


def describe() -> list[tuple[str, str, str]]:
    """(name, default, doc) for the README and `--help` epilogue."""
    rows: list[tuple[str, str, str]] = []
    for var in VARIABLES:
        default = "" if var.default is None else str(var.default)
        rows.append((var.name, default, var.doc))
    return rows
