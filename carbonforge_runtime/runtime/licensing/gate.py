"""The premium gate, called by every serving mode before anything starts.

Premium status comes from the shipped recipes (those inside the package) only: a model that any shipped
premium recipe serves is premium in every mode and under every recipe, and a local recipe
(``CF_RECIPES_DIR``) can tune its knobs but never make it free. A model matches a shipped premium model by
name (any spelling, hub id or local path, see :func:`model_matches`) or, for a model on local disk, by the
shape its config.json declares (:mod:`carbonforge_runtime.runtime.licensing.premium`).

What a licence covers: ``*`` covers everything; ``model=ORG/NAME`` covers that model; a context-key pattern
covers the models of the *shipped* premium recipes whose keys it matches. So:

* recipe mode, a shipped premium recipe: the licence must match its key (or name its model, or be ``*``);
* recipe mode, a local recipe serving a premium model (under any key, with any plan): the licence must
  cover that model through one of the shipped premium recipes that serve it;
* override mode and ``fetch --model``: the same, for the model vLLM would serve
  (see :mod:`carbonforge_runtime.runtime.vllm_cli.served_model`);
* a local recipe that declares ``plan: premium`` for a model no shipped recipe makes premium is the
  operator's own gate: the licence must match that recipe's key or model.

Either way a refusal is a :class:`LicenseInvalid` (exit code 4) raised before vLLM is started.

A speculative-decoding draft model is served too, so it is gated like the main model in both modes:
vLLM 0.32 takes it from ``--speculative-config``/``-sc`` (JSON with a ``model`` key), the dotted
``--speculative-config.model X``, ``--spec-model X``, or the same keys of a ``--config`` file.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from carbonforge_runtime import log as cflog
from carbonforge_runtime.errors import LicenseError, UsageError
from carbonforge_runtime.recipes.loader import load_recipes, shipped_recipes_dir
from carbonforge_runtime.recipes.model import Recipe
from carbonforge_runtime.runtime.licensing import keys as key_table
from carbonforge_runtime.runtime.licensing.core import (
    PLAN_PREMIUM,
    LicenseClaims,
    LicenseInvalid,
    entitles,
    format_time,
    verify,
)
from carbonforge_runtime.runtime.licensing.source import ENV_VAR, LicenseSource, license_file, read_license
from carbonforge_runtime.runtime.vllm_cli.args import normalise
from carbonforge_runtime.runtime.vllm_cli.served_model import (
    CONFIG_FLAG,
    model_choices,
    model_matches,
    normalise_model_id,
    read_config_file,
    resolve_model,
)
from carbonforge_runtime.settings import Settings

NO_LICENSE = "no license key provided"


def _remedy_provide(settings: Settings) -> str:
    return (f"pass the licence key in {ENV_VAR}, or mount the licence file at {license_file(settings)} "
            "(CF_LICENSE_FILE); free-plan recipes need no licence (`carbonforge-runtime recipes list`)")


def licensed_claims(subject: str, settings: Settings, now: float,
                    keys: Callable[[], Mapping[str, bytes]] | None = None) -> tuple[LicenseClaims, LicenseSource]:
    """Read and verify the licence for ``subject`` (a phrase naming what needs it)."""
    logger = cflog.get_logger()
    source = read_license(settings)
    if source.text is None:
        if source.problem and source.origin and not os.path.lexists(source.origin):
            raise LicenseInvalid("missing", f"{subject}: {NO_LICENSE}: the licence file {source.origin} "
                                 f"{source.problem}", _remedy_provide(settings))
        if source.problem:
            raise LicenseInvalid(
                "unreadable",
                f"{subject}: {NO_LICENSE}: the licence file {source.origin} cannot be used: {source.problem}",
                f"make the file readable by the runtime's user on the host (owner and mode, e.g. chmod 600 "
                f"and chown to that uid), or pass the key in {ENV_VAR} instead",
            )
        raise LicenseInvalid("missing", f"{subject}: {NO_LICENSE}", _remedy_provide(settings))
    logger.info("licence: using %s", source.describe())
    table = (keys or key_table.public_keys)()
    try:
        claims = verify(source.text, table, now)
    except LicenseInvalid as exc:
        where = ENV_VAR if source.origin == ENV_VAR else f"the licence file {source.origin}"
        raise LicenseInvalid(exc.reason, f"{subject}: the licence key in {where} was refused: {exc.message}",
                             exc.remedy) from None
    return claims, source


def _covered(claims: LicenseClaims) -> str:
    return ", ".join(claims.entitlements)


def _log_granted(claims: LicenseClaims, what: str, now: float) -> None:
    cflog.get_logger().info(
        "licence %s for %s entitles %s (premium plan, expires %s, %.0f days left)",
        claims.licence_id, claims.licensee, what, format_time(claims.expires_at), claims.days_left(now),
    )


@functools.lru_cache(maxsize=1)
def shipped_recipes() -> tuple[Recipe, ...]:
    """The recipes inside the package (never ``CF_RECIPES_DIR``): the only source of premium status."""
    return tuple(recipe for _, recipe in sorted(load_recipes([shipped_recipes_dir()]).items()))


def _is_shipped(recipe: Recipe, shipped: Sequence[Recipe]) -> bool:
    return any(recipe == candidate and recipe.source == candidate.source for candidate in shipped)


def premium_owners(model: str, recipes: Mapping[str, Recipe], shipped: Sequence[Recipe] | None = None) -> list[Recipe]:
    """The premium recipes whose entitlement covers serving ``model`` (any spelling, hub id or local path).

    The shipped premium recipes serving it, when there are any (``recipes`` cannot change that); else
    the recipes of ``recipes`` that declare ``plan: premium`` for it (a local recipe may ask for a
    licence for its own model, never waive one)."""
    from carbonforge_runtime.runtime.licensing.premium import shape_matches

    table = shipped_recipes() if shipped is None else shipped
    owners = [recipe for recipe in table if recipe.is_premium and model_matches(model, recipe.model.repo)]
    if not owners:
        owners = [recipe for recipe in table if recipe.is_premium and shape_matches(model, recipe.model.repo)]
    if owners:
        return owners
    return [recipe for _, recipe in sorted(recipes.items())
            if recipe.is_premium and model_matches(model, recipe.model.repo)]


def recipe_owners(recipe: Recipe, shipped: Sequence[Recipe] | None = None) -> list[Recipe]:
    """The recipes a licence must entitle for ``recipe`` to be served; empty when it is free.

    A shipped premium recipe: itself. Any other recipe: the shipped premium recipes that serve its
    model, else itself when it declares ``plan: premium``."""
    table = shipped_recipes() if shipped is None else shipped
    if recipe.is_premium and _is_shipped(recipe, table):
        return [recipe]
    return premium_owners(recipe.model.repo, {recipe.key_text: recipe}, table)


def entitled_owners(claims: LicenseClaims, owners: Sequence[Recipe]) -> list[Recipe]:
    """The owners the licence entitles (by ``*``, the owner's model, or a pattern matching its key)."""
    return [owner for owner in owners if entitles(claims, owner.key_text, owner.model.repo)]


def gate_recipe(recipe: Recipe, settings: Settings, now: float,
                keys: Callable[[], Mapping[str, bytes]] | None = None,
                shipped: Sequence[Recipe] | None = None) -> LicenseClaims | None:
    """None for a free recipe; the licence claims for an entitled premium recipe; LicenseInvalid otherwise."""
    owners = recipe_owners(recipe, shipped)
    if not owners:
        return None
    if owners == [recipe]:
        subject = f"{recipe.key_text} is a {PLAN_PREMIUM}-plan recipe"
        wanted = recipe.key_text
    else:
        listed = ", ".join(owner.key_text for owner in owners)
        waived = " (a local recipe cannot make it free)" if not recipe.is_premium else ""
        subject = (f"{recipe.key_text} ({recipe.source}) serves {recipe.model.repo!r}, the model of "
                   f"{PLAN_PREMIUM}-plan recipe(s) {listed}{waived}")
        wanted = f"{owners[0].key_text} (or model={owners[0].model.repo})"
    claims, _ = licensed_claims(subject, settings, now, keys)
    entitled = entitled_owners(claims, owners)
    if not entitled:
        raise LicenseInvalid(
            "not-entitled",
            f"{subject}: licence {claims.licence_id} ({claims.licensee}) is not entitled to {wanted} "
            f"(it covers: {_covered(claims)})",
            f"serve a recipe the licence covers, or ask CarbonForge for a licence that includes {wanted}",
        )
    through = "" if entitled == [recipe] else f" (through {entitled[0].key_text})"
    _log_granted(claims, f"{recipe.key_text}{through}", now)
    return claims


def gate_override(model: str, args: Sequence[str], recipes: Mapping[str, Recipe], settings: Settings,
                  now: float, keys: Callable[[], Mapping[str, bytes]] | None = None) -> LicenseClaims | None:
    """The override mode's gate. ``model`` is what :func:`resolve_model` found in ``args``; it is
    resolved again here so that a caller cannot pass a different one."""
    served = resolve_model(args).model
    if normalise_model_id(served) != normalise_model_id(model):
        raise LicenseInvalid("malformed", f"the model to gate ({model!r}) is not the one the arguments serve "
                             f"({served!r})", "name the model exactly once")
    claims = _gate_model(served, "model", recipes, settings, now, keys)
    drafts = gate_draft_models(args, recipes, settings, now, keys)
    return claims or drafts


def _gate_model(served: str, role: str, recipes: Mapping[str, Recipe], settings: Settings, now: float,
                keys: Callable[[], Mapping[str, bytes]] | None) -> LicenseClaims | None:
    """None when ``served`` belongs to no premium recipe; else the claims of a licence entitling one of them."""
    owners = premium_owners(served, recipes)
    if not owners:
        return None
    listed = ", ".join(recipe.key_text for recipe in owners)
    subject = f"{role} {served!r} belongs to {PLAN_PREMIUM}-plan recipe(s) {listed}"
    claims, _ = licensed_claims(subject, settings, now, keys)
    entitled = entitled_owners(claims, owners)
    if not entitled:
        raise LicenseInvalid(
            "not-entitled",
            f"{subject}: licence {claims.licence_id} ({claims.licensee}) is not entitled to it "
            f"(it covers: {_covered(claims)})",
            "serve a model the licence covers, or ask CarbonForge for a licence that includes "
            f"{owners[0].key_text}",
        )
    _log_granted(claims, f"{served} (through {entitled[0].key_text})", now)
    return claims


SPEC_CONFIG_FLAG = "--speculative-config"
SPEC_CONFIG_SHORT = "-sc"
SPEC_MODEL_FLAG = "--spec-model"
CANNOT_GATE_DRAFT = "could not determine which draft model to gate"


def _refuse_draft(message: str, remedy: str) -> LicenseError:
    return LicenseError(f"{CANNOT_GATE_DRAFT}: {message}", remedy)


def _draft_in_json(text: str) -> str | None:
    """The ``model`` of a --speculative-config value (JSON, or empty/None for no config)."""
    if text in ("", "None"):
        return None
    try:
        config = json.loads(text)
    except ValueError:
        return None  # vLLM refuses a value that is not JSON, so nothing is served from it
    model = config.get("model") if isinstance(config, dict) else None
    return model if isinstance(model, str) else None


def _dotted_value(text: str) -> str:
    """A dotted field's value as vLLM reads it: JSON when it parses, else the text itself."""
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, str) else text


def _drafts_in_config(path: str, read: Callable[[str], Any]) -> list[str]:
    try:
        config = read(path)
    except Exception as exc:
        raise _refuse_draft(f"the --config file {path!r} cannot be read ({exc})",
                            "make the config file readable, or name the models on the command line") from None
    found: list[str] = []
    for key, value in (config.items() if isinstance(config, dict) else ()):
        name = str(key).replace("_", "-")
        if name == SPEC_CONFIG_FLAG[2:]:
            model = value.get("model") if isinstance(value, dict) else _draft_in_json(str(value))
            if isinstance(model, str):
                found.append(model)
        elif name == SPEC_MODEL_FLAG[2:] and value is not None:
            found.append(str(value))
    return found


def draft_models(args: Sequence[str], read: Callable[[str], Any] = read_config_file) -> list[str]:
    """Every model the vLLM arguments name as a speculative-decoding draft model, in every form vLLM
    0.32 accepts. An abbreviation of one of those flags (argparse would accept it) is refused rather
    than guessed."""
    found: list[str] = []
    args = list(args)
    for i, arg in enumerate(args):
        if arg == CONFIG_FLAG and i + 1 < len(args):
            found += _drafts_in_config(args[i + 1], read)
            continue
        if not arg.startswith("-"):
            continue
        head, sep, inline = arg.partition("=")
        base, dot, field_path = head.partition(".")
        base = normalise(base)
        if not base.startswith("--") and base.startswith(SPEC_CONFIG_SHORT) and base != SPEC_CONFIG_SHORT:
            raise _refuse_draft(f"{arg!r} joins a value to {SPEC_CONFIG_SHORT}",
                                f"write {SPEC_CONFIG_SHORT} JSON or {SPEC_CONFIG_FLAG} JSON as two arguments")
        following = args[i + 1] if i + 1 < len(args) else None
        value = inline if sep else following
        if base in (SPEC_CONFIG_FLAG, SPEC_CONFIG_SHORT):
            if value is None:
                continue
            if not dot:
                model = _draft_in_json(value)
            elif field_path == "model":
                model = _dotted_value(value)
            else:
                model = None
            if model is not None:
                found.append(model)
        elif base == SPEC_MODEL_FLAG and not dot:
            if value is not None and (sep or not value.startswith("-")):
                found.append(value)
        elif len(base) > 3 and any(full.startswith(base) for full in (SPEC_CONFIG_FLAG, SPEC_MODEL_FLAG)) \
                and base not in ("--spec-method", "--spec-tokens"):
            raise _refuse_draft(f"{head!r} abbreviates a speculative-decoding flag",
                                f"write {SPEC_CONFIG_FLAG} or {SPEC_MODEL_FLAG} in full")
    return found


def gate_draft_models(args: Sequence[str], recipes: Mapping[str, Recipe], settings: Settings, now: float,
                      keys: Callable[[], Mapping[str, bytes]] | None = None) -> LicenseClaims | None:
    """Gate every speculative draft model ``args`` name like a main model: a premium one needs a
    licence entitling one of its recipes. Returns the claims used, if any."""
    granted = None
    for draft in dict.fromkeys(draft_models(args)):
        granted = _gate_model(draft, "speculative draft model", recipes, settings, now, keys) or granted
    return granted


def check_recipe_args(recipe: Recipe, planned_model: str, engine_args: Sequence[str]) -> None:
    """In recipe mode, extra vLLM flags (after -- or CF_VLLM_EXTRA_ARGS) must not change the model."""
    remedy = ("drop --model/--config from the extra arguments (after -- or in CF_VLLM_EXTRA_ARGS); to serve "
              "another model use the override mode (carbonforge-runtime -- MODEL ...)")
    try:
        choices = model_choices(engine_args)
    except LicenseError as exc:
        raise UsageError(f"the extra vLLM arguments for {recipe.key_text} make the served model unclear: "
                         f"{exc.message}", remedy) from None
    others = [choice.model for choice in choices if choice.model != planned_model]
    if others or not choices:
        raise UsageError(
            f"the extra vLLM arguments replace the model of {recipe.key_text} ({planned_model}) with "
            f"{others[0] if others else 'none'!r}",
            remedy,
        )
