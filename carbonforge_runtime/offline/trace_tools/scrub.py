"""Credentials taken out of exported text: each match of a known pattern becomes ``[REDACTED:kind]``.

Best effort, by pattern: a secret in a shape no pattern knows passes through. The built-in
patterns (:data:`PATTERNS`) are listed in docs/datasets.md (generated from this table); more come
from a file given to ``trace export --scrub-patterns``: one pattern per line, ``kind: REGEX`` or
just ``REGEX`` (kind ``custom``), blank lines and lines starting with ``#`` ignored. A pattern with
a group named ``secret`` replaces only that group (``password=[REDACTED:password]``), otherwise the
whole match.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from carbonforge_runtime.errors import UsageError

#: (kind, what it catches, regex): the built-in patterns, applied in this order.
PATTERNS: tuple[tuple[str, str, str], ...] = (
    ("private_key", "PEM private key blocks (RSA, EC, OpenSSH, PKCS#8, encrypted), BEGIN to END",
     r"-----BEGIN (?:[A-Z0-9]+ )*PRIVATE KEY-----[\s\S]*?-----END (?:[A-Z0-9]+ )*PRIVATE KEY-----"),
    ("jwt", "JSON Web Tokens (three base64url parts, the first two starting `eyJ`)",
     r"\beyJ[A-Za-z0-9_-]{8,}\.eyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}"),
    ("openai_key", "OpenAI-style secret keys: `sk-` then 20 or more key characters (`sk-proj-...`, `sk-ant-...`)",
     r"\bsk-[A-Za-z0-9_-]{20,}"),
    ("github_token", "GitHub tokens: `ghp_`, `gho_`, `ghu_`, `ghs_`, `ghr_` and fine-grained `github_pat_`",
     r"\b(?:gh[pousr]_[A-Za-z0-9]{36,}|github_pat_[A-Za-z0-9_]{22,})"),
    ("slack_token", "Slack tokens: `xoxb-`, `xoxp-`, `xoxa-`, `xoxr-`, `xoxs-`, `xoxo-`",
     r"\bxox[abposr]-[A-Za-z0-9-]{10,}"),
    ("aws_access_key_id", "AWS access key ids (`AKIA`, `ASIA`, ... and 16 capitals or digits)",
     r"\b(?:AKIA|ASIA|ABIA|ACCA|AGPA|AIDA|AROA|ANPA|ANVA|APKA)[A-Z0-9]{16}\b"),
    ("aws_secret_access_key", "AWS secret keys: 40 base64 characters after `aws_secret_access_key` `=` or `:`",
     r"(?i)aws_?secret_?access_?key[\"']?\s*[:=]\s*[\"']?(?P<secret>[A-Za-z0-9/+=]{40})"),
    ("huggingface_token", "Hugging Face tokens: `hf_` then 30 or more letters and digits",
     r"\bhf_[A-Za-z0-9]{30,}"),
    ("google_api_key", "Google API keys: `AIza` then 35 key characters",
     r"\bAIza[0-9A-Za-z_-]{35}"),
    ("bearer_token", "the token after `Bearer ` (an Authorization header), 16 or more token characters",
     r"\b[Bb]earer\s+(?P<secret>[A-Za-z0-9._~+/=-]{16,})"),
    ("password", "the value in `password=...`, `passwd: ...`, `pwd=...` (4 or more characters)",
     r"(?i)\b(?:password|passwd|pwd)[\"']?\s*[:=]\s*[\"']?(?P<secret>[^\s\"',;]{4,})"),
    ("api_key", "the value in `api_key=...`, `apikey: ...`, `access_token=...`, `auth_token=...`, "
     "`client_secret=...`, `secret_key=...` (8 or more characters)",
     r"(?i)\b(?:api[_-]?key|access[_-]?token|auth[_-]?token|client[_-]?secret|secret[_-]?key)[\"']?\s*[:=]\s*"
     r"[\"']?(?P<secret>[^\s\"',;]{8,})"),
)
#: Keys of a JSON object (tool call arguments) whose string value is a secret whatever it looks like.
SECRET_KEYS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("password", re.compile(r"(?i)(?:password|passwd|pwd)\Z")),
    ("aws_secret_access_key", re.compile(r"(?i)aws_?secret_?access_?key\Z")),
    ("api_key", re.compile(r"(?i)(?:api[_-]?key|access[_-]?token|auth[_-]?token|client[_-]?secret|secret[_-]?key)\Z")),
)
_KIND = re.compile(r"([a-z][a-z0-9_]{0,40}):\s+(.+)\Z")


def marker(kind: str) -> str:
    return f"[REDACTED:{kind}]"


@dataclass
class Scrubber:
    patterns: list[tuple[str, re.Pattern[str]]]

    def __post_init__(self) -> None:
        self.counts: Counter[str] = Counter()

    def text(self, value: str) -> str:
        """``value`` with every match replaced; the replacements are counted in :attr:`counts`."""
        for kind, pattern in self.patterns:
            if "secret" in pattern.groupindex:
                value = pattern.sub(self._replacer(kind), value)
            else:
                value, n = pattern.subn(marker(kind), value)
                if n:
                    self.counts[kind] += n
        return value

    def _replacer(self, kind: str) -> Callable[[re.Match[str]], str]:
        def replace(match: re.Match[str]) -> str:
            self.counts[kind] += 1
            start, end = match.span("secret")
            whole = match.group(0)
            return whole[: start - match.start()] + marker(kind) + whole[end - match.start():]
        return replace

    def value(self, value: Any) -> Any:
        """Every string inside ``value`` (a JSON-like structure) scrubbed, and the whole string value of a
        key named like a credential (:data:`SECRET_KEYS`: ``{"password": "..."}``); keys are left alone."""
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, list):
            return [self.value(item) for item in value]
        if isinstance(value, dict):
            return {key: self._keyed(key, item) for key, item in value.items()}
        return value

    def _keyed(self, key: Any, item: Any) -> Any:
        if isinstance(key, str) and isinstance(item, str) and item and not item.startswith("[REDACTED:"):
            for kind, pattern in SECRET_KEYS:
                if pattern.match(key):
                    self.counts[kind] += 1
                    return marker(kind)
        return self.value(item)


def _compile(kind: str, regex: str, where: str) -> re.Pattern[str]:
    try:
        return re.compile(regex)
    except re.error as exc:
        raise UsageError(f"{where}: the pattern {regex!r} is not a valid regular expression ({exc})",
                         "fix or remove that line (Python regular expression syntax)") from None


def load_patterns(path: Path) -> list[tuple[str, str]]:
    """(kind, regex) from a ``--scrub-patterns`` file; UsageError naming the line for a bad one."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UsageError(f"--scrub-patterns {path} does not exist", "give the path of a patterns file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"--scrub-patterns {path} cannot be read ({exc})",
                         "give a readable UTF-8 file, one pattern per line") from None
    out = []
    for number, line in enumerate(text.splitlines(), start=1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        named = _KIND.match(line)
        kind, regex = (named.group(1), named.group(2)) if named else ("custom", line)
        _compile(kind, regex, f"{path}:{number}")
        if re.compile(regex).search("") is not None:
            raise UsageError(f"{path}:{number}: the pattern {regex!r} matches empty text",
                             "make it match at least one character")
        out.append((kind, regex))
    return out


def scrubber(extra: Iterable[tuple[str, str]] = ()) -> Scrubber:
    """The built-in patterns followed by ``extra`` (kind, regex)."""
    compiled = [(kind, _compile(kind, regex, "built-in")) for kind, _, regex in PATTERNS]
    compiled += [(kind, _compile(kind, regex, "--scrub-patterns")) for kind, regex in extra]
    return Scrubber(compiled)

