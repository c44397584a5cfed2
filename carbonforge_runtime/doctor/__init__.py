"""The doctor: host checks that give a verdict and name the fix.

Three layers, so that every rule can be tested without the machine it describes:

* :mod:`.facts` reads the host (GPU backend, files, sockets, packages, licence) into plain data;
* :mod:`.checks` turns those facts into OK / WARN / FAIL verdicts, each WARN and FAIL with a remedy;
* :mod:`.report` prints them as text or JSON.

:func:`run_doctor` is the ``doctor`` command (and the bare launch); :func:`preflight` runs the quick
subset before every serve.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, TextIO

from carbonforge_runtime.doctor.checks import run_checks
from carbonforge_runtime.doctor.facts import (
    DOCTOR,
    PREFLIGHT,
    DoctorFacts,
    DoctorRequest,
    Probes,
    SystemProbes,
    collect_facts,
    tolerant_settings,
)
from carbonforge_runtime.doctor.model import FAIL, OK, WARN, Check, exit_code, verdict
from carbonforge_runtime.doctor.report import REMEDY_PREFIX, check_line, render_json, render_text
from carbonforge_runtime.errors import CarbonForgeError
from carbonforge_runtime.gpu import GpuBackend
from carbonforge_runtime.settings import Settings

if TYPE_CHECKING:
    from carbonforge_runtime.serve import Prepared, ServeOptions

PREFLIGHT_PREFIX = "pre-flight: "


class PreflightFailed(CarbonForgeError):
    """A pre-flight check failed: the launch would fail, so it does not start."""

    exit_code = 1


def diagnose(
    request: DoctorRequest,
    environ: Mapping[str, str],
    gpu: GpuBackend,
    *,
    probes: Probes | None = None,
    now: float | None = None,
) -> list[Check]:
    """Every check for ``request``; invalid variables are reported as checks, not raised."""
    settings, problems = tolerant_settings(environ)
    facts = collect_facts(request, settings, environ, gpu, probes=probes, now=now, setting_problems=problems)
    return run_checks(facts)


def run_doctor(
    request: DoctorRequest,
    environ: Mapping[str, str],
    gpu: GpuBackend,
    *,
    json_output: bool = False,
    probes: Probes | None = None,
    now: float | None = None,
) -> tuple[str, int]:
    """The report (text or JSON) and the exit code: 0 for OK and WARN, 1 for FAIL."""
    checks = diagnose(request, environ, gpu, probes=probes, now=now)
    key = request.context_key or (environ.get("CF_CONTEXT_KEY", "").strip() or None)
    text = render_json(checks, key) if json_output else render_text(checks)
    return text, exit_code(checks)


def preflight(
    prepared: Prepared,
    options: ServeOptions,
    settings: Settings,
    environ: Mapping[str, str],
    gpu: GpuBackend,
    *,
    probes: Probes | None = None,
    out: TextIO | None = None,
) -> list[Check]:
    """The quick checks before a launch. Prints only WARN and FAIL lines (to stderr); raises
    :class:`PreflightFailed` on a FAIL unless this is a dry run (which starts nothing)."""
    request = DoctorRequest(
        mode=PREFLIGHT,
        metrics=options.metrics,
        trace_file=options.trace_file,
        trace_endpoint=options.trace_endpoint,
    )
    facts = collect_facts(request, settings, environ, gpu, probes=probes, plan=prepared.plan,
                          snapshot=prepared.snapshot)
    problems = [check for check in run_checks(facts) if check.status != OK]
    stream = out if out is not None else sys.stderr
    for check in problems:
        print(PREFLIGHT_PREFIX + check_line(check), file=stream)
        print(" " * len(PREFLIGHT_PREFIX) + REMEDY_PREFIX.lstrip() + check.remedy, file=stream)
    failures = [check for check in problems if check.status == FAIL]
    if failures and not options.dry_run:
        first = failures[0].detail
        more = f" (and {len(failures) - 1} more)" if len(failures) > 1 else ""
        raise PreflightFailed(
            f"pre-flight check failed: {first}{more}",
            "fix the FAIL line(s) above (`carbonforge-runtime doctor` explains every check), "
            "or pass --skip-preflight to launch anyway",
        )
    return problems


__all__ = [
    "DOCTOR",
    "FAIL",
    "OK",
    "PREFLIGHT",
    "WARN",
    "Check",
    "DoctorFacts",
    "DoctorRequest",
    "PreflightFailed",
    "Probes",
    "SystemProbes",
    "collect_facts",
    "diagnose",
    "exit_code",
    "preflight",
    "render_json",
    "render_text",
    "run_checks",
    "run_doctor",
    "verdict",
]
