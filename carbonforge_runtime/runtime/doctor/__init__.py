"""The doctor: host checks that give a verdict and name the fix.

Three layers, so that every rule can be tested without the machine it describes:

* :mod:`.collect` reads the host into the plain data of :mod:`.facts`, asking the probes of
  :mod:`.probes` (files, sockets, packages, licence) and a GPU backend; :mod:`.fake` holds fixed probes;
* :mod:`.checks` turns those facts into OK / WARN / FAIL verdicts, each WARN and FAIL with a remedy;
* :mod:`.report` prints them as text or JSON.

:func:`run_doctor` is the ``doctor`` command (and the bare launch). Serving runs the quick subset
for its plan as its pre-flight (:func:`carbonforge_runtime.runtime.doctor.preflight.preflight`).
"""

from __future__ import annotations

from collections.abc import Mapping

from carbonforge_runtime.gpu.types import GpuBackend
from carbonforge_runtime.runtime.doctor.checks import run_checks
from carbonforge_runtime.runtime.doctor.collect import collect_facts, tolerant_settings
from carbonforge_runtime.runtime.doctor.facts import DOCTOR, PREFLIGHT, DoctorFacts, DoctorRequest, Probes
from carbonforge_runtime.runtime.doctor.model import FAIL, OK, WARN, Check, exit_code, verdict
from carbonforge_runtime.runtime.doctor.probes import SystemProbes
from carbonforge_runtime.runtime.doctor.report import render_json, render_text


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


__all__ = [
    "DOCTOR",
    "FAIL",
    "OK",
    "PREFLIGHT",
    "WARN",
    "Check",
    "DoctorFacts",
    "DoctorRequest",
    "Probes",
    "SystemProbes",
    "collect_facts",
    "diagnose",
    "exit_code",
    "render_json",
    "render_text",
    "run_checks",
    "run_doctor",
    "verdict",
]
