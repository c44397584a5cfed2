"""The group secret: what every host of a multi-host group shares, so that the leader's watch port
admits only the group's own runtimes. From CF_GROUP_SECRET, or read from the file
CF_GROUP_SECRET_FILE names (a mounted Kubernetes Secret); never from the command line, never logged."""

from __future__ import annotations

from carbonforge_runtime import files
from carbonforge_runtime.errors import UsageError
from carbonforge_runtime.settings import Settings

#: A secret is a line of text; a file far larger is the wrong file.
MAX_SECRET_FILE_BYTES = 4096
#: Shorter secrets could be guessed from one overheard join (an offline search over its HMAC).
MIN_SECRET_CHARS = 16

MAKE_ONE = ("put the same random secret on every host of the group, in a file named by CF_GROUP_SECRET_FILE "
            "(e.g. `head -c 32 /dev/urandom | base64 > group.secret`; on Kubernetes a Secret mounted as a file)")


def read_group_secret(settings: Settings) -> bytes:
    """The secret, as bytes. Raises :class:`UsageError` naming the fix when none is given or it is unusable:
    a group of more than one host does not start without one."""
    if settings.group_secret is not None:
        return _checked(settings.group_secret, "CF_GROUP_SECRET")
    path = settings.group_secret_file
    if not path:
        raise UsageError("a group of more than one host needs a group secret, and none is set", MAKE_ONE)
    fix = "point CF_GROUP_SECRET_FILE at a readable file holding the group's secret on one line"
    try:  # a FIFO without a writer must not hang the start-up: refused at once
        raw = files.read_regular(path, MAX_SECRET_FILE_BYTES)
    except files.NotRegularFile as exc:
        raise UsageError(f"CF_GROUP_SECRET_FILE={path}: is {exc.strerror}", fix) from None
    except OSError as exc:
        raise UsageError(f"CF_GROUP_SECRET_FILE={path}: cannot be read ({exc.strerror})", fix) from None
    if len(raw) > MAX_SECRET_FILE_BYTES:
        raise UsageError(f"CF_GROUP_SECRET_FILE={path}: over {MAX_SECRET_FILE_BYTES} bytes is too large for a "
                         "secret", fix)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise UsageError(f"CF_GROUP_SECRET_FILE={path}: is not UTF-8 text", fix) from None
    return _checked(text, f"CF_GROUP_SECRET_FILE={path}")


def _checked(text: str, where: str) -> bytes:
    secret = text.strip()
    if len(secret) < MIN_SECRET_CHARS:
        raise UsageError(f"{where}: the group secret is shorter than {MIN_SECRET_CHARS} characters", MAKE_ONE)
    return secret.encode("utf-8")
