"""Credential scrubbing: every built-in pattern catches a planted secret of its kind, ordinary text
is left alone, and a patterns file extends the list."""

from __future__ import annotations

from pathlib import Path

import pytest

from carbonforge_runtime.errors import UsageError
from carbonforge_runtime.offline.trace_tools import scrub

#: One planted secret per built-in kind: (text, the secret part that must disappear).
PLANTED = {
    "private_key": ("key:\n-----BEGIN RSA PRIVATE KEY-----\nMIIEowIBAAKCAQEA7vYx\nq1w2e3r4\n"
                    "-----END RSA PRIVATE KEY-----\n", "MIIEowIBAAKCAQEA7vYx"),
    "jwt": ("token eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N_XgL0n3I9PlFUP0THsR8U ok",
            "dozjgNryP4J3jVmNHl0w5N"),
    "openai_key": ("use sk-proj-Ab3dEf6hIj9kLm2nOp5qRs8tUv1wXy4z please", "Ab3dEf6hIj9kLm2nOp5q"),
    "github_token": ("GH ghp_A1b2C3d4E5f6G7h8I9j0K1l2M3n4O5p6Q7r8 and github_pat_11ABCDEFG0123456789_abcdefghijklmnop",
                     "A1b2C3d4E5f6G7h8I9j0"),
    "slack_token": ("slack xoxb-123456789012-1234567890123-AbCdEfGhIjKlMnOpQrStUvWx", "AbCdEfGhIjKlMnOpQrStUvWx"),
    "aws_access_key_id": ("aws id AKIAIOSFODNN7EXAMPLE here", "AKIAIOSFODNN7EXAMPLE"),
    "aws_secret_access_key": ("aws_secret_access_key = wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY",
                              "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"),
    "huggingface_token": ("HF_TOKEN hf_AbCdEfGhIjKlMnOpQrStUvWxYz01234567", "AbCdEfGhIjKlMnOpQrStUvWxYz"),
    "google_api_key": ("maps AIzaSyA1b2C3d4E5f6G7h8I9j0K1l2M3n4O5p6Q", "SyA1b2C3d4E5f6G7h8I9j0"),
    "bearer_token": ("Authorization: Bearer 9f8e7d6c5b4a39281706f5e4d3c2b1a0.x_y", "9f8e7d6c5b4a39281706f5e4d3c2b1a0"),
    "password": ('{"user": "ann", "password": "hunter2hunter2"}', "hunter2hunter2"),
    "api_key": ("curl -d api_key=Zx81mQ0pLk77aa https://internal", "Zx81mQ0pLk77aa"),
}

ORDINARY = [
    "The skeleton of the skyscraper; ask-me-anything; risk-free.",
    "commit 3f2c9a1b, hash deadbeefcafe, uuid 123e4567-e89b-12d3-a456-426614174000",
    "A password is required. Set your api key in the settings page.",
    "Bearer of bad news. AKIA alone. eyJhbGci alone. sk-short. xoxb-1.",
    "def f(token):\n    return token  # pwd: cd ..",
]


@pytest.mark.parametrize("kind", sorted(PLANTED))
def test_each_planted_secret_is_redacted_with_its_kind(kind: str) -> None:
    text, secret = PLANTED[kind]
    cleaner = scrub.scrubber()
    out = cleaner.text(text)
    assert secret not in out
    assert scrub.marker(kind) in out
    assert cleaner.counts[kind] >= 1


def test_every_built_in_pattern_has_a_planted_secret() -> None:
    assert {kind for kind, _, _ in scrub.PATTERNS} == set(PLANTED)


@pytest.mark.parametrize("text", ORDINARY)
def test_ordinary_text_is_left_alone(text: str) -> None:
    cleaner = scrub.scrubber()
    assert cleaner.text(text) == text
    assert not cleaner.counts


def test_a_named_group_keeps_the_name_and_replaces_the_value() -> None:
    assert scrub.scrubber().text("password=hunter22 next") == "password=[REDACTED:password] next"


def test_structures_are_scrubbed_in_every_string_but_not_keys() -> None:
    cleaner = scrub.scrubber()
    value = {"sk-keyname-is-not-touched-1234567": ["x", {"k": "sk-abcdefghijklmnopqrstuvwx"}], "n": 3}
    assert cleaner.value(value) == {"sk-keyname-is-not-touched-1234567": ["x", {"k": "[REDACTED:openai_key]"}], "n": 3}


def test_a_patterns_file_adds_kinds(tmp_path: Path) -> None:
    path = tmp_path / "patterns.txt"
    path.write_text("# internal ids\n\nemployee_id: EMP-\\d{6}\nproject-[A-Z]{4}-secret\n")
    extra = scrub.load_patterns(path)
    assert extra == [("employee_id", r"EMP-\d{6}"), ("custom", "project-[A-Z]{4}-secret")]
    cleaner = scrub.scrubber(extra)
    assert cleaner.text("EMP-123456 on project-ABCD-secret") == "[REDACTED:employee_id] on [REDACTED:custom]"


@pytest.mark.parametrize("line, message", [("broken: (unclosed", "patterns.txt:2: the pattern"),
                                           ("x*", "matches empty text")])
def test_a_bad_pattern_is_refused_naming_its_line(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "patterns.txt"
    path.write_text(f"# one\n{line}\n")
    with pytest.raises(UsageError, match=message):
        scrub.load_patterns(path)


def test_a_missing_patterns_file_is_a_usage_error(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="does not exist"):
        scrub.load_patterns(tmp_path / "nope.txt")


def test_a_credential_named_key_hides_its_whole_value() -> None:
    cleaner = scrub.scrubber()
    assert cleaner.value({"user": "ann", "Password": "correct horse", "api_key": "short1", "n": {"pwd": "x y"}}) == {
        "user": "ann", "Password": "[REDACTED:password]", "api_key": "[REDACTED:api_key]",
        "n": {"pwd": "[REDACTED:password]"}}
    assert cleaner.counts == {"password": 2, "api_key": 1}
