"""Named API keys: the keys file (``CF_API_KEYS_FILE``), the scopes, and what each route needs.

The file is YAML, mounted read-only, and holds no secret: each entry is a key's name (its tenant),
the SHA-256 of its secret, its scopes, and its optional limits, priority class, fair share and
expiry::

    keys:
      - name: team-a
        sha256: 4e3c...   # 64 hex digits: hashlib.sha256(secret.encode()).hexdigest()
        scopes: [models:read, inference:invoke]
        requests_per_minute: 600
        max_in_flight: 8
        priority: 1
        share: 2.0
        expires: 2027-01-01T00:00:00Z

Why a plain SHA-256 and no slow KDF: a secret from :func:`new_secret` carries 256 random bits, so
no dictionary or brute force reaches it however fast the hash is (GitHub's and Stripe's tokens are
checked the same way), and a fast hash keeps the check per request at a microsecond. A person's
password would need a slow KDF; a generated key does not.

:func:`parse_keys` judges the text (every mistake names the entry, its line and the fix);
:func:`load_keys` reads a file first. Both give a :class:`KeySet`, which the API server's middleware
looks keys up in (by the digest of the presented secret) and the runtime's metrics read the names of
(:attr:`KeySet.names`: the only tenants that can reach the engine).

Plain data in, plain data out; :func:`load_keys` reads one regular file.
"""

from __future__ import annotations

import hashlib
import math
import re
import secrets
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, time
from typing import Any

import yaml

from carbonforge_runtime import files
from carbonforge_runtime.core.tenant_labels import RESERVED_TENANT_NAMES
from carbonforge_runtime.errors import UsageError

#: The variable naming the keys file (in the runtime's and the API server's environment).
KEYS_FILE_VARIABLE = "CF_API_KEYS_FILE"
#: The variable the API server reads the SHA-256 (hex) of ``CF_API_KEY`` from when a keys file is
#: also in use: the shortcut key, with every scope and no limit, beside the named keys.
SHORTCUT_DIGEST_VARIABLE = "CF_API_KEY_SHA256"

MODELS_READ = "models:read"
INFERENCE_INVOKE = "inference:invoke"
#: The scopes a key of the file may hold.
SCOPES = (MODELS_READ, INFERENCE_INVOKE)
#: The scope only the ``CF_API_KEY`` shortcut holds: vLLM's routes that act on the whole server
#: (scaling, aborting any request by id, the KV event sources).
OPERATOR = "operator"

WHOAMI_PATH = "/v1/auth/whoami"
#: Routes a ``models:read`` key may call (GET): the model list and the server's description.
MODELS_READ_PATHS = frozenset({"/v1/models", "/version", "/docs", "/docs/oauth2-redirect", "/redoc",
                               "/openapi.json", "/load"})
#: Routes that act on the whole server, not on one request of the caller's own.
OPERATOR_PATHS = frozenset({"/scale_elastic_ep", "/is_scaling_elastic_ep", "/inference/v1/abort_requests",
                            "/kv_event_sources"})

#: The prefix of every secret :func:`new_secret` makes, for secret scanners.
SECRET_PREFIX = "cf-"
#: A name is a metric label and a tenant: letters, digits, ``.``, ``_`` and ``-``, at most 64.
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}\Z")
#: Names the runtime's metrics keep for requests without a named key and for tenants past its cap.
RESERVED_NAMES = RESERVED_TENANT_NAMES
_HEX = re.compile(r"[0-9a-fA-F]{64}\Z")
#: A keys file far larger than this is the wrong file (100,000 entries fit).
MAX_FILE_BYTES = 32 * 1024 * 1024
_FIELDS = ("name", "sha256", "scopes", "requests_per_minute", "max_in_flight", "priority", "share", "expires")
_FIX_HASH = ("store only the hash: `carbonforge-runtime keys new NAME` prints the secret once and the "
             "entry to add")


def required_scope(method: str, route: str) -> str | None:
    """The scope a request needs (``route`` as routed, see :func:`~carbonforge_runtime.core.api_contract.route_path`):
    None for :data:`WHOAMI_PATH` (any valid key), :data:`MODELS_READ` for reading the model list and
    the server's description, :data:`OPERATOR` for the server-wide routes, :data:`INFERENCE_INVOKE`
    for everything else (the routes that reach the engine, and any a later vLLM adds)."""
    if route == WHOAMI_PATH:
        return None
    if method in ("GET", "HEAD") and (route in MODELS_READ_PATHS or route.startswith("/v1/models/")):
        return MODELS_READ
    if route in OPERATOR_PATHS:
        return OPERATOR
    return INFERENCE_INVOKE


@dataclass(frozen=True)
class ApiKey:
    """One key: its name (the tenant; None for the ``CF_API_KEY`` shortcut), the SHA-256 digest of
    its secret, scopes, limits (None: none), priority class, fair share and expiry (UTC, or None)."""

    name: str | None
    digest: bytes
    scopes: frozenset[str]
    requests_per_minute: int | None = None
    max_in_flight: int | None = None
    priority: int = 0
    share: float = 1.0
    expires: datetime | None = None

    def expired(self, now: float) -> bool:
        """Whether the key has expired at ``now`` (seconds since the epoch)."""
        return self.expires is not None and now >= self.expires.timestamp()

    def identity(self) -> dict[str, Any]:
        """What ``GET /v1/auth/whoami`` answers about the key: never the secret, nor its hash."""
        return {
            "object": "api_key",
            "name": self.name,
            "scopes": sorted(self.scopes - {OPERATOR}) + ([OPERATOR] if OPERATOR in self.scopes else []),
            "limits": {"requests_per_minute": self.requests_per_minute, "max_in_flight": self.max_in_flight},
            "priority": self.priority if self.name is not None else None,
            "share": self.share if self.name is not None else None,
            "expires_at": _iso(self.expires) if self.expires is not None else None,
        }


def shortcut_key(digest: bytes) -> ApiKey:
    """The ``CF_API_KEY`` shortcut: no name (no tenant), every scope, no limit, no expiry."""
    return ApiKey(None, digest, frozenset((*SCOPES, OPERATOR)))


@dataclass(frozen=True)
class KeySet:
    """The keys of one reading of the file, by the digest of their secret."""

    by_digest: Mapping[bytes, ApiKey] = field(default_factory=dict)

    @property
    def names(self) -> tuple[str, ...]:
        """The names of the keys, in the file's order: the only tenants a request can carry."""
        return tuple(key.name for key in self.by_digest.values() if key.name is not None)

    def __len__(self) -> int:
        return len(self.by_digest)


def digest_of(secret: str | bytes) -> bytes:
    """The SHA-256 digest a presented secret is looked up by."""
    return hashlib.sha256(secret.encode("utf-8") if isinstance(secret, str) else secret).digest()


def _iso(moment: datetime) -> str:
    return moment.astimezone(UTC).isoformat().replace("+00:00", "Z")


class KeysFileError(UsageError):
    """The keys file cannot be used; the message names the file, the entry and its line."""


def load_keys(path: str) -> KeySet:
    """The keys of the file at ``path``; :class:`KeysFileError` naming the fix when it cannot be read or
    is not a valid keys file."""
    fix = f"point {KEYS_FILE_VARIABLE} at a readable YAML file of keys (see `carbonforge-runtime keys new`)"
    try:
        raw = files.read_regular(path, MAX_FILE_BYTES)
    except files.NotRegularFile as exc:
        raise KeysFileError(f"{KEYS_FILE_VARIABLE}={path}: is {exc.strerror}", fix) from None
    except OSError as exc:
        raise KeysFileError(f"{KEYS_FILE_VARIABLE}={path}: cannot be read ({exc.strerror})", fix) from None
    if len(raw) > MAX_FILE_BYTES:
        raise KeysFileError(f"{KEYS_FILE_VARIABLE}={path}: over {MAX_FILE_BYTES} bytes", fix)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise KeysFileError(f"{KEYS_FILE_VARIABLE}={path}: is not UTF-8 text", fix) from None
    return parse_keys(text, path)


_LOADER: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def parse_keys(text: str, source: str = KEYS_FILE_VARIABLE) -> KeySet:
    """The keys of a keys file's ``text`` (``source`` names it in errors); :class:`KeysFileError` for
    the first mistake, naming its entry and line."""
    try:
        document = yaml.load(text, Loader=_LOADER)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise KeysFileError(f"{source}: is not valid YAML{where}",
                            "fix the YAML syntax (an entry per key under `keys:`)") from None
    shape = "a mapping with a list of entries under `keys:` (`keys: []` for none)"
    if not isinstance(document, dict) or "keys" not in document:
        raise KeysFileError(f"{source}: is not {shape}", f"write the file as {shape}")
    unknown = sorted(str(k) for k in document if k != "keys")
    if unknown:
        raise KeysFileError(f"{source}: unknown top-level field {unknown[0]!r}", "keep only `keys:` at the top")
    entries = document["keys"]
    if entries is None:
        entries = []
    if not isinstance(entries, list):
        raise KeysFileError(f"{source}: `keys` is not a list", f"write the file as {shape}")
    by_digest: dict[bytes, ApiKey] = {}
    names: set[str] = set()
    for index, entry in enumerate(entries):
        try:
            key = _entry(entry)
        except _EntryError as exc:
            raise KeysFileError(f"{source}: {_where(text, index, entry)}: {exc.args[0]}", exc.args[1]) from None
        if key.name in names:
            raise KeysFileError(f"{source}: {_where(text, index, entry)}: the name {key.name!r} is taken by an "
                                "earlier entry", "give every key a name of its own (it is the key's tenant)")
        if key.digest in by_digest:
            raise KeysFileError(f"{source}: {_where(text, index, entry)}: the same sha256 as the entry "
                                f"{by_digest[key.digest].name!r}", "give every key a secret of its own")
        assert key.name is not None
        names.add(key.name)
        by_digest[key.digest] = key
    return KeySet(by_digest)


class _EntryError(Exception):
    """(what is wrong, the fix) about one entry."""


def _where(text: str, index: int, entry: Any) -> str:
    """``entry 3 ('team-a', line 12)``: the entry's position, name and line (found only for the error)."""
    name = entry.get("name") if isinstance(entry, dict) else None
    label = f"entry {index + 1}" + (f" ({name!r}" if isinstance(name, str) else " (")
    line = _entry_line(text, index)
    label += (", " if isinstance(name, str) else "") + (f"line {line})" if line else ")")
    return label.replace(" ()", "")


def _entry_line(text: str, index: int) -> int | None:
    try:
        node = yaml.compose(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    except yaml.YAMLError:
        return None
    if not isinstance(node, yaml.MappingNode):
        return None
    for key_node, value in node.value:
        if key_node.value == "keys" and isinstance(value, yaml.SequenceNode) and index < len(value.value):
            return int(value.value[index].start_mark.line) + 1
    return None


def _whole(entry: Mapping[str, Any], name: str, minimum: int | None) -> int | None:
    value = entry.get(name)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or (minimum is not None and value < minimum):
        raise _EntryError(f"{name}: {value!r} is not a whole number" + (f" >= {minimum}" if minimum else ""),
                          f"set {name} to a whole number" + (f" of at least {minimum}" if minimum else "")
                          + " or leave it out (no limit)" * (minimum is not None))
    return value


def _expiry(value: Any) -> datetime | None:
    if value is None:
        return None
    moment: datetime | None = None
    if isinstance(value, datetime):
        moment = value
    elif isinstance(value, date):
        moment = datetime.combine(value, time())
    elif isinstance(value, str):
        try:
            moment = datetime.fromisoformat(value.strip().replace("Z", "+00:00"))
        except ValueError:
            moment = None
    if moment is None:
        raise _EntryError(f"expires: {value!r} is not a date or time",
                          "write an ISO date or time, e.g. 2027-01-01 or 2027-01-01T00:00:00Z (UTC when no zone)")
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)


def _entry(entry: Any) -> ApiKey:
    if not isinstance(entry, dict):
        raise _EntryError("is not a mapping", "write each key as `- name: ...` with `sha256:` and `scopes:`")
    for name in entry:
        if name not in _FIELDS:
            if name in ("secret", "key", "token", "api_key"):
                raise _EntryError(f"has a field {name!r}: the file must not hold a secret", _FIX_HASH)
            raise _EntryError(f"unknown field {name!r}", f"use only {', '.join(_FIELDS)}")
    name = entry.get("name")
    if not isinstance(name, str) or not NAME_PATTERN.match(name):
        raise _EntryError(f"name: {name!r} is not a key name",
                          "name the key (its tenant) with 1 to 64 letters, digits, '.', '_' or '-', starting "
                          "with a letter or digit")
    if name in RESERVED_NAMES:
        raise _EntryError(f"name: {name!r} is reserved (the metrics' group for requests without a named key, or "
                          "for tenants past their cap)", "choose another name")
    digest = entry.get("sha256")
    if not isinstance(digest, str) or not _HEX.match(digest):
        raise _EntryError("sha256: is not 64 hexadecimal digits", _FIX_HASH)
    scopes = entry.get("scopes")
    if isinstance(scopes, str):
        scopes = [scopes]
    if not isinstance(scopes, list) or not scopes:
        raise _EntryError("scopes: none given", f"list the key's scopes: {', '.join(SCOPES)}")
    for scope in scopes:
        if scope not in SCOPES:
            raise _EntryError(f"scopes: unknown scope {scope!r}", f"use {' and/or '.join(SCOPES)}")
    share = entry.get("share", 1.0)
    if (not isinstance(share, (int, float)) or isinstance(share, bool) or not math.isfinite(share)
            or share <= 0):
        raise _EntryError(f"share: {share!r} is not a positive number",
                          "set share to the key's weight, a number above 0 (1.0 by default)")
    priority = _whole(entry, "priority", None)
    return ApiKey(name=name, digest=bytes.fromhex(digest), scopes=frozenset(scopes),
                  requests_per_minute=_whole(entry, "requests_per_minute", 1),
                  max_in_flight=_whole(entry, "max_in_flight", 1), priority=priority or 0, share=float(share),
                  expires=_expiry(entry.get("expires")))


def new_secret() -> str:
    """A fresh secret: :data:`SECRET_PREFIX` and 256 random bits in URL-safe base64 (43 characters)."""
    return SECRET_PREFIX + secrets.token_urlsafe(32)


def entry_yaml(name: str, secret: str, scopes: Iterable[str], requests_per_minute: int | None = None,
               max_in_flight: int | None = None, priority: int | None = None, share: float | None = None,
               expires: str | None = None) -> str:
    """The keys-file entry for ``secret`` (its hash only), as text to add under ``keys:``; checked by
    :func:`parse_keys` first, so a bad name, scope, limit or expiry raises :class:`KeysFileError`."""
    fields: dict[str, Any] = {"name": name, "sha256": hashlib.sha256(secret.encode("utf-8")).hexdigest(),
                              "scopes": list(dict.fromkeys(scopes))}
    for label, value in (("requests_per_minute", requests_per_minute), ("max_in_flight", max_in_flight),
                         ("priority", priority), ("share", share), ("expires", expires)):
        if value is not None:
            fields[label] = value
    text = yaml.safe_dump([fields], sort_keys=False, default_flow_style=None, width=200)
    try:
        _entry(yaml.safe_load(text)[0])  # as the file will read it
    except _EntryError as exc:
        raise KeysFileError(f"the new key: {exc.args[0]}", exc.args[1]) from None
    return text
