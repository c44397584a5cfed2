"""The API key clients must send: from CF_API_KEY, or read from the file CF_API_KEY_FILE names; and
the keys file of named keys, CF_API_KEYS_FILE, checked before anything starts."""

from __future__ import annotations

import os

from carbonforge_runtime import files
from carbonforge_runtime.core.api_keys import load_keys
from carbonforge_runtime.errors import UsageError
from carbonforge_runtime.settings import Settings

#: A key is a line of text; a file far larger is the wrong file.
MAX_KEY_FILE_BYTES = 4096


def read_api_key(settings: Settings) -> str | None:
    """The key, or None when the API is to stay open. CF_API_KEY wins over the file."""
    if settings.api_key:
        return settings.api_key
    path = settings.api_key_file
    if not path:
        return None
    fix = "point CF_API_KEY_FILE at a readable file holding the key on one line (or set CF_API_KEY)"
    try:  # a FIFO without a writer must not hang the start-up: refused at once
        raw = files.read_regular(path, MAX_KEY_FILE_BYTES)
    except files.NotRegularFile as exc:
        raise UsageError(f"CF_API_KEY_FILE={path}: is {exc.strerror}", fix) from None
    except OSError as exc:
        raise UsageError(f"CF_API_KEY_FILE={path}: cannot be read ({exc.strerror})", fix) from None
    if len(raw) > MAX_KEY_FILE_BYTES:
        raise UsageError(f"CF_API_KEY_FILE={path}: over {MAX_KEY_FILE_BYTES} bytes is too large for a key", fix)
    try:
        key = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise UsageError(f"CF_API_KEY_FILE={path}: is not UTF-8 text", fix) from None
    if not key or any(ch.isspace() for ch in key):
        raise UsageError(f"CF_API_KEY_FILE={path}: holds no key, or a key with spaces in it", fix)
    return key


def check_keys_file(settings: Settings) -> str | None:
    """The absolute path of CF_API_KEYS_FILE once it reads as a valid keys file (None: not set); the
    API server reads it again, and whenever it changes. An unusable file stops the start-up with the
    entry, the line and the fix (:class:`~carbonforge_runtime.core.api_keys.KeysFileError`)."""
    path = settings.api_keys_file
    if not path:
        return None
    path = os.path.abspath(os.path.expanduser(path))
    load_keys(path)
    return path
