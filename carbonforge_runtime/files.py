"""Opening the files the runtime and the engine write in directories others may also write to (the
log directory, the trace file's directory, the cache): never through a symbolic link. And opening the
files an operator names for reading (a licence, a model file, a trace, a TLS certificate): never
anything that could block the read (a FIFO without a writer, a device).

A link planted where one of our files belongs (``vllm.log``, ``runtime.log``, a trace file) would
make us append to, chmod or truncate whatever it points at. So every such file is opened with
``O_NOFOLLOW`` and checked to be a regular file, and a directory is probed with a uniquely named
file created with ``O_EXCL`` (which never follows a link either) instead of a fixed name.
Only the last component of a path is guarded: the directories on the way are the operator's choice.
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
from typing import BinaryIO

from carbonforge_runtime.errors import CarbonForgeError

_LINK_REMEDY = ("remove the symbolic link (files are never written through one) and start again, or give the "
                "real path of the file instead of a link to it")


class SymlinkRefused(OSError):
    """``path`` is a symbolic link: it was neither followed nor touched."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        super().__init__(errno.ELOOP, "is a symbolic link, not followed", os.fspath(path))
        self.path = os.fspath(path)
        self.message = f"{self.path} is a symbolic link; it was not followed and its target was left untouched"
        self.remedy = _LINK_REMEDY

    def __str__(self) -> str:
        return self.message

    def as_error(self) -> CarbonForgeError:
        """The operator's error: what was found, and the fix."""
        return CarbonForgeError(self.message, self.remedy)


#: The fix for a path that names something other than a regular file.
NOT_REGULAR_REMEDY = ("name a regular file: a FIFO, socket, device or directory is never read or written, "
                      "since it could block the runtime or never end")


def _kind(mode: int) -> str:
    for test, kind in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):
        if test(mode):
            return kind
    return "not a regular file"


class NotRegularFile(OSError):
    """``path`` is a directory, a FIFO, a device or a socket, not a regular file to read or append to."""

    def __init__(self, path: str | os.PathLike[str], mode: int | None = None) -> None:
        kind = _kind(mode) if mode is not None else "not a regular file"
        reason = "not a regular file" if kind == "not a regular file" else f"{kind}, not a regular file"
        super().__init__(errno.EINVAL, reason, os.fspath(path))
        self.path = os.fspath(path)
        self.remedy = NOT_REGULAR_REMEDY

    def __str__(self) -> str:
        return f"{self.path} is {self.strerror}"

    def as_error(self) -> CarbonForgeError:
        """The operator's error: what was found, and the fix."""
        return CarbonForgeError(str(self), self.remedy)


def open_append(path: str | os.PathLike[str], mode: int) -> int:
    """An ``O_APPEND`` write descriptor on the regular file ``path``, created with ``mode`` if it is
    missing. Raises :class:`SymlinkRefused` for a link (never followed), :class:`NotRegularFile` for
    anything but a regular file (a FIFO is refused at once rather than blocking), else ``OSError``."""
    try:
        found = os.lstat(path)
    except FileNotFoundError:
        found = None
    if found is not None and stat.S_ISLNK(found.st_mode):
        raise SymlinkRefused(path)
    if found is not None and not stat.S_ISREG(found.st_mode):
        raise NotRegularFile(path, found.st_mode)
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
    try:
        fd = os.open(path, flags, mode)
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # a link put there since the lstat above
            raise SymlinkRefused(path) from None
        if exc.errno in (errno.ENXIO, errno.EISDIR):  # a FIFO without a reader, a directory
            raise NotRegularFile(path) from None
        raise
    _require_regular(fd, path)
    return fd


def _require_regular(fd: int, path: str | os.PathLike[str]) -> None:
    """Close ``fd`` and raise :class:`NotRegularFile` unless it is a regular file; else make it blocking
    again (``O_NONBLOCK`` was only for the open: nothing inherits it)."""
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise NotRegularFile(path, mode)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise


def open_regular(path: str | os.PathLike[str]) -> BinaryIO:
    """``path``, a file an operator named, open for reading in binary; links are followed (a mounted
    secret is often one). The open never blocks: a FIFO without a writer (or a device, a socket, a
    directory) raises :class:`NotRegularFile` at once, naming the path, with the fix in ``remedy``.
    Other failures raise ``OSError`` as ``open`` does."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    _require_regular(fd, path)
    return os.fdopen(fd, "rb")


def read_regular(path: str | os.PathLike[str], limit: int) -> bytes:
    """At most ``limit + 1`` bytes of ``path`` (so a caller sees that a file is over ``limit``), read
    through :func:`open_regular`: a FIFO, device, socket or directory is refused at once."""
    with open_regular(path) as handle:
        return handle.read(limit + 1)


def probe_writable(directory: str | os.PathLike[str]) -> None:
    """Create ``directory`` (and its parents) if needed and prove that a file can be created in it.

    The probe is a new file with a unique name, created with ``O_CREAT | O_EXCL | O_NOFOLLOW`` and
    removed at once: nothing that already exists there, a planted link included, is opened or
    changed. Raises ``OSError``."""
    os.makedirs(directory, exist_ok=True)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    for _ in range(100):
        probe = os.path.join(directory, f".cf-write-probe-{secrets.token_hex(8)}")
        try:
            fd = os.open(probe, flags, 0o600)
        except FileExistsError:
            continue
        os.close(fd)
        os.unlink(probe)
        return
    raise FileExistsError(errno.EEXIST, "no unused name for a write probe", os.fspath(directory))
