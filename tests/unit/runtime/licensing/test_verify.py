"""Offline licence verification: the format, every rejection, entitlements, no network."""

from __future__ import annotations

import json
import socket
import time

import pytest

from carbonforge_runtime.errors import LicenseError
from carbonforge_runtime.runtime.licensing import (
    CLOCK_SKEW_S,
    MAX_LICENSE_CHARS,
    MAX_TERM_DAYS,
    LicenseClaims,
    LicenseInvalid,
    entitles,
    public_keys,
    verify,
)
from carbonforge_runtime.runtime.licensing.core import b64url_decode, b64url_encode
from tests.support.licensed_runtime import Signer

NOW = 1_780_000_000.0  # a fixed "now": verification is a pure function of (text, keys, now)
DAY = 86400


@pytest.fixture(scope="module")
def signer() -> Signer:
    return Signer("test-1")


@pytest.fixture(scope="module")
def licence(signer: Signer) -> str:
    return signer.issue(entitlements=("cf-tiny-premium:*:*:*",), issued_at=int(NOW) - DAY, days=30)


def rejected(text: str, table: dict[str, bytes], now: float = NOW) -> LicenseInvalid:
    with pytest.raises(LicenseInvalid) as info:
        verify(text, table, now)
    err = info.value
    assert isinstance(err, LicenseError)
    assert err.message and err.remedy, "every refusal says what is wrong and what to do"
    assert "Traceback" not in err.render()
    return err


def test_valid_licence_verifies_to_its_claims(signer: Signer, licence: str) -> None:
    claims = verify(licence, signer.table, NOW)
    assert claims == LicenseClaims(
        licence_id="lic-test-0001", licensee="Acme Test GmbH", plan="premium",
        issued_at=NOW - DAY, not_before=NOW - DAY, expires_at=NOW - DAY + 30 * DAY, key_id="test-1",
        entitlements=("cf-tiny-premium:*:*:*",),
    )
    assert licence.startswith("cfl1.") and licence.count(".") == 2 and "\n" not in licence
    assert len(licence) < 1024
    # Surrounding whitespace (a file's trailing newline) is accepted.
    assert verify(f"  {licence}\n", signer.table, NOW) == claims


def test_embedded_table_has_a_production_key_and_no_test_key() -> None:
    table = public_keys()
    assert table and all(len(raw) == 32 for raw in table.values())
    assert "test-1" not in table


def _flip_payload_byte(text: str, index: int) -> str:
    prefix, payload, signature = text.split(".")
    raw = bytearray(b64url_decode(payload))
    raw[index] ^= 0x01
    return f"{prefix}.{b64url_encode(bytes(raw))}.{signature}"


def _flip_signature_byte(text: str, index: int) -> str:
    prefix, payload, signature = text.split(".")
    raw = bytearray(b64url_decode(signature))
    raw[index] ^= 0x80
    return f"{prefix}.{payload}.{b64url_encode(bytes(raw))}"


def test_every_payload_byte_flipped_is_rejected(signer: Signer, licence: str) -> None:
    size = len(b64url_decode(licence.split(".")[1]))
    reasons = [rejected(_flip_payload_byte(licence, i), signer.table).reason for i in range(size)]
    # A flip inside the key id names an unknown key; everywhere else the signature fails.
    assert set(reasons) <= {"bad-signature", "unknown-key"}
    assert reasons.count("bad-signature") > size - len("test-1") - 1


def test_every_payload_character_changed_is_rejected(signer: Signer, licence: str) -> None:
    prefix, payload, signature = licence.split(".")
    for i, ch in enumerate(payload):
        for other in {"A", "_", "-", "z", "="} - {ch}:
            changed = f"{prefix}.{payload[:i]}{other}{payload[i + 1:]}.{signature}"
            assert rejected(changed, signer.table).reason in {"bad-signature", "unknown-key", "malformed"}


def test_every_signature_byte_flipped_is_rejected(signer: Signer, licence: str) -> None:
    for i in range(64):
        assert rejected(_flip_signature_byte(licence, i), signer.table).reason == "bad-signature"


def test_every_signature_character_changed_is_rejected(signer: Signer, licence: str) -> None:
    head, signature = licence.rsplit(".", 1)
    for i, ch in enumerate(signature):
        for other in {"A", "B", "w", "_"} - {ch}:
            # The last character carries 4 padding bits: a change there that keeps the bytes
            # identical is refused as non-canonical base64, never accepted.
            changed = f"{head}.{signature[:i]}{other}{signature[i + 1:]}"
            assert rejected(changed, signer.table).reason in {"bad-signature", "malformed"}


def test_wrong_key_id(signer: Signer) -> None:
    text = signer.issue(key_id="retired-9", issued_at=int(NOW))
    err = rejected(text, signer.table)
    assert err.reason == "unknown-key"
    assert "'retired-9'" in err.message and "upgrade" in err.remedy


def test_key_from_another_pair(signer: Signer) -> None:
    impostor = Signer("test-1")  # same key id, different private key
    err = rejected(impostor.issue(issued_at=int(NOW)), signer.table)
    assert err.reason == "bad-signature"


def test_rotation_keeps_licences_of_the_previous_key_valid(signer: Signer) -> None:
    newer = Signer("test-2")
    table = {**signer.table, **newer.table}
    assert verify(signer.issue(issued_at=int(NOW)), table, NOW).key_id == "test-1"
    assert verify(newer.issue(issued_at=int(NOW)), table, NOW).key_id == "test-2"


def test_expired(signer: Signer) -> None:
    text = signer.issue(issued_at=int(NOW) - 40 * DAY, days=30)
    err = rejected(text, signer.table)
    assert err.reason == "expired"
    expiry = time.strftime("%Y-%m-%d", time.gmtime(NOW - 10 * DAY))
    assert f"expired on {expiry}" in err.message and "renew" in err.remedy


def test_not_yet_valid_with_clock_skew_allowance(signer: Signer) -> None:
    start = int(NOW) + 3 * DAY
    text = signer.issue(issued_at=int(NOW), not_before=start, days=30)
    err = rejected(text, signer.table)
    assert err.reason == "not-yet-valid"
    assert time.strftime("%Y-%m-%d", time.gmtime(start)) in err.message and "clock" in err.remedy
    # A host clock a little behind the issuer's is tolerated; more is not.
    assert verify(text, signer.table, start - CLOCK_SKEW_S + 1).not_before == start
    assert rejected(text, signer.table, start - CLOCK_SKEW_S - 1).reason == "not-yet-valid"


def test_expiry_is_exact(signer: Signer) -> None:
    text = signer.issue(issued_at=int(NOW), days=1)
    assert verify(text, signer.table, NOW + DAY - 1)
    assert rejected(text, signer.table, NOW + DAY).reason == "expired"


def test_entitlement_for_another_key(signer: Signer) -> None:
    claims = verify(signer.issue(entitlements=("qwen3-32b:fp8:*:*",), issued_at=int(NOW)), signer.table, NOW)
    assert entitles(claims, "qwen3-32b:fp8:chat:a100-80x1", "Qwen/Qwen3-32B-FP8")
    assert not entitles(claims, "cf-tiny-premium:bf16:chat:cpu", "carbonforge-test/tiny-premium")


@pytest.mark.parametrize(("entitlement", "key", "model", "expected"), [
    ("*", "any:thing:at:all", "", True),
    ("cf-tiny-premium:bf16:chat:cpu", "CF-Tiny-Premium:BF16:chat:cpu", "", True),
    ("cf-tiny-premium:*:*:*", "cf-tiny-premium:fp8:coding:h100x8", "", True),
    ("cf-tiny-premium:*:*:*", "cf-tiny-premium-2:bf16:chat:cpu", "", False),
    ("*:*:*:h100x?", "qwen3.6-27b:fp8:agentic:h100x8", "", True),
    ("*:*:*:h100x?", "qwen3.6-27b:fp8:agentic:h100x16", "", False),
    ("qwen3.6-27b:fp8:agentic:h100x8", "qwen3:6-27b:fp8:agentic", "", False),
    ("model=Qwen/Qwen3.6-27B-FP8", "qwen3.6-27b:fp8:agentic:h100x8", "qwen/qwen3.6-27b-fp8/", True),
    ("model=Qwen/Qwen3.6-27B-FP8", "qwen3.6-27b:fp8:agentic:h100x8", "Qwen/Qwen3.6-27B", False),
    ("model=Qwen/Qwen3.6-27B-FP8", "", "", False),
])
def test_entitlement_patterns(signer: Signer, entitlement: str, key: str, model: str, expected: bool) -> None:
    claims = verify(signer.issue(entitlements=(entitlement,), issued_at=int(NOW)), signer.table, NOW)
    assert entitles(claims, key, model) is expected


@pytest.mark.parametrize("cut", [1, 5, 20, 60, 100, -1, -10, -43, -86, -87])
def test_truncated(signer: Signer, licence: str, cut: int) -> None:
    err = rejected(licence[:cut], signer.table)
    assert err.reason in {"malformed", "bad-signature"}


def test_simple_garbage_each_has_its_own_message(signer: Signer, licence: str) -> None:
    prefix, payload, signature = licence.split(".")
    cases = {
        "empty": "",
        "whitespace": " \t\n  \r\n",
        "non-base64 payload": f"{prefix}.{payload[:10]}*{payload[11:]}.{signature}",
        "non-base64 signature": f"{prefix}.{payload}.{signature[:10]}+{signature[11:]}",
        "padding": f"{prefix}.{payload}.{signature}==",
        "wrong prefix": f"cfx1.{payload}.{signature}",
        "newer version": f"cfl2.{payload}.{signature}",
        "jwt-like": "eyJhbGciOiJFZERTQSJ9.eyJzdWIiOiJ4In0.c2ln",
        "two parts": f"{prefix}.{payload}",
        "four parts": f"{licence}.{signature}",
        "space inside": f"{prefix}.{payload[:30]} {payload[30:]}.{signature}",
        "short signature": f"{prefix}.{payload}.{signature[:40]}",
        "1 MiB": "A" * (1024 * 1024),
        "1 MiB of a licence": licence + "A" * (1024 * 1024),
        "just over the limit": "cfl1." + "A" * MAX_LICENSE_CHARS,
        "non-ascii": f"{prefix}.{payload}.{signature[:-1]}é",
        "NUL": f"{prefix}.{payload}\x00.{signature}",
    }
    messages: dict[str, str] = {}
    for name, text in cases.items():
        err = rejected(text, signer.table)
        messages[name] = err.message
        if name.startswith(("1 MiB", "just over")):
            assert err.reason == "too-large", name
        else:
            assert err.reason == "malformed", name
    distinct = {messages[name] for name in ("empty", "non-base64 payload", "non-base64 signature",
                                            "wrong prefix", "newer version", "two parts", "space inside",
                                            "short signature", "1 MiB")}
    assert len(distinct) == 9, messages
    assert messages["whitespace"] == messages["empty"] == "the licence key is empty"
    assert "cfl1." in messages["wrong prefix"] and "upgrade" in rejected(cases["newer version"], signer.table).remedy


def test_oversize_is_refused_before_decoding(signer: Signer, monkeypatch: pytest.MonkeyPatch) -> None:
    from carbonforge_runtime.runtime.licensing import core as module

    def no_decoding(text: str) -> bytes:
        raise AssertionError("decoded an oversized licence")

    monkeypatch.setattr(module, "b64url_decode", no_decoding)
    assert rejected("cfl1." + "A" * (1024 * 1024) + ".AA", signer.table).reason == "too-large"


def test_all_rejection_reasons_have_distinct_messages(signer: Signer, licence: str) -> None:
    other = Signer("test-1")
    texts = {
        "unknown-key": signer.issue(key_id="gone-1", issued_at=int(NOW)),
        "bad-signature": other.issue(issued_at=int(NOW)),
        "expired": signer.issue(issued_at=int(NOW) - 40 * DAY, days=30),
        "not-yet-valid": signer.issue(issued_at=int(NOW), not_before=int(NOW) + 5 * DAY),
        "malformed": "",
        "too-large": "x" * (MAX_LICENSE_CHARS + 1),
    }
    seen = {}
    for reason, text in texts.items():
        err = rejected(text, signer.table)
        assert err.reason == reason
        seen[err.message] = reason
    assert len(seen) == len(texts)


def test_signed_but_invalid_claims_are_refused(signer: Signer) -> None:
    good = json.loads(b64url_decode(signer.issue(issued_at=int(NOW)).split(".")[1]))
    variants = {
        "missing field": {k: v for k, v in good.items() if k != "licensee"},
        "unknown field": {**good, "max_gpus": 8},
        "plan": {**good, "plan": "enterprise"},
        "float time": {**good, "expires_at": float(good["expires_at"])},
        "bool time": {**good, "issued_at": True},
        "empty entitlements": {**good, "entitlements": []},
        "bad entitlement": {**good, "entitlements": ["qwen3-32b:fp8"]},
        "ends before start": {**good, "not_before": good["expires_at"]},
        "term too long": {**good, "expires_at": good["issued_at"] + (MAX_TERM_DAYS + 1) * DAY},
        "not an object": [good],
    }
    for name, data in variants.items():
        text = signer.sign_payload(json.dumps(data).encode())
        err = rejected(text, signer.table)
        assert err.reason == "malformed", name
    assert verify(signer.sign_payload(json.dumps(good).encode()), signer.table, NOW)


def test_issuing_tool_refuses_a_term_over_the_maximum(signer: Signer) -> None:
    from tests.support.licensed_runtime import vendor_tool

    with pytest.raises(vendor_tool().ToolError, match=f"maximum is {MAX_TERM_DAYS}"):
        signer.issue(days=MAX_TERM_DAYS + 1)
    assert signer.issue(days=MAX_TERM_DAYS)
    with pytest.raises(vendor_tool().ToolError, match="entitlement"):
        signer.issue(entitlements=("qwen3-32b",))


def test_verification_makes_no_network_call(signer: Signer, licence: str, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_network(*args: object, **kwargs: object) -> None:
        raise AssertionError("licence verification touched the network")

    for name in ("socket", "create_connection", "getaddrinfo", "gethostbyname", "socketpair"):
        monkeypatch.setattr(socket, name, no_network)
    assert verify(licence, signer.table, NOW).licence_id == "lic-test-0001"
    assert rejected(_flip_signature_byte(licence, 3), signer.table).reason == "bad-signature"
    assert rejected(signer.issue(key_id="gone-2", issued_at=int(NOW)), signer.table).reason == "unknown-key"
    assert rejected(licence, signer.table, NOW + 400 * DAY).reason == "expired"


_FRESH_PROCESS_CHECK = """
import socket, sys
def no_network(*args, **kwargs):
    raise AssertionError("network used")
for name in ("socket", "create_connection", "getaddrinfo", "gethostbyname", "socketpair"):
    setattr(socket, name, no_network)
from carbonforge_runtime.runtime.licensing import verify, LicenseInvalid
table = {sys.argv[2]: bytes.fromhex(sys.argv[3])}
claims = verify(sys.argv[1], table, float(sys.argv[4]))
try:
    verify(sys.argv[5], table, float(sys.argv[4]))
except LicenseInvalid as exc:
    print("verified", claims.licence_id, exc.reason)
"""


def test_verification_in_a_fresh_process_without_network(signer: Signer, licence: str) -> None:
    """Imports included (the crypto backend is loaded lazily, on first use)."""
    import subprocess
    import sys

    # The tampered copy flips a bit of the signature itself: editing the text's last characters
    # can leave the signature unchanged when it already ends in them.
    tampered = _flip_signature_byte(licence, 7)
    result = subprocess.run(
        [sys.executable, "-c", _FRESH_PROCESS_CHECK, licence, signer.key_id, signer.public.hex(), str(NOW), tampered],
        capture_output=True, text=True, timeout=60, check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["verified", "lic-test-0001", "bad-signature"]
