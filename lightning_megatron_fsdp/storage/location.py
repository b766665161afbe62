"""Where a checkpoint (or an export) lives, resolved once: a path or URL becomes a
:class:`Location` (:func:`~lightning_megatron_fsdp.storage.store_location.locate`), and everything
above ``storage/`` works through its methods only.

A tool, a weight reader or the plugin never asks which backend holds a checkpoint: it
reads the manifest, lists and reads files, opens a DCP reader, writes an output, all
through the location ``locate`` gave. Two backends implement it: :class:`LocalLocation`
(a local or shared POSIX directory or file) and
:class:`~lightning_megatron_fsdp.storage.store_location.StoreLocation` (any fsspec
filesystem: ``s3://``, ``gs://``, ``memory://``, ...). A URL is never taken for a local
directory named ``s3:``; a ``file://`` URL is a local path.

Rejected: a ``Path | StoreCheckpoint`` union with an ``isinstance`` at each use (it was
written forty times across the tools, the weight readers and the launcher, each a place a
third backend had to be added); an fsspec ``LocalFileSystem`` for local paths (it loses
the confined, descriptor-based reads that refuse links and FIFOs, and ``preadv`` into
tensors). ``Location`` is an abstract base class rather than a ``Protocol`` so that what
all backends share (``write_atomically``'s contract and its refusal of an output that
appeared meanwhile) is written once, each backend supplying the primitive beneath it.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import logging
import mmap
import os
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Protocol

from lightning_megatron_fsdp.storage.checksums import file_digest
from lightning_megatron_fsdp.storage.commit import (
    latest_complete_checkpoint,
    matching_checkpoints,
    recover_matching,
)
from lightning_megatron_fsdp.storage.confined_files import (
    create_exclusive,
    open_regular,
    read_regular,
)
from lightning_megatron_fsdp.storage.format import (
    MANIFEST_FILE,
    Manifest,
    check_files,
    checkpoints_in_directory,
    read_manifest,
)

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata
    from torch.distributed.checkpoint.storage import StorageReader, StorageWriter

    from lightning_megatron_fsdp.storage.filesystem import (
        ChecksummingFileSystemWriter,
        VerifyingFileSystemReader,
    )

__all__ = ["ByteRanges", "LocalLocation", "Location", "MappedFile"]

log = logging.getLogger(__name__)


class ByteRanges(Protocol):
    """Random access to the bytes of one file: what a weight reader needs to read a header,
    then only the rows each rank owns."""

    size: int
    """The file's size in bytes, when it was opened."""

    def read(self, start: int, stop: int) -> memoryview | bytearray:
        """Bytes ``[start, stop)``, writable (a view of a private mapping, or a buffer).

        Raises:
            OSError: If the file ends before ``stop``.
        """
        ...

    def close(self) -> None:
        """Release the file; views read before stay valid."""
        ...


class Location(abc.ABC):
    """A checkpoint, a file or a directory on one backend; ``str()`` is how a user writes it.

    A checkpoint's files are plain names directly inside it; every read is confined to it
    (no link, FIFO or device is followed) and nothing raises for a missing file but
    :class:`FileNotFoundError`.
    """

    @property
    @abc.abstractmethod
    def name(self) -> str:
        """The last component of the location."""
        ...

    @property
    @abc.abstractmethod
    def suffix(self) -> str:
        """The file suffix of :attr:`name` (``".safetensors"``), or ``""``."""
        ...

    @abc.abstractmethod
    def file(self, name: str) -> str:
        """``name`` inside this location, as messages show it."""
        ...

    @abc.abstractmethod
    def exists(self) -> bool:
        """Whether anything is there (a fresh look: another process may have written)."""
        ...

    @abc.abstractmethod
    def is_file(self) -> bool:
        """Whether it is one file (object)."""
        ...

    @abc.abstractmethod
    def is_dir(self) -> bool:
        """Whether it holds files (a directory; on a store a prefix with objects)."""
        ...

    @abc.abstractmethod
    def size(self) -> int:
        """The size of the file in bytes."""
        ...

    @abc.abstractmethod
    def open(self, *, block_size: int | None = None) -> IO[bytes]:
        """The file, for reading (closed by the caller); ``block_size``: read-ahead, where
        the backend has one."""
        ...

    @abc.abstractmethod
    def read_range(self, start: int, stop: int) -> bytes:
        """Bytes ``[start, stop)`` of the file; fewer where it ends first."""
        ...

    @abc.abstractmethod
    def ranges(self) -> ByteRanges:
        """The file, for reads of byte ranges (closed by the caller)."""
        ...

    @abc.abstractmethod
    def sizes(self) -> dict[str, int]:
        """Every regular file directly inside, by name, with its size."""
        ...

    @abc.abstractmethod
    def read_manifest(self) -> Manifest:
        """The checkpoint's manifest.

        Raises:
            NotACheckpointError: None there, or it does not parse; the message says what
                is there instead.
        """
        ...

    @abc.abstractmethod
    def read_bytes(self, name: str, *, size: int | None = None) -> bytes:
        """The whole file ``name``, which must have ``size`` bytes when it is given.

        Raises:
            FileNotFoundError: If it is missing.
            OSError: If it is no regular file or has another size.
        """
        ...

    @abc.abstractmethod
    def open_records(self, name: str) -> contextlib.AbstractContextManager[Any]:
        """File ``name`` for :class:`~lightning_megatron_fsdp.storage.confined_files.FileWindow`
        reads of a few bytes each (a descriptor, or a stream with a small read-ahead)."""
        ...

    @abc.abstractmethod
    def digest(self, name: str, algorithm: str) -> str:
        """The digest of file ``name``, streamed."""
        ...

    @abc.abstractmethod
    def check_files(
        self, manifest: Manifest, *, checksum_files: list[str] | None = None
    ) -> list[str]:
        """One line per file ``manifest`` lists that is missing, has another size or (for
        ``checksum_files``) another digest."""
        ...

    @abc.abstractmethod
    def loaded_version(self) -> tuple[Location, list[str]]:
        """What a load of this checkpoint reads, and one note per saved version of it.

        Raises:
            NotACheckpointError: If nothing is there.
        """
        ...

    @abc.abstractmethod
    def checkpoints_inside(self) -> list[str]:
        """Complete checkpoints directly inside, by name, if this is not one itself
        (``ModelCheckpoint``'s ``dirpath``)."""
        ...

    @abc.abstractmethod
    def latest(
        self, pattern: str, *, on_restored: Callable[[str], Any] | None = None
    ) -> tuple[float, Location] | None:
        """The most recently written complete checkpoint directly inside whose name
        matches the ``fnmatch`` ``pattern``, with when its manifest was written (seconds);
        ``None`` if there is none. A checkpoint a crash left renamed aside is restored
        first, and ``on_restored`` (default: a logged warning) told so."""
        ...

    @abc.abstractmethod
    def reader(self, *, verify: bool, trust_checkpoint: bool) -> StorageReader:
        """The DCP reader of this checkpoint: nothing from it runs, every file is read
        confined to it, and (``verify``) every record checked against its CRC32C."""
        ...

    @abc.abstractmethod
    def writer(self, *, checksum: bool, thread_count: int) -> StorageWriter:
        """The DCP writer of a save into this (staging) location: every file written with
        its size and (``checksum``) CRC32C as the writer produced them, with
        ``thread_count`` threads per rank."""
        ...

    @abc.abstractmethod
    def checked_reader(
        self, metadata: Metadata, *, trust_checkpoint: bool
    ) -> VerifyingFileSystemReader:
        """The DCP reader of a checkpoint already checked: ``metadata`` (parsed) reused,
        nothing verified again, records read straight into their targets."""
        ...

    @abc.abstractmethod
    def absolute(self) -> Location:
        """The same location, independent of the working directory."""
        ...

    @abc.abstractmethod
    def returned(self) -> Any:
        """What a public function returns for this output: a ``Path``, or the URL."""
        ...

    @abc.abstractmethod
    def check_output(self, checkpoint: Location, *, overwrite: bool, who: str) -> None:
        """Refuse this location as the output of an export of ``checkpoint``, before
        anything is read or written, if it must not be written.

        Raises:
            IsADirectoryError: If it is a directory (on a store: a prefix with objects).
            FileExistsError: If it exists and ``overwrite`` is false.
            FileNotFoundError: If a local output's directory does not exist.
            ValueError: If it lies inside ``checkpoint`` (or names a bucket, not an object).
        """
        ...

    def write_atomically(
        self,
        write: Callable[[IO[bytes]], None],
        *,
        overwrite: bool,
        who: str,
        size: int | None = None,
    ) -> None:
        """Write the file with ``write`` (front to back, never seeking) so that no reader
        sees half of it: nothing appears if ``write`` raises. ``size``, if known, is how
        many bytes ``write`` writes.

        Raises:
            FileExistsError: If the file appeared meanwhile and ``overwrite`` is false.
        """

        def refuse_if_present() -> None:
            if not overwrite and self.exists():
                raise FileExistsError(
                    f"{who}: output {self} appeared while exporting; nothing was written. "
                    "Pass overwrite=True (--overwrite) to replace it."
                )

        with self._unseen(who, size, refuse_if_present) as stream:
            write(stream)

    @abc.abstractmethod
    def _unseen(
        self, who: str, size: int | None, before_publish: Callable[[], None]
    ) -> contextlib.AbstractContextManager[IO[bytes]]:
        """:meth:`write_atomically`'s backend half: a stream to the file that no reader
        sees while it is written. On a clean exit ``before_publish`` is called (it raises
        to refuse) and the file appears whole; on any error nothing of it stays."""


class MappedFile:
    """:class:`ByteRanges` of a local file, memory-mapped copy-on-write: a read is a view
    (no copy, nothing read the caller does not touch) that torch can wrap without a warning
    about read-only memory; writes to it never reach the file."""

    def __init__(self, path: Path) -> None:
        with open(path, "rb") as file:
            self.size = os.fstat(file.fileno()).st_size
            self._map = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_COPY) if self.size else None
        self._path = path

    def read(self, start: int, stop: int) -> memoryview | bytearray:
        if stop > self.size:
            raise OSError(
                f"{self._path} ends at byte {self.size}; bytes up to {stop} were expected."
            )
        if self._map is None or stop <= start:
            return bytearray(0)
        return memoryview(self._map)[start:stop]

    def close(self) -> None:
        # Dropped, not closed: tensors made from earlier views keep the mapping alive.
        self._map = None


@dataclasses.dataclass(frozen=True)
class LocalLocation(Location):
    """A :class:`Location` on the local (or a shared POSIX) filesystem."""

    path: Path

    def __str__(self) -> str:
        return str(self.path)

    def __fspath__(self) -> str:
        return os.fspath(self.path)

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def suffix(self) -> str:
        return self.path.suffix

    def file(self, name: str) -> str:
        return str(self.path / name)

    def exists(self) -> bool:
        return self.path.exists()

    def is_file(self) -> bool:
        return self.path.is_file()

    def is_dir(self) -> bool:
        return self.path.is_dir()

    def size(self) -> int:
        return self.path.stat().st_size

    def open(self, *, block_size: int | None = None) -> IO[bytes]:
        return open(self.path, "rb")

    def read_range(self, start: int, stop: int) -> bytes:
        with open(self.path, "rb") as file:
            return os.pread(file.fileno(), stop - start, start)

    def ranges(self) -> MappedFile:
        return MappedFile(self.path)

    def sizes(self) -> dict[str, int]:
        with os.scandir(self.path) as entries:
            return {
                entry.name: entry.stat().st_size
                for entry in entries
                if entry.is_file(follow_symlinks=False)
            }

    def read_manifest(self) -> Manifest:
        return read_manifest(self.path)

    def read_bytes(self, name: str, *, size: int | None = None) -> bytes:
        return read_regular(self.path, name, size=size)

    @contextlib.contextmanager
    def open_records(self, name: str) -> Iterator[int]:
        fd = open_regular(self.path, name)
        try:
            yield fd
        finally:
            os.close(fd)

    def digest(self, name: str, algorithm: str) -> str:
        return file_digest(self.path / name, algorithm)

    def check_files(
        self, manifest: Manifest, *, checksum_files: list[str] | None = None
    ) -> list[str]:
        return check_files(self.path, manifest, checksum_files=checksum_files)

    def loaded_version(self) -> tuple[LocalLocation, list[str]]:
        """This directory as it is: a local checkpoint has one version."""
        return self, []

    def checkpoints_inside(self) -> list[str]:
        if not self.path.is_dir() or (self.path / MANIFEST_FILE).exists():
            return []
        return checkpoints_in_directory(self.path)

    def latest(
        self, pattern: str, *, on_restored: Callable[[str], Any] | None = None
    ) -> tuple[float, Location] | None:
        for restored in recover_matching(self.path, pattern):
            (on_restored or log.warning)(
                f"Restored {restored}, which an interrupted save had renamed aside."
            )
        newest = latest_complete_checkpoint(matching_checkpoints(self.path, pattern), by="written")
        if newest is None:
            return None
        return (newest / MANIFEST_FILE).stat().st_mtime, LocalLocation(newest)

    def reader(self, *, verify: bool, trust_checkpoint: bool) -> VerifyingFileSystemReader:
        from lightning_megatron_fsdp.storage.filesystem import VerifyingFileSystemReader

        return VerifyingFileSystemReader(
            self.path, verify=verify, trust_checkpoint=trust_checkpoint
        )

    def writer(self, *, checksum: bool, thread_count: int) -> ChecksummingFileSystemWriter:
        from lightning_megatron_fsdp.storage.filesystem import ChecksummingFileSystemWriter

        return ChecksummingFileSystemWriter(self.path, checksum=checksum, thread_count=thread_count)

    def checked_reader(
        self, metadata: Metadata, *, trust_checkpoint: bool
    ) -> VerifyingFileSystemReader:
        from lightning_megatron_fsdp.storage.streaming_reader import StreamingReader

        return StreamingReader(self.path, metadata, trust=trust_checkpoint)

    def absolute(self) -> LocalLocation:
        return LocalLocation(Path(os.path.abspath(self.path)))

    def returned(self) -> Path:
        return self.path

    def check_output(self, checkpoint: Location, *, overwrite: bool, who: str) -> None:
        output = self.path
        if output.is_dir():
            raise IsADirectoryError(f"{who}: output {output} is a directory; expected a file path.")
        if output.exists() and not overwrite:
            raise FileExistsError(
                f"{who}: output {output} already exists; nothing was written. "
                "Pass overwrite=True (--overwrite) to replace it, or choose another path."
            )
        if not output.parent.is_dir():
            raise FileNotFoundError(
                f"{who}: the output's directory {output.parent} does not exist; create it first."
            )
        if (
            isinstance(checkpoint, LocalLocation)
            and checkpoint.path.is_dir()
            and output.parent.resolve() == checkpoint.path.resolve()
        ):
            raise ValueError(
                f"{who}: output {output} lies inside the checkpoint directory; a new file "
                "there would make the checkpoint fail verification. Write it elsewhere."
            )

    @contextlib.contextmanager
    def _unseen(
        self, who: str, size: int | None, before_publish: Callable[[], None]
    ) -> Iterator[IO[bytes]]:
        """A new hidden file next to the output (created with ``O_EXCL | O_NOFOLLOW`` and
        only ever used through the descriptor that created it), fsynced and renamed into
        place; before the rename the name must still be that file (someone who can write to
        the folder could otherwise swap in their own). It is removed on any error."""
        output = self.path
        temporary = output.parent / f".{output.name}.tmp-{uuid.uuid4().hex[:12]}"
        try:
            with open(create_exclusive(temporary), "w+b") as stream:
                yield stream
                stream.flush()
                os.fsync(stream.fileno())
                mine, now = os.fstat(stream.fileno()), os.stat(temporary, follow_symlinks=False)
                if (mine.st_dev, mine.st_ino) != (now.st_dev, now.st_ino):
                    raise FileExistsError(
                        f"{who}: the temporary file {temporary} was replaced while exporting "
                        "(another process writes to the output folder); nothing was written. "
                        "Export into a folder only you can write to."
                    )
            before_publish()
            os.replace(temporary, output)
        finally:
            with contextlib.suppress(FileNotFoundError):
                temporary.unlink()
