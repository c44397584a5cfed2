"""Collecting the facts: what the doctor (or a serve's pre-flight) asks the probes, and when.

:func:`collect_facts` fills :class:`~.facts.DoctorFacts` from the settings, the recipe's launch plan,
a GPU backend and a :class:`~.facts.Probes` object (:class:`~.probes.SystemProbes` unless given).
A probe that breaks is reported as "cannot be checked", never raised.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TypeVar

from carbonforge_runtime.errors import CarbonForgeError, OverrideError
from carbonforge_runtime.gpu.types import GpuBackend, GpuSnapshot
from carbonforge_runtime.recipes import load_recipes, recipe_dirs, resolve
from carbonforge_runtime.runtime.doctor.facts import (
    PREFLIGHT,
    VLLM_DEFAULT_MEMORY_FRACTION,
    CompileCacheFacts,
    DoctorFacts,
    DoctorRequest,
    EngineFacts,
    GroupFacts,
    LicenseFacts,
    MountFacts,
    PathFacts,
    PortFacts,
    Probes,
    RecipeFacts,
    SettingProblem,
    TracePolicyFacts,
    WeightsFacts,
)
from carbonforge_runtime.runtime.doctor.probes import SystemProbes
from carbonforge_runtime.runtime.engine_env.compile_cache import ROOT_VARIABLE, cache_location, resolve_root
from carbonforge_runtime.runtime.engine_env.privacy import WATCHED_VARIABLES
from carbonforge_runtime.runtime.group.placement import GROUP_VARIABLES, resolve_group
from carbonforge_runtime.runtime.group.secret import read_group_secret
from carbonforge_runtime.runtime.planning.command import LaunchPlan, build_recipe_plan, engine_args
from carbonforge_runtime.runtime.vllm_cli.args import read
from carbonforge_runtime.runtime.weights.hub_cache import hub_cache_dir
from carbonforge_runtime.settings import VARIABLES, Settings

_TRUE_WORDS = ("1", "true", "yes", "on")


# --- settings and the recipe -------------------------------------------------------------------


def tolerant_settings(environ: Mapping[str, str]) -> tuple[Settings, tuple[SettingProblem, ...]]:
    """Like :func:`carbonforge_runtime.settings.load_settings`, but an invalid variable is reported
    (and left at its default) instead of stopping the diagnosis."""
    values: dict[str, object] = {}
    raw: dict[str, str] = {}
    problems: list[SettingProblem] = []
    for var in VARIABLES:
        text = environ.get(var.name)
        if text is None or text.strip() == "":
            continue
        try:
            values[var.name] = var.parse(var.name, text)
        except OverrideError as exc:
            problems.append(SettingProblem(var.name, exc.message, exc.remedy))
            continue
        raw[var.name] = text
    return Settings(values=values, raw=raw), tuple(problems)


def effective_memory_fraction(plan: LaunchPlan) -> float:
    """--gpu-memory-utilization as the engine will get it (recipe, override, extra flag or vLLM's default)."""
    for knob in plan.knobs:
        if knob.name == "gpu_memory_utilization":
            try:
                return float(knob.value)
            except (TypeError, ValueError):
                break
    text = read(engine_args(plan.argv)).value("--gpu-memory-utilization")
    try:
        return float(text) if text else VLLM_DEFAULT_MEMORY_FRACTION
    except ValueError:
        return VLLM_DEFAULT_MEMORY_FRACTION


def _recipe_plan(key: str, settings: Settings, environ: Mapping[str, str]) -> tuple[RecipeFacts, LaunchPlan | None]:
    try:
        recipe = resolve(key, load_recipes(recipe_dirs(settings.recipes_dir)))
        model_path = None
        if recipe.model.builtin:
            model_path = str(settings.tiny_model_dir)
        plan = build_recipe_plan(recipe, settings, [], model_path=model_path, base_env=dict(environ))
    except CarbonForgeError as exc:
        return RecipeFacts(key, error_message=exc.message, error_remedy=exc.remedy), None
    return RecipeFacts(key, recipe, memory_fraction=effective_memory_fraction(plan),
                       departures=tuple(plan.departures)), plan


def recipe_facts_from_plan(plan: LaunchPlan) -> RecipeFacts | None:
    if plan.recipe is None:
        return None
    return RecipeFacts(plan.recipe.key_text, plan.recipe, memory_fraction=effective_memory_fraction(plan),
                       departures=tuple(plan.departures))


# --- the weights --------------------------------------------------------------------------------


def _default_cache_dirs(env: Mapping[str, str]) -> list[str]:
    home = env.get("HOME", "").strip() or str(Path.home())
    dirs = [str(Path(home) / ".cache" / "huggingface" / "hub")]
    hf_home = env.get("HF_HOME", "").strip()
    if hf_home:
        dirs.insert(0, str(Path(hf_home).expanduser() / "hub"))
    return dirs


def _is_true(value: object) -> bool:
    return (isinstance(value, bool) and value) or str(value).strip().lower() in _TRUE_WORDS


def weights_facts(model: str, revision: str | None, builtin: bool, env: Mapping[str, str], offline: bool,
                  probes: Probes, lock_check: bool = False, deep: bool = False) -> WeightsFacts:
    """Where the weights are; with ``lock_check`` also the snapshot against the lock fetch wrote
    (sizes and times, or every sha256 with ``deep``)."""
    if builtin:
        return WeightsFacts(model, "builtin", offline)
    cache_dir, source = hub_cache_dir(env)
    if model.startswith(("/", "./", "../", "~")) or Path(model).expanduser().exists():
        return WeightsFacts(model, "local", offline, cache_dir, source,
                            snapshot=model if Path(model).expanduser().is_dir() else None)
    snapshot, has_files = probes.find_weights(cache_dir, model, revision)
    missing = probes.weights_missing(cache_dir, model, revision) if snapshot is not None else ()
    lock = probes.weights_lock(cache_dir, model, revision, deep) if snapshot is not None and lock_check else None
    elsewhere = None
    if snapshot is None:
        for other in [str(Path(cache_dir) / "hub"), *_default_cache_dirs(env)]:
            if other != cache_dir and probes.find_weights(other, model, revision)[0] is not None:
                elsewhere = other
                break
    return WeightsFacts(model, "hub", offline, cache_dir, source, snapshot, has_files, elsewhere, revision,
                        tuple(missing), lock)


# --- collection ---------------------------------------------------------------------------------

T = TypeVar("T")


def _unexpected(exc: Exception) -> str:
    return f"cannot be checked ({type(exc).__name__}: {exc})"


def _guarded(probe: Callable[[], T], fallback: Callable[[Exception], T]) -> T:
    """A probe that breaks in an unforeseen way yields "cannot be determined", never a traceback."""
    try:
        return probe()
    except Exception as exc:  # the doctor reports what it cannot find out instead of crashing
        return fallback(exc)


def collect_facts(
    request: DoctorRequest,
    settings: Settings,
    environ: Mapping[str, str],
    gpu: GpuBackend,
    *,
    probes: Probes | None = None,
    now: float | None = None,
    setting_problems: tuple[SettingProblem, ...] = (),
    plan: LaunchPlan | None = None,
    snapshot: GpuSnapshot | None = None,
) -> DoctorFacts:
    """Find out what the checks need. In ``preflight`` mode ``plan`` is the launch about to start and
    ``snapshot`` the GPU snapshot serve already took; only the quick, launch-relevant facts are read."""
    probes = probes or SystemProbes()
    now = time.time() if now is None else now
    preflight = request.mode == PREFLIGHT

    recipe_facts: RecipeFacts | None = None
    if preflight:
        recipe_facts = recipe_facts_from_plan(plan) if plan else None
    else:
        key = request.context_key or settings.context_key
        if key:
            recipe_facts, plan = _recipe_plan(str(key), settings, environ)
    recipe = recipe_facts.recipe if recipe_facts else None
    gpu_recipe = recipe is not None and not recipe.key.hardware.is_cpu

    engine = _guarded(probes.engine, lambda exc: EngineFacts(None, None, False, problem=_unexpected(exc)))
    # The pre-flight asks NVML only when the launch needs a GPU: never for a CPU recipe, and in the
    # full-override mode only when the GPU build of vLLM is installed.
    override_on_gpu = recipe is None and engine.distribution == "vllm"
    if snapshot is None and (not preflight or gpu_recipe or override_on_gpu):
        snapshot = _guarded(gpu.snapshot,
                            lambda exc: GpuSnapshot(False, f"NVML query failed: {exc}", failure="other"))

    env: Mapping[str, str] = plan.env if plan is not None else environ
    offline = settings.hf_hub_offline or _is_true(env.get("HF_HUB_OFFLINE", ""))
    weights = None
    if plan is not None:
        revision = recipe.model.revision if recipe else None
        builtin = bool(recipe and recipe.model.builtin)
        model = plan.model
        # The serve start checks the lock itself (not skipped with the pre-flight): the doctor only.
        weights = _guarded(lambda: weights_facts(model, revision, builtin, env, offline, probes,
                                                 lock_check=not preflight, deep=request.deep), lambda exc: None)
    cache_dir, cache_source = hub_cache_dir(env)

    host = plan.host if plan else settings.host
    api_port = plan.port if plan else settings.port
    port_setting = "CF_PORT" if plan is None or plan.mode == "recipe" else "--port"
    wanted_ports = [("API", host, api_port, port_setting)]
    if request.metrics:
        wanted_ports.append(("metrics", settings.metrics_host or settings.host, settings.metrics_port,
                             "CF_METRICS_PORT"))

    def port(purpose: str, address: str, number: int, setting: str) -> PortFacts:
        return _guarded(lambda: probes.port(purpose, address, number, setting),
                        lambda exc: PortFacts(purpose, address, number, False, _unexpected(exc), setting))

    ports = [port(purpose, address, number, setting) for purpose, address, number, setting in wanted_ports]

    def directory(path: str) -> PathFacts:
        return _guarded(lambda: probes.directory(path), lambda exc: PathFacts(path, False, False, _unexpected(exc)))

    controller = recipe is not None and recipe.controller.policy != "none"
    multi_gpu = recipe_facts is not None and recipe_facts.gpus_used > 1
    trace_dir = None
    if request.trace_file:
        trace_dir = directory(str(Path(request.trace_file).expanduser().parent))
    trace_policy = trace_policy_facts(request, settings, setting_problems, plan)
    want_hf_cache = not preflight or (weights is not None and weights.kind == "hub")
    compile_root = resolve_root(settings.compile_cache_dir, environ)
    compile_path, compile_source = cache_location(
        compile_root, ROOT_VARIABLE if settings.is_set("CF_COMPILE_CACHE_DIR") else "default", environ)
    compile_cache = CompileCacheFacts(compile_path, compile_source, directory(compile_path), _guarded(
        lambda: probes.mount(compile_path), lambda exc: MountFacts(True, problem=_unexpected(exc))))
    return DoctorFacts(
        mode=request.mode,
        now=now,
        runtime=None if preflight else _guarded(probes.runtime, lambda exc: None),
        settings_checked=not preflight,
        variables_set=tuple(sorted(settings.raw)),
        setting_problems=setting_problems,
        gpu=snapshot,
        cuda_visible_devices=env.get("CUDA_VISIBLE_DEVICES"),
        privileges=_guarded(probes.privileges, lambda exc: None) if (not preflight or controller) else None,
        controller_dry_run=settings.dry_run,
        shm_bytes=_guarded(probes.shm_bytes, lambda exc: None) if (not preflight or multi_gpu) else None,
        recipe=recipe_facts,
        license=None if preflight else _guarded(
            lambda: probes.license(settings, recipe, now),
            lambda exc: LicenseFacts("unknown", message=_unexpected(exc), remedy="run `carbonforge-runtime license "
                                     "show` for details, or pass the key again in CARBONFORGE_LICENSE_KEY")),
        otel=_guarded(probes.otel, lambda exc: None) if (not preflight or request.trace_endpoint) else None,
        trace_dir=trace_dir,
        trace_policy=trace_policy,
        hf_cache=directory(cache_dir) if want_hf_cache else None,
        hf_cache_source=cache_source,
        weights=weights,
        log_dir=directory(str(settings.log_dir)),
        compile_cache=compile_cache,
        engine=engine,
        ports=tuple(ports),
        privacy_env=None if preflight else tuple((name, environ[name]) for name in WATCHED_VARIABLES
                                                 if environ.get(name)),
        group=group_facts(settings, probes),
    )


def trace_policy_facts(request: DoctorRequest, settings: Settings, setting_problems: tuple[SettingProblem, ...],
                       plan: LaunchPlan | None) -> TracePolicyFacts | None:
    """Before a launch, the trace settings the engine gets (None with tracing off); for the doctor, the
    level and file it was given (the level off when none) and CF_TRACE_RETENTION."""
    if request.mode == PREFLIGHT:
        trace = plan.contract.tracing if plan is not None and plan.contract is not None else None
        if trace is None:
            return None
        return TracePolicyFacts(trace.level, files=trace.file_shown, retention_s=trace.retention_s)
    problem = next((p for p in setting_problems if p.name == "CF_TRACE_RETENTION"), None)
    level = (request.request_trace or "").strip().lower()
    files = str(Path(request.trace_file).expanduser().absolute()) if request.trace_file else None
    return TracePolicyFacts(level or "off", level_given=bool(level), files=files,
                            retention_s=settings.trace_retention_s,
                            retention_problem=problem.message if problem else "",
                            retention_remedy=problem.remedy if problem else "")


def group_facts(settings: Settings, probes: Probes) -> GroupFacts | None:
    """The host's place when any group variable is set (else None: it serves alone)."""
    if not any(settings.is_set(name) for name in GROUP_VARIABLES):
        return None
    try:
        group = resolve_group(settings)
    except CarbonForgeError as exc:
        return GroupFacts(problem=exc.message, remedy=exc.remedy)
    if group is None:
        return GroupFacts(role="serves alone (a group of one host)", hosts=1)
    try:  # read, never shown
        read_group_secret(settings)
        secret_problem = secret_remedy = ""
    except CarbonForgeError as exc:
        secret_problem, secret_remedy = exc.message, exc.remedy
    if group.leader:
        return GroupFacts(role=group.describe(), hosts=group.nnodes, secret_problem=secret_problem,
                          secret_remedy=secret_remedy)
    # The leader's runtime opens its watch port as soon as it starts (vLLM's ports come later).
    reach, detail = _guarded(lambda: probes.leader(group.master_addr, group.watch_port),
                             lambda exc: ("unreachable", _unexpected(exc)))
    return GroupFacts(group.describe(), leader=f"{group.master_addr}:{group.watch_port}", reach=reach,
                      reach_detail=detail, hosts=group.nnodes, secret_problem=secret_problem,
                      secret_remedy=secret_remedy)



__all__ = ["collect_facts", "tolerant_settings"]
