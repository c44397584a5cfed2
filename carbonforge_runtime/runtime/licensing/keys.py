"""The public keys licences are checked against, embedded in the package and indexed by key id.

Rotation: a new signing key gets a new id and is added here; older ids stay until every licence
they signed has expired, so a rotation never invalidates a licence already issued. The private
halves are held by the vendor only and are never part of this repository or the image.
"""

from __future__ import annotations

import base64

#: key id -> raw 32-byte Ed25519 public key, base64url without padding.
EMBEDDED_PUBLIC_KEYS: dict[str, str] = {
    "cf-2026-1": "IM0KIGieH3yTwAlfl7RrKirxdIUHr3pMOJQw1HxBajE",
}


def decode_public_key(text: str) -> bytes:
    """Raw key bytes from base64url text (padding optional); ValueError when not 32 bytes."""
    raw = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    if len(raw) != 32:
        raise ValueError(f"an Ed25519 public key is 32 bytes, got {len(raw)}")
    return raw


def public_keys() -> dict[str, bytes]:
    """The embedded key table: key id -> raw 32-byte Ed25519 public key."""
    return {kid: decode_public_key(text) for kid, text in EMBEDDED_PUBLIC_KEYS.items()}
