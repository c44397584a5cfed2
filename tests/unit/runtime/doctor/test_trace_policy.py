"""The doctor's trace policy line (``tracing.retention``): the level, where trace files go and how long
they are kept, and a WARN before full-level files, which hold prompts and answers, are kept forever."""

from __future__ import annotations

import io
from pathlib import Path

from typer.testing import CliRunner

from carbonforge_runtime.cli import main as cli
from carbonforge_runtime.gpu.fake import FakeGpuBackend, host
from carbonforge_runtime.runtime.doctor import FAIL, OK, WARN, Check, DoctorRequest, diagnose
from carbonforge_runtime.runtime.doctor.checks import RETENTION_REMEDY
from carbonforge_runtime.runtime.doctor.fake import FIXED_NOW, FixedProbes
from carbonforge_runtime.runtime.doctor.preflight import preflight
from carbonforge_runtime.runtime.serve.launch import ServeOptions, prepare
from carbonforge_runtime.settings import load_settings

CPU_KEY = "cf-tiny:bf16:chat:cpu"


def policy(env: dict[str, str] | None = None, **request: object) -> Check:
    checks = diagnose(DoctorRequest(**request), {"HOME": "/home/cf", **(env or {})},  # type: ignore[arg-type]
                      FakeGpuBackend(host("l4")), probes=FixedProbes(), now=FIXED_NOW)
    [check] = [c for c in checks if c.name == "tracing.retention"]
    return check


def test_full_level_files_kept_forever_are_a_warning_with_the_fix() -> None:
    check = policy(request_trace="full", trace_file="/var/log/carbonforge/traces.jsonl")
    assert check.status == WARN
    assert check.detail == ("trace level full, trace file /var/log/carbonforge/traces.jsonl: full-level trace files "
                            "hold every prompt and answer and are kept forever (CF_TRACE_RETENTION unset)")
    assert check.remedy == RETENTION_REMEDY and "CF_TRACE_RETENTION=7d" in check.remedy
    assert policy(request_trace="FULL").status == WARN  # no file named yet: serve's file would be kept forever


def test_the_retention_is_reported_with_its_rotation() -> None:
    check = policy({"CF_TRACE_RETENTION": "7d"}, request_trace="full", trace_file="/logs/traces.jsonl")
    assert check.status == OK
    assert check.detail == ("trace level full, trace file /logs/traces.jsonl; trace files rotate hourly and each "
                            "segment is deleted 7d after its newest record (CF_TRACE_RETENTION=7d)")
    assert "rotate daily" in policy({"CF_TRACE_RETENTION": "30d"}).detail
    assert "rotate every minute" in policy({"CF_TRACE_RETENTION": "30m"}).detail


def test_standard_and_unset_levels_are_information() -> None:
    check = policy(request_trace="standard", trace_file="/logs/t.jsonl")
    assert (check.status, check.detail) == (OK, "trace level standard, trace file /logs/t.jsonl; trace files are "
                                                "kept forever (CF_TRACE_RETENTION unset)")
    check = policy()
    assert check.status == OK and check.detail.startswith("trace level not given (serve's default is off; pass "
                                                          "--request-trace LEVEL to check one), no trace file")


def test_a_bad_retention_or_level_is_named_with_its_fix() -> None:
    checks = diagnose(DoctorRequest(request_trace="full"), {"CF_TRACE_RETENTION": "7 days"},
                      FakeGpuBackend(host("l4")), probes=FixedProbes(), now=FIXED_NOW)
    settings = next(c for c in checks if c.name == "host.settings")
    assert settings.status == FAIL and "CF_TRACE_RETENTION='7 days' is not a retention" in settings.detail
    check = next(c for c in checks if c.name == "tracing.retention")
    assert check.status == WARN and "CF_TRACE_RETENTION cannot be used" in check.detail
    assert "7d, 12h, 30m" in check.remedy
    bad = policy(request_trace="verbose")
    assert bad.status == WARN and bad.remedy == "use --request-trace off, standard or full"


def test_the_doctor_command_takes_the_level(tmp_path: Path, monkeypatch: object) -> None:
    monkeypatch.setattr(cli, "gpu_backend", lambda: FakeGpuBackend(host(None)))  # type: ignore[attr-defined]
    env = {"HOME": str(tmp_path), "CF_LOG_DIR": str(tmp_path / "logs"), "CF_TRACE_RETENTION": "12h"}
    result = CliRunner().invoke(cli.app, ["doctor", "--request-trace", "full", "--trace-file",
                                          str(tmp_path / "t" / "requests.jsonl")], env=env)
    assert (f"  OK    trace level full, trace file {tmp_path}/t/requests.jsonl; trace files rotate hourly and each "
            "segment is deleted 12h after its newest record (CF_TRACE_RETENTION=12h)") in result.output


def run_preflight(options: ServeOptions, env: dict[str, str]) -> tuple[list[Check], str]:
    settings = load_settings(env)
    backend = FakeGpuBackend(host(None))
    prepared = prepare(options, settings, env, backend)
    out = io.StringIO()
    checks = preflight(prepared.serve_plan, options, settings, env, backend, prepared.snapshot,
                       probes=FixedProbes(), out=out)
    printed = [line for line in out.getvalue().splitlines(keepends=True) if "trace" in line or "CF_TRACE" in line]
    return [c for c in checks if c.section == "Tracing"], "".join(printed)


def test_a_full_level_serve_without_retention_warns_before_the_launch(tmp_path: Path) -> None:
    file = tmp_path / "requests.jsonl"
    options = ServeOptions(context_key=CPU_KEY, request_trace="full", trace_file=str(file), dry_run=True)
    checks, printed = run_preflight(options, {})
    assert [(c.name, c.status) for c in checks] == [("tracing.retention", WARN)]
    assert f"pre-flight: WARN  trace level full, trace file {file}: full-level trace files hold" in printed
    # with a retention, or at the standard level, nothing is printed
    assert run_preflight(options, {"CF_TRACE_RETENTION": "7d"}) == ([], "")
    standard = ServeOptions(context_key=CPU_KEY, request_trace="standard", trace_file=str(file), dry_run=True)
    assert run_preflight(standard, {}) == ([], "")


def test_data_parallel_ranks_are_shown_as_their_pattern(tmp_path: Path) -> None:
    file = tmp_path / "requests.jsonl"
    options = ServeOptions(request_trace="full", trace_file=str(file), dry_run=True,
                           vllm_args=["Qwen/Qwen2.5-0.5B-Instruct", "--data-parallel-size", "2"])
    checks, _ = run_preflight(options, {})
    [check] = checks
    assert f"trace file {tmp_path}/requests.dp<rank>.jsonl" in check.detail
