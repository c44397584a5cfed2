"""Secrets on command lines and in URLs: kept off vLLM's argv where the engine can read them from its
environment instead, and redacted wherever the runtime prints a command or an endpoint. Pure.

A secret on a command line is visible to every user of the host (``ps``, ``/proc/<pid>/cmdline``)
and lands in logs; vLLM reads the same values from its environment, which only the process owner
can read.
"""

from __future__ import annotations

from collections.abc import Sequence

REDACTED = "<redacted>"
#: vLLM flags whose value is a secret -> the variable vLLM reads the same value from.
SECRET_FLAGS = {"--api-key": "VLLM_API_KEY", "--hf-token": "HF_TOKEN"}


def _split(arg: str) -> tuple[str, str | None]:
    name, sep, value = arg.partition("=")
    return (name, value) if sep else (arg, None)


def secrets_to_env(args: Sequence[str]) -> tuple[list[str], dict[str, str], list[str]]:
    """(``args`` without the single-valued secret flags, the variables that carry them instead, notes)."""
    out: list[str] = []
    env: dict[str, str] = {}
    notes: list[str] = []
    i = 0
    while i < len(args):
        name, inline = _split(args[i])
        variable = SECRET_FLAGS.get(name)
        if variable is None:
            out.append(args[i])
            i += 1
            continue
        values = [inline] if inline is not None else []
        j = i + 1
        if inline is None:
            while j < len(args) and not args[j].startswith("-"):
                values.append(args[j])
                j += 1
        if len(values) == 1:
            env[variable] = values[0]
            notes.append(f"{name} is passed to vLLM as {variable}, not on its command line (set {variable} "
                         "in the environment to keep it out of the runtime's own command line too)")
        else:  # a bare flag, or several values: vLLM must see them as given
            out.extend(args[i:j])
        i = j
    return out, env, notes


def redact_args(args: Sequence[str]) -> list[str]:
    """``args`` with every value of a secret flag, and every URL's credentials, replaced for display."""
    out: list[str] = []
    hide_next = False
    for arg in args:
        name, inline = _split(arg)
        if hide_next and not arg.startswith("-"):
            out.append(REDACTED)
            continue
        hide_next = False
        if name in SECRET_FLAGS:
            if inline is not None:
                out.append(f"{name}={REDACTED}")
            else:
                out.append(arg)
                hide_next = True
            continue
        out.append(redact_url(arg) if "://" in arg else arg)
    return out


def redact_url(url: str) -> str:
    """``scheme://user:token@host/...`` -> ``scheme://<redacted>@host/...``; other text unchanged."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    authority_end = len(rest)
    for stop in "/?#":
        found = rest.find(stop)
        if found >= 0:
            authority_end = min(authority_end, found)
    authority = rest[:authority_end]
    if "@" not in authority:
        return url
    host = authority.rsplit("@", 1)[1]
    return f"{scheme}://{REDACTED}@{host}{rest[authority_end:]}"
