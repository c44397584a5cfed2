"""Every environment variable the runtime reads, declared once with its meaning and parser.

Nothing else in the package reads ``os.environ`` for these names: callers receive a
:class:`Settings` built by :func:`load_settings` from a mapping (tests pass their own).
"""

from __future__ import annotations

import math
import shlex
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, cast

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


def _seconds(name: str, raw: str) -> float:
    try:
        value = float(raw.strip())
    except ValueError:
        value = -1.0
    if not (value > 0 and math.isfinite(value)):  # nan and inf would remove the deadline
        raise OverrideError(f"{name}={raw!r} is not a positive number of seconds", f"set {name} to e.g. 600")
    return value


@dataclass(frozen=True)
class Var:
    name: str
    doc: str
    parse: Callable[[str, str], Any]
    default: Any = None
    #: True for the CF_* knobs that change the benchmarked configuration.
    departs_from_benchmark: bool = False


VARIABLES: tuple[Var, ...] = (
    Var("CF_CONTEXT_KEY", "Recipe to serve, as <model>:<quant>:<workload>:<hardware>; unset runs the doctor",
        _text),
    Var("CARBONFORGE_LICENSE_KEY", "Licence key text; takes precedence over the licence file", _text),
    Var("CF_LICENSE_FILE", "Path of the licence file", _text, "/etc/carbonforge/license.key"),
    Var("CF_DRY_RUN", "Observe-only: the energy controller logs what it would do and changes nothing",
        _flag, False),
    Var("CF_MAX_MODEL_LEN", "Override the recipe's context length (--max-model-len)", _positive_int,
        departs_from_benchmark=True),
    Var("CF_GPU_MEMORY_UTILIZATION", "Override the recipe's GPU memory fraction (--gpu-memory-utilization)",
        _fraction, departs_from_benchmark=True),
    Var("CF_VLLM_EXTRA_ARGS", "Extra vLLM flags appended to the recipe's, split like a shell line",
        _shell_words, departs_from_benchmark=True),
    Var("CF_RECIPES_DIR", "An extra directory of recipe YAML files (they win over shipped ones on the same key)",
        _text),
    Var("CF_LOG_DIR", "Where vllm.log, the runtime's own runtime.log and default trace files go", _text,
        "/var/log/carbonforge"),
    Var("CF_PORT", "Port of the OpenAI-compatible API", _port, 8000),
    Var("CF_HOST", "Address the API binds to", _text, "0.0.0.0"),
    Var("CF_METRICS_PORT", "Port of the Prometheus metrics endpoint (with --metrics; same address as the API)",
        _port, 9105),
    Var("CF_FAKE_NVML", "Testing only: path of a JSON script that replaces NVML with a simulated GPU", _text),
    Var("CF_READY_TIMEOUT_S", "Deadline for the engine to become ready (weights download included)",
        _seconds, 3600.0),
    Var("CF_TINY_MODEL_DIR", "Where the built-in tiny CPU model is generated", _text,
        str(Path.home() / ".cache" / "carbonforge" / "tiny-chat")),
    Var("CF_COMPILE_CACHE_DIR", "Where the engine keeps its compile and kernel caches (vLLM, torch Inductor, "
        "Triton, FlashInfer, CUDA); on a volume, later boots skip compiling", _directory,
        "~/.cache/carbonforge/compile"),
    Var("HF_TOKEN", "Hugging Face token for gated models (passed to the engine untouched)", _text),
    Var("HF_HUB_OFFLINE", "1, on, yes or true (any case) = never contact the Hugging Face hub; other values "
        "mean online, as in huggingface_hub (passed to the engine untouched)", _hf_flag, False),
    Var("HUGGINGFACE_HUB_CACHE", "Directory of the Hugging Face hub cache (passed to the engine untouched)",
        _text),
    Var("CF_API_KEY", "API key clients must send as `Authorization: Bearer <key>`; unset leaves the API open",
        _text),
    Var("CF_API_KEY_FILE", "File holding the API key (e.g. a read-only secret mount); CF_API_KEY wins", _text),
    Var("CF_NNODES", "Hosts in this serving group (a multi-host recipe); unset or 1: one host", _positive_int),
    Var("CF_NODE_RANK", "This host's place in the group: 0 is the leader (API server), 1.. are workers", _index),
    Var("CF_MASTER_ADDR", "Address of the group's leader, reachable from every host", _text),
    Var("CF_MASTER_PORT", "Port on the leader where the hosts of a group meet (vLLM's --master-port)", _port, 29501),
    Var("CF_GROUP_PORT", "Port on the leader where the runtimes of a group watch each other, so that the group "
        "stops as one when a host is gone; it has no authentication: let only the group's hosts reach it",
        _port, 29499),
    Var("CF_JOIN_TIMEOUT_S", "How long the hosts of a group wait for each other at start and for a collective "
        "operation (vLLM's --distributed-timeout-seconds); raise it (e.g. 1800) for large models that hosts "
        "download and load slowly", _seconds, 300.0),
    Var("LWS_GROUP_SIZE", "Set by LeaderWorkerSet: hosts in the group (read when CF_NNODES is unset)",
        _positive_int),
    Var("LWS_WORKER_INDEX", "Set by LeaderWorkerSet: this pod's index, 0 for the leader (read when CF_NODE_RANK "
        "is unset)", _index),
    Var("LWS_LEADER_ADDRESS", "Set by LeaderWorkerSet: the leader pod's address (read when CF_MASTER_ADDR is "
        "unset)", _text),
    Var("CF_ENGINE_ENV_PASS", "More environment variables vLLM may see, comma-separated (`NAME*` for a prefix); "
        "by default it sees only the variable families a serving engine reads", _text),
)

_BY_NAME = {var.name: var for var in VARIABLES}

#: The declared names; a name outside this list fails type checking wherever a name is passed.
VarName = Literal[
    "CF_CONTEXT_KEY", "CARBONFORGE_LICENSE_KEY", "CF_LICENSE_FILE", "CF_DRY_RUN", "CF_MAX_MODEL_LEN",
    "CF_GPU_MEMORY_UTILIZATION", "CF_VLLM_EXTRA_ARGS", "CF_RECIPES_DIR", "CF_LOG_DIR", "CF_PORT", "CF_HOST",
    "CF_METRICS_PORT", "CF_FAKE_NVML", "CF_READY_TIMEOUT_S", "CF_TINY_MODEL_DIR", "HF_TOKEN", "HF_HUB_OFFLINE",
    "HUGGINGFACE_HUB_CACHE", "CF_API_KEY", "CF_API_KEY_FILE", "CF_COMPILE_CACHE_DIR", "CF_ENGINE_ENV_PASS",
    "CF_NNODES", "CF_NODE_RANK", "CF_MASTER_ADDR", "CF_MASTER_PORT", "CF_GROUP_PORT", "CF_JOIN_TIMEOUT_S",
    "LWS_GROUP_SIZE",
    "LWS_WORKER_INDEX", "LWS_LEADER_ADDRESS",
]


@dataclass(frozen=True)
class Settings:
    """Parsed values of :data:`VARIABLES`, read through one typed property per variable;
    ``raw`` keeps the text for provenance messages."""

    values: Mapping[str, Any]
    raw: Mapping[str, str] = field(default_factory=dict)

    def value(self, name: VarName) -> Any:
        """The parsed value of ``name``, or its default (for code that loops over names)."""
        return self.values.get(name, _BY_NAME[name].default)

    def is_set(self, name: VarName) -> bool:
        return name in self.values

    @property
    def context_key(self) -> str | None:
        return cast("str | None", self.value("CF_CONTEXT_KEY"))

    @property
    def license_key(self) -> str | None:
        return cast("str | None", self.value("CARBONFORGE_LICENSE_KEY"))

    @property
    def license_file(self) -> Path:
        return Path(str(self.value("CF_LICENSE_FILE"))).expanduser()

    @property
    def dry_run(self) -> bool:
        return bool(self.value("CF_DRY_RUN"))

    @property
    def max_model_len(self) -> int | None:
        return cast("int | None", self.value("CF_MAX_MODEL_LEN"))

    @property
    def gpu_memory_utilization(self) -> float | None:
        return cast("float | None", self.value("CF_GPU_MEMORY_UTILIZATION"))

    @property
    def vllm_extra_args(self) -> list[str]:
        return list(self.value("CF_VLLM_EXTRA_ARGS") or [])

    @property
    def recipes_dir(self) -> str | None:
        return cast("str | None", self.value("CF_RECIPES_DIR"))

    @property
    def log_dir(self) -> Path:
        return Path(str(self.value("CF_LOG_DIR"))).expanduser()

    @property
    def port(self) -> int:
        return int(self.value("CF_PORT"))

    @property
    def host(self) -> str:
        return str(self.value("CF_HOST"))

    @property
    def metrics_port(self) -> int:
        return int(self.value("CF_METRICS_PORT"))

    @property
    def fake_nvml(self) -> str | None:
        return cast("str | None", self.value("CF_FAKE_NVML")) or None

    @property
    def ready_timeout_s(self) -> float:
        return float(self.value("CF_READY_TIMEOUT_S"))

    @property
    def api_key(self) -> str | None:
        return cast("str | None", self.value("CF_API_KEY")) or None

    @property
    def api_key_file(self) -> str | None:
        return cast("str | None", self.value("CF_API_KEY_FILE")) or None

    @property
    def engine_env_pass(self) -> str | None:
        return cast("str | None", self.value("CF_ENGINE_ENV_PASS")) or None

    @property
    def tiny_model_dir(self) -> Path:
        return Path(str(self.value("CF_TINY_MODEL_DIR"))).expanduser()

    @property
    def compile_cache_dir(self) -> str:
        """As given (``~`` unexpanded: it stands for the engine's HOME)."""
        return str(self.value("CF_COMPILE_CACHE_DIR"))

    @property
    def hf_hub_offline(self) -> bool:
        return bool(self.value("HF_HUB_OFFLINE"))


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
    rows = []
    for var in VARIABLES:
        default = "" if var.default is None else str(var.default)
        rows.append((var.name, default, var.doc))
    return rows


def _check_names() -> None:
    """The typed names and the declared variables are the same list (checked on import)."""
    declared = {var.name for var in VARIABLES}
    typed = set(VarName.__args__)  # type: ignore[attr-defined]
    if declared != typed:
        raise RuntimeError(f"settings: VarName and VARIABLES differ: {sorted(declared ^ typed)}")


_check_names()
