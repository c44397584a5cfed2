"""The keys file: what it accepts, every mistake named with its entry, line and fix, the scope each route
needs, and the entries `keys new` prints."""

from __future__ import annotations

import hashlib
import os
import re
from datetime import UTC, datetime
from pathlib import Path

import pytest
import yaml

from carbonforge_runtime.core.api_contract import PUBLIC_PATHS, ROUTES
from carbonforge_runtime.core.api_keys import (
    INFERENCE_INVOKE,
    MODELS_READ,
    OPERATOR,
    SECRET_PREFIX,
    WHOAMI_PATH,
    KeysFileError,
    digest_of,
    entry_yaml,
    load_keys,
    new_secret,
    parse_keys,
    required_scope,
    shortcut_key,
)
from carbonforge_runtime.errors import UsageError

SECRET_A = "cf-secret-a-0123456789abcdef0123456789abcdef"
SECRET_B = "cf-secret-b-0123456789abcdef0123456789abcdef"
HASH_A = hashlib.sha256(SECRET_A.encode()).hexdigest()
HASH_B = hashlib.sha256(SECRET_B.encode()).hexdigest()

GOOD = f"""\
# two teams
keys:
  - name: team-a
    sha256: {HASH_A}
    scopes: [models:read, inference:invoke]
    requests_per_minute: 600
    max_in_flight: 8
    priority: 2
    share: 3
    expires: 2027-01-01T12:00:00Z
  - name: batch.jobs_1
    sha256: {HASH_B.upper()}
    scopes: inference:invoke
"""


def test_a_good_file_gives_every_field_and_defaults() -> None:
    keys = parse_keys(GOOD)
    assert keys.names == ("team-a", "batch.jobs_1") and len(keys) == 2
    a = keys.by_digest[digest_of(SECRET_A)]
    assert (a.name, a.scopes, a.requests_per_minute, a.max_in_flight, a.priority, a.share) == (
        "team-a", frozenset({MODELS_READ, INFERENCE_INVOKE}), 600, 8, 2, 3.0)
    assert a.expires == datetime(2027, 1, 1, 12, tzinfo=UTC)
    assert not a.expired(datetime(2027, 1, 1, 11, 59, tzinfo=UTC).timestamp())
    assert a.expired(datetime(2027, 1, 1, 12, tzinfo=UTC).timestamp())
    b = keys.by_digest[digest_of(SECRET_B.encode())]
    assert (b.scopes, b.requests_per_minute, b.max_in_flight, b.priority, b.share, b.expires) == (
        frozenset({INFERENCE_INVOKE}), None, None, 0, 1.0, None)
    assert parse_keys("keys: []").names == () and parse_keys("keys:").names == ()


@pytest.mark.parametrize(("expires", "moment"), [
    ("2027-01-01", datetime(2027, 1, 1, tzinfo=UTC)),                # a date: its first instant, UTC
    ("'2027-01-01T08:30:00'", datetime(2027, 1, 1, 8, 30, tzinfo=UTC)),  # no zone: UTC
    ("2027-01-01T10:00:00+02:00", datetime(2027, 1, 1, 8, tzinfo=UTC)),
])
def test_expiry_forms(expires: str, moment: datetime) -> None:
    keys = parse_keys(f"keys:\n  - name: a\n    sha256: {HASH_A}\n    scopes: [models:read]\n    expires: {expires}\n")
    found = keys.by_digest[digest_of(SECRET_A)].expires
    assert found is not None and found == moment


def entry(**fields: object) -> str:
    base: dict[str, object] = {"name": "a", "sha256": HASH_A, "scopes": ["inference:invoke"]}
    base.update(fields)
    return yaml.safe_dump({"keys": [{k: v for k, v in base.items() if v is not ...}]}, sort_keys=False)


@pytest.mark.parametrize(("text", "says", "fix"), [
    ("keys: [\n", "not valid YAML at line", "YAML syntax"),
    ("- name: a\n", "is not a mapping with a list of entries under `keys:`", "keys: []"),
    ("keys: {}\n", "`keys` is not a list", "keys:"),
    ("keys: []\nversion: 2\n", "unknown top-level field 'version'", "keep only"),
    ("keys:\n  - just-a-string\n", "entry 1 (line 2): is not a mapping", "name:"),
    (entry(name="default"), "entry 1 ('default', line 2): name: 'default' is reserved", "another name"),
    (entry(name="other"), "'other' is reserved", "another name"),
    (entry(name="has space"), "name: 'has space' is not a key name", "1 to 64 letters"),
    (entry(name="x" * 65), "is not a key name", "1 to 64"),
    (entry(name=7), "name: 7 is not a key name", "letters"),
    (entry(name=...), "name: None is not a key name", "letters"),
    (entry(sha256="abc"), "sha256: is not 64 hexadecimal digits", "keys new"),
    (entry(sha256=...), "sha256: is not 64 hexadecimal digits", "keys new"),
    (entry(secret=SECRET_A), "has a field 'secret': the file must not hold a secret", "store only the hash"),
    (entry(colour="red"), "unknown field 'colour'", "use only name, sha256"),
    (entry(scopes=[]), "scopes: none given", "models:read, inference:invoke"),
    (entry(scopes=["admin"]), "scopes: unknown scope 'admin'", "models:read and/or inference:invoke"),
    (entry(requests_per_minute=0), "requests_per_minute: 0 is not a whole number >= 1", "or leave it out"),
    (entry(max_in_flight=1.5), "max_in_flight: 1.5 is not a whole number >= 1", "at least 1"),
    (entry(max_in_flight=True), "max_in_flight: True is not a whole number", "at least 1"),
    (entry(priority="high"), "priority: 'high' is not a whole number", "whole number"),
    (entry(share=0), "share: 0 is not a positive number", "above 0"),
    (entry(share=float("nan")), "share: nan is not a positive number", "above 0"),
    (entry(expires="soon"), "expires: 'soon' is not a date or time", "2027-01-01"),
])
def test_every_mistake_names_its_entry_and_the_fix(text: str, says: str, fix: str) -> None:
    with pytest.raises(KeysFileError) as caught:
        parse_keys(text, "/etc/cf/keys.yaml")
    assert isinstance(caught.value, UsageError)
    assert caught.value.message.startswith("/etc/cf/keys.yaml: ") and says in caught.value.message
    assert fix in caught.value.remedy
    assert SECRET_A not in caught.value.render()  # a secret put in the file by mistake is never repeated


def test_the_line_of_a_later_entry_and_duplicates() -> None:
    text = GOOD + f"  - name: team-c\n    sha256: {HASH_A}\n    scopes: [models:read]\n"
    with pytest.raises(KeysFileError, match=r"entry 3 \('team-c', line 14\): the same sha256 as the entry 'team-a'"):
        parse_keys(text)
    text = GOOD + f"  - name: team-a\n    sha256: {'ab' * 32}\n    scopes: [models:read]\n"
    with pytest.raises(KeysFileError, match=r"entry 3 \('team-a', line 14\): the name 'team-a' is taken"):
        parse_keys(text)


def test_load_keys_reads_a_regular_file_only(tmp_path: Path) -> None:
    good = tmp_path / "keys.yaml"
    good.write_text(GOOD)
    assert load_keys(str(good)).names == ("team-a", "batch.jobs_1")
    with pytest.raises(KeysFileError, match="cannot be read") as caught:
        load_keys(str(tmp_path / "absent.yaml"))
    assert "CF_API_KEYS_FILE" in caught.value.remedy
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(KeysFileError, match="a FIFO"):
        load_keys(str(fifo))  # refused at once, never waited on
    binary = tmp_path / "binary"
    binary.write_bytes(b"\xff\xfe keys")
    with pytest.raises(KeysFileError, match="not UTF-8"):
        load_keys(str(binary))


def test_which_scope_each_route_needs() -> None:
    assert required_scope("GET", "/v1/models") == MODELS_READ
    assert required_scope("GET", "/v1/models/carbonforge/tiny-chat") == MODELS_READ
    assert required_scope("GET", "/version") == MODELS_READ
    assert required_scope("GET", WHOAMI_PATH) is None
    for path in ROUTES:  # everything that takes a body for the engine (and its render routes)
        assert required_scope("POST", path) == INFERENCE_INVOKE, path
    for path in ("/tokenize", "/v1/responses/resp_1", "/v1/audio/transcriptions", "/v1/realtime", "/v9/new"):
        assert required_scope("POST", path) == INFERENCE_INVOKE, path
    assert required_scope("POST", "/v1/models") == INFERENCE_INVOKE  # only reading the list is models:read
    for path in ("/scale_elastic_ep", "/inference/v1/abort_requests"):
        assert required_scope("POST", path) == OPERATOR
    assert not set(PUBLIC_PATHS) & {WHOAMI_PATH}


def test_new_secrets_are_long_random_and_recognisable() -> None:
    made = {new_secret() for _ in range(50)}
    assert len(made) == 50
    for secret in made:
        assert re.fullmatch(re.escape(SECRET_PREFIX) + r"[A-Za-z0-9_-]{43}", secret), secret


def test_the_printed_entry_holds_only_the_hash_and_reads_back() -> None:
    secret = new_secret()
    text = entry_yaml("team-a", secret, [MODELS_READ, INFERENCE_INVOKE], requests_per_minute=60, max_in_flight=2,
                      priority=1, share=2.5, expires="2027-01-01")
    assert secret not in text and secret[len(SECRET_PREFIX):] not in text
    keys = parse_keys("keys:\n" + "".join("  " + line + "\n" for line in text.splitlines()))
    key = keys.by_digest[digest_of(secret)]
    assert (key.name, key.requests_per_minute, key.max_in_flight, key.priority, key.share) == ("team-a", 60, 2, 1, 2.5)
    minimal = entry_yaml("b", secret, [INFERENCE_INVOKE])
    assert "requests_per_minute" not in minimal and "expires" not in minimal
    with pytest.raises(KeysFileError, match="the new key: name: 'other' is reserved"):
        entry_yaml("other", secret, [INFERENCE_INVOKE])
    with pytest.raises(KeysFileError, match="unknown scope 'models:write'"):
        entry_yaml("b", secret, ["models:write"])


def test_whoami_shows_name_scopes_and_limits_never_the_secret_or_hash() -> None:
    key = parse_keys(GOOD).by_digest[digest_of(SECRET_A)]
    shown = key.identity()
    assert shown == {"object": "api_key", "name": "team-a", "scopes": [INFERENCE_INVOKE, MODELS_READ],
                     "limits": {"requests_per_minute": 600, "max_in_flight": 8}, "priority": 2, "share": 3.0,
                     "expires_at": "2027-01-01T12:00:00Z"}
    assert HASH_A not in repr(shown) and SECRET_A not in repr(shown)
    shortcut = shortcut_key(digest_of("k")).identity()
    assert shortcut["name"] is None and shortcut["scopes"] == [INFERENCE_INVOKE, MODELS_READ, OPERATOR]
    assert shortcut["limits"] == {"requests_per_minute": None, "max_in_flight": None}
