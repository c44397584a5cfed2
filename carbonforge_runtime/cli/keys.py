"""``carbonforge-runtime keys ...``: named API keys for the keys file (``CF_API_KEYS_FILE``)."""

from __future__ import annotations

import typer

from carbonforge_runtime.cli.errors import run_guarded
from carbonforge_runtime.core.api_keys import KEYS_FILE_VARIABLE, MODELS_READ, SCOPES, entry_yaml, new_secret

keys_app = typer.Typer(help="Make named API keys for the keys file (CF_API_KEYS_FILE).", no_args_is_help=True)

NEW_EPILOG = (f"The secret is printed once, to stdout, and stored nowhere: hand it to the key's holder. The "
              f"entry holds only its SHA-256; add it under `keys:` in the file {KEYS_FILE_VARIABLE} names. The "
              "API server re-reads the file within seconds, no restart needed.")


def new_key_text(name: str, scopes: list[str], rpm: int | None, max_in_flight: int | None, priority: int | None,
                 share: float | None, expires: str | None) -> str:
    """What ``keys new`` prints: the secret, then the entry to add (checked as the file is)."""
    secret = new_secret()
    entry = entry_yaml(name, secret, scopes, requests_per_minute=rpm, max_in_flight=max_in_flight,
                       priority=priority, share=share, expires=expires)
    indented = "".join("  " + line + "\n" for line in entry.splitlines())
    return (f"secret (shown once; give it to the key's holder, keep it out of files and logs):\n{secret}\n\n"
            f"entry to add under `keys:` in {KEYS_FILE_VARIABLE} (the secret's SHA-256 only):\n{indented}")


@keys_app.command("new", epilog=NEW_EPILOG)
def new_command(
    name: str = typer.Argument(..., help="The key's name: its tenant in traces, metrics and the scheduler"),
    scope: list[str] = typer.Option(None, "--scope", help=f"A scope ({', '.join(SCOPES)}); repeat for more "
                                    "(default: both)"),
    rpm: int | None = typer.Option(None, "--rpm", help="Requests per minute (default: no limit)"),
    max_in_flight: int | None = typer.Option(None, "--max-in-flight", help="Requests in flight at once "
                                             "(default: no limit)"),
    priority: int | None = typer.Option(None, "--priority", help="Priority class: higher is served sooner "
                                        "(default 0)"),
    share: float | None = typer.Option(None, "--share", help="Fair share, a weight above 0 (default 1.0)"),
    expires: str | None = typer.Option(None, "--expires", help="Expiry, an ISO date or time (UTC when no zone), "
                                       "e.g. 2027-01-01 or 2027-01-01T12:00:00Z"),
) -> None:
    """Print a fresh secret (once) and the keys-file entry that holds its hash."""
    scopes = list(scope) if scope else [MODELS_READ, *[s for s in SCOPES if s != MODELS_READ]]
    text = run_guarded(lambda: new_key_text(name, scopes, rpm, max_in_flight, priority, share, expires))
    typer.echo(text, nl=False)
