"""The engine's environment switches that keep it from reporting home or reaching a hub. Pure.

vLLM reports usage statistics to its authors unless one of its switches turns that off
(``vllm/usage/usage_lib.py``, read through ``vllm/envs.py``): ``VLLM_NO_USAGE_STATS=1``,
``VLLM_DO_NOT_TRACK=1``, or ``DO_NOT_TRACK=1``; only the exact value ``1`` counts, and a set
``VLLM_DO_NOT_TRACK`` hides ``DO_NOT_TRACK``. The runtime sets all three to ``1`` for every engine
it starts, whatever the environment says (``DO_NOT_TRACK=1`` also turns off the Hugging Face Hub
library's telemetry).

The Hugging Face offline switches (``HF_HUB_OFFLINE``, and its older alias ``TRANSFORMERS_OFFLINE``,
read only when the first is unset) are set for the engine when the weights are already on this
machine, so that it never asks the hub for anything. An operator who sets either one keeps their
value.

vLLM also looks up its own address, when ``VLLM_HOST_IP`` is unset, by a UDP connect() towards a
public address (``vllm/utils/network_utils.py``: ``get_ip``; no packet is sent, but in an air-gapped
network the call fails and a network monitor sees it). An engine on one host needs no routable
address, so the runtime sets ``VLLM_HOST_IP=127.0.0.1`` unless the operator set it or the vLLM
arguments spread the engine over several hosts.

The functions here decide; the caller says whether the weights are present (the plan reads no file).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from carbonforge_runtime.runtime.vllm_cli.args import read

#: vLLM's switches that turn its usage reporting off, each with the only value it honours.
USAGE_STATS_OFF: dict[str, str] = {"VLLM_NO_USAGE_STATS": "1", "VLLM_DO_NOT_TRACK": "1", "DO_NOT_TRACK": "1"}
#: The Hugging Face switches that keep the engine off the hub (huggingface_hub reads the first, and the
#: second only when the first is unset).
HUB_OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
#: vLLM fetches models from ModelScope instead of Hugging Face when this is ``1`` or ``true`` (any case).
MODELSCOPE_VARIABLE = "VLLM_USE_MODELSCOPE"
#: vLLM's own address for its processes to reach each other; looked up on the network when unset.
HOST_IP_VARIABLE = "VLLM_HOST_IP"
LOOPBACK = "127.0.0.1"
#: vLLM flags that make other hosts reach this engine's processes (so they need a routable address).
MULTI_HOST_FLAGS = frozenset({
    "--node-rank", "--master-addr", "--headless", "--data-parallel-address", "--data-parallel-start-rank",
    "--data-parallel-hybrid-lb", "--data-parallel-external-lb", "--kv-transfer-config", "--ec-transfer-config",
    "--kv-events-config",
})
#: Flags that spread the engine over hosts only with some values.
_NODE_COUNT_FLAGS = frozenset({"--nnodes"})
_BACKEND_FLAGS = frozenset({"--distributed-executor-backend", "--data-parallel-backend"})
#: Every variable this module looks at (the doctor reads these from the runtime's environment).
WATCHED_VARIABLES = (*USAGE_STATS_OFF, *HUB_OFFLINE_VARIABLES, MODELSCOPE_VARIABLE)

_TRUE_WORDS = ("1", "true", "yes", "on")
#: What huggingface_hub takes for true (it compares the value in upper case, unstripped).
_HF_TRUE_WORDS = frozenset({"1", "ON", "YES", "TRUE"})


def _set(environ: Mapping[str, str], name: str) -> str | None:
    """The value of ``name`` when it is set and not empty (vLLM and huggingface_hub skip empty ones)."""
    return environ.get(name) or None


def asks_for_reporting(environ: Mapping[str, str]) -> list[tuple[str, str]]:
    """(name, value) of every usage-statistics switch set to a value that means "report": anything
    but a true word. Truthy spellings vLLM would not honour (``true``) are not listed: the runtime's
    ``1`` does what they meant."""
    found = []
    for name in USAGE_STATS_OFF:
        value = _set(environ, name)
        if value is not None and value.strip().lower() not in _TRUE_WORDS:
            found.append((name, value))
    return found


def hub_offline_choice(environ: Mapping[str, str]) -> tuple[str, str] | None:
    """The offline switch the operator set, as (name, value), or None when they set neither."""
    for name in HUB_OFFLINE_VARIABLES:
        value = _set(environ, name)
        if value is not None:
            return name, value
    return None


def is_offline(environ: Mapping[str, str]) -> bool:
    """Whether huggingface_hub runs offline with ``environ`` (its own reading of the two switches)."""
    choice = hub_offline_choice(environ)
    return choice is not None and choice[1].upper() in _HF_TRUE_WORDS


def multi_host_flag(args: Sequence[str]) -> str | None:
    """The first vLLM flag among ``args`` (as written) that lets other hosts take part in serving, or None."""
    for occurrence in read(args).occurrences:
        name = occurrence.written.split("=", 1)[0]
        value = occurrence.values[0] if occurrence.values else ""
        if occurrence.flag in MULTI_HOST_FLAGS:
            return name
        if occurrence.flag in _NODE_COUNT_FLAGS and value.strip() not in ("", "1"):
            return f"{name} {value}"
        if occurrence.flag in _BACKEND_FLAGS and value.strip().lower() == "ray":
            return f"{name} {value}"
    return None


def uses_modelscope(environ: Mapping[str, str]) -> bool:
    return (_set(environ, MODELSCOPE_VARIABLE) or "").strip().lower() in ("1", "true")


@dataclass(frozen=True)
class EnvLine:
    """One variable of the engine's environment, with why it has its value (for the dry run)."""

    name: str
    value: str | None
    why: str


@dataclass
class PrivacyEnv:
    """What the runtime sets in the engine's environment, why, and what it says about it."""

    #: Set over the engine's environment as it is.
    env: dict[str, str] = field(default_factory=dict)
    lines: list[EnvLine] = field(default_factory=list)
    #: Log lines at warning level: a value the runtime replaced, or one it kept against its advice.
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def engine_privacy_env(env: Mapping[str, str], model: str, weights_present: str | None,
                       operator: Mapping[str, str] | None = None, args: Sequence[str] = ()) -> PrivacyEnv:
    """The switches for an engine serving ``model``. ``env`` is the environment it would inherit (the
    runtime's, with the recipe's variables), ``operator`` the runtime's own (``env`` by default): an
    offline switch set there is the operator's choice and is kept. ``weights_present`` says why the
    weights need no download (e.g. "built-in model"), or is None when they are not on this machine.
    ``args`` are the engine's vLLM arguments (they tell a single-host engine from a multi-host one)."""
    operator = env if operator is None else operator
    out = PrivacyEnv()
    replaced = dict(asks_for_reporting(env))
    for name, value in USAGE_STATS_OFF.items():
        out.env[name] = value
        if name in replaced:
            out.lines.append(EnvLine(name, value, f"runtime, replaces {name}={replaced[name]} from the environment"))
        else:
            out.lines.append(EnvLine(name, value, "runtime: vLLM usage statistics off"))
    if replaced:
        given = ", ".join(f"{name}={value}" for name, value in replaced.items())
        out.warnings.append(f"{given} would let vLLM report usage statistics: the engine runs with "
                            f"{', '.join(f'{name}=1' for name in replaced)} instead (the runtime reports nothing)")

    choice = hub_offline_choice(operator)
    if choice is not None:
        name, value = choice
        offline = is_offline(operator)
        state = "stays offline" if offline else "may contact the Hugging Face Hub"
        out.lines.append(EnvLine(name, value, f"environment, kept: the engine {state}"))
        if weights_present is not None and not offline:
            out.warnings.append(f"{name}={value} lets the engine contact the Hugging Face Hub although {model} "
                                f"needs no download ({weights_present}); unset {name} to serve offline")
    elif weights_present is not None:
        for name in HUB_OFFLINE_VARIABLES:
            out.env[name] = "1"
            out.lines.append(EnvLine(name, "1", f"runtime: nothing to download ({weights_present})"))
    elif hub_offline_choice(env) is not None:
        name, value = hub_offline_choice(env) or ("", "")
        out.lines.append(EnvLine(name, value, f"recipe, kept: {model} is not in the Hugging Face cache"))
    else:
        out.lines.append(EnvLine("HF_HUB_OFFLINE", None,
                                 f"not set: {model} is not in the Hugging Face cache, the engine downloads it"))
        out.notes.append(f"the weights of {model} are not (all) in the Hugging Face cache: the engine downloads "
                         "them from the hub; `carbonforge-runtime fetch` gets them ahead, to serve without network "
                         "access")
    host_ip = _set(env, HOST_IP_VARIABLE)
    spread = multi_host_flag(args)
    if host_ip is not None:
        out.lines.append(EnvLine(HOST_IP_VARIABLE, host_ip, "given, kept"))
    elif spread is not None:
        out.lines.append(EnvLine(HOST_IP_VARIABLE, None, f"not set: {spread} involves other hosts, so vLLM looks "
                                                         "up its routable address"))
    else:
        out.env[HOST_IP_VARIABLE] = LOOPBACK
        out.lines.append(EnvLine(HOST_IP_VARIABLE, LOOPBACK, "runtime: one host, so vLLM needs no network lookup "
                                                             "of its own address"))
    if uses_modelscope(env):
        out.warnings.append(f"{MODELSCOPE_VARIABLE}={env[MODELSCOPE_VARIABLE]} makes the engine fetch {model} "
                            "from ModelScope; unset it to load the weights from the Hugging Face cache")
    return out
