"""Where the licence text comes from: CARBONFORGE_LICENSE_KEY, else the licence file.

The variable wins when both are present. Reading never raises: a file that exists but cannot be
read is reported in :attr:`LicenseSource.problem`, so the gate and the doctor can explain it.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from carbonforge_runtime import files
from carbonforge_runtime.settings import Settings

ENV_VAR: Final = "CARBONFORGE_LICENSE_KEY"
FILE_VAR: Final = "CF_LICENSE_FILE"
#: Read at most this much of the licence file: enough for the verifier to call anything longer too large.
MAX_FILE_READ_BYTES = 64 * 1024


@dataclass
class LicenseSource:
    #: "CARBONFORGE_LICENSE_KEY", the licence file's path, or None when no licence was found.
    origin: str | None
    #: The licence text as read (None when nothing could be read).
    text: str | None
    #: Why a licence file that is present could not be read (None when it could, or when absent).
    problem: str | None
    #: The licence file that is present but ignored because the variable is set.
    shadowed: str | None = None
    #: The licence file named by CF_LICENSE_FILE does not exist (its :attr:`problem` says so).
    missing: bool = False

    @property
    def found(self) -> bool:
        return self.text is not None

    def describe(self) -> str:
        """Where the licence came from, for logs (never the key itself)."""
        if self.origin is None:
            return "no licence key (CARBONFORGE_LICENSE_KEY unset and no licence file)"
        if self.origin == ENV_VAR:
            note = f"; the licence file {self.shadowed} is ignored" if self.shadowed else ""
            return f"the licence key from {ENV_VAR}{note}"
        return f"the licence file {self.origin}"


def license_file(settings: Settings) -> Path:
    return settings.license_file


def missing_file_remedy(path: Path | str) -> str:
    """The fix for a licence file that does not exist: put it there, name where it is, or use the variable."""
    return (f"put the licence file at {path} (in a container, mount it: -v ./license.key:{path}:ro), set "
            f"{FILE_VAR} to where it is, or pass the key in {ENV_VAR} instead")


def _permission_detail(path: Path) -> str:
    try:
        info = path.stat()
    except OSError:
        return "permission denied"
    mode = stat.S_IMODE(info.st_mode)
    return (f"permission denied: mode {mode:04o}, owner uid {info.st_uid} gid {info.st_gid}; "
            f"the runtime runs as uid {os.geteuid()} gid {os.getegid()}")


def read_license(settings: Settings) -> LicenseSource:
    """The licence text and its origin. Never raises for a missing or unreadable file."""
    path = license_file(settings)
    env_text = settings.license_key
    if env_text:
        shadowed = None
        try:
            if path.exists():
                shadowed = str(path)
        except OSError:
            pass
        return LicenseSource(origin=ENV_VAR, text=str(env_text), problem=None, shadowed=shadowed)
    try:
        present = path.exists() or path.is_symlink()
    except OSError as exc:
        return LicenseSource(origin=str(path), text=None, problem=f"cannot be checked ({exc.strerror})")
    if not present:
        if settings.is_set(FILE_VAR):
            return LicenseSource(origin=str(path), text=None,
                                 problem=f"does not exist ({FILE_VAR} points to it)", missing=True)
        return LicenseSource(origin=None, text=None, problem=None)
    if path.is_dir():
        return LicenseSource(origin=str(path), text=None,
                             problem="it is a directory, not a file (a bind mount of a host file that "
                                     "did not exist creates a directory)")
    try:
        data = files.read_regular(path, MAX_FILE_READ_BYTES)
    except files.NotRegularFile as exc:  # a FIFO or a device would block the read (or never end)
        return LicenseSource(origin=str(path), text=None, problem=f"it is {exc.strerror} (a FIFO, socket or device)")
    except PermissionError:
        return LicenseSource(origin=str(path), text=None, problem=_permission_detail(path))
    except OSError as exc:
        return LicenseSource(origin=str(path), text=None, problem=f"it cannot be read ({exc.strerror or exc})")
    return LicenseSource(origin=str(path), text=data.decode("utf-8", errors="replace"), problem=None)
