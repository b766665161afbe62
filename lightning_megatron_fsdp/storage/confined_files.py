"""Open a checkpoint's files so that a hostile directory cannot redirect, hang or bloat a read.

A checkpoint directory may come from someone else. Every file a load or tool reads from it
is named by the checkpoint itself (the manifest, DCP's ``.metadata``), so a name such as
``../x`` or ``/etc/passwd``, a symbolic link to a file elsewhere, a FIFO (whose ``open``
blocks until a writer appears) or ``/dev/zero`` (endless) would otherwise be followed.
The helpers here accept a plain file name only, open it with ``O_NOFOLLOW`` and
``O_NONBLOCK``, refuse anything but a regular file, and compare its size with the size
the caller expects before anything is allocated. Outputs are created with
``O_EXCL | O_NOFOLLOW`` and written through the descriptor that created them. Errors are
:class:`UnsafeCheckpointFileError`, an ``OSError``, so the callers' handling of unreadable
files covers them. See docs/DESIGN.md, "Untrusted checkpoints".
"""

from __future__ import annotations

import ctypes
import fcntl
import io
import os
import stat
import sys
from typing import Any

__all__ = [
    "FileWindow",
    "SeekableStream",
    "UnsafeCheckpointFileError",
    "check_plain_name",
    "create_exclusive",
    "open_regular",
    "read_regular",
    "regular_size",
]

_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)


class UnsafeCheckpointFileError(OSError):
    """A checkpoint names a file that must not be read: not a plain name inside the
    checkpoint directory, a symbolic link, not a regular file, or not the size expected."""


def check_plain_name(name: object, *, what: str = "file name") -> str:
    """Return ``name`` if it is a plain file name (no directory part, not ``.``/``..``).

    Raises:
        UnsafeCheckpointFileError: Otherwise.
    """
    if (
        not isinstance(name, str)
        or name in ("", ".", "..")
        or "/" in name
        or "\\" in name
        or "\0" in name
    ):
        raise UnsafeCheckpointFileError(
            f"{what} {name!r} is not a plain file name inside the checkpoint directory (a "
            "path with '/', '..' or an absolute path would read outside it); the checkpoint "
            "is damaged or crafted. Use another checkpoint."
        )
    return name


def _refuse_kind(path: str, mode: int) -> UnsafeCheckpointFileError:
    kind = (
        "a FIFO"
        if stat.S_ISFIFO(mode)
        else "a device"
        if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
        else "a directory"
        if stat.S_ISDIR(mode)
        else "a socket"
        if stat.S_ISSOCK(mode)
        else "not a regular file"
    )
    return UnsafeCheckpointFileError(
        f"{path} is {kind}, expected a regular file; a checkpoint's files are regular files. "
        "Use another checkpoint."
    )


def regular_size(directory: str | os.PathLike[str], name: str) -> int:
    """Size of the regular file ``name`` in ``directory``, without following a link.

    Raises:
        FileNotFoundError: If it does not exist.
        UnsafeCheckpointFileError: If ``name`` is not plain, or the entry is a symbolic
            link or not a regular file.
    """
    path = os.path.join(directory, check_plain_name(name))
    info = os.lstat(path)
    if stat.S_ISLNK(info.st_mode):
        raise UnsafeCheckpointFileError(
            f"{path} is a symbolic link; a checkpoint's files are regular files inside its "
            "directory (a link could read any file). Copy the real file in, or use another "
            "checkpoint."
        )
    if not stat.S_ISREG(info.st_mode):
        raise _refuse_kind(path, info.st_mode)
    return info.st_size


def open_regular(directory: str | os.PathLike[str], name: str, *, size: int | None = None) -> int:
    """Open the regular file ``name`` in ``directory`` for reading; return its descriptor.

    Never follows a symbolic link, never blocks on a FIFO, and refuses devices.

    Args:
        directory: The checkpoint directory (trusted: the caller chose it).
        name: A plain file name, as the checkpoint records it.
        size: The size the file must have (the manifest's), or ``None``.

    Raises:
        FileNotFoundError: If it does not exist.
        UnsafeCheckpointFileError: If it is not a plain name, a link, not a regular file,
            or not ``size`` bytes.
    """
    path = os.path.join(directory, check_plain_name(name))
    try:
        fd = os.open(path, _READ_FLAGS)
    except OSError as err:
        if os.path.islink(path):
            regular_size(directory, name)  # raises the explanation
        raise err
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise _refuse_kind(path, info.st_mode)
        if size is not None and info.st_size != size:
            raise UnsafeCheckpointFileError(
                f"{path}: {info.st_size} bytes on disk, {size} expected (the manifest's); the "
                "file changed after it was written. Use another checkpoint."
            )
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_regular(
    directory: str | os.PathLike[str],
    name: str,
    *,
    size: int | None = None,
    limit: int | None = None,
) -> bytes:
    """The whole regular file ``name`` of ``directory`` (see :func:`open_regular`).

    Args:
        directory: The checkpoint directory.
        name: A plain file name.
        size: The size it must have, or ``None``.
        limit: The largest size accepted when ``size`` is not known, or ``None``.

    Raises:
        FileNotFoundError: If it does not exist.
        UnsafeCheckpointFileError: As :func:`open_regular`; or larger than ``limit``, or
            it changed size while being read.
    """
    fd = open_regular(directory, name, size=size)
    try:
        length = os.fstat(fd).st_size
        if limit is not None and length > limit:
            raise UnsafeCheckpointFileError(
                f"{os.path.join(directory, name)}: {length} bytes, more than the {limit} "
                "accepted for this file; the checkpoint is damaged or crafted."
            )
        data = bytearray(length)
        view = memoryview(data)
        done = 0
        while done < length:
            n = os.readv(fd, [view[done:]])
            if n == 0:
                break
            done += n
        if done != length or os.read(fd, 1):
            raise UnsafeCheckpointFileError(
                f"{os.path.join(directory, name)} changed size while it was read."
            )
        return bytes(data)
    finally:
        os.close(fd)


def create_exclusive(path: str | os.PathLike[str], mode: int = 0o644) -> int:
    """Create ``path`` as a new file (never an existing file or link); return its
    descriptor, open for reading and writing. Write and re-read through it, never by name:
    whoever can write to the folder could otherwise swap the file in between.

    Raises:
        FileExistsError: If anything, a link included, exists at ``path``.
    """
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    return os.open(path, flags, mode)


class SeekableStream(io.RawIOBase):
    """A raw stream over ``[0, end)`` with a position that may be sought anywhere from 0
    on: what :class:`FileWindow` and the tools' in-memory files share. A subclass keeps
    ``_position`` and says where the end is (:meth:`_end`)."""

    _position: int = 0

    def _end(self) -> int:
        raise NotImplementedError

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: self._end()}[whence]
        if base + offset < 0:
            raise ValueError(f"negative seek position {base + offset}")
        self._position = base + offset
        return self._position


class FileWindow(SeekableStream):
    """A read-only, seekable view of bytes ``[offset, offset + length)`` of an open file,
    for parsers that want a file (``zipfile``): reads never leave the window.

    ``source`` is a descriptor (read with ``preadv``) or a seekable binary file object
    (an fsspec file: seek, then ``readinto``).
    """

    def __init__(self, source: int | Any, offset: int, length: int) -> None:
        super().__init__()
        self._source, self._offset, self._length, self._position = source, offset, length, 0

    def _end(self) -> int:
        return self._length

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        count = max(0, min(view.nbytes, self._length - self._position))
        if count == 0:
            return 0
        at = self._offset + self._position
        if isinstance(self._source, int):
            n = os.preadv(self._source, [view[:count]], at)
        else:
            self._source.seek(at)
            n = int(self._source.readinto(view[:count]))
        self._position += n
        return n


def linux_call(name: str, argtypes: list[Any]) -> Any:
    """libc's function ``name`` (a Linux file call :mod:`os` lacks), returning a C ``int``
    and setting ``errno``; ``None`` where there is none (not Linux, old glibc, musl)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        function = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError):
        return None
    function.argtypes = argtypes
    function.restype = ctypes.c_int
    return function
