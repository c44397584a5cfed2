"""Opening the files the runtime and the engine write in directories others may also write to (the
log directory, the trace file's directory, the cache): never through a symbolic link. And opening the
files an operator names for reading (a licence, a model file, a trace, a TLS certificate): never
anything that could block the read (a FIFO without a writer, a device).

A link planted where one of our files belongs (``vllm.log``, ``runtime.log``, a trace file) would
make us append to, chmod or truncate whatever it points at. So every such file is opened with
``O_NOFOLLOW`` and checked to be a regular file, and a directory is probed with a uniquely named
file created with ``O_EXCL`` (which never follows a link either) instead of a fixed name.
Only the last component of a path is guarded: the directories on the way are the operator's choice.

And writing every file the project writes for a user (a result, a model, a plot, a recipe, the
address file): :func:`write_atomic`, the one writer, through a new file of a random name beside it,
renamed over the target only once complete and on disk.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
from collections.abc import Callable
from typing import IO, Any, BinaryIO

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


#: The mode of a file :func:`write_atomic` writes (it does not keep an earlier file's mode).
WRITE_MODE = 0o644


def write_atomic(path: str | os.PathLike[str], write: Callable[[IO[Any]], object], *, binary: bool = False,
                 mode: int = WRITE_MODE) -> None:
    """Replace ``path`` with what ``write(handle)`` writes: the project's one writer of user files.

    The content goes to a new file with a random name in the same directory (created with
    ``O_CREAT | O_EXCL | O_NOFOLLOW``, so nothing that already exists there, a planted link included,
    is ever opened), is flushed to disk, given ``mode``, and renamed over ``path``. Readers see the old
    file or the whole new one, never a part. A symbolic link at ``path`` is replaced by the file, never
    written through: its target is left as it was. On any failure (``write`` raising included) the
    temporary file is removed and ``path`` is left as it was. The directory is created if missing.

    ``handle`` is text (UTF-8) unless ``binary``. Raises ``OSError`` (``IsADirectoryError`` when
    ``path`` is a directory), or whatever ``write`` raises."""
    target = os.fspath(path)
    directory = os.path.dirname(target) or "."
    os.makedirs(directory, exist_ok=True)
    fd, temp = _create_temp(directory, os.path.basename(target))
    try:
        handle: IO[Any] = os.fdopen(fd, "wb") if binary else os.fdopen(fd, "w", encoding="utf-8")
        with handle:
            write(handle)
            handle.flush()
            os.fchmod(handle.fileno(), mode)
            os.fsync(handle.fileno())
        os.replace(temp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise
    _sync_directory(directory)


def write_text_atomic(path: str | os.PathLike[str], text: str, *, mode: int = WRITE_MODE) -> None:
    """:func:`write_atomic` of ``text`` (UTF-8)."""
    write_atomic(path, lambda handle: handle.write(text), mode=mode)


def _create_temp(directory: str, name: str) -> tuple[int, str]:
    """A new, empty, owner-only file beside ``name`` in ``directory``: its descriptor and path."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    for _ in range(100):
        temp = os.path.join(directory, f".{name[:200]}.{secrets.token_hex(8)}.tmp")
        try:
            return os.open(temp, flags, 0o600), temp
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, "no unused name for a temporary file", directory)


def _sync_directory(directory: str) -> None:
    """Put the rename on disk too (best effort: some file systems refuse to sync a directory)."""
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
