"""Serving, as one pipeline: options -> plan -> checks -> launch -> supervise.

1. :func:`~carbonforge_runtime.runtime.planning.plan.build_plan` (pure) turns the options, settings and
   recipes into the plan: the recipe, the trace configuration, the vLLM command, the engine contract.
2. :mod:`~carbonforge_runtime.runtime.doctor.preflight` judges that plan: licence, hardware, pre-flight.
3. The dry run prints the plan and the verdicts and stops; otherwise the plan is launched as it is
   (:mod:`~carbonforge_runtime.runtime.process.supervisor`) with the observability around it.

Each step calls only the steps below it. The CLI calls :func:`serve`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import stat
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from carbonforge_runtime import files
from carbonforge_runtime import log as cflog
from carbonforge_runtime.core.api_contract import GROUP_DOWN_VARIABLE, LICENCE_EXPIRED_VARIABLE
from carbonforge_runtime.core.contract import EngineContract, TraceConfig
from carbonforge_runtime.errors import CarbonForgeError, LicenseError
from carbonforge_runtime.gpu.types import GpuBackend, GpuSnapshot
from carbonforge_runtime.recipes import Recipe, load_recipes, recipe_dirs, resolve
from carbonforge_runtime.runtime.doctor.preflight import (
    Verdicts,
    check_hardware,
    check_licence,
    hardware_refusal,
    preflight,
)
from carbonforge_runtime.runtime.doctor.probes import weights_lock_on_host, weights_on_host
from carbonforge_runtime.runtime.group.placement import Group
from carbonforge_runtime.runtime.group.secret import read_group_secret
from carbonforge_runtime.runtime.licensing.watch import watch_licence
from carbonforge_runtime.runtime.planning.command import LaunchPlan
from carbonforge_runtime.runtime.planning.emulate import EmulateOptions, check_slowdown, emulation_report
from carbonforge_runtime.runtime.planning.plan import (
    ServeOptions,
    ServePlan,
    build_plan,
    command_line,
    describe_plan,
    model_source,
)
from carbonforge_runtime.runtime.process.exit_report import log_tail
from carbonforge_runtime.runtime.process.startup_phases import repo_cache_folder
from carbonforge_runtime.runtime.process.supervisor import GroupHooks
from carbonforge_runtime.runtime.serve import address as serve_address
from carbonforge_runtime.runtime.serve.api_key import check_keys_file, read_api_key
from carbonforge_runtime.runtime.weights.hub_cache import hub_cache_dir
from carbonforge_runtime.runtime.weights.lock import (
    NO_LOCK,
    LockCheck,
    WeightsMismatch,
    fetch_command,
    mismatch_error,
)
from carbonforge_runtime.settings import Settings

if TYPE_CHECKING:
    from carbonforge_runtime.runtime.process.supervisor import StopFlag

__all__ = ["Prepared", "ServeOptions", "describe_prepared", "load_all_recipes", "prepare", "serve"]


@dataclass
class Prepared:
    """A plan with the verdicts of the licence and hardware checks."""

    serve_plan: ServePlan
    verdicts: Verdicts
    #: The cached weights against the lock fetch wrote (None: built-in, local or not in the cache).
    weights_lock: LockCheck | None = None

    @property
    def plan(self) -> LaunchPlan:
        return self.serve_plan.launch

    @property
    def trace(self) -> TraceConfig | None:
        return self.serve_plan.trace

    @property
    def hardware_problems(self) -> list[str]:
        return self.verdicts.hardware_problems

    @property
    def snapshot(self) -> GpuSnapshot | None:
        return self.verdicts.snapshot

    @property
    def licence(self) -> Any:
        return self.verdicts.licence


def load_all_recipes(settings: Settings) -> dict[str, Recipe]:
    return load_recipes(recipe_dirs(settings.recipes_dir))


def emulate_options(options: ServeOptions, recipes: Mapping[str, Recipe]) -> EmulateOptions | None:
    """``--emulate``'s step-time model (``--cost-model``, else the shipped one of the recipe's GPU and
    tensor-parallel size) and slowdown; None without --emulate. Reads the model's file."""
    if not options.emulate or not options.context_key:
        return None  # build_plan refuses what is missing, with the fix
    model = resolve(options.context_key, recipes).step_model(options.cost_model)
    return EmulateOptions(model, check_slowdown(options.emulate_slowdown))


def _log_messages(plan: ServePlan) -> None:
    logger = cflog.get_logger()
    for message in plan.messages:
        if message.level == "banner":
            logger.warning("\n%s", cflog.banner(message.text.split("\n")))
        elif message.level == "warning":
            logger.warning(message.text)
        else:
            logger.info(message.text)


def prepare(options: ServeOptions, settings: Settings, environ: Mapping[str, str], gpu: GpuBackend,
            now: float | None = None) -> Prepared:
    """The plan (step 1) and the licence and hardware checks (step 2 without the pre-flight). Starts nothing.

    A refusal raises, except in a dry run: that one records it in the verdicts, so that the whole plan
    is still shown with what a launch would do and the fix."""
    recipes = load_all_recipes(settings)
    emulate = emulate_options(options, recipes)
    source = model_source(options, recipes)
    present = weights_on_host(source.model, source.revision, source.builtin, environ) if source else None
    plan = build_plan(options, settings, recipes, environ, weights_present=present, api_key=read_api_key(settings),
                      keys_file=check_keys_file(settings), emulate=emulate)
    _log_messages(plan)
    refusals: list[CarbonForgeError] = []
    try:
        licence = check_licence(plan, recipes, settings, now=time.time() if now is None else now)
    except LicenseError as exc:
        if not options.dry_run:
            raise
        licence = None
        refusals.append(exc)
    problems, snapshot = check_hardware(plan.recipe, gpu, strict=False)
    # A host of a multi-host group refuses a mismatch whatever the flags: on other GPUs it would stall
    # or break the whole group. A host alone serves anyway unless --strict-hardware.
    group = plan.launch.group
    if problems and (options.strict_hardware or group is not None) and plan.recipe is not None:
        refusal = hardware_refusal(plan.recipe, problems, group)
        if not options.dry_run:
            raise refusal
        refusals.append(refusal)
    if group is not None:  # a group's watch port admits only hosts that prove the group secret
        try:
            read_group_secret(settings)
        except CarbonForgeError as exc:
            if not options.dry_run:
                raise
            refusals.append(exc)
    lock = weights_lock_on_host(source.model, source.revision, source.builtin, environ) if present and source else None
    weights_refusal = check_weights_lock(lock, plan, cflog.get_logger())
    if weights_refusal is not None:
        if not options.dry_run:
            raise weights_refusal
        refusals.append(weights_refusal)
    return Prepared(plan, Verdicts(licence=licence, hardware_problems=problems, snapshot=snapshot,
                                   refusals=refusals), lock)


def check_weights_lock(check: LockCheck | None, plan: ServePlan, logger: logging.Logger) -> WeightsMismatch | None:
    """The cached weights against their lock, a stat per file, before anything starts: the refusal
    naming the first file that changed; weights without a lock get one warning and are served."""
    if check is None:
        return None
    what = plan.recipe.key_text if plan.recipe else check.repo + (f"@{check.revision}" if check.revision else "")
    if check.status == NO_LOCK:
        logger.warning("weights of %s at %s have no lock (they were not put there by `carbonforge-runtime fetch`): "
                       "served without verification; run `%s` to verify them against the hub and record one",
                       check.repo, check.commit[:12], fetch_command(what))
        return None
    if not check.ok:
        return mismatch_error(check, fetch_command(what))
    logger.info("weights of %s at commit %s match their lock (%d files, sizes and times; `doctor --deep` "
                "compares every sha256)", check.repo, check.commit, check.files)
    return None


def describe_prepared(prepared: Prepared, options: ServeOptions, environ: Mapping[str, str]) -> str:
    """The dry run's output: the plan, the verdicts, and the vLLM command the launch would run."""
    lines = describe_plan(prepared.serve_plan, options, environ)
    lines += prepared.verdicts.describe()
    lines += ["vLLM command:", "  " + command_line(prepared.serve_plan)]
    return "\n".join(lines)


def create_trace_file(path: str, private: bool) -> bool:
    """Create ``path`` (and its directory) before the engine starts; at the full level make it
    readable by its owner only. Returns True when an existing file's mode was tightened. A symbolic
    link at ``path`` is refused (:class:`~carbonforge_runtime.files.SymlinkRefused`), never followed."""
    directory = os.path.dirname(path) or "."
    os.makedirs(directory, exist_ok=True)
    fd = files.open_append(path, 0o600 if private else 0o644)
    try:
        if private and stat.S_IMODE(os.fstat(fd).st_mode) != 0o600:
            os.fchmod(fd, 0o600)
            return True
        return False
    finally:
        os.close(fd)


def _create_before_launch(path: str, what: str, flag: str, private: bool = False) -> bool:
    """Create the file ``path`` that the engine will append to (see :func:`create_trace_file`), or
    refuse the launch with the fix (``what`` names it, ``flag`` is the option that set it)."""
    try:
        return create_trace_file(path, private=private)
    except files.SymlinkRefused as exc:
        raise exc.as_error() from None
    except OSError as exc:
        raise CarbonForgeError(
            f"cannot create the {what} {path} ({exc.strerror or exc})",
            f"give {flag} a path in a writable directory (e.g. on the /var/log/carbonforge volume)",
        ) from None


def _create_trace_file(trace: TraceConfig | None) -> None:
    """Create the JSONL file before the engine starts (owner-only at the full level); with data
    parallel, the file of each rank this host runs is created by that rank's engine core, so only
    its directory is made and checked here."""
    if trace is None or not trace.file:
        return
    if trace.data_parallel_size > 1:
        directory = os.path.dirname(trace.file) or "."
        try:
            files.probe_writable(directory)
        except OSError as exc:
            raise CarbonForgeError(
                f"cannot create the trace files of the data-parallel ranks in {directory} ({exc.strerror or exc})",
                "give --trace-file a path in a writable directory (e.g. on the /var/log/carbonforge volume)",
            ) from None
        return
    if _create_before_launch(trace.file, "trace file", "--trace-file", private=trace.full):
        cflog.get_logger().warning("trace file %s existed with a wider mode: now readable by its owner only",
                                   trace.file)


def _create_step_log(contract: EngineContract | None) -> None:
    """Create the step log's file (and its directory) before the engine starts, so that a path that
    cannot be written stops the launch here instead of costing every step's line."""
    if contract is None or contract.step_log is None:
        return
    _create_before_launch(contract.step_log.file, "step log", "--step-log")


def _log_dir(settings: Settings) -> Path:
    path = settings.log_dir
    try:
        files.probe_writable(path)
    except OSError as exc:
        raise CarbonForgeError(
            f"log directory {path} is not writable ({exc.strerror})",
            "mount a writable volume at /var/log/carbonforge, or set CF_LOG_DIR to a writable directory",
        ) from None
    return path


def _record_serve_address(log_dir: Path, host: str, port: int) -> None:
    """Tell the image's healthcheck where the API will answer (a failure only costs the probe's aim)."""
    try:
        serve_address.write(log_dir, host, port)
    except OSError as exc:
        cflog.get_logger().warning("cannot write %s (%s): the image healthcheck falls back to CF_PORT",
                                   log_dir / serve_address.FILE_NAME, exc.strerror or exc)


def serve(options: ServeOptions, settings: Settings, environ: Mapping[str, str], gpu: GpuBackend) -> int:
    from carbonforge_runtime.runtime.process import supervisor

    stop = supervisor.StopFlag()
    stop.install()  # from here on a SIGTERM is handled, even during preparation
    # The runtime's own log also goes to runtime.log beside vllm.log once the launch goes ahead
    # (a dry run or a refused launch writes no file).
    runtime_log = cflog.RuntimeLogFile()
    try:
        return _serve(options, settings, environ, gpu, stop, runtime_log)
    finally:
        runtime_log.close()


def _hardware_outcome(options: ServeOptions, in_group: bool = False) -> list[str]:
    """What the hardware-mismatch banner says happens next."""
    if options.dry_run and in_group:
        return ["Dry run: a host of a multi-host group refuses to start on other GPUs, so a launch would",
                "not start (with or without --strict-hardware)."]
    if options.dry_run and options.strict_hardware:
        return ["Dry run: with --strict-hardware a launch would refuse to start on this host."]
    if options.dry_run:
        return ["Dry run: a launch would serve anyway, and the recipe's performance and energy figures would",
                "not apply to this host. Pass --strict-hardware to make it refuse to start instead."]
    return ["Serving anyway: the recipe's performance and energy figures do not apply to this host.",
            "Pass --strict-hardware to refuse to start instead."]


def _serve(options: ServeOptions, settings: Settings, environ: Mapping[str, str], gpu: GpuBackend,
           stop: StopFlag, runtime_log: cflog.RuntimeLogFile) -> int:
    from carbonforge_runtime.runtime.process import supervisor

    logger = cflog.get_logger()
    prepared = prepare(options, settings, environ, gpu)
    plan = prepared.plan
    if prepared.hardware_problems and plan.recipe:
        lines = [f"HARDWARE MISMATCH for {plan.recipe.key_text}", *prepared.hardware_problems,
                 *_hardware_outcome(options, plan.group is not None)]
        logger.warning("\n%s", cflog.banner(lines))
    if not options.skip_preflight:
        # Prints WARN/FAIL lines; raises on a FAIL unless this is a dry run.
        prepared.verdicts.preflight = preflight(prepared.serve_plan, options, settings, environ, gpu,
                                                prepared.snapshot)
        prepared.verdicts.preflight_ran = True
    if options.dry_run:
        print(describe_prepared(prepared, options, environ))
        return prepared.verdicts.exit_code  # 0, or the code the refused launch would exit with

    if stop.set:  # a stop signal while the launch was prepared: start nothing
        logger.info("stop signal received during preparation: vLLM is not started")
        return 0
    log_dir = _log_dir(settings)
    try:
        runtime_log.open(log_dir)
    except files.SymlinkRefused as exc:
        raise exc.as_error() from None
    except OSError as exc:
        raise CarbonForgeError(
            f"cannot write {log_dir / cflog.RUNTIME_LOG_NAME} ({exc.strerror or exc})",
            "make the log directory writable (the /var/log/carbonforge volume, or CF_LOG_DIR)",
        ) from None
    _create_trace_file(prepared.trace)
    _create_step_log(plan.contract)
    if plan.serves_api:  # a headless worker serves no API for the healthcheck to probe
        _record_serve_address(log_dir, plan.host, plan.port)
    # A premium serve's licence is re-checked every minute (refused here when the clock was set back past expiry).
    licence_watch = watch_licence(prepared.licence, log_dir, logger)
    if plan.recipe and plan.recipe.model.builtin:
        from carbonforge_runtime.runtime.weights.tiny_model import ensure_tiny_model

        logger.info("preparing the built-in model %s in %s", plan.recipe.model.builtin, plan.model)
        ensure_tiny_model(Path(plan.model))
    from carbonforge_runtime.runtime.serve.observability import Observability, start_observability

    observe: Observability | None = None
    group: GroupHooks | None = None
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

    try:  # from the first thing started on, the finally below stops whatever was started
        # Metrics, GPU monitor and energy controller (None when the run needs none of them).
        observe = start_observability(prepared, options, settings, environ, logger, stop)
        contract = observe.engine_contract(plan.contract) if observe is not None else plan.contract
        engine_env = plan.engine_env(contract)
        if licence_watch is not None:  # the API server refuses new requests once this file exists
            engine_env[LICENCE_EXPIRED_VARIABLE] = str(licence_watch.expired_file)
        group = _watch_group(plan.group, settings, log_dir, engine_env, logger)
        if observe is not None and group is not None:
            observe.watch_group(group.hosts_lost)
        engine = supervisor.EngineProcess(plan.argv, engine_env, log_dir / "vllm.log")
        what = f"{plan.recipe.key_text} (recipe {plan.recipe.source})" if plan.recipe else f"override ({plan.model})"
        logger.info("starting vLLM for %s; engine log: %s", what, engine.log_path)
        if licence_watch is not None:  # checks every minute until the finally below
            licence_watch.start()
        report = supervisor.supervise(
            engine,
            # A headless worker of a group has no API: nothing to wait for, it serves through the leader.
            ready_url=f"http://{ready_host}:{plan.port}/health" if plan.serves_api else None,
            api_port=plan.port,
            download_folder=repo_cache_folder(plan.model, hub_cache_dir(engine_env)[0]),
            ready_timeout_s=settings.ready_timeout_s,
            drain_timeout_s=plan.drain_timeout_s,
            log=logger,
            on_ready=on_ready,
            stop=stop,
            group=group,
        )
        if contract is not None and contract.emulation is not None:  # the paced engine's verdict, here too
            for level, line in emulation_report(log_tail(engine.log_path, 200)):
                (logger.warning if level == "warning" else logger.info)(line)
    finally:  # every way out (stop signal, engine death, exception) puts the GPUs back as found
        if group is not None:  # the leader tells its workers to stop; a worker leaves the group
            group.close()
        if observe is not None:
            observe.close()
        if licence_watch is not None:
            licence_watch.close()
    return report.exit_code


#: The file whose presence makes the leader's /health answer 503 (in the log directory).
GROUP_DOWN_FILE = "group-down"


def _watch_group(group: Group | None, settings: Settings, log_dir: Path, engine_env: dict[str, str],
                 logger: logging.Logger) -> GroupHooks | None:
    """Start watching the other hosts of the group (nothing for a host alone)."""
    if group is None:
        return None
    from carbonforge_runtime.runtime.group import watch as group_watch

    secret = read_group_secret(settings)
    if not group.leader:
        watch = group_watch.WorkerWatch(group.rank, group.nnodes, group.master_addr, group.watch_port,
                                        group.join_timeout_s, secret=secret, on_join=logger.info).start()
        logger.info("group: watching the leader %s:%d", group.master_addr, group.watch_port)
        return group_watch.WorkerHooks(watch)
    # The port listens where the workers are told to connect, not on every interface.
    host, why = group_watch.listen_address(group.master_addr, settings.host)
    if why:
        logger.warning("group: %s: the watch port listens on CF_HOST (%s) instead", why, host)
    try:
        leader = group_watch.LeaderWatch(group.nnodes, group.watch_port, group.join_timeout_s, secret=secret,
                                         host=host, on_join=logger.info, log=logger.warning).start()
    except OSError as exc:
        raise CarbonForgeError(
            f"the group's watch port {group.watch_port} cannot be opened ({exc.strerror or exc})",
            "free the port, or set CF_GROUP_PORT to a free port on every host of the group",
        ) from None
    down = log_dir / GROUP_DOWN_FILE
    with contextlib.suppress(FileNotFoundError):
        down.unlink()  # left by an earlier run
    engine_env[GROUP_DOWN_VARIABLE] = str(down)
    logger.info("group: watching %d worker(s) on %s port %d", group.nnodes - 1, leader.host, group.watch_port)
    return group_watch.LeaderHooks(leader, down)
