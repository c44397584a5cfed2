"""Serving: from options and settings to a supervised vLLM engine. The CLI calls :func:`serve`."""

from __future__ import annotations

import json
import os
import shlex
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from carbonforge_runtime import log as cflog
from carbonforge_runtime.errors import CarbonForgeError, HardwareMismatchError, UsageError
from carbonforge_runtime.gpu import GpuBackend, GpuSnapshot
from carbonforge_runtime.gpu.hardware import hardware_mismatches
from carbonforge_runtime.launch.command import ENGINE_MODULE, LaunchPlan, build_override_plan, build_recipe_plan
from carbonforge_runtime.launch.model_arg import model_from_args
from carbonforge_runtime.recipes import Recipe, load_recipes, recipe_dirs, resolve
from carbonforge_runtime.settings import Settings
from carbonforge_runtime.tracing.config import TraceConfig


@dataclass
class ServeOptions:
    context_key: str | None = None
    strict_hardware: bool = False
    request_trace: str = "off"
    trace_file: str | None = None
    trace_endpoint: str | None = None
    trace_format: str | None = None
    metrics: bool = False
    dry_run: bool = False
    #: Do not run the pre-flight checks, so that a failing one cannot stop the launch.
    skip_preflight: bool = False
    vllm_args: list[str] = field(default_factory=list)


@dataclass
class Prepared:
    plan: LaunchPlan
    hardware_problems: list[str]
    snapshot: GpuSnapshot | None
    trace: TraceConfig | None = None
    #: The verified licence claims when a premium recipe or model was granted (for the metrics).
    licence: Any = None


def load_all_recipes(settings: Settings) -> dict[str, Recipe]:
    return load_recipes(recipe_dirs(settings.get("CF_RECIPES_DIR")))


def _check_hardware(recipe: Recipe, gpu: GpuBackend, strict: bool) -> tuple[list[str], GpuSnapshot | None]:
    if recipe.key.hardware.is_cpu:
        return [], None
    snapshot = gpu.snapshot()
    problems = hardware_mismatches(recipe.key.hardware, snapshot)
    if problems and strict:
        raise HardwareMismatchError(
            f"the detected hardware does not match {recipe.key.hardware}: " + "; ".join(problems),
            "serve a key whose hardware segment matches this host (`carbonforge-runtime recipes list`), "
            "or drop --strict-hardware to serve anyway",
        )
    return problems, snapshot


def _trace_config(options: ServeOptions, environ: Mapping[str, str]) -> TraceConfig | None:
    """Validate the tracing flags (errors raise) and log their warnings."""
    from carbonforge_runtime.tracing.config import full_level_banner_lines, resolve_trace_options

    logger = cflog.get_logger()
    decision = resolve_trace_options(
        options.request_trace, options.trace_file, options.trace_endpoint, options.trace_format, environ
    )
    for line in decision.warnings:
        logger.warning(line)
    trace = decision.config
    if trace is not None:
        logger.info("request trace: %s", _describe_trace(trace, options))
        if trace.full:
            logger.warning("\n%s", cflog.banner(full_level_banner_lines(trace)))
    return trace


def _check_scheduler(family: str, params: Mapping[str, object], args: list[str], trace: TraceConfig | None) -> None:
    """Fail before launch on an unknown family, or tracing with another scheduler class."""
    from carbonforge_runtime.launch.command import user_scheduler_cls
    from carbonforge_runtime.scheduler.policy import make_family

    make_family(family, params)
    other = user_scheduler_cls(args)
    if trace is not None and other is not None:
        raise UsageError(
            f"request tracing runs inside the CarbonForge scheduler, but --scheduler-cls {other} replaces it",
            "remove --scheduler-cls from the vLLM arguments, or turn request tracing off",
        )


def prepare(options: ServeOptions, settings: Settings, environ: Mapping[str, str], gpu: GpuBackend) -> Prepared:
    """Validate everything and build the launch plan. Starts nothing."""
    logger = cflog.get_logger()
    base_env = dict(environ)
    base_env.setdefault("PYTHONUNBUFFERED", "1")
    trace = _trace_config(options, environ)
    recipes = load_all_recipes(settings)
    if options.context_key:
        recipe = resolve(options.context_key, recipes)
        from carbonforge_runtime.licensing.gate import gate_recipe

        licence = gate_recipe(recipe, settings, now=time.time())
        problems, snapshot = _check_hardware(recipe, gpu, options.strict_hardware)
        model_path = None
        if recipe.model.builtin:
            model_path = str(Path(settings.get("CF_TINY_MODEL_DIR")).expanduser())
        extra = [*recipe.extra_args, *(settings.get("CF_VLLM_EXTRA_ARGS") or []), *options.vllm_args]
        _check_scheduler(recipe.scheduler.family, recipe.scheduler.params, extra, trace)
        plan = build_recipe_plan(recipe, settings, options.vllm_args, model_path=model_path, base_env=base_env,
                                 trace=trace)
        from carbonforge_runtime.licensing.gate import check_recipe_args

        # Extra flags (after -- or CF_VLLM_EXTRA_ARGS) must not swap the recipe's model for another.
        check_recipe_args(recipe, plan.model, plan.argv[plan.argv.index(ENGINE_MODULE) + 1:])
        return Prepared(plan, problems, snapshot, trace, licence)
    if not options.vllm_args:
        raise CarbonForgeError(
            "nothing to serve: no context key and no vLLM arguments",
            "pass --context-key KEY, set CF_CONTEXT_KEY, or give the vLLM command after --",
        )
    model = model_from_args(options.vllm_args)
    from carbonforge_runtime.licensing.gate import gate_override

    licence = gate_override(model, options.vllm_args, recipes, settings, now=time.time())
    logger.info("full-override mode: the recipe is bypassed; the arguments go to vLLM as given")
    _check_scheduler("fcfs", {}, options.vllm_args, trace)
    plan = build_override_plan(options.vllm_args, settings, model, base_env=base_env, trace=trace)
    return Prepared(plan, [], None, trace, licence)


def describe_plan(prepared: Prepared, options: ServeOptions) -> str:
    """The effective configuration, with the source of every knob (the dry run's output)."""
    plan = prepared.plan
    out = [f"mode:               {plan.mode}"]
    if plan.recipe:
        recipe = plan.recipe
        out.append(f"context key:        {recipe.key_text}  ({recipe.source})")
        out.append(f"plan:               {recipe.plan}")
        verified = "" if recipe.model.verified else "  [unverified repository]"
        out.append(f"model:              {recipe.model.repo}{verified}")
        if plan.model != recipe.model.repo:
            out.append(f"model path:         {plan.model}  (built-in, generated at launch)")
    else:
        out.append(f"model:              {plan.model}")
    out.append(f"served model name:  {plan.served_model_name}")
    out.append(f"API:                http://{plan.host}:{plan.port}/v1")
    out.append(f"drain time:         {plan.drain_timeout_s:g} s")
    if plan.knobs:
        out.append("vLLM knobs (value, source):")
        width = max(len(k.name) for k in plan.knobs)
        for knob in plan.knobs:
            out.append(f"  {knob.name.ljust(width)}  {str(knob.value).ljust(10)}  {knob.source}")
    if plan.extra_args:
        out.append("extra vLLM arguments (source):")
        for extra in plan.extra_args:
            out.append(f"  {extra.name}    ({extra.source})")
    if plan.recipe:
        out.append(f"scheduler:          {plan.recipe.scheduler.family} {dict(plan.recipe.scheduler.params) or ''}")
        out.append(f"controller:         {plan.recipe.controller.policy}")
        for name, value in plan.recipe.env.items():
            origin = "recipe" if plan.env.get(name) == value and name not in os.environ else "environment"
            out.append(f"engine environment: {name}={plan.env.get(name)}  ({origin})")
    out.append(f"request trace:      {_describe_trace(prepared.trace, options)}")
    for line in plan.departures:
        out.append(f"departure:          {line}")
    for line in plan.notes:
        out.append(f"note:               {line}")
    for line in prepared.hardware_problems:
        out.append(f"hardware mismatch:  {line}")
    out.append("vLLM command:")
    out.append("  " + shlex.join(plan.argv))
    return "\n".join(out)


def _describe_trace(trace: TraceConfig | None, options: ServeOptions) -> str:
    if trace is None:
        return "off" if options.request_trace in ("off", "", None) else f"off ({options.request_trace} has no sink)"
    sinks = []
    if trace.file:
        sinks.append(f"file {trace.file}")
    if trace.otlp:
        sinks.append(f"OTLP {trace.otlp.protocol} {trace.otlp.endpoint}")
    return f"{trace.level} -> {', '.join(sinks)}"


def _create_trace_file(trace: TraceConfig | None) -> None:
    """Create the JSONL file before the engine starts (owner-only at the full level)."""
    if trace is None or not trace.file:
        return
    from carbonforge_runtime.tracing.sinks import create_trace_file

    try:
        tightened = create_trace_file(trace.file, private=trace.full)
    except OSError as exc:
        raise CarbonForgeError(
            f"cannot create the trace file {trace.file} ({exc.strerror or exc})",
            "give --trace-file a path in a writable directory (e.g. on the /var/log/carbonforge volume)",
        ) from None
    if tightened:
        cflog.get_logger().warning("trace file %s existed with a wider mode: now readable by its owner only",
                                   trace.file)


def _log_dir(settings: Settings) -> Path:
    path = Path(settings.get("CF_LOG_DIR")).expanduser()
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / ".write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise CarbonForgeError(
            f"log directory {path} is not writable ({exc.strerror})",
            "mount a writable volume at /var/log/carbonforge, or set CF_LOG_DIR to a writable directory",
        ) from None
    return path


def serve(options: ServeOptions, settings: Settings, environ: Mapping[str, str], gpu: GpuBackend) -> int:
    from carbonforge_runtime.launch import supervisor

    logger = cflog.get_logger()
    stop = supervisor.StopFlag()
    stop.install()  # from here on a SIGTERM is handled, even during preparation
    prepared = prepare(options, settings, environ, gpu)
    plan = prepared.plan
    if prepared.hardware_problems and plan.recipe:
        lines = [f"HARDWARE MISMATCH for {plan.recipe.key_text}", *prepared.hardware_problems,
                 "Serving anyway: the recipe's performance and energy figures do not apply to this host.",
                 "Pass --strict-hardware to refuse to start instead."]
        logger.warning("\n%s", cflog.banner(lines))
    for line in plan.departures:
        logger.warning(line)
    for line in plan.notes:
        logger.info(line)
    if not options.skip_preflight:
        from carbonforge_runtime.doctor import preflight

        preflight(prepared, options, settings, environ, gpu)  # prints WARN/FAIL; raises on FAIL unless dry run
    if options.dry_run:
        print(describe_plan(prepared, options))
        return 0

    log_dir = _log_dir(settings)
    _create_trace_file(prepared.trace)
    if plan.recipe and plan.recipe.model.builtin:
        from carbonforge_runtime.tiny_model import ensure_tiny_model

        logger.info("preparing the built-in model %s in %s", plan.recipe.model.builtin, plan.model)
        ensure_tiny_model(Path(plan.model))
    from carbonforge_runtime.metrics.runtime import start_observability

    # Metrics, GPU monitor and energy controller (None when the run needs none of them).
    observe = start_observability(prepared, options, settings, environ, logger, stop)
    engine_env = observe.engine_env(plan.env) if observe is not None else plan.env
    engine = supervisor.EngineProcess(plan.argv, engine_env, log_dir / "vllm.log")
    what = plan.recipe.key_text if plan.recipe else f"override ({plan.model})"
    logger.info("starting vLLM for %s; engine log: %s", what, engine.log_path)
    ready_host = "127.0.0.1" if plan.host in ("0.0.0.0", "::", "") else plan.host

    def on_ready() -> None:
        logger.info("ready: OpenAI API on http://%s:%d/v1 serving model %r", ready_host, plan.port,
                    plan.served_model_name)
        body = json.dumps({"model": plan.served_model_name,
                           "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 32})
        logger.info("try: curl -s http://%s:%d/v1/chat/completions -H 'Content-Type: application/json' -d '%s'",
                    ready_host, plan.port, body)
        if observe is not None:
            observe.engine_ready()

    try:
        report = supervisor.supervise(
            engine,
            ready_url=f"http://{ready_host}:{plan.port}/health",
            ready_timeout_s=settings.get("CF_READY_TIMEOUT_S"),
            drain_timeout_s=plan.drain_timeout_s,
            log=logger,
            on_ready=on_ready,
            stop=stop,
        )
    finally:  # every way out (stop signal, engine death, exception) puts the GPUs back as found
        if observe is not None:
            observe.close()
    return report.exit_code
