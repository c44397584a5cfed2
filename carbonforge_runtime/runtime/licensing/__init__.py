"""Offline licence verification and the premium gate.

Public API (used by the gate, the doctor and ``carbonforge-runtime license show``)::

    read_license(settings) -> LicenseSource
    verify(text, public_keys, now) -> LicenseClaims      # raises LicenseInvalid
    public_keys() -> dict[str, bytes]                    # the embedded key table
    entitles(claims, recipe_key, model) -> bool
"""

from carbonforge_runtime.errors import LicenseError
from carbonforge_runtime.runtime.licensing.core import (
    CLOCK_SKEW_S,
    MAX_LICENSE_CHARS,
    MAX_TERM_DAYS,
    PREFIX,
    LicenseClaims,
    LicenseInvalid,
    entitles,
    format_time,
    verify,
)
from carbonforge_runtime.runtime.licensing.keys import public_keys
from carbonforge_runtime.runtime.licensing.source import LicenseSource, missing_file_remedy, read_license

__all__ = [
    "CLOCK_SKEW_S",
    "MAX_LICENSE_CHARS",
    "MAX_TERM_DAYS",
    "PREFIX",
    "LicenseClaims",
    "LicenseError",
    "LicenseInvalid",
    "LicenseSource",
    "entitles",
    "format_time",
    "missing_file_remedy",
    "public_keys",
    "read_license",
    "verify",
]
