"""Step 1 of serving: from the options, the settings and the known recipes to a plan. Pure.

:func:`build_plan` reads no file, opens no device and starts no process: everything it needs is
passed in (the recipes are loaded by the caller). The plan it returns holds everything the later
steps act on: the recipe (if any), the request-trace configuration, the vLLM command line and
environment, the engine contract, and the messages to log. The checks
(:mod:`carbonforge_runtime.runtime.doctor.preflight`) judge this plan; the launch runs it as it is, so a dry
run and a real launch of the same options run the same command.
"""

from __future__ import annotations

import hashlib
import os
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace

from carbonforge_runtime.core.api_contract import EFFORTS
from carbonforge_runtime.core.api_keys import KEYS_FILE_VARIABLE, SHORTCUT_DIGEST_VARIABLE
from carbonforge_runtime.core.contract import StepLogConfig, TraceConfig, full_level_banner_lines
from carbonforge_runtime.core.ordering.registry import make_family
from carbonforge_runtime.core.redaction import redact_args, redact_url
from carbonforge_runtime.core.trace_retention import format_duration, period_word, rotation_period
from carbonforge_runtime.errors import CarbonForgeError, UsageError
from carbonforge_runtime.recipes import Recipe, resolve
from carbonforge_runtime.runtime.engine_env.compile_cache import CompileCacheEnv, engine_cache_env, resolve_root
from carbonforge_runtime.runtime.engine_env.passthrough import engine_environment, parse_pass_list, withheld_names
from carbonforge_runtime.runtime.engine_env.privacy import PrivacyEnv, engine_privacy_env
from carbonforge_runtime.runtime.group.placement import (
    Group,
    GroupFlags,
    check_no_group_flags,
    check_recipe_fits,
    place_command,
    resolve_group,
)
from carbonforge_runtime.runtime.licensing.gate import check_recipe_args
from carbonforge_runtime.runtime.planning.command import (
    AUTO_TOOL_FLAG,
    ENGINE_MODULE,
    REASONING_FLAG,
    TOOL_PARSER_FLAG,
    LaunchPlan,
    build_override_plan,
    build_recipe_plan,
    data_parallel_size,
    engine_args,
    user_scheduler_cls,
)
from carbonforge_runtime.runtime.planning.emulate import (
    EmulateOptions,
    describe_emulation,
    emulated_recipe,
    emulation_contract,
)
from carbonforge_runtime.runtime.planning.trace_options import resolve_trace_options, trace_export_lines
from carbonforge_runtime.runtime.process.drain import stop_timeout_s
from carbonforge_runtime.runtime.vllm_cli.args import read
from carbonforge_runtime.runtime.vllm_cli.served_model import model_from_args
from carbonforge_runtime.settings import Settings

#: Secrets the runtime reads and the engine never needs: kept out of the engine's environment (and so
#: out of /proc/<pid>/environ of every vLLM process).
RUNTIME_ONLY_VARIABLES = frozenset({"CARBONFORGE_LICENSE_KEY", "CF_API_KEY", "CF_API_KEY_FILE", "CF_GROUP_SECRET",
                                    "CF_GROUP_SECRET_FILE", "CF_API_KEYS_FILE", "CF_API_KEY_SHA256"})
#: The variable vLLM's API server reads its key from; set, every /v1 request must carry it.
ENGINE_KEY_VARIABLE = "VLLM_API_KEY"


@dataclass
class ServeOptions:
    """The ``serve`` command's flags (and the vLLM arguments after ``--``)."""

    context_key: str | None = None
    strict_hardware: bool = False
    request_trace: str = "off"
    trace_file: str | None = None
    trace_endpoint: str | None = None
    trace_format: str | None = None
    #: Append one JSON line per engine step here (for sim-calibrate); None: no step log.
    step_log: str | None = None
    metrics: bool = False
    dry_run: bool = False
    #: Do not run the pre-flight checks, so that a failing one cannot stop the launch.
    skip_preflight: bool = False
    #: This host's place in a multi-host group (else CF_NNODES, CF_NODE_RANK, ... or LWS_*).
    nnodes: int | None = None
    node_rank: int | None = None
    master_addr: str | None = None
    master_port: int | None = None
    #: Serve the recipe on the CPU with the built-in model, every step paced to a step-time model.
    emulate: bool = False
    #: --emulate's step-time model (a shipped name or a YAML file); None: the recipe's.
    cost_model: str | None = None
    #: --emulate: every step this many times longer than the model says.
    emulate_slowdown: float = 1.0
    vllm_args: list[str] = field(default_factory=list)

    def group_flags(self) -> GroupFlags:
        return GroupFlags(self.nnodes, self.node_rank, self.master_addr, self.master_port)


@dataclass(frozen=True)
class Message:
    level: str  # "info" or "warning"
    text: str


@dataclass
class ServePlan:
    """What serving will do, before anything is checked or started."""

    launch: LaunchPlan
    trace: TraceConfig | None
    #: The model vLLM serves in the full-override mode, and the user's vLLM arguments (``None``
    #: and empty in the recipe mode).
    override_model: str | None = None
    override_args: list[str] = field(default_factory=list)
    messages: list[Message] = field(default_factory=list)
    #: The switches that keep the engine from reporting usage or reaching a hub, and why.
    privacy: PrivacyEnv | None = None
    #: Where the engine's compile and kernel caches go (CF_COMPILE_CACHE_DIR), and why.
    compile_cache: CompileCacheEnv | None = None
    #: serve --emulate: the recipe as it is in its file, and the emulation's options.
    emulated: tuple[Recipe, EmulateOptions] | None = None

    @property
    def recipe(self) -> Recipe | None:
        return self.launch.recipe


#: Why the built-in model needs no download (the dry run and the log say so).
BUILTIN_WEIGHTS = "built-in model, generated on this machine"


@dataclass(frozen=True)
class ModelSource:
    """The weights serving some options loads: a repository id (at a revision) or a path."""

    model: str
    revision: str | None
    builtin: bool = False


def model_source(options: ServeOptions, recipes: Mapping[str, Recipe]) -> ModelSource | None:
    """Which weights :func:`build_plan` would serve for ``options``, so that the caller can look for
    them before planning; None when the options name none (build_plan then says what is wrong)."""
    try:
        if options.context_key:
            recipe = resolve(options.context_key, recipes)
            if options.emulate:
                return ModelSource(recipe.model.repo, None, True)
            return ModelSource(recipe.model.repo, recipe.model.revision, bool(recipe.model.builtin))
        if options.vllm_args:
            return ModelSource(model_from_args(options.vllm_args), read(options.vllm_args).value("--revision"))
    except CarbonForgeError:
        return None
    return None


def _privacy(launch: LaunchPlan, model: str, weights_present: str | None, environ: Mapping[str, str],
             messages: list[Message]) -> PrivacyEnv:
    """Put the no-reporting and offline switches into the engine's environment; say what changed."""
    privacy = engine_privacy_env(launch.env, model, weights_present, operator=environ,
                                 args=engine_args(launch.argv))
    launch.env.update(privacy.env)
    messages += [Message("warning", line) for line in privacy.warnings]
    messages += [Message("info", line) for line in privacy.notes]
    return privacy


def _compile_cache(launch: LaunchPlan, settings: Settings, environ: Mapping[str, str],
                   messages: list[Message]) -> CompileCacheEnv:
    """Point the engine's compile and kernel caches into CF_COMPILE_CACHE_DIR (unless already set)."""
    cache = engine_cache_env(resolve_root(settings.compile_cache_dir, launch.env), launch.env, operator=environ)
    launch.env.update(cache.env)
    messages += [Message("info", line) for line in cache.notes]
    return cache


def build_plan(options: ServeOptions, settings: Settings, recipes: Mapping[str, Recipe],
               environ: Mapping[str, str], cwd: str | None = None, weights_present: str | None = None,
               api_key: str | None = None, keys_file: str | None = None,
               emulate: EmulateOptions | None = None) -> ServePlan:
    """The plan for ``options``; raises :class:`UsageError` (or another fixable error) on options
    that cannot be served. ``environ`` is the runtime's environment, which the engine inherits.
    ``weights_present`` says why the weights of :func:`model_source` need no download (already in the
    Hugging Face cache, a local directory), or is None when they are not on this machine; the engine
    then serves offline (:mod:`~carbonforge_runtime.runtime.engine_env.privacy`). ``api_key`` is the key clients
    must send (CF_API_KEY or the file CF_API_KEY_FILE, read by the caller); ``keys_file`` the keys file
    of named keys (CF_API_KEYS_FILE, checked by the caller), which vLLM's API server reads itself.
    ``emulate`` (``serve --emulate``, its step-time model read by the caller) serves the recipe paced on
    the CPU (:mod:`~carbonforge_runtime.runtime.planning.emulate`)."""
    check_emulate_flags(options, emulate)
    messages: list[Message] = []
    group = resolve_group(settings, options.group_flags())
    check_no_group_flags([*settings.vllm_extra_args, *options.vllm_args])
    trace = _trace_config(options, settings, environ, cwd, messages)
    # The engine sees only the variables a serving engine reads (and those the operator adds), never
    # what only the runtime may read.
    base_env = engine_environment(environ, parse_pass_list(settings.engine_env_pass), never=RUNTIME_ONLY_VARIABLES)
    base_env.setdefault("PYTHONUNBUFFERED", "1")
    _key_env(base_env, api_key, keys_file)
    if options.context_key:
        recipe = resolve(options.context_key, recipes)
        original = recipe
        if emulate is not None:
            recipe, notes = emulated_recipe(recipe, emulate)
            messages += [Message("info", line) for line in notes]
        check_recipe_fits(recipe, group)
        check_no_group_flags(recipe.extra_args)
        model_path = str(settings.tiny_model_dir) if recipe.model.builtin else None
        extra = [*recipe.extra_args, *settings.vllm_extra_args, *options.vllm_args]
        _check_scheduler(recipe.scheduler.family, recipe.scheduler.params, extra, trace)
        launch = build_recipe_plan(recipe, settings, options.vllm_args, model_path=model_path, base_env=base_env,
                                   trace=trace)
        # Extra flags (after -- or CF_VLLM_EXTRA_ARGS) must not swap the recipe's model for another.
        check_recipe_args(recipe, launch.model, engine_args(launch.argv))
        messages += [Message("warning", line) for line in launch.departures]
        messages += [Message("info", line) for line in launch.notes]
        present = BUILTIN_WEIGHTS if recipe.model.builtin else weights_present
        trace = _trace_per_rank(launch, trace, messages)
        _place(launch, group, messages)
        _step_log(launch, options, cwd, messages)
        if emulate is not None:
            _emulation(launch, original, emulate, messages)
        privacy = _privacy(launch, recipe.model.repo, present, environ, messages)
        cache = _compile_cache(launch, settings, environ, messages)
        _api_access(launch, messages)
        return ServePlan(launch, trace, messages=messages, privacy=privacy, compile_cache=cache,
                         emulated=(original, emulate) if emulate is not None else None)
    if not options.vllm_args:
        raise _nothing_to_serve(options, environ)
    if options.strict_hardware:
        raise UsageError(
            "--strict-hardware needs a context key: the full override has no hardware segment to check the "
            "GPUs against",
            "serve a recipe with --context-key KEY --strict-hardware, or drop --strict-hardware",
        )
    model = model_from_args(options.vllm_args)
    messages.append(Message("info", "full-override mode: the recipe is bypassed; the arguments go to vLLM as given"))
    _check_scheduler("fcfs", {}, options.vllm_args, trace)
    launch = build_override_plan(options.vllm_args, settings, model, base_env=base_env, trace=trace)
    messages += [Message("info", line) for line in launch.notes]
    trace = _trace_per_rank(launch, trace, messages)
    _place(launch, group, messages)
    _step_log(launch, options, cwd, messages)
    privacy = _privacy(launch, model, weights_present, environ, messages)
    cache = _compile_cache(launch, settings, environ, messages)
    _api_access(launch, messages)
    return ServePlan(launch, trace, model, list(options.vllm_args), messages, privacy, cache)


def _trace_per_rank(launch: LaunchPlan, trace: TraceConfig | None, messages: list[Message]) -> TraceConfig | None:
    """With data parallel, each engine core writes its own trace file, named by its rank: several
    processes never share one file, and a rank's file tells which engine served what."""
    size = data_parallel_size(engine_args(launch.argv))
    if trace is None or not trace.file or size <= 1:
        return trace
    directory = os.path.dirname(trace.file) or "."
    trace = replace(trace, data_parallel_size=size)
    if launch.contract is not None:
        launch.contract = replace(launch.contract, tracing=trace)
    messages.append(Message("info", f"request trace: data parallel {size}, so each rank writes its own file: "
                                    f"{trace.file_shown} (summarize them together with `trace summarize "
                                    f"{directory}`)"))
    return trace


def _place(launch: LaunchPlan, group: Group | None, messages: list[Message]) -> None:
    """Put the command in this host's place in its group (nothing to do for a host alone)."""
    if group is None:
        return
    launch.group = group
    launch.argv = place_command(launch.argv, ENGINE_MODULE, group)
    messages.append(Message("info", f"group: {group.describe()}"))
    if not group.leader:
        messages.append(Message("info", "group: a worker runs vLLM headless (no API server); the leader "
                                        f"{group.master_addr} serves the API"))


def step_log_path(step_log: str | None, cwd: str | None = None) -> str | None:
    """The absolute path ``--step-log`` names (None without one); an empty value is refused."""
    if step_log is None:
        return None
    if not step_log.strip():
        raise UsageError("--step-log is empty",
                         "give a file path, e.g. --step-log /var/log/carbonforge/steps.jsonl")
    return os.path.abspath(os.path.join(cwd or os.getcwd(), os.path.expanduser(step_log.strip())))


def _step_log(launch: LaunchPlan, options: ServeOptions, cwd: str | None, messages: list[Message]) -> None:
    """Ask the engine's scheduler for the step log (``--step-log``), through the engine contract."""
    path = step_log_path(options.step_log, cwd)
    if path is None:
        return
    if launch.contract is None:
        raise UsageError(
            f"the step log is written by the CarbonForge scheduler, but --scheduler-cls "
            f"{user_scheduler_cls(launch.argv) or '?'} replaces it",
            "remove --scheduler-cls from the vLLM arguments, or drop --step-log",
        )
    launch.contract = replace(launch.contract, step_log=StepLogConfig(file=path))
    messages.append(Message("info", f"step log: one line per engine step to {path} (for sim-calibrate)"))


def check_emulate_flags(options: ServeOptions, emulate: EmulateOptions | None) -> None:
    """--emulate serves a recipe; --cost-model and --emulate-slowdown belong to it."""
    if options.emulate and not options.context_key:
        raise UsageError("--emulate serves a recipe, and no --context-key is given (the full-override mode has no "
                         "step-time model)", "add --context-key KEY, or drop --emulate")
    if not options.emulate and (options.cost_model is not None or options.emulate_slowdown != 1.0):
        flag = "--cost-model" if options.cost_model is not None else "--emulate-slowdown"
        raise UsageError(f"{flag} only applies to a paced engine", f"add --emulate, or drop {flag}")
    if options.emulate and emulate is None:
        raise UsageError("--emulate needs its step-time model", "pass --cost-model NAME|FILE")


def _emulation(launch: LaunchPlan, original: Recipe, emulate: EmulateOptions, messages: list[Message]) -> None:
    """Tell the engine's scheduler to pace every step (``--emulate``), through the engine contract."""
    if launch.contract is None:
        raise UsageError(
            f"--emulate paces steps inside the CarbonForge scheduler, but --scheduler-cls "
            f"{user_scheduler_cls(launch.argv) or '?'} replaces it",
            "remove --scheduler-cls from the vLLM arguments, or drop --emulate",
        )
    launch.contract = replace(launch.contract, emulation=emulation_contract(emulate))
    model = emulate.cost_model
    proxy = " (a PROXY model: its figures are estimates)" if model.proxy else ""
    messages.append(Message("info", f"emulated: {original.key_text} on the CPU with the built-in model standing in "
                                    f"for {original.model.repo}; every step paced to {model.name} v{model.version}"
                                    f"{proxy} x{emulate.slowdown:g}; no licence needed"))


def _key_env(env: dict[str, str], api_key: str | None, keys_file: str | None) -> None:
    """Tell the API server its keys. One key alone goes to vLLM as ``VLLM_API_KEY`` (vLLM checks it
    too). With a keys file, vLLM's own check would refuse the named keys, so the middleware alone
    checks them: it gets the file's path and, for ``CF_API_KEY`` beside it, the key's SHA-256 only."""
    if keys_file is None:
        if api_key:
            env[ENGINE_KEY_VARIABLE] = api_key
        return
    env[KEYS_FILE_VARIABLE] = keys_file
    if api_key:
        env[SHORTCUT_DIGEST_VARIABLE] = hashlib.sha256(api_key.encode("utf-8")).hexdigest()


def api_keys_required(launch: LaunchPlan) -> bool:
    return bool(launch.env.get(ENGINE_KEY_VARIABLE) or launch.env.get(KEYS_FILE_VARIABLE))


def _api_access(launch: LaunchPlan, messages: list[Message]) -> None:
    """One warning when the API takes requests without a key; a refusal for vLLM's ``--api-key`` beside a
    keys file (vLLM's own check of that key would refuse every named key)."""
    if launch.env.get(KEYS_FILE_VARIABLE) and launch.env.get(ENGINE_KEY_VARIABLE):
        raise UsageError("--api-key among vLLM's arguments cannot be used with CF_API_KEYS_FILE: vLLM would "
                         "refuse every named key", "give that key through CF_API_KEY instead (it stays valid "
                         "beside the keys file, with every scope)")
    if launch.serves_api and not api_keys_required(launch):
        messages.append(Message("warning", f"the API on port {launch.port} takes requests from anyone who can "
                                           "reach it: set CF_API_KEY (or CF_API_KEY_FILE) to require a key"))


def _runtime_flags(options: ServeOptions) -> list[str]:
    """The runtime flags ``options`` were given with (every one that differs from its default)."""
    words: list[str] = []
    for item in fields(ServeOptions):
        if item.name in ("context_key", "vllm_args"):
            continue
        value = getattr(options, item.name)
        if value == item.default:
            continue
        flag = "--" + item.name.replace("_", "-")
        words += [flag] if isinstance(value, bool) else [flag, str(value)]
    return words


def _nothing_to_serve(options: ServeOptions, environ: Mapping[str, str]) -> UsageError:
    key = environ.get("CF_CONTEXT_KEY", "").strip()
    if key:
        # Arguments were given, so the variable does not count (the launch modes); show the command
        # that serves the key with the same flags.
        command = shlex.join(["carbonforge-runtime", "--context-key", key, *redact_args(_runtime_flags(options))])
        return UsageError(
            f"nothing to serve: CF_CONTEXT_KEY ({key}) is ignored when arguments are given, and the arguments "
            "name no --context-key and no vLLM command",
            f"put the key on the command line: {command}",
        )
    return UsageError(
        "nothing to serve: no context key and no vLLM arguments",
        "pass --context-key KEY, set CF_CONTEXT_KEY (with no arguments), or give the vLLM command after --",
    )


def _trace_config(options: ServeOptions, settings: Settings, environ: Mapping[str, str], cwd: str | None,
                  messages: list[Message]) -> TraceConfig | None:
    """Validate the tracing flags (errors raise); their warnings join ``messages``. The trace file's
    retention comes from CF_TRACE_RETENTION."""
    decision = resolve_trace_options(
        options.request_trace, options.trace_file, options.trace_endpoint, options.trace_format, environ, cwd=cwd
    )
    messages += [Message("warning", line) for line in decision.warnings]
    trace = decision.config
    retention = settings.trace_retention_s
    if trace is not None and retention is not None:
        if trace.file:
            trace = replace(trace, retention_s=retention)
        else:
            messages.append(Message("info", "request trace: CF_TRACE_RETENTION applies to trace files, and there "
                                            "is none (--trace-file); the collector keeps spans by its own policy"))
    if trace is not None:
        messages.append(Message("info", f"request trace: {describe_trace(trace, options)}"))
        messages += [Message("info", f"request trace: {line}") for line in decision.notes]
        if trace.full:
            messages.append(Message("banner", "\n".join(full_level_banner_lines(trace))))
    return trace


def _check_scheduler(family: str, params: Mapping[str, object], args: list[str], trace: TraceConfig | None) -> None:
    """Fail before launch on an unknown family, or tracing with another scheduler class."""
    make_family(family, params)
    other = user_scheduler_cls(args)
    if trace is not None and other is not None:
        raise UsageError(
            f"request tracing runs inside the CarbonForge scheduler, but --scheduler-cls {other} replaces it",
            "remove --scheduler-cls from the vLLM arguments, or turn request tracing off",
        )


def describe_trace(trace: TraceConfig | None, options: ServeOptions) -> str:
    if trace is None:
        return "off" if options.request_trace in ("off", "", None) else f"off ({options.request_trace} has no sink)"
    sinks = []
    if trace.file:
        kept = ""
        if trace.retention_s is not None:
            kept = (f" (rotated {period_word(rotation_period(trace.retention_s))}, segments deleted "
                    f"{format_duration(trace.retention_s)} after their newest record: CF_TRACE_RETENTION)")
        sinks.append(f"file {trace.file_shown}{kept}")
    if trace.otlp:
        sinks.append(f"OTLP {trace.otlp.protocol} {redact_url(trace.otlp.endpoint)}")
    return f"{trace.level} -> {', '.join(sinks)}"


def describe_plan(plan: ServePlan, options: ServeOptions, environ: Mapping[str, str]) -> list[str]:
    """The effective configuration, with the source of every knob (the first part of the dry run)."""
    launch = plan.launch
    out = [f"mode:               {launch.mode}"]
    if plan.emulated is not None:
        out += describe_emulation(*plan.emulated)
    recipe = launch.recipe
    if recipe:
        out.append(f"context key:        {recipe.key_text}  ({recipe.source})")
        out.append(f"plan:               {recipe.plan}")
        verified = "" if recipe.model.verified else "  [unverified repository]"
        out.append(f"model:              {recipe.model.repo}{verified}")
        if launch.model != recipe.model.repo:
            out.append(f"model path:         {launch.model}  (built-in, generated at launch)")
    else:
        out.append(f"model:              {launch.model}")
    out.append(f"served model name:  {launch.served_model_name}")
    if recipe and recipe.hosts:
        out.append(f"hosts:              {recipe.hosts.describe(recipe.vllm)}")
    if launch.group is not None:
        out.append(f"group:              {launch.group.describe()}")
    if launch.serves_api:
        out.append(f"API:                http://{launch.host}:{launch.port}/v1")
        out += describe_api(launch)
    else:
        out.append("API:                none on a worker (headless); clients use the leader's")
    out.append(f"drain time:         {launch.drain_timeout_s:g} s  (stop timeout: at least "
               f"{stop_timeout_s(launch.drain_timeout_s)} s, e.g. docker run --stop-timeout)")
    if launch.knobs:
        out.append("vLLM knobs (value, source):")
        width = max(len(k.name) for k in launch.knobs)
        for knob in launch.knobs:
            out.append(f"  {knob.name.ljust(width)}  {str(knob.value).ljust(10)}  {knob.source}")
    if launch.extra_args:
        out.append("extra vLLM arguments (source):")
        for extra in launch.extra_args:
            out.append(f"  {extra.name}    ({extra.source})")
    if recipe:
        if launch.contract is None:  # another --scheduler-cls replaces the recipe's family
            out.append(f"scheduler:          {user_scheduler_cls(engine_args(launch.argv))} (--scheduler-cls; "
                       f"the recipe's {recipe.scheduler.family} is not loaded)")
        else:
            out.append(f"scheduler:          {recipe.scheduler.family} {dict(recipe.scheduler.params) or ''}")
        out.append(f"controller:         {recipe.controller.policy}")
        covered = {entry.name for entry in plan.privacy.lines} if plan.privacy else set()
        covered |= {entry.name for entry in plan.compile_cache.lines} if plan.compile_cache else set()
        for name, value in recipe.env.items():
            if name in covered:  # listed below, with why it has its value
                continue
            origin = "recipe" if launch.env.get(name) == value and name not in environ else "environment"
            out.append(f"engine environment: {name}={launch.env.get(name)}  ({origin})")
    for entry in plan.privacy.lines if plan.privacy else []:
        setting = f"{entry.name}={entry.value}" if entry.value is not None else f"{entry.name} unset"
        out.append(f"engine environment: {setting}  ({entry.why})")
    for entry in plan.compile_cache.lines if plan.compile_cache else []:
        out.append(f"engine environment: {entry.name}={entry.value}  ({entry.why})")
    withheld = withheld_names(environ, launch.env)
    if withheld:
        out.append(f"engine environment: withheld from vLLM: {', '.join(withheld)} "
                   f"(CF_ENGINE_ENV_PASS passes more)")
    out.append(f"request trace:      {describe_trace(plan.trace, options)}")
    step_log = plan.launch.contract.step_log if plan.launch.contract is not None else None
    out.append(f"step log:           {step_log.file if step_log is not None else 'off'}")
    out += [f"trace export:       {line}" for line in trace_export_lines(plan.trace, environ)]
    for line in launch.departures:
        out.append(f"departure:          {line}")
    for line in launch.notes:
        out.append(f"note:               {line}")
    return out


def describe_api(launch: LaunchPlan) -> list[str]:
    """The API's key requirement, parsers and effort mapping, for the dry run."""
    given = read(engine_args(launch.argv))
    keys = ("required (Authorization: Bearer)" if api_keys_required(launch)
            else "none: open to anyone who can reach the port")
    if launch.env.get(KEYS_FILE_VARIABLE):
        keys += (f"; named keys from {launch.env[KEYS_FILE_VARIABLE]} (re-read when it changes)"
                 + (", and CF_API_KEY with every scope" if launch.env.get(SHORTCUT_DIGEST_VARIABLE) else ""))
    out = [f"API keys:           {keys}"]
    reasoning = given.value(REASONING_FLAG)
    out.append(f"reasoning parser:   {reasoning or 'none (the model does not reason)'}")
    tools = given.value(TOOL_PARSER_FLAG)
    auto = ", auto tool choice" if given.switch(AUTO_TOOL_FLAG) else ""
    out.append(f"tool-call parser:   {tools + auto if tools else 'none (requests with tools are refused)'}")
    if launch.api.reasoning:
        budget = launch.api.thinking_budget
        efforts = ", ".join(f"{e} {budget[e]} tokens" if budget.get(e) else f"{e} no cap" for e in EFFORTS)
        out.append(f"thinking budget:    {efforts}; enable_thinking false: none")
    return out


def command_line(plan: ServePlan) -> str:
    """The vLLM command the launch runs, as one shell line (secrets redacted)."""
    return shlex.join(redact_args(plan.launch.argv))
