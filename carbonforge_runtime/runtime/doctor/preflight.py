"""Step 2 of serving: the checks over a plan, before anything starts.

Three checks, in this order, each reading the host only as far as it must:

* the licence gate (a premium recipe or model needs a licence that entitles it);
* the hardware match (the GPUs against the key's hardware segment; ``--strict-hardware`` refuses, and
  so does a host of a multi-host group, whose mismatch would stall or break the whole group);
* the pre-flight, the doctor's quick subset for this plan (ports, directories, the engine install),
  which refuses the launch on a FAIL unless the run is a dry run.

A refusal raises the check's own error (exit codes as documented); what passes is returned as
:class:`Verdicts`, which the dry run prints and the launch acts on.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TextIO

from carbonforge_runtime.errors import CarbonForgeError, HardwareMismatchError, LicenseError
from carbonforge_runtime.gpu.types import GpuBackend, GpuSnapshot
from carbonforge_runtime.recipes import Recipe
from carbonforge_runtime.recipes.hardware import hardware_mismatches
from carbonforge_runtime.runtime.doctor import (
    FAIL,
    OK,
    PREFLIGHT,
    Check,
    DoctorRequest,
    Probes,
    collect_facts,
    run_checks,
)
from carbonforge_runtime.runtime.doctor.report import REMEDY_PREFIX, check_line
from carbonforge_runtime.runtime.group.placement import Group, hardware_remedy
from carbonforge_runtime.runtime.licensing.core import format_time
from carbonforge_runtime.runtime.licensing.gate import gate_draft_models, gate_override, gate_recipe
from carbonforge_runtime.runtime.planning.command import engine_args
from carbonforge_runtime.runtime.planning.plan import ServeOptions, ServePlan
from carbonforge_runtime.settings import Settings

PREFLIGHT_PREFIX = "pre-flight: "


class GroupHardwareMismatch(HardwareMismatchError):
    """A host of a multi-host group does not have the GPUs of the recipe's host split: refused with or
    without --strict-hardware (same exit code)."""


class PreflightFailed(CarbonForgeError):
    """A pre-flight check failed: the launch would fail, so it does not start."""

    exit_code = 1


@dataclass
class Verdicts:
    #: The verified licence claims when a premium recipe or model was granted (for the metrics).
    licence: Any = None
    hardware_problems: list[str] = field(default_factory=list)
    snapshot: GpuSnapshot | None = None
    #: The pre-flight's WARN and FAIL checks (empty when it was skipped or found nothing).
    preflight: list[Check] = field(default_factory=list)
    preflight_ran: bool = False
    #: What a launch would be refused for (licence, --strict-hardware). Only a dry run gets this far
    #: with a refusal: it reports them and exits with the first one's code.
    refusals: list[CarbonForgeError] = field(default_factory=list)

    def describe(self) -> list[str]:
        """The verdicts' part of the dry run."""
        licence_refusal = next((exc for exc in self.refusals if isinstance(exc, LicenseError)), None)
        if licence_refusal is not None:
            out = [f"licence:            REFUSED: {licence_refusal.message}",
                   f"                    fix: {licence_refusal.remedy}"]
        elif self.licence is None:
            out = ["licence:            not needed (free plan)"]
        else:
            out = [f"licence:            granted: {self.licence.licence_id} for {self.licence.licensee}, "
                   f"expires {format_time(self.licence.expires_at)}"]
        out += [f"hardware mismatch:  {line}" for line in self.hardware_problems]
        for exc in self.refusals:
            if isinstance(exc, HardwareMismatchError):
                why = "a host of a multi-host group" if isinstance(exc, GroupHardwareMismatch) else "--strict-hardware"
                out += [f"hardware:           REFUSED ({why}): a launch would not start",
                        f"                    fix: {exc.remedy}"]
            elif not isinstance(exc, LicenseError):  # e.g. a group without its secret
                out += [f"refused:            {exc.message}", f"                    fix: {exc.remedy}"]
        if self.preflight_ran:
            out.append(f"pre-flight:         {_preflight_summary(self.preflight)}")
        if self.refusals:
            out.append(f"verdict:            a launch would be refused (exit {self.exit_code}); nothing would start")
        return out

    @property
    def exit_code(self) -> int:
        """The exit status a launch would end with now: the first refusal's, else 0."""
        return self.refusals[0].exit_code if self.refusals else 0


def _preflight_summary(problems: list[Check]) -> str:
    if not problems:
        return "OK"
    fails = sum(1 for check in problems if check.status == FAIL)
    return f"{fails} FAIL, {len(problems) - fails} WARN (listed above)"


def check_licence(plan: ServePlan, recipes: Mapping[str, Recipe], settings: Settings, now: float) -> Any:
    """The licence gate for the plan: the granted claims, ``None`` for free, or a raised refusal."""
    if plan.recipe is not None:
        claims = gate_recipe(plan.recipe, settings, now=now)
        # A draft model named in the recipe's or the extra flags is served too: gated like a model.
        return claims or gate_draft_models(engine_args(plan.launch.argv), recipes, settings, now=now)
    assert plan.override_model is not None
    return gate_override(plan.override_model, plan.override_args, recipes, settings, now=now)


def check_fetch_licence(recipe: Recipe | None, model: str, recipes: Mapping[str, Recipe], settings: Settings,
                        now: float) -> Any:
    """The same gate for weights about to be fetched (``carbonforge-runtime fetch``): a premium recipe,
    or a model that belongs to one, needs a licence that entitles it; raises the refusal."""
    if recipe is not None:
        return gate_recipe(recipe, settings, now=now)
    return gate_override(model, [model], recipes, settings, now=now)


def check_hardware(recipe: Recipe | None, gpu: GpuBackend, strict: bool) -> tuple[list[str], GpuSnapshot | None]:
    """The key's hardware segment against the GPUs (nothing to do for a CPU key or an override)."""
    if recipe is None or recipe.key.hardware.is_cpu:
        return [], None
    snapshot = gpu.snapshot()
    problems = hardware_mismatches(recipe.key.hardware, snapshot)
    if problems and strict:
        raise hardware_refusal(recipe, problems)
    return problems, snapshot


def hardware_refusal(recipe: Recipe, problems: list[str], group: Group | None = None) -> HardwareMismatchError:
    """The refusal for these mismatches: a host of a group is refused whatever the flags say (each host
    runs the same share of the model, so one host on other GPUs stalls or breaks the whole group, or
    leaves the others idle); a host alone only with --strict-hardware."""
    if group is not None:
        return GroupHardwareMismatch(
            f"this host ({group.role}, rank {group.rank} of {group.nnodes} hosts) does not have the GPUs of "
            f"{recipe.key.hardware}: " + "; ".join(problems),
            hardware_remedy(recipe),
        )
    return HardwareMismatchError(
        f"the detected hardware does not match {recipe.key.hardware}: " + "; ".join(problems),
        "serve a key whose hardware segment matches this host (`carbonforge-runtime recipes list`), "
        "or drop --strict-hardware to serve anyway",
    )


def preflight(
    plan: ServePlan,
    options: ServeOptions,
    settings: Settings,
    environ: Mapping[str, str],
    gpu: GpuBackend,
    snapshot: GpuSnapshot | None = None,
    *,
    probes: Probes | None = None,
    out: TextIO | None = None,
) -> list[Check]:
    """The doctor's quick checks for this plan. Prints only WARN and FAIL lines (to stderr); raises
    :class:`PreflightFailed` on a FAIL unless this is a dry run (which starts nothing)."""
    request = DoctorRequest(
        mode=PREFLIGHT,
        metrics=options.metrics,
        trace_file=options.trace_file,
        trace_endpoint=options.trace_endpoint,
        request_trace=options.request_trace,
    )
    facts = collect_facts(request, settings, environ, gpu, probes=probes, plan=plan.launch, snapshot=snapshot)
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
