"""Snapshots of the whole doctor report for a healthy and a broken host, so the format cannot drift unnoticed.

After an intended change of the report, regenerate with:
    CF_UPDATE_SNAPSHOTS=1 .venv/bin/pytest tests/test_doctor_report.py
and review the diff of tests/unit/runtime/doctor/snapshots/.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from carbonforge_runtime.gpu.fake import FakeGpuBackend, device, host, host_of, process
from carbonforge_runtime.gpu.types import GpuSnapshot
from carbonforge_runtime.runtime.doctor import DoctorRequest, diagnose, render_json, render_text
from carbonforge_runtime.runtime.doctor.facts import EngineFacts, LicenseFacts, MountFacts, OtelFacts, PrivilegeFacts
from carbonforge_runtime.runtime.doctor.fake import FIXED_NOW, FixedProbes
from carbonforge_runtime.runtime.engine_env.compile_cache import Mount

SNAPSHOTS = Path(__file__).resolve().parent / "snapshots"

# Recipes owned by this test, so that tuning a shipped recipe does not move these snapshots.
HEALTHY_RECIPE = """\
key: snapshot-0.5b:fp8:chat:l4x1
plan: free
model: {repo: Qwen/Qwen2.5-0.5B-Instruct}
hardware: {family: l4, count: 1}
vllm: {quantization: fp8, max_model_len: 8192, gpu_memory_utilization: 0.9, tensor_parallel_size: 1}
"""
BROKEN_RECIPE = """\
key: snapshot-80b:fp8:chat:h100x2
plan: premium
model: {repo: Qwen/Qwen3-Next-80B-A3B-Instruct-FP8}
hardware: {family: h100, count: 2}
vllm: {max_model_len: 65536, gpu_memory_utilization: 0.9, tensor_parallel_size: 2}
controller: {policy: power-cap}
"""


def report(tmp_path: Path, key: str, snapshot: GpuSnapshot, probes: FixedProbes, env: dict[str, str],
           **request: object) -> tuple[str, str]:
    recipes = tmp_path / "recipes"
    recipes.mkdir()
    (recipes / "healthy.yaml").write_text(HEALTHY_RECIPE)
    (recipes / "broken.yaml").write_text(BROKEN_RECIPE)
    environ = {"HOME": "/home/cf", "CF_RECIPES_DIR": str(recipes), **env}
    checks = diagnose(DoctorRequest(context_key=key, **request), environ, FakeGpuBackend(snapshot),  # type: ignore[arg-type]
                      probes=probes, now=FIXED_NOW)
    # The recipes directory is a temporary path; it is the one variable that differs run to run.
    text = render_text(checks).replace(str(recipes), "<recipes>") + "\n"
    document = render_json(checks, key).replace(str(recipes), "<recipes>") + "\n"
    return text, document


def assert_snapshot(name: str, actual: str) -> None:
    path = SNAPSHOTS / name
    if os.environ.get("CF_UPDATE_SNAPSHOTS") == "1":
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(actual, encoding="utf-8")
    if not path.exists():
        pytest.fail(f"{path} is missing; create it with CF_UPDATE_SNAPSHOTS=1 and review it")
    assert actual == path.read_text(encoding="utf-8"), f"the report differs from {path}"


def test_healthy_host_report(tmp_path: Path) -> None:
    text, _ = report(tmp_path, "snapshot-0.5b:fp8:chat:l4x1", host("l4"), FixedProbes(), {})
    assert text.endswith("doctor: OK\n")
    assert_snapshot("doctor_healthy.txt", text)


def test_broken_host_report(tmp_path: Path) -> None:
    snapshot = host_of(device("a100-40", 0),
                       device("a100-40", 1, processes=(process(31337, "python3", 30_000),)))
    probes = FixedProbes(
        privilege_facts=PrivilegeFacts(1000, False),
        shm=64 * 1024**2,
        license_facts=LicenseFacts("invalid", origin="CARBONFORGE_LICENSE_KEY", reason="bad-signature",
                                   message="the licence signature does not match its contents",
                                   remedy="copy the key again exactly as issued into CARBONFORGE_LICENSE_KEY"),
        otel_facts=OtelFacts(None, False),
        unwritable={"/var/log/carbonforge": "Read-only file system", "/traces": "Permission denied"},
        engine_facts=EngineFacts("vllm", "0.31.1", True),
        busy_ports={8000: "another process is listening on it"},
        # The compile cache on the container's own overlay root, not on a volume.
        mount_facts=MountFacts(True, Mount("/", "overlay", "overlay", "/")),
    )
    env = {"CF_MAX_MODEL_LEN": "32768", "HF_HUB_OFFLINE": "1", "HUGGINGFACE_HUB_CACHE": "/models/hub"}
    text, document = report(tmp_path, "snapshot-80b:fp8:chat:h100x2", snapshot, probes, env,
                            metrics=True, trace_file="/traces/requests.jsonl", request_trace="full")
    assert text.endswith("doctor: FAIL\n")
    assert_snapshot("doctor_broken.txt", text)
    assert_snapshot("doctor_broken.json", document)
