"""Property: whatever the input, the verifier returns claims or raises LicenseInvalid, nothing else."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from carbonforge_runtime.runtime.licensing import LicenseClaims, LicenseInvalid, verify
from carbonforge_runtime.runtime.licensing.core import CLAIM_FIELDS, b64url_encode
from tests.support.licensed_runtime import Signer

NOW = 1_780_000_000.0
SIGNER = Signer("prop-1")
VALID = SIGNER.issue(entitlements=("*", "qwen3-32b:*:*:*"), issued_at=int(NOW) - 86400, days=60)
TABLE = {**SIGNER.table, **Signer("prop-2").table}


def outcome(text: str, now: float = NOW) -> str:
    try:
        claims = verify(text, TABLE, now)
    except LicenseInvalid as exc:
        assert exc.reason in {"malformed", "too-large", "unknown-key", "bad-signature", "not-yet-valid",
                              "expired"}
        assert exc.message and exc.remedy
        return exc.reason
    assert isinstance(claims, LicenseClaims)
    return "valid"


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=12,
)


@st.composite
def mutated(draw: st.DrawFn) -> str:
    """The valid licence with a few random edits: replace, insert, delete, cut, duplicate."""
    text = VALID
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["replace", "insert", "delete", "cut", "repeat", "swap-dot"]))
        pos = draw(st.integers(0, max(len(text) - 1, 0)))
        char = draw(st.characters() | st.sampled_from(list("AZaz09-_.= \n")))
        if kind == "replace" and text:
            text = text[:pos] + char + text[pos + 1:]
        elif kind == "insert":
            text = text[:pos] + char + text[pos:]
        elif kind == "delete" and text:
            text = text[:pos] + text[pos + 1:]
        elif kind == "cut":
            text = text[:pos]
        elif kind == "repeat":
            text = text + text[pos:]
        elif kind == "swap-dot":
            text = text.replace(".", draw(st.sampled_from([",", "..", ":", ""])), 1)
    return text


@st.composite
def signed_payloads(draw: st.DrawFn) -> str:
    """Correctly signed licences whose payload is arbitrary JSON, or the claim set with random values."""
    if draw(st.booleans()):
        data: Any = draw(json_values)
    else:
        data = {name: draw(json_values) for name in CLAIM_FIELDS if draw(st.integers(0, 9)) > 0}
        if draw(st.booleans()):
            data["key_id"] = SIGNER.key_id
    payload = json.dumps(data).encode() if draw(st.booleans()) else draw(st.binary(max_size=300))
    return SIGNER.sign_payload(payload or b"{}")


@st.composite
def shaped(draw: st.DrawFn) -> str:
    """Three dotted parts with random base64url contents of random lengths."""
    prefix = draw(st.sampled_from(["cfl1", "cfl2", "CFL1", "", "cfl1 "]))
    payload = b64url_encode(draw(st.binary(max_size=400)))
    signature = b64url_encode(draw(st.binary(min_size=60, max_size=70)))
    return f"{prefix}.{payload}.{signature}"


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.text(max_size=300) | st.binary(max_size=300).map(lambda b: b.decode("latin-1")))
def test_random_text(text: str) -> None:
    assert outcome(text) != "valid"


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutated())
def test_mutated_licences(text: str) -> None:
    result = outcome(text)
    # Only edits that leave the key intact apart from surrounding whitespace can still verify.
    assert result != "valid" or text.strip(" \t\r\n\ufeff") == VALID


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(signed_payloads(), st.floats(0, 2**34, allow_nan=False))
def test_signed_arbitrary_payloads(text: str, now: float) -> None:
    outcome(text, now)


@settings(max_examples=300, deadline=None)
@given(shaped())
def test_shaped_garbage(text: str) -> None:
    assert outcome(text) != "valid"
