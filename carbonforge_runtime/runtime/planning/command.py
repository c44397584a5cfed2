"""The vLLM command line for a launch, with the provenance of every knob. Pure functions."""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from carbonforge_runtime.core.api_contract import ApiContract
from carbonforge_runtime.core.contract import SCHEDULER_CLS, EngineContract, Ordering, TraceConfig
from carbonforge_runtime.core.redaction import redact_args, secrets_to_env
from carbonforge_runtime.errors import UsageError
from carbonforge_runtime.recipes.model import DEFAULT_DRAIN_TIMEOUT_S, VLLM_KNOBS, ApiSpec, Recipe, departures_from
from carbonforge_runtime.runtime.group.placement import WORKER_MODULE, Group
from carbonforge_runtime.runtime.vllm_cli.args import VllmArgs, flag_name, read
from carbonforge_runtime.settings import DEFAULT_MAX_REQUEST_BYTES, Settings, VarName

ENGINE_MODULE = "vllm.entrypoints.openai.api_server"

SOURCE_RECIPE = "recipe"
SOURCE_EXTRA = "extra flag after --"
SOURCE_ENV_EXTRA = "CF_VLLM_EXTRA_ARGS"
SOURCE_RUNTIME = "runtime"
SOURCE_USER = "command line"

#: CF_* variables that replace one recipe knob.
KNOB_OVERRIDES: dict[VarName, str] = {
    "CF_MAX_MODEL_LEN": "max_model_len",
    "CF_GPU_MEMORY_UTILIZATION": "gpu_memory_utilization",
}


@dataclass(frozen=True)
class Knob:
    name: str
    value: Any
    source: str


@dataclass
class LaunchPlan:
    """Everything needed to start the engine, and to explain the configuration to a person."""

    mode: str  # "recipe" or "override"
    recipe: Recipe | None
    model: str
    served_model_name: str
    host: str
    port: int
    drain_timeout_s: float
    knobs: list[Knob]
    extra_args: list[Knob]
    argv: list[str]
    env: dict[str, str]
    departures: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    #: What the CarbonForge scheduler inside the engine is told; ``None`` when another
    #: ``--scheduler-cls`` replaces it. Serialised once, at launch (:meth:`engine_env`).
    contract: EngineContract | None = None
    #: What the request-contract middleware in the API server enforces (in the plan's ``env``).
    api: ApiContract = field(default_factory=ApiContract)
    #: This host's place in a multi-host group; None when it serves alone.
    group: Group | None = None

    @property
    def serves_api(self) -> bool:
        """False for a headless worker of a group: it runs no API server, so nothing answers /health."""
        return self.group is None or self.group.leader

    def engine_env(self, contract: EngineContract | None = None) -> dict[str, str]:
        """The engine's environment: the plan's, plus ``contract`` (the plan's own by default, or the
        one the observability extended) in the variable the engine side parses."""
        contract = contract if contract is not None else self.contract
        env = dict(self.env)
        if self.contract is not None and contract is not None:
            env.update(contract.env())
        return env


def knob_args(name: str, value: Any) -> list[str]:
    if isinstance(value, bool):
        return [flag_name(name)] if value else ["--no-" + name.replace("_", "-")]
    return [flag_name(name), str(value)]


def data_parallel_size(args: Sequence[str]) -> int:
    """The data-parallel size ``args`` give vLLM (any spelling of ``--data-parallel-size``, ``-dp``);
    1 when absent or not a positive number."""
    size = read(args).value("--data-parallel-size") or "1"
    return int(size) if size.isdigit() and int(size) > 0 else 1


def effective_endpoint(args: Sequence[str], served: str, host: str, port: int) -> tuple[str, str, int]:
    """(served model name, host, port) vLLM will use once ``args`` (appended last, so they win) are
    applied over the given defaults. The first of several served names is the one responses carry."""
    given = read(args)
    names = given.values("--served-model-name")
    if names is not None:
        if not names or not names[0].strip():
            raise UsageError("--served-model-name is given without a name",
                             "write --served-model-name NAME, or leave the flag out")
        served = names[0]
    hosts = given.values("--host")
    if hosts is not None:
        if len(hosts) != 1 or not hosts[0].strip():
            raise UsageError("--host takes exactly one address", "write --host ADDRESS (e.g. --host 0.0.0.0)")
        host = hosts[0]
    ports = given.values("--port")
    if ports is not None:
        text = ports[0] if len(ports) == 1 else " ".join(ports)
        if len(ports) != 1 or not text.isdigit() or not 0 < int(text) < 65536:
            raise UsageError(f"--port {text!r} is not a TCP port", "write --port N with N between 1 and 65535")
        port = int(text)
    return served, host, port


def _knobs_given(args: Sequence[str]) -> list[tuple[str, Any]]:
    """(recipe knob, value) for each knob ``args`` set, in order (``--no-enable-prefix-caching`` gives
    ('enable_prefix_caching', False))."""
    found: list[tuple[str, Any]] = []
    for occurrence in read(args).occurrences:
        name = occurrence.flag[2:].replace("-", "_")
        if occurrence.field is not None or name not in VLLM_KNOBS:
            continue
        if VLLM_KNOBS[name] is bool:
            found.append((name, occurrence.kind != "off"))
        else:
            found.append((name, occurrence.values[0] if occurrence.values else None))
    return found


def engine_prefix() -> list[str]:
    return [sys.executable, "-m", ENGINE_MODULE]


def engine_args(argv: Sequence[str]) -> list[str]:
    """The vLLM arguments of a launch command: what follows the API server module (a leader or a host
    alone) or the headless worker's module."""
    for module in (ENGINE_MODULE, WORKER_MODULE):
        if module in argv:
            return list(argv[list(argv).index(module) + 1:])
    return list(argv)


SCHEDULER_FLAG = "--scheduler-cls"


def user_scheduler_cls(args: Sequence[str]) -> str | None:
    """The ``--scheduler-cls`` the user passed among ``args`` in any spelling (it replaces ours), if any."""
    given = read(args)
    return (given.value(SCHEDULER_FLAG) or "?") if given.given(SCHEDULER_FLAG) else None


def scheduler_wiring(
    user_args: Sequence[str], family: str, params: Mapping[str, Any], trace: TraceConfig | None
) -> tuple[list[str], EngineContract | None, list[str]]:
    """(vLLM flags, engine contract, notes) that load the CarbonForge scheduler with its
    configuration, unless the user names another scheduler class."""
    other = user_scheduler_cls(user_args)
    if other is not None:
        return [], None, [f"{SCHEDULER_FLAG} {other} given: the CarbonForge scheduler is not loaded "
                          f"(no scheduler family {family!r}, no request trace)"]
    return [SCHEDULER_FLAG, SCHEDULER_CLS], EngineContract(Ordering(family, dict(params)), trace), []


#: Structured output for the built-in random-weight model: the guidance backend, with no free whitespace
#: and no properties a schema does not name. Random weights favour whitespace (valid between JSON tokens,
#: so a forced tool call would run on to max_tokens), control characters (which xgrammar 0.2.8 lets into
#: a string with maxLength) and, where a schema leaves additionalProperties open (vLLM's own wrapper of a
#: "required" tool call does), keys of their own; guidance then allows none of them, so JSON with a
#: bounded schema always completes.
STRUCTURED_FLAG = "--structured-outputs-config"
BUILTIN_STRUCTURED_OUTPUTS = '{"backend":"guidance","disable_any_whitespace":true,"disable_additional_properties":true}'
#: vLLM forces the hermes parser's tool calls with xgrammar's structural tags unless this is 0.
STRICT_TOOLS_VARIABLE = "VLLM_ENFORCE_STRICT_TOOL_CALLING"

MIDDLEWARE = "carbonforge_runtime.apiserver.request_contract.RequestContract"
API_KEY_FLAG = "--api-key"
REASONING_FLAG = "--reasoning-parser"
TOOL_PARSER_FLAG = "--tool-call-parser"
AUTO_TOOL_FLAG = "--enable-auto-tool-choice"


def api_wiring(spec: ApiSpec | None, user_args: Sequence[str],
               max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES) -> tuple[list[str], ApiContract]:
    """(vLLM flags, API contract): the request-contract middleware always; the recipe's parsers
    unless the user's flags name others (then the contract follows the user's flags).

    ``user_args`` come without single-valued secret flags (moved to the environment): an
    ``--api-key`` still there holds several keys or none, which the middleware, reading the key
    from the environment, would not enforce on every route, so it is refused."""
    args = ["--middleware", MIDDLEWARE]
    given = read(user_args)
    if given.given(API_KEY_FLAG):
        raise UsageError(f"{API_KEY_FLAG} among vLLM's arguments holds several keys (or none)",
                         "give the server one key through CF_API_KEY or CF_API_KEY_FILE, not on the command line")
    reasoning = spec.reasoning_parser if spec else None
    tools = spec.tool_call_parser if spec else None
    if reasoning and not given.given(REASONING_FLAG):
        args += [REASONING_FLAG, reasoning]
    if tools and not given.given(TOOL_PARSER_FLAG):
        args += [TOOL_PARSER_FLAG, tools]
        if not given.given(AUTO_TOOL_FLAG):
            args.append(AUTO_TOOL_FLAG)
    budget = dict(spec.thinking_budget) if spec and not given.given(REASONING_FLAG) else {}
    contract = ApiContract(reasoning=bool(reasoning or given.value(REASONING_FLAG)),
                           tools=bool(tools or given.value(TOOL_PARSER_FLAG)), thinking_budget=budget,
                           max_request_bytes=max_request_bytes)
    return args, contract


def build_recipe_plan(
    recipe: Recipe,
    settings: Settings,
    extra_args: Sequence[str],
    model_path: str | None = None,
    base_env: Mapping[str, str] | None = None,
    trace: TraceConfig | None = None,
) -> LaunchPlan:
    """The plan for serving ``recipe``; ``model_path`` replaces the repo for built-in models;
    ``trace`` is the validated request-trace configuration handed to the scheduler."""
    knobs = {name: Knob(name, value, SOURCE_RECIPE) for name, value in recipe.vllm.items()}
    departures: list[str] = []
    if recipe.replaces is not None:
        changed = departures_from(recipe.replaces, recipe)
        if changed:
            departures.append(f"recipe {recipe.source} (CF_RECIPES_DIR) departs from the shipped benchmark of "
                              f"{recipe.key_text}: {'; '.join(changed)}")
    # Secret flags among the extra arguments reach vLLM through its environment instead.
    env_extra, env_secrets, secret_notes = secrets_to_env(settings.vllm_extra_args)
    extra_args, more_secrets, more_notes = secrets_to_env(extra_args)
    env_secrets.update(more_secrets)
    secret_notes += more_notes
    for var, name in KNOB_OVERRIDES.items():
        if settings.is_set(var):
            new = settings.value(var)
            old = knobs[name].value if name in knobs else "unset (vLLM default)"
            knobs[name] = Knob(name, new, var)
            departures.append(f"{var} departs from the benchmark: {name} {old} (recipe) -> {new}")

    extras = [Knob(" ".join(redact_args(args)), redact_args(args), source)
              for source, args in ((SOURCE_ENV_EXTRA, env_extra), (SOURCE_EXTRA, list(extra_args))) if args]
    if env_extra:
        departures.append(f"CF_VLLM_EXTRA_ARGS departs from the benchmark: adds {' '.join(redact_args(env_extra))}")
    if extra_args:
        departures.append(f"extra vLLM flags depart from the benchmark: adds {' '.join(redact_args(extra_args))}")
    # Appended flags win in vLLM's parser; record that as the knob's provenance.
    for source, args in ((SOURCE_ENV_EXTRA, env_extra), (SOURCE_EXTRA, list(extra_args))):
        for name, value in _knobs_given(args):
            knobs[name] = Knob(name, value, source)

    host = settings.host
    port = settings.port
    model = model_path or recipe.model.repo
    argv = [*engine_prefix(), "--model", model, "--served-model-name", recipe.model.served_name]
    argv += ["--host", str(host), "--port", str(port)]
    # The extra flags are appended below and win in vLLM's parser: the plan reports what vLLM will use.
    served_name, host, port = effective_endpoint([*recipe.extra_args, *env_extra, *extra_args],
                                                 recipe.model.served_name, str(host), int(port))
    if recipe.model.revision and not model_path:
        argv += ["--revision", recipe.model.revision]
    for name, value in recipe.vllm.items():
        # A CF_* override replaces the recipe's value in place; extra flags are appended below
        # and win there, the way vLLM's parser treats a repeated flag.
        argv += knob_args(name, knobs[name].value if knobs[name].source in KNOB_OVERRIDES else value)
    for name in KNOB_OVERRIDES.values():
        if name not in recipe.vllm and name in knobs and knobs[name].source in KNOB_OVERRIDES:
            argv += knob_args(name, knobs[name].value)
    argv += list(recipe.extra_args)
    # The drain is the recipe's unless the extra flags set it (vLLM keeps the last): the runtime
    # then adds none and enforces theirs.
    user_args = [*recipe.extra_args, *env_extra, *extra_args]
    given = read(user_args)
    drain = drain_seconds(given, recipe.drain_timeout_s)
    if not given.given(DRAIN_FLAG):
        argv += [DRAIN_FLAG, _seconds_text(drain)]
    sched_args, contract, sched_notes = scheduler_wiring(user_args, recipe.scheduler.family,
                                                         recipe.scheduler.params, trace)
    argv += sched_args
    api_args, api = api_wiring(recipe.api, user_args, settings.max_request_bytes)
    argv += api_args
    notes: list[str] = []
    builtin_env: dict[str, str] = {}
    if recipe.model.builtin and not given.given(STRUCTURED_FLAG):
        argv += [STRUCTURED_FLAG, BUILTIN_STRUCTURED_OUTPUTS]
        # Forced tool calls as JSON with the tool's schema (guidance has no structural tags).
        builtin_env[STRICT_TOOLS_VARIABLE] = "0"
        notes.append(f"built-in model: structured output with {BUILTIN_STRUCTURED_OUTPUTS} and forced tool calls as "
                     f"JSON ({STRICT_TOOLS_VARIABLE}=0): its random weights then complete JSON of a bounded schema")
    argv += env_extra + list(extra_args)

    env = dict(base_env or {})
    env.update(env_secrets)
    for name, value in {**builtin_env, **recipe.env}.items():
        env.setdefault(name, value)
    env.update(api.env())
    return LaunchPlan(
        mode="recipe",
        recipe=recipe,
        model=model,
        served_model_name=served_name,
        host=str(host),
        port=int(port),
        drain_timeout_s=drain,
        knobs=sorted(knobs.values(), key=lambda k: k.name),
        extra_args=extras,
        argv=argv,
        env=env,
        departures=departures,
        notes=[*secret_notes, *sched_notes, *notes],
        contract=contract,
        api=api,
    )


def _seconds_text(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


DEFAULT_OVERRIDE_DRAIN_S = DEFAULT_DRAIN_TIMEOUT_S
#: vLLM's drain: how long its API server lets requests in flight finish after SIGTERM.
DRAIN_FLAG = "--shutdown-timeout"


def drain_seconds(args: VllmArgs, default: float) -> float:
    """The drain vLLM runs with: the last ``--shutdown-timeout`` among ``args`` (any spelling), else
    ``default``. vLLM takes whole seconds; anything else is refused here, before launch."""
    if not args.given(DRAIN_FLAG):
        return default
    text = (args.value(DRAIN_FLAG) or "").strip()
    if not text.lstrip("-").isdigit() or int(text) < 0:
        raise UsageError(f"{DRAIN_FLAG} {text!r} is not a whole number of seconds",
                         f"write {DRAIN_FLAG} N with N the seconds vLLM lets requests in flight finish (e.g. 30)")
    return float(int(text))


def build_override_plan(
    args: Sequence[str],
    settings: Settings,
    model: str,
    base_env: Mapping[str, str] | None = None,
    trace: TraceConfig | None = None,
) -> LaunchPlan:
    """The full-override mode: the user's arguments are vLLM's, the runtime only adds what it
    must (an explicit served model name, the port) and says so in ``notes``."""
    args, env_secrets, secret_notes = secrets_to_env(list(args))
    if args and not args[0].startswith("-"):
        # `vllm serve MODEL ...` takes the model positionally; the API server module wants --model.
        args = ["--model", args[0], *args[1:]]
    argv = [*engine_prefix(), *args]
    given = read(args)
    notes: list[str] = list(secret_notes)
    served, host, port = effective_endpoint(args, model, str(settings.host), settings.port)
    if not given.given("--served-model-name"):
        argv += ["--served-model-name", model]
        notes.append(f"no --served-model-name given: serving as {model!r}")
    if not given.given("--port"):
        argv += ["--port", str(port)]
    if not given.given("--host"):
        argv += ["--host", str(host)]
    drain = drain_seconds(given, DEFAULT_OVERRIDE_DRAIN_S)
    if not given.given(DRAIN_FLAG):
        argv += [DRAIN_FLAG, _seconds_text(drain)]
    sched_args, contract, sched_notes = scheduler_wiring(args, "fcfs", {}, trace)
    argv += sched_args
    notes += sched_notes
    api_args, api = api_wiring(None, args, settings.max_request_bytes)
    argv += api_args
    ignored: tuple[VarName, ...] = ("CF_MAX_MODEL_LEN", "CF_GPU_MEMORY_UTILIZATION", "CF_VLLM_EXTRA_ARGS")
    for var in ignored:
        if settings.is_set(var):
            notes.append(f"{var} is ignored in the full-override mode: put the flag in the command instead")
    return LaunchPlan(
        mode="override",
        recipe=None,
        model=model,
        served_model_name=served,
        host=str(host),
        port=port,
        drain_timeout_s=drain,
        knobs=[],
        extra_args=[Knob(" ".join(redact_args(args)), redact_args(args), SOURCE_USER)] if args else [],
        argv=argv,
        env={**(base_env or {}), **env_secrets, **api.env()},
        notes=notes,
        contract=contract,
        api=api,
    )
