"""The licence format and its offline verification: a pure function of (text, public keys, now).

Format (one line, so it fits in an environment variable)::

    cfl1.<base64url payload>.<base64url signature>

The payload is UTF-8 JSON; the signature is Ed25519 over the exact payload bytes (the bytes the
base64url text decodes to). Base64url is unpadded and must be canonical. ``cryptography`` is
imported only when a signature is checked, so importing this module stays cheap.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from carbonforge_runtime.errors import LicenseError
from carbonforge_runtime.runtime.vllm_cli.served_model import normalise_model_id

PREFIX = "cfl1"
#: Anything longer is refused before any decoding. A real licence is well under 1 KiB.
MAX_LICENSE_CHARS = 4096
#: Longest term the issuing tool accepts and the verifier honours: issued-at to expires-at.
MAX_TERM_DAYS = 400
MAX_TERM_S = MAX_TERM_DAYS * 86400
#: Allowance for a host clock slightly behind the issuer's when checking not-before.
CLOCK_SKEW_S = 300
PLAN_PREMIUM = "premium"
MAX_ENTITLEMENTS = 64
MAX_ENTITLEMENT_CHARS = 200
#: Timestamps are whole Unix seconds in [0, 2**33) (until the year 2242).
_MAX_TIMESTAMP = 2**33

CLAIM_FIELDS = ("licence_id", "licensee", "plan", "issued_at", "not_before", "expires_at", "key_id",
                "entitlements")

_B64URL = re.compile(r"[A-Za-z0-9_-]*")
_PRINTABLE_ASCII = re.compile(r"[!-~]+")  # no spaces, no control characters, nothing beyond ASCII
_WHITESPACE = re.compile(r"\s")
_VERSION = re.compile(r"cfl\d+")

REMEDY_COPY = ("copy the key again exactly as issued (one line starting with 'cfl1.') into "
               "CARBONFORGE_LICENSE_KEY or the licence file")
REMEDY_REISSUE = "ask CarbonForge support for a replacement licence key"


class LicenseInvalid(LicenseError):
    """The licence text was read but is not a valid licence for this use. ``reason`` is a short code:
    malformed, too-large, unknown-key, bad-signature, not-yet-valid, expired, not-entitled
    (and ``missing``/``unreadable`` from the gate when there is no text to verify)."""

    def __init__(self, reason: str, message: str, remedy: str) -> None:
        super().__init__(message, remedy)
        self.reason = reason


@dataclass(frozen=True)
class LicenseClaims:
    licence_id: str
    licensee: str
    plan: str
    issued_at: float
    not_before: float
    expires_at: float
    key_id: str
    entitlements: tuple[str, ...]

    def days_left(self, now: float) -> float:
        return (self.expires_at - now) / 86400.0

    def to_json(self) -> dict[str, Any]:
        """The payload object (timestamps as whole seconds), as the issuing tool writes it."""
        return {
            "licence_id": self.licence_id,
            "licensee": self.licensee,
            "plan": self.plan,
            "issued_at": int(self.issued_at),
            "not_before": int(self.not_before),
            "expires_at": int(self.expires_at),
            "key_id": self.key_id,
            "entitlements": list(self.entitlements),
        }


def format_time(ts: float) -> str:
    """A Unix time as ``YYYY-MM-DD HH:MM UTC`` (for messages)."""
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(ts))


def b64url_encode(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def b64url_decode(text: str) -> bytes:
    """Strict, canonical, unpadded base64url; ValueError otherwise (so every text has one meaning)."""
    if not _B64URL.fullmatch(text) or len(text) % 4 == 1:
        raise ValueError("not base64url")
    try:
        data = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    except (binascii.Error, ValueError):
        raise ValueError("not base64url") from None
    if b64url_encode(data) != text:
        raise ValueError("not canonical base64url")
    return data


def encode_payload(claims: LicenseClaims) -> bytes:
    """The exact bytes the issuing tool signs (compact, sorted JSON)."""
    return json.dumps(claims.to_json(), sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def assemble(payload: bytes, signature: bytes) -> str:
    return f"{PREFIX}.{b64url_encode(payload)}.{b64url_encode(signature)}"


def _malformed(message: str, remedy: str = REMEDY_COPY) -> LicenseInvalid:
    return LicenseInvalid("malformed", message, remedy)


def split_licence(text: object) -> tuple[bytes, bytes]:
    """Format, size and base64 checks; the payload and signature bytes. Raises LicenseInvalid."""
    if not isinstance(text, str):
        raise _malformed(f"the licence key must be text, got {type(text).__name__}")
    if len(text) > MAX_LICENSE_CHARS:
        raise LicenseInvalid(
            "too-large",
            f"the licence key is {len(text)} characters long; a licence key is at most {MAX_LICENSE_CHARS}",
            "check that CARBONFORGE_LICENSE_KEY or the licence file holds only the one-line key you were "
            "issued, nothing else",
        )
    text = text.strip(" \t\r\n\ufeff")
    if not text:
        raise _malformed("the licence key is empty")
    if not _PRINTABLE_ASCII.fullmatch(text):
        raise _malformed("the licence key contains spaces, line breaks or characters that never appear in a key")
    parts = text.split(".")
    if parts[0] != PREFIX:
        if _VERSION.fullmatch(parts[0]) and len(parts) == 3:
            raise LicenseInvalid(
                "malformed",
                f"the licence key has format version {parts[0]!r}, which this runtime does not understand",
                "upgrade the runtime image to a release that reads this licence format",
            )
        raise _malformed(f"this is not a CarbonForge licence key: it must start with '{PREFIX}.'")
    if len(parts) != 3:
        raise _malformed(
            f"the licence key has {len(parts)} dot-separated parts; it must have 3 ({PREFIX}.PAYLOAD.SIGNATURE)"
        )
    try:
        payload = b64url_decode(parts[1])
    except ValueError:
        raise _malformed("the licence payload (between the first and second dot) is not valid base64url") from None
    try:
        signature = b64url_decode(parts[2])
    except ValueError:
        raise _malformed("the licence signature (after the second dot) is not valid base64url") from None
    if not payload:
        raise _malformed("the licence payload is empty")
    if len(signature) != 64:
        raise _malformed(f"the licence signature is {len(signature)} bytes long; an Ed25519 signature is 64")
    return payload, signature


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not allowed")


def _load_json(payload: bytes) -> Any:
    return json.loads(payload.decode("utf-8"), parse_constant=_reject_constant)


def _key_id_hint(payload: bytes) -> str | None:
    """The key id the (not yet authenticated) payload names, if it can be read at all."""
    try:
        data = _load_json(payload)
    except Exception:  # anything unreadable: the signature check decides
        return None
    if isinstance(data, dict) and isinstance(data.get("key_id"), str):
        return str(data["key_id"])
    return None


def _signature_ok(public_key: bytes, signature: bytes, payload: bytes) -> bool:
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    try:
        Ed25519PublicKey.from_public_bytes(public_key).verify(signature, payload)
    except (InvalidSignature, ValueError):
        return False
    return True


def _bad_signature() -> LicenseInvalid:
    return LicenseInvalid(
        "bad-signature",
        "the licence signature does not match its contents: the key was altered or truncated, "
        "or it was not issued by CarbonForge",
        REMEDY_COPY,
    )


def _claims_from(payload: bytes) -> LicenseClaims:
    """Parse the authenticated payload strictly."""
    try:
        data = _load_json(payload)
    except (ValueError, RecursionError):
        raise _malformed("the licence payload is not valid JSON", REMEDY_REISSUE) from None
    if not isinstance(data, dict):
        raise _malformed("the licence payload is not a JSON object", REMEDY_REISSUE)
    missing = [name for name in CLAIM_FIELDS if name not in data]
    if missing:
        raise _malformed(f"the licence lacks the field(s) {', '.join(missing)}", REMEDY_REISSUE)
    unknown = sorted(str(name) for name in data if name not in CLAIM_FIELDS)
    if unknown:
        raise _malformed(
            f"the licence has field(s) this runtime does not know: {', '.join(unknown)}",
            "upgrade the runtime image, or ask CarbonForge support for a licence key for this release",
        )
    for name in ("licence_id", "licensee", "plan", "key_id"):
        value = data[name]
        if not isinstance(value, str) or not value.strip() or len(value) > 256:
            raise _malformed(f"the licence field {name} must be a non-empty text", REMEDY_REISSUE)
    stamps: dict[str, int] = {}
    for name in ("issued_at", "not_before", "expires_at"):
        value = data[name]
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < _MAX_TIMESTAMP:
            raise _malformed(f"the licence field {name} must be a Unix time in whole seconds", REMEDY_REISSUE)
        stamps[name] = value
    entitlements = data["entitlements"]
    if not isinstance(entitlements, list) or not entitlements or len(entitlements) > MAX_ENTITLEMENTS:
        raise _malformed(f"the licence field entitlements must be a list of 1 to {MAX_ENTITLEMENTS} entries",
                         REMEDY_REISSUE)
    for entry in entitlements:
        problem = entitlement_problem(entry)
        if problem:
            raise _malformed(f"the licence entitlement {entry!r} is invalid: {problem}", REMEDY_REISSUE)
    if data["plan"] != PLAN_PREMIUM:
        raise _malformed(f"the licence is for plan {data['plan']!r}; this runtime knows only {PLAN_PREMIUM!r}",
                         "upgrade the runtime image, or ask CarbonForge support for a premium licence key")
    if not stamps["not_before"] < stamps["expires_at"] or not stamps["issued_at"] < stamps["expires_at"]:
        raise _malformed("the licence expires before it becomes valid", REMEDY_REISSUE)
    if stamps["expires_at"] - stamps["issued_at"] > MAX_TERM_S:
        raise _malformed(f"the licence term is longer than the maximum of {MAX_TERM_DAYS} days",
                         REMEDY_REISSUE)
    return LicenseClaims(
        licence_id=data["licence_id"],
        licensee=data["licensee"],
        plan=data["plan"],
        issued_at=float(stamps["issued_at"]),
        not_before=float(stamps["not_before"]),
        expires_at=float(stamps["expires_at"]),
        key_id=data["key_id"],
        entitlements=tuple(entitlements),
    )


def verify(text: str, public_keys: Mapping[str, bytes], now: float) -> LicenseClaims:
    """The claims of a valid licence; LicenseInvalid (with a distinct message per failure) otherwise.

    Checks, in order: size, format, base64url, signature length, signing key known, signature,
    claims, not-before (with :data:`CLOCK_SKEW_S`), expiry. Entitlement is :func:`entitles`.
    Never touches the network or the file system.
    """
    if isinstance(now, bool) or not isinstance(now, (int, float)) or math.isnan(now):
        raise TypeError("now must be a Unix time in seconds")
    payload, signature = split_licence(text)
    hint = _key_id_hint(payload)
    if hint is not None and hint not in public_keys:
        known = ", ".join(sorted(public_keys)) or "none"
        raise LicenseInvalid(
            "unknown-key",
            f"the licence was signed with key {hint!r}, which this runtime does not know (it knows: {known})",
            "upgrade the runtime image, or ask CarbonForge support for a key signed with a current signing key",
        )
    if hint is not None:
        if not _signature_ok(public_keys[hint], signature, payload):
            raise _bad_signature()
    elif not any(_signature_ok(key, signature, payload) for key in public_keys.values()):
        raise _bad_signature()
    claims = _claims_from(payload)
    if now + CLOCK_SKEW_S < claims.not_before:
        raise LicenseInvalid(
            "not-yet-valid",
            f"the licence is not valid until {format_time(claims.not_before)} (the host clock says "
            f"{format_time(now)})",
            "wait until the start date, or correct the host clock if it is wrong",
        )
    if now >= claims.expires_at:
        raise LicenseInvalid(
            "expired",
            f"the licence expired on {format_time(claims.expires_at)}",
            "renew the licence in the CarbonForge console and replace the key "
            "(CARBONFORGE_LICENSE_KEY or the licence file)",
        )
    return claims


def decode_unverified(text: str) -> dict[str, Any] | None:
    """The payload object without any check of authenticity (for display only), or None."""
    try:
        payload, _ = split_licence(text)
        data = _load_json(payload)
    except Exception:
        return None
    return data if isinstance(data, dict) else None


# --- entitlements -------------------------------------------------------------------------------

MODEL_PREFIX = "model="


def entitlement_problem(entry: object) -> str | None:
    """Why an entitlement entry is not valid, or None. Forms: ``*`` (every premium recipe),
    ``model=ORG/NAME`` (one model, in any recipe or the override mode), or a context-key pattern
    of four ``:``-separated segments where ``*`` and ``?`` are wildcards within a segment."""
    if not isinstance(entry, str) or not entry or len(entry) > MAX_ENTITLEMENT_CHARS:
        return f"it must be a non-empty text of at most {MAX_ENTITLEMENT_CHARS} characters"
    if _WHITESPACE.search(entry):
        return "it contains spaces"
    if entry == "*":
        return None
    if entry.startswith(MODEL_PREFIX):
        return None if normalise_model_id(entry[len(MODEL_PREFIX):]) else "the model id is empty"
    segments = entry.split(":")
    if len(segments) != 4 or not all(segments):
        return "a context-key pattern has four non-empty segments (model:quant:workload:hardware)"
    return None


def _segment_matches(pattern: str, value: str) -> bool:
    regex = "".join(".*" if ch == "*" else "." if ch == "?" else re.escape(ch) for ch in pattern.lower())
    return re.fullmatch(regex, value.lower()) is not None


def key_pattern_matches(pattern: str, recipe_key: str) -> bool:
    pat = pattern.split(":")
    key = recipe_key.strip().split(":")
    return len(pat) == 4 and len(key) == 4 and all(_segment_matches(p, k) for p, k in zip(pat, key, strict=True))


def entitles(claims: LicenseClaims, recipe_key: str, model: str) -> bool:
    """Whether the licence covers serving ``model`` under the premium recipe ``recipe_key``."""
    if claims.plan != PLAN_PREMIUM:
        return False
    wanted = normalise_model_id(model) if model else ""
    for entry in claims.entitlements:
        if entry == "*":
            return True
        if entry.startswith(MODEL_PREFIX):
            if wanted and normalise_model_id(entry[len(MODEL_PREFIX):]) == wanted:
                return True
        elif recipe_key and key_pattern_matches(entry, recipe_key):
            return True
    return False
