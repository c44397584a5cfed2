"""``carbonforge-runtime license ...``: what licence this runtime would use, and whether it holds."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping

import typer

from carbonforge_runtime.errors import CarbonForgeError
from carbonforge_runtime.runtime.licensing import keys as key_table
from carbonforge_runtime.runtime.licensing.core import (
    LicenseClaims,
    LicenseInvalid,
    decode_unverified,
    format_time,
    verify,
)
from carbonforge_runtime.runtime.licensing.source import missing_file_remedy, read_license
from carbonforge_runtime.settings import load_settings

license_app = typer.Typer(help="Show the licence this runtime uses and whether it is valid.",
                          no_args_is_help=True)

EXIT_INVALID = LicenseInvalid.exit_code


def _claim_lines(data: Mapping[str, object], now: float) -> list[tuple[str, str]]:
    def when(name: str) -> str:
        value = data.get(name)
        return format_time(float(value)) if isinstance(value, int) and not isinstance(value, bool) else repr(value)

    rows = [
        ("licence id", str(data.get("licence_id"))),
        ("licensee", str(data.get("licensee"))),
        ("plan", str(data.get("plan"))),
        ("issued", when("issued_at")),
        ("valid from", when("not_before")),
        ("expires", when("expires_at")),
    ]
    expires = data.get("expires_at")
    if isinstance(expires, int) and not isinstance(expires, bool):
        days = (expires - now) / 86400.0
        rows[-1] = ("expires", f"{when('expires_at')} ({days:.0f} days left)" if days >= 0
                    else f"{when('expires_at')} ({-days:.0f} days ago)")
    entitlements = data.get("entitlements")
    shown = ", ".join(str(e) for e in entitlements) if isinstance(entitlements, list) else repr(entitlements)
    rows += [("signing key", str(data.get("key_id"))), ("entitlements", shown)]
    return rows


def show_license(environ: Mapping[str, str], now: float,
                 keys: Callable[[], Mapping[str, bytes]] = key_table.public_keys) -> tuple[str, str, int]:
    """(stdout text, stderr text, exit code) of ``license show``. Never prints the key itself."""
    try:
        settings = load_settings(environ)
    except CarbonForgeError as exc:
        return "", exc.render(), exc.exit_code
    source = read_license(settings)
    out = [f"source:        {source.describe()}"]
    if source.text is None:
        if source.missing:
            out.append(f"status:        MISSING: {source.problem}")
            err = (f"error: no license key provided: the licence file {source.origin} {source.problem}\n"
                   f"  fix: {missing_file_remedy(source.origin or '')}")
        elif source.problem:
            out.append(f"status:        UNREADABLE: {source.problem}")
            err = (f"error: no license key provided: the licence file {source.origin} cannot be used: "
                   f"{source.problem}\n  fix: make the file readable by the runtime's user (owner and mode), "
                   "or pass the key in CARBONFORGE_LICENSE_KEY instead")
        else:
            out.append("status:        NONE (free-plan recipes only)")
            err = ("error: no license key provided\n  fix: pass the key in CARBONFORGE_LICENSE_KEY or mount the "
                   f"licence file at {settings.license_file}")
        return "\n".join(out), err, EXIT_INVALID
    try:
        claims: LicenseClaims = verify(source.text, keys(), now)
    except LicenseInvalid as exc:
        out.append(f"status:        INVALID ({exc.reason}): {exc.message}")
        data = decode_unverified(source.text)
        if data is not None:
            out.append("claims as written (NOT verified):")
            out += [f"  {name + ':':<15}{value}" for name, value in _claim_lines(data, now)]
        return "\n".join(out), exc.render(), EXIT_INVALID
    out.append("status:        valid")
    out += [f"{name + ':':<15}{value}" for name, value in _claim_lines(claims.to_json(), now)]
    return "\n".join(out), "", 0


@license_app.command("show")
def show() -> None:
    """Where the licence comes from, its claims and days left. Exit 4 when missing or invalid."""
    text, err, code = show_license(os.environ, time.time())
    typer.echo(text)
    if err:
        typer.echo(err, err=True)
    raise typer.Exit(code)
