"""The doctor on the no-phone-home promise: reporting switches and hub access for weights already present."""

from __future__ import annotations

from carbonforge_runtime.gpu.fake import FakeGpuBackend, host
from carbonforge_runtime.runtime.doctor import OK, PREFLIGHT, WARN, Check, DoctorRequest, diagnose
from carbonforge_runtime.runtime.doctor.fake import FIXED_NOW, FixedProbes
from carbonforge_runtime.runtime.doctor.report import render_text

L4_KEY = "qwen2.5-0.5b:fp8:chat:l4x1"
CPU_KEY = "cf-tiny:bf16:chat:cpu"
CACHE = "/models/hub"
CACHED = FixedProbes(weights_in={CACHE: f"{CACHE}/models--Qwen--Qwen2.5-0.5B-Instruct/snapshots/abc"})


def run(env: dict[str, str], key: str | None = L4_KEY, probes: FixedProbes | None = None,
        mode: str = "doctor") -> list[Check]:
    environ = {"HOME": "/home/cf", "HUGGINGFACE_HUB_CACHE": CACHE, **env}
    return diagnose(DoctorRequest(mode=mode, context_key=key), environ, FakeGpuBackend(host("l4")),
                    probes=probes or FixedProbes(), now=FIXED_NOW)


def named(checks: list[Check], name: str) -> list[Check]:
    return [c for c in checks if c.name == name]


def test_a_clean_environment_reports_no_usage_reporting() -> None:
    [check] = named(run({}), "engine.telemetry")
    assert check.status == OK
    assert check.detail == ("no usage reporting: the engine runs with VLLM_NO_USAGE_STATS=1, VLLM_DO_NOT_TRACK=1, "
                            "DO_NOT_TRACK=1")


def test_a_switch_that_asks_for_reporting_warns_and_says_the_runtime_overrides_it() -> None:
    checks = run({"VLLM_NO_USAGE_STATS": "0", "DO_NOT_TRACK": "0", "VLLM_DO_NOT_TRACK": "1"})
    [check] = named(checks, "engine.telemetry")
    assert check.status == WARN
    assert check.detail.startswith("VLLM_NO_USAGE_STATS=0, DO_NOT_TRACK=0 would turn vLLM's usage reporting on")
    assert "the runtime overrides it" in check.detail
    assert check.remedy.startswith("unset VLLM_NO_USAGE_STATS and DO_NOT_TRACK")
    text = render_text(checks)
    assert "  WARN  VLLM_NO_USAGE_STATS=0" in text and "        fix: unset VLLM_NO_USAGE_STATS" in text


def test_online_by_choice_although_the_weights_are_cached_warns() -> None:
    [check] = named(run({"HF_HUB_OFFLINE": "0"}, probes=CACHED), "storage.offline")
    assert check.status == WARN
    assert "HF_HUB_OFFLINE=0 lets the engine contact the Hugging Face Hub" in check.detail
    assert "Qwen/Qwen2.5-0.5B-Instruct" in check.detail and "keeps that value" in check.detail
    assert check.remedy.startswith("unset HF_HUB_OFFLINE")
    [alias] = named(run({"TRANSFORMERS_OFFLINE": "false"}, probes=CACHED), "storage.offline")
    assert alias.status == WARN and alias.remedy.startswith("unset TRANSFORMERS_OFFLINE")


def test_cached_weights_without_a_choice_are_served_offline_by_the_runtime() -> None:
    [check] = named(run({}, probes=CACHED), "storage.offline")
    assert check.status == OK and "HF_HUB_OFFLINE=1 by the runtime" in check.detail
    [builtin] = named(run({}, key=CPU_KEY), "storage.offline")
    assert builtin.status == OK and "tiny-chat without contacting a hub" in builtin.detail


def test_modelscope_with_cached_weights_warns() -> None:
    [check] = named(run({"VLLM_USE_MODELSCOPE": "true"}, probes=CACHED), "storage.offline")
    assert check.status == WARN and "ModelScope" in check.detail and check.remedy == "unset VLLM_USE_MODELSCOPE"


def test_no_offline_verdict_when_the_weights_must_be_downloaded() -> None:
    assert named(run({"HF_HUB_OFFLINE": "0"}), "storage.offline") == []
    assert named(run({}, key=None), "storage.offline") == []


def test_the_preflight_leaves_both_to_the_launch_which_logs_them() -> None:
    checks = run({"VLLM_NO_USAGE_STATS": "0", "HF_HUB_OFFLINE": "0"}, probes=CACHED, mode=PREFLIGHT)
    assert named(checks, "engine.telemetry") == [] and named(checks, "storage.offline") == []
