"""DCP storage that checksums records as it writes them and verifies them as it reads them.

Checking a checkpoint's integrity must not cost extra passes over every byte, and DCP's own
reader pays a ``torch.load`` and a copy per record. :class:`ChecksummingFileSystemWriter`
is torch's writer whose streams CRC32C every record as it goes out and note where its
tensor payload starts, kept on DCP's own storage entries in ``.metadata``;
:class:`VerifyingFileSystemReader` reads each annotated record straight into its target, in
chunks CRC32Ced as they arrive, and checks its CRC32C over exactly those bytes
(docs/DESIGN.md, "On-disk format", "Atomic load" and "Storage": the mechanism, the
guarantees, the alternatives).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import io
import math
import os
import re
import stat
import struct
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, cast

import torch
from crc32c import crc32c as _crc32c_update  # the C function: no Python frame per write
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemBase
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future
from typing_extensions import override

from lightning_megatron_fsdp import _torch
from lightning_megatron_fsdp.errors import CheckpointCorruptedError, NotACheckpointError
from lightning_megatron_fsdp.storage.checksums import (
    bytes_digest,
    crc32c_combine,
    crc32c_hex,
    file_digest,
)
from lightning_megatron_fsdp.storage.confined_files import (
    linux_call,
    open_regular,
    read_regular,
    regular_size,
)
from lightning_megatron_fsdp.storage.format import Manifest, read_manifest
from lightning_megatron_fsdp.storage.records import TensorRecords, shared_records
from lightning_megatron_fsdp.storage.safe_unpickling import (
    check_tensor_record,
    inflate_record,
    load_dcp_metadata,
    safe_byte_record,
)

__all__ = [
    "RECORD_ATTR",
    "BatchRead",
    "ChecksummingFileSystemWriter",
    "ReadProgress",
    "Record",
    "RecordStream",
    "VerifyingFileSystemReader",
    "WrittenFile",
    "byte_view",
]

RECORD_ATTR = "lmf_record"
"""Name of the attribute a :class:`ChecksummingFileSystemWriter` adds to each DCP storage
entry: ``{"crc32c": int}`` (absent without checksums) plus, for a tensor record,
``"payload": [local header offset, payload offset]`` (relative to the record) and
``"byteorder"``."""

_WRITE_BEHIND = 16 << 20
"""Bytes a local file's stream hands the kernel between asking it to start writing them
to disk, so the final ``fsync`` finds most of the file already there instead of starting
the whole write then (the CPU's checksums and copies overlap the disk's writes)."""


_SYNC_FILE_RANGE: Callable[[int, int, int, int], int] | None = linux_call(
    "sync_file_range", [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
)
"""Linux's ``sync_file_range``: only a hint to begin writeback; durability still comes from
the ``fsync`` after the last write, so a platform without it, or a call that fails, changes
no guarantee."""
_SYNC_FILE_RANGE_WRITE = 2  # start writeback of the range's dirty pages, do not wait


def _regular_fd(file: Any) -> int | None:
    """``file``'s descriptor when it has one of a regular file, else ``None``."""
    try:
        fd = file.fileno()
        return fd if stat.S_ISREG(os.fstat(fd).st_mode) else None
    except (OSError, AttributeError, ValueError):  # io.UnsupportedOperation is an OSError
        return None


_LOCAL_HEADER = b"PK\x03\x04"
_LOCAL_HEADER_SIZE = 30
_STORAGE_NAME = re.compile(rb"(?:^|/)data/\d+$")


@dataclasses.dataclass(frozen=True)
class WrittenFile:
    """Size and (with checksums) CRC32C of a file a :class:`ChecksummingFileSystemWriter`
    wrote, both taken from the bytes as they were written."""

    size: int
    crc32c: int | None


@dataclasses.dataclass(frozen=True)
class Record:
    start: int
    length: int
    crc: int | None
    storages: tuple[tuple[int, int], ...]  # (local header, payload), relative to start


def byte_view(data: Any) -> memoryview:
    """``data`` (any contiguous buffer) as a flat view of its bytes, without a copy."""
    view = memoryview(data)
    if view.ndim != 1 or view.format != "B":
        view = view.cast("B")
    return view


class RecordStream(io.RawIOBase):
    """A binary output file that CRC32Cs bytes as they pass and cuts them into records.

    DCP calls ``tell()`` right before and right after writing each item, so the bytes
    between two ``tell()`` calls are one record. Within a record, a 30-byte zip local
    header followed by a ``.../data/<n>`` name announces a tensor payload.

    With ``write_behind`` and a local file, every :data:`_WRITE_BEHIND` bytes are handed
    to the kernel with a request to start writing them to disk (the file is synced
    after its last record all the same).
    """

    def __init__(self, file: Any, checksum: bool, *, write_behind: bool = False) -> None:
        super().__init__()
        self._file = file
        self._write_kept = getattr(file, "write_kept", file.write)
        self._checksum = checksum
        self._fd = _regular_fd(file) if write_behind and _SYNC_FILE_RANGE else None
        self._behind = 0  # bytes up to here were handed to the kernel's writeback
        self._position = 0
        self._start = 0
        self._crc = 0
        self._storages: list[tuple[int, int]] = []
        self._header: tuple[int, int, int] | None = None
        self.records: list[Record] = []

    @override
    def writable(self) -> bool:
        return True

    @override
    def write(self, data: Any) -> int:
        view = byte_view(data)
        size = view.nbytes
        self._sniff(view, size)
        if self._checksum:
            self._crc = _crc32c_update(view, self._crc)
        self._file.write(view)
        self._position += size
        if self._fd is not None and self._position - self._behind >= _WRITE_BEHIND:
            self._write_behind()
        return size

    def write_raw(self, data: Any) -> None:
        """Write a piece of a record that :class:`~lightning_megatron_fsdp.storage.records.
        TensorRecords` built itself (no sniffing: it reports the payload's place). Each
        piece is ``bytes`` or a view that keeps its tensor alive, so a file that sends
        pieces later may keep it instead of a copy (``write_kept``)."""
        if self._checksum:
            self._crc = _crc32c_update(data, self._crc)
        self._write_kept(data)
        self._position += len(data) if isinstance(data, bytes) else memoryview(data).nbytes
        if self._fd is not None and self._position - self._behind >= _WRITE_BEHIND:
            self._write_behind()

    def _write_behind(self) -> None:
        """Ask the kernel to start writing the bytes since the last request to disk."""
        assert self._fd is not None and _SYNC_FILE_RANGE is not None
        self._file.flush()
        _SYNC_FILE_RANGE(
            self._fd, self._behind, self._position - self._behind, _SYNC_FILE_RANGE_WRITE
        )
        self._behind = self._position

    def add_storage(self, header: int, payload: int) -> None:
        """Note a tensor payload of the current record (offsets relative to its start)."""
        self._storages.append((header, payload))

    def _sniff(self, view: memoryview, size: int) -> None:
        at = self._position - self._start
        if self._header is not None:
            header, name_length, extra_length = self._header
            self._header = None
            if (
                at == header + _LOCAL_HEADER_SIZE
                and size == name_length
                and _STORAGE_NAME.search(view.tobytes())
            ):
                payload = header + _LOCAL_HEADER_SIZE + name_length + extra_length
                self._storages.append((header, payload))
        if size == _LOCAL_HEADER_SIZE and view[:4] == _LOCAL_HEADER:
            name_length, extra_length = struct.unpack_from("<HH", view, 26)
            self._header = (at, name_length, extra_length)

    @override
    def tell(self) -> int:
        self._cut()
        return self._position

    def _cut(self) -> None:
        if self._position > self._start:
            self.records.append(
                Record(
                    self._start,
                    self._position - self._start,
                    self._crc if self._checksum else None,
                    tuple(self._storages),
                )
            )
        self._start, self._crc, self._storages, self._header = self._position, 0, [], None

    @override
    def flush(self) -> None:
        if not self._file.closed:
            self._file.flush()

    @override
    def fileno(self) -> int:
        """The file's descriptor, with every byte written so far handed to the kernel, so
        an ``os.fsync`` on it (ours, or torch's on ``.metadata``) syncs the whole file."""
        self.flush()
        return cast(int, self._file.fileno())

    @override
    def close(self) -> None:
        if not self.closed:
            self._cut()
            self._file.close()
        super().close()

    def written(self) -> WrittenFile:
        """The whole file: its size and the combination of its records' CRCs."""
        value = None
        if self._checksum:
            value = 0
            for record in self.records:
                assert record.crc is not None
                value = crc32c_combine(value, record.crc, record.length)
        return WrittenFile(self._position, value)


class _RecordingFileSystem(FileSystemBase):
    """A DCP file system (torch's local one, an fsspec one, or whichever the user put in
    ``writer.fs``) whose write streams are wrapped in :class:`RecordStream`\\ s, so records
    and files are checksummed whatever the file system underneath."""

    def __init__(self, inner: FileSystemBase, checksum: bool) -> None:
        self.inner = inner
        self.checksum = checksum
        self.write_behind = True
        """Start writing local files to disk while they are written (the writer sets it to
        its ``sync_files``: without a final ``fsync`` there is nothing to get ahead of)."""
        self.files: dict[str, WrittenFile] = {}
        self.records: dict[str, dict[int, Record]] = {}

    @override
    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[io.IOBase]:
        with self.inner.create_stream(path, mode) as inner:
            if mode != "wb":
                yield inner
                return
            stream = RecordStream(inner, self.checksum, write_behind=self.write_behind)
            # On an exception the inner stream's own context closes or aborts the file
            # (closing it here would complete an object store's upload of a part).
            yield stream
            stream.close()
            name = Path(path).name
            self.files[name] = stream.written()
            self.records[name] = {r.start: r for r in stream.records}

    @override
    def rename(self, path: str | os.PathLike[str], new_path: str | os.PathLike[str]) -> None:
        self.inner.rename(path, new_path)
        old, new = Path(path).name, Path(new_path).name
        if old in self.files:
            self.files[new] = self.files.pop(old)
            self.records[new] = self.records.pop(old)

    @override
    def concat_path(self, path: str | os.PathLike[str], suffix: str) -> str | os.PathLike[str]:
        return self.inner.concat_path(path, suffix)

    @override
    def init_path(self, path: str | os.PathLike[str]) -> str | os.PathLike[str]:
        return self.inner.init_path(path)

    @override
    def mkdir(self, path: str | os.PathLike[str]) -> None:
        self.inner.mkdir(path)

    @override
    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return FileSystem.validate_checkpoint_id(checkpoint_id)

    @override
    def exists(self, path: str | os.PathLike[str]) -> bool:
        return self.inner.exists(path)

    @override
    def rm_file(self, path: str | os.PathLike[str]) -> None:
        self.inner.rm_file(path)

    def ls(self, path: str | os.PathLike[str]) -> list[str]:
        return cast(list[str], self.inner.ls(path))

    def __getattr__(self, name: str) -> Any:  # a file system's own extras
        return getattr(self.__dict__["inner"], name)


def _exact(tensor: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """``tensor`` as ``torch.save`` should write it for a direct read: contiguous, and on
    CPU backed by a storage of exactly its bytes, so DCP neither clones it nor saves the
    rest of a packed buffer. Returns the tensor and whether it is such a tensor."""
    if type(tensor) is not torch.Tensor:
        return tensor, False
    if not tensor.is_contiguous():
        tensor = tensor.contiguous()
    if tensor.device.type != "cpu" or tensor.numel() == 0:
        return tensor, True  # DCP copies device tensors into fresh CPU memory itself
    nbytes = tensor.numel() * tensor.element_size()
    if tensor.untyped_storage().nbytes() != nbytes:
        start = tensor.storage_offset() * tensor.element_size()
        storage = tensor.untyped_storage()[start : start + nbytes]  # a view, no copy
        tensor = torch.empty(0, dtype=tensor.dtype).set_(storage, 0, tensor.shape)
    return tensor, True


class _ExactPlanner:
    """Wraps DCP's save planner for one ``write_data``: resolves tensors through
    :func:`_exact` and remembers which items were written that way."""

    def __init__(self, planner: SavePlanner) -> None:
        self._planner = planner
        self.exact: dict[Any, int] = {}  # item index -> payload bytes

    def __getattr__(self, name: str) -> Any:
        return getattr(self._planner, name)

    def resolve_data(self, item: WriteItem) -> Any:
        data = self._planner.resolve_data(item)
        if isinstance(data, torch.Tensor):
            data, exact = _exact(data.detach())
            if exact:
                self.exact[item.index] = data.numel() * data.element_size()
        return data


class ChecksummingFileSystemWriter(_torch.OwnWriteLoopWriter):
    """torch's ``FileSystemWriter`` that records a CRC32C of every record and file as it
    writes them (see the module docstring); the files are byte-identical to torch's.

    Args:
        path: Directory to write into.
        checksum: Compute CRC32Cs; ``False`` still records payload offsets (they make
            loading fast) and file sizes.
        records: Writes the tensor records; the process's shared
            :class:`~lightning_megatron_fsdp.storage.records.TensorRecords` (whose
            templates outlive one save) when ``None``.
        *args, **kwargs: ``FileSystemWriter``'s options, positional or by name
            (``single_file_per_rank``, ``sync_files``, ``thread_count``, ...,
            ``_extensions``).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *args: Any,
        checksum: bool = True,
        records: TensorRecords | None = None,
        **kwargs: Any,
    ):
        self._checksum = checksum  # before torch's __init__ assigns ``self.fs``
        super().__init__(path, *args, **kwargs)
        self.records = shared_records() if records is None else records

    @property
    def fs(self) -> _RecordingFileSystem:
        """The file system the writer writes through. Assign any DCP ``FileSystemBase``
        (as with torch's writer): it is wrapped, so its files are still checksummed."""
        return self._fs

    @fs.setter
    def fs(self, fs: FileSystemBase) -> None:
        if not isinstance(fs, _RecordingFileSystem):
            fs = _RecordingFileSystem(fs, self._checksum)
        self._fs = fs

    @override
    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        exact = _ExactPlanner(planner)
        self.fs.write_behind = self.sync_files
        written = super().write_data(plan, cast(SavePlanner, exact))
        for result in written.wait():
            self._annotate(result, exact.exact.get(result.index))
        return written

    @override
    def write_record(
        self, stream: Any, storage_key: str, item: WriteItem, data: Any
    ) -> WriteResult:
        offset = stream.tell()
        if item.type == WriteItemType.BYTE_IO:
            stream.write(data.getbuffer())
        elif isinstance(stream, RecordStream):
            self.records.write(data, stream.write, raw=stream.write_raw, storage=stream.add_storage)
        else:
            self.records.write(data, stream.write)
        length = stream.tell() - offset
        return WriteResult(
            index=item.index,
            size_in_bytes=length,
            storage_data=_torch.storage_info(storage_key, offset, length),
        )

    def _annotate(self, result: WriteResult, payload_bytes: int | None) -> None:
        info = result.storage_data
        record = self.fs.records.get(getattr(info, "relative_path", ""), {}).get(
            getattr(info, "offset", -1)
        )
        if record is None or record.length != info.length:
            return
        annotation: dict[str, Any] = {}
        if record.crc is not None:
            annotation["crc32c"] = record.crc
        if payload_bytes is not None and len(record.storages) == 1:
            header, payload = record.storages[0]
            if payload + payload_bytes <= record.length:
                annotation["payload"] = [header, payload]
                annotation["byteorder"] = sys.byteorder
        with contextlib.suppress(AttributeError):  # a future torch with slots: no annotation
            setattr(info, RECORD_ATTR, annotation)

    def written_files(self) -> dict[str, WrittenFile]:
        """Every file this writer wrote (this rank's shards; on the coordinator also
        ``.metadata``), by name, as written."""
        return dict(self.fs.files)


@dataclasses.dataclass
class ReadProgress:
    """How far a :class:`VerifyingFileSystemReader` got writing into the load targets."""

    started: bool = False
    total: int = 0
    written: int = 0
    last: str | None = None
    current: str | None = None
    """The record being read when the reader stopped: its target may hold part of it."""
    also: int = 0
    """Records after :attr:`current` read in the same request (or, on a store, already
    requested), whose targets may hold unchecked bytes too."""
    bytes_read: int = 0
    """Bytes of records read from storage and checked (tensor and byte records)."""
    tensor_bytes_read: int = 0
    """Of those, bytes of tensor records."""

    def describe(self) -> str:
        """E.g. ``"wrote 7 of 24 records (last 'w'); 'v' failed, its target may hold
        unverified bytes"``."""
        if not self.started:
            return "had not begun reading tensor data"
        if self.written == self.total:
            return f"wrote all {self.total} of its records"
        text = f"wrote {self.written} of {self.total} records"
        if self.last:
            text += f" (last {self.last!r})"
        if self.current and self.also:
            text += (
                f"; {self.current!r} failed, its target and those of the {self.also} "
                "record(s) read with it may hold unverified bytes"
            )
        elif self.current:
            text += f"; {self.current!r} failed, its target may hold unverified bytes"
        return text


def _tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """A writable view of a contiguous CPU tensor's bytes (the tensor must outlive it)."""
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return memoryview(bytearray())
    return memoryview((ctypes.c_ubyte * nbytes).from_address(tensor.data_ptr())).cast("B")


@dataclasses.dataclass
class BatchRead:
    """A run of adjacent records of one file being read: the buffers its bytes go to, in
    file order, and what checks and hands on each record once they are there."""

    name: str
    items: list[ReadItem]
    start: int
    """The file offset of the first record."""
    pieces: list[tuple[int, memoryview]] = dataclasses.field(default_factory=list)
    """(record index, buffer) in file order: together they hold the run's bytes."""
    finishers: list[Callable[[int], None]] = dataclasses.field(default_factory=list)
    checked: list[bool] = dataclasses.field(default_factory=list)
    crcs: list[int] = dataclasses.field(default_factory=list)

    def checksum(self, pieces: list[tuple[int, memoryview]], n: int) -> None:
        """Take the first ``n`` bytes of ``pieces`` (in order, as just read) into each
        checked record's CRC32C."""
        for index, view in pieces:
            if n <= 0:
                break
            if self.checked[index]:
                self.crcs[index] = _crc32c_update(view[:n], self.crcs[index])
            n -= view.nbytes


_ReadAt = Callable[[list[Any], int], int]
"""Fill ``buffers`` from a file at ``offset``; returns the bytes read (short at its end)."""


def _chunks(
    pieces: list[tuple[int, memoryview]], limit: int
) -> Iterator[list[tuple[int, memoryview]]]:
    """``pieces`` (tagged views) cut into runs of at most ``limit`` bytes, in order, a view
    split where a run ends; ``limit`` 0: one run of all of them."""
    if limit <= 0:
        yield pieces
        return
    chunk: list[tuple[int, memoryview]] = []
    size = 0
    for index, view in pieces:
        while view.nbytes:
            take = min(view.nbytes, limit - size)
            chunk.append((index, view[:take]))
            size += take
            view = view[take:]
            if size == limit:
                yield chunk
                chunk, size = [], 0
    if chunk:
        yield chunk


def _read_stream_exact(stream: Any, buffers: list[Any], offset: int) -> int:
    """:func:`_read_exact` through a file system's stream (``seek`` and ``readinto``)."""
    stream.seek(offset)
    total = 0
    for buffer in buffers:
        view = memoryview(buffer).cast("B")
        while view.nbytes:
            n = stream.readinto(view)
            if not n:
                return total
            total += n
            view = view[n:]
    return total


def _read_exact(fd: int, buffers: list[Any], offset: int) -> int:
    """``preadv`` until every buffer is full or the file ends; returns bytes read."""
    views = [memoryview(b).cast("B") for b in buffers]
    views = [v for v in views if v.nbytes]
    total = 0
    while views:
        n = os.preadv(fd, views, offset + total)
        if n == 0:
            break
        total += n
        while views and n >= views[0].nbytes:
            n -= views[0].nbytes
            views.pop(0)
        if n:
            views[0] = views[0][n:]
    return total


class VerifyingFileSystemReader(FileSystemReader):
    """torch's ``FileSystemReader`` that verifies what it reads as it reads it.

    Standalone (``dcp.load(..., storage_reader=VerifyingFileSystemReader(path))``) it
    reads the checkpoint's manifest itself; :class:`MegatronFSDPCheckpointIO` hands it
    the manifest it already validated (:meth:`expect`).

    Args:
        path: The checkpoint directory.
        _extension_registry: torch's stream extensions, to read records written with
            ``_extensions`` (as for torch's ``FileSystemReader``; experimental there).
        verify: Check ``.metadata``'s digest and every record's CRC32C (records without
            one: their file's digest, before any record is read). ``False`` still reads
            records directly into their targets.
        trust_checkpoint: Unpickle ``.metadata`` and byte records in full. By default
            nothing from the checkpoint is run (``checkpoint.safe_unpickling``)
            and every file is opened confined to the directory (``confined_files``),
            with or without ``verify``.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        _extension_registry: Any = None,
        *,
        verify: bool = True,
        trust_checkpoint: bool = False,
    ) -> None:
        super().__init__(path, _extension_registry)
        self.verify = verify
        self.trust_checkpoint = trust_checkpoint
        self.progress = ReadProgress()
        self._manifest: Manifest | None = None
        self._manifest_read = False
        self._chunks: dict[tuple[str, tuple[int, ...]], tuple[tuple[int, ...], torch.dtype]] = {}
        self._given: Metadata | None = None

    def use_metadata(self, metadata: Metadata) -> None:
        """Hand DCP ``metadata`` (checked already) instead of reading ``.metadata``."""
        self._given = metadata

    def read_files(self, names: Sequence[str]) -> list[bytes]:
        """Whole files of the checkpoint, as :meth:`read_checked` reads one, unchecked
        (:meth:`check_digest`).

        Raises:
            CheckpointCorruptedError: If one cannot be read, naming it.
        """
        found = []
        for name in names:
            try:
                found.append(self._read_whole(name))
            except OSError as err:
                raise self._corrupted(name, str(err)) from err
        return found

    def expect(self, manifest: Manifest, *, verify: bool) -> None:
        """Verify against ``manifest`` (already read and validated), or not at all."""
        self._manifest, self._manifest_read, self.verify = manifest, True, verify

    def _checkpoint_manifest(self) -> Manifest | None:
        if not self._manifest_read:
            self._manifest_read = True
            with contextlib.suppress(NotACheckpointError):
                self._manifest = read_manifest(self.path)
        return self._manifest

    def _expected_digest(self, name: str) -> tuple[str, str] | None:
        manifest = self._checkpoint_manifest() if self.verify else None
        record = None if manifest is None else manifest.files.get(name)
        return None if record is None else record.digest()

    def _expected_size(self, name: str) -> int | None:
        """The manifest's size of ``name``; ``None`` without a manifest.

        Raises:
            CheckpointCorruptedError: If there is a manifest and it does not list ``name``.
        """
        manifest = self._checkpoint_manifest()
        if manifest is None:
            return None
        record = manifest.files.get(name)
        if record is None:
            raise self._corrupted(
                name, "not listed in manifest.json; a load reads only the files it lists"
            )
        return record.size

    def _corrupted(self, name: str, what: str) -> CheckpointCorruptedError:
        return CheckpointCorruptedError(f"{self._display(name)}: {what}")

    # Storage access: the local filesystem here (confined), ``self.fs`` when the user
    # replaced it; ``fsspec_storage`` overrides ``_display``, ``_file_digest``, ``_file_size``,
    # ``_read_whole`` and ``read_data`` (its reads, not its checks).

    def _display(self, name: str) -> str:
        """``name`` inside the checkpoint, as messages show it."""
        return str(Path(self.path) / name)

    def _file_digest(self, name: str, algorithm: str) -> str:
        return file_digest(Path(self.path) / name, algorithm)

    def _file_size(self, name: str) -> int:
        """The size of ``name`` where there is no manifest to say it."""
        return regular_size(self.path, name)

    @override
    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = self._given
        if metadata is None:
            metadata = self._read_metadata_file(kwargs.get("rank"))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def _read_metadata_file(self, rank: int | None) -> Metadata:
        """``.metadata``, its digest checked, through the allow-list reader."""
        name = Path(_torch.metadata_path(self, rank)).name
        return load_dcp_metadata(
            self.read_checked(name), source=str(Path(self.path) / name), trust=self.trust_checkpoint
        )

    def read_checked(self, name: str) -> bytes:
        """One whole file of the checkpoint (``.metadata``, ``.metadata.keys``), its digest
        checked against the manifest when verifying.

        Raises:
            CheckpointCorruptedError: If it cannot be read or differs, naming it.
        """
        return self.check_digest(name, self.read_files([name])[0])

    def check_digest(self, name: str, data: bytes) -> bytes:
        """``data``, the file ``name``, checked against the manifest's digest when verifying.

        Raises:
            CheckpointCorruptedError: If it differs, naming it.
        """
        expected = self._expected_digest(name)
        if expected is not None:
            algorithm, digest = expected
            found = bytes_digest(data, algorithm)
            if found != digest:
                raise self._corrupted(
                    name,
                    f"{algorithm} {found} on disk, {digest} in the manifest (the file changed "
                    "after it was written)",
                )
        return data

    @override
    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        self._check_records_fit()
        self._chunks = {}
        for fqn, entry in metadata.state_dict_metadata.items():
            if isinstance(entry, TensorStorageMetadata):
                for chunk in entry.chunks:
                    key = (fqn, tuple(chunk.offsets))
                    self._chunks[key] = (tuple(chunk.sizes), entry.properties.dtype)

    def _check_records_fit(self) -> None:
        """Every record lies inside a regular file of the directory (one the manifest
        lists, when there is one), before anything is allocated for it.

        Raises:
            CheckpointCorruptedError: Naming the first file or record that does not.
        """
        sizes: dict[str, int] = {}
        for index, info in self.storage_data.items():
            name = info.relative_path
            if name not in sizes:
                try:
                    expected = self._expected_size(name)
                    sizes[name] = self._file_size(name) if expected is None else expected
                except OSError as err:
                    raise self._corrupted(name, str(err)) from err
            if info.offset + info.length > sizes[name]:
                raise self._corrupted(
                    name,
                    f"the record of {index.fqn!r} spans bytes [{info.offset}, "
                    f"{info.offset + info.length}) of a {sizes[name]}-byte file",
                )

    @override
    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        """Check, before any rank reads, every file this rank reads records of that carry
        no CRC32C of their own (format 1, or files of another writer), whole, against the
        manifest's digest."""
        plan = super().prepare_local_plan(plan)
        if self.verify:
            unannotated = sorted(
                {
                    self.storage_data[item.storage_index].relative_path
                    for item in plan.items
                    if "crc32c" not in self._annotation(item)
                }
            )
            for name in unannotated:
                expected = self._expected_digest(name)
                if expected is None:
                    continue
                found = self._file_digest(name, expected[0])
                if found != expected[1]:
                    raise self._corrupted(
                        name,
                        f"{expected[0]} {found} on disk, {expected[1]} in the manifest (the "
                        "file changed after it was written)",
                    )
        return plan

    def _annotation(self, item: ReadItem) -> dict[str, Any]:
        return getattr(self.storage_data[item.storage_index], RECORD_ATTR, None) or {}

    batch_bytes = 0
    """Consecutive records of a file are read together while their bytes stay within this
    (a larger record alone): one request per batch where requests cost more than bytes.
    ``0``: one record per read."""

    @override
    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        self.progress = ReadProgress(started=True, total=len(plan.items))
        for name, items in self._per_file(plan).items():
            with self._opened(name) as read_at:
                for batch in self._batches(items):
                    self._read_batch(read_at, name, batch, planner)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _per_file(self, plan: LoadPlan) -> dict[str, list[ReadItem]]:
        """``plan``'s items by the file holding their records, each file's by offset."""
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            name = self.storage_data[item.storage_index].relative_path
            per_file.setdefault(name, []).append(item)
        for items in per_file.values():
            items.sort(key=lambda i: self.storage_data[i.storage_index].offset)
        return per_file

    def _batches(self, items: list[ReadItem]) -> Iterator[list[ReadItem]]:
        """``items`` (sorted by offset) in runs of adjacent records of at most
        :attr:`batch_bytes` (a larger record alone)."""
        batch: list[ReadItem] = []
        end = size = 0
        for item in items:
            info = self.storage_data[item.storage_index]
            if batch and (info.offset != end or size + info.length > self.batch_bytes):
                yield batch
                batch, size = [], 0
            batch.append(item)
            end, size = info.offset + info.length, size + info.length
        if batch:
            yield batch

    read_chunk_bytes = 2 << 20
    """A batch is read in requests of at most this many bytes, each CRC32Ced as soon as
    it is read, while its bytes are still in the CPU's cache (one pass over memory for
    both, not a read pass and then a checksum pass). ``0``: one request per batch."""

    def _read_batch(
        self, read_at: _ReadAt, name: str, batch: list[ReadItem], planner: LoadPlanner
    ) -> None:
        """Read a run of adjacent records, CRC32C each piece as it arrives, then check each
        record and hand it to its target, in order."""
        self.progress.current, self.progress.also = batch[0].dest_index.fqn, len(batch) - 1
        reading = self._prepare_batch(name, batch, planner)
        got = 0
        for chunk in _chunks(reading.pieces, self.read_chunk_bytes):
            wanted = sum(view.nbytes for _, view in chunk)
            n = read_at([view for _, view in chunk], reading.start + got)
            reading.checksum(chunk, n)
            got += n
            if n < wanted:
                break  # the file ended
        self._finish_batch(reading, got)

    def _prepare_batch(self, name: str, batch: list[ReadItem], planner: LoadPlanner) -> BatchRead:
        """Where each of a run of adjacent records of ``name`` is to be read, and how each
        is then checked and handed on (:meth:`_finish_batch`)."""
        reading = BatchRead(name, batch, self.storage_data[batch[0].storage_index].offset)
        for index, item in enumerate(batch):
            pieces, expected, finish = self._prepare(name, item, planner)
            reading.pieces += [(index, byte_view(piece)) for piece in pieces]
            reading.finishers.append(finish)
            reading.checked.append(expected is not None)
        reading.crcs = [0] * len(batch)
        return reading

    def _finish_batch(self, reading: BatchRead, got: int, *, after: int = 0) -> None:
        """Check each record of ``reading`` (``got`` bytes of it read, CRC32Ced) and hand
        it to its target, in order; ``after``: records prepared beyond it whose targets
        may already hold unchecked bytes (what a failure reports)."""
        progress = self.progress
        batch = reading.items
        for index, (item, finish) in enumerate(zip(batch, reading.finishers, strict=True)):
            progress.current, progress.also = item.dest_index.fqn, len(batch) - 1 - index + after
            info = self.storage_data[item.storage_index]
            if got < info.offset + info.length - reading.start:
                raise self._truncated(reading.name, item)
            finish(reading.crcs[index])
            progress.written += 1
            progress.bytes_read += info.length
            if item.type == LoadItemType.TENSOR:
                progress.tensor_bytes_read += info.length
            progress.last = item.dest_index.fqn
        progress.current, progress.also = None, 0

    @contextlib.contextmanager
    def _opened(self, name: str) -> Iterator[_ReadAt]:
        """Read access to one file: ``preadv`` on a descriptor with torch's local file
        system; through ``self.fs``'s streams when the user replaced it (as torch's
        reader allows)."""
        if type(self.fs) is FileSystem:
            try:
                fd = open_regular(self.path, name, size=self._expected_size(name))
            except OSError as err:
                raise self._corrupted(name, str(err)) from err
            try:
                yield functools.partial(_read_exact, fd)
            finally:
                os.close(fd)
            return
        with self.fs.create_stream(self.fs.concat_path(self.path, name), "rb") as stream:
            yield functools.partial(_read_stream_exact, stream)

    def _read_whole(self, name: str) -> bytes:
        """One whole file of the checkpoint: confined to the directory (a plain, regular
        file of the manifest's size) with torch's local file system; through ``self.fs``'s
        streams when the user replaced it."""
        if type(self.fs) is FileSystem:
            return read_regular(self.path, name, size=self._expected_size(name))
        with self.fs.create_stream(self.fs.concat_path(self.path, name), "rb") as stream:
            return cast(bytes, stream.read())

    def _prepare(
        self, name: str, item: ReadItem, planner: LoadPlanner
    ) -> tuple[list[Any], int | None, Callable[[int], None]]:
        """Where ``item``'s record is to be read (buffers covering it, in order), the
        CRC32C to check it against (``None``: none), and what, given the CRC32C of the
        bytes read, checks it and hands it to its target once it is there."""
        info = self.storage_data[item.storage_index]
        annotation = self._annotation(item)
        expected = annotation.get("crc32c") if self.verify else None
        if (
            item.type == LoadItemType.TENSOR
            and "payload" in annotation
            and annotation.get("byteorder") == sys.byteorder
            and not info.transform_descriptors
        ):
            pieces, finish = self._prepare_payload(name, item, planner, annotation, expected)
            return pieces, expected, finish
        data = bytearray(info.length)
        finish = functools.partial(self._finish_record, name, item, planner, data, expected)
        return [data], expected, finish

    def _finish_record(
        self,
        name: str,
        item: ReadItem,
        planner: LoadPlanner,
        data: bytearray,
        expected: int | None,
        found: int,
    ) -> None:
        info = self.storage_data[item.storage_index]
        if expected is not None and found != expected:
            raise self._mismatch(name, item, found, expected)
        where = f"{self._display(name)}: {self._where(item)}"
        nbytes = None
        if item.type != LoadItemType.BYTE_IO:
            key = (item.storage_index.fqn, tuple(item.storage_index.offset or ()))
            if key not in self._chunks:
                raise self._corrupted(name, f"{key[0]!r}: no such chunk in .metadata")
            sizes, dtype = self._chunks[key]
            nbytes = math.prod(sizes) * dtype.itemsize
        record = io.BytesIO(data)
        if info.transform_descriptors:
            stream = self.transforms.transform_load_stream(item, info.transform_descriptors, record)
            record = inflate_record(stream, nbytes, source=where, trust=self.trust_checkpoint)
        if nbytes is None:
            value = safe_byte_record(record.read(), source=where, trust=self.trust_checkpoint)
            planner.load_bytes(item, io.BytesIO(value))
            return
        check_tensor_record(record, nbytes, source=where)
        record.seek(0)
        stored = torch.load(record, map_location="cpu", weights_only=True)
        source = _torch.narrow_tensor_by_index(stored, item.storage_offsets, item.lengths)
        target = planner.resolve_tensor(item).detach()
        if target.size() != source.size():
            raise AssertionError(
                f"req {item.storage_index} mismatch sizes {target.size()} vs {source.size()}"
            )
        target.copy_(source)
        planner.commit_tensor(item, target)

    def _prepare_payload(
        self,
        name: str,
        item: ReadItem,
        planner: LoadPlanner,
        annotation: dict[str, Any],
        expected: int | None,
    ) -> tuple[list[Any], Callable[[int], None]]:
        """A tensor record read as header, payload, trailer: the payload straight into the
        target when it is this exact chunk, else into a buffer."""
        info = self.storage_data[item.storage_index]
        key = (item.storage_index.fqn, tuple(item.storage_index.offset or ()))
        if key not in self._chunks:
            raise self._corrupted(name, f"{key[0]!r}: no chunk at {list(key[1])} in .metadata")
        sizes, dtype = self._chunks[key]
        nbytes = math.prod(sizes) * dtype.itemsize
        header, payload = (int(v) for v in annotation["payload"])
        if not 0 <= header < payload or payload + nbytes > info.length:
            raise self._corrupted(name, f"{key[0]!r}: payload outside its record")
        target = planner.resolve_tensor(item).detach()
        whole = all(o == 0 for o in item.storage_offsets) and tuple(item.lengths) == sizes
        direct = (
            whole
            and type(target) is torch.Tensor
            and target.device.type == "cpu"
            and target.dtype == dtype
            and target.is_contiguous()
        )
        chunk = target if direct else torch.empty(sizes, dtype=dtype)
        head, tail = bytearray(payload), bytearray(info.length - payload - nbytes)
        body = _tensor_bytes(chunk)

        def finish(found: int) -> None:
            if expected is not None and found != expected:
                raise self._mismatch(name, item, found, expected)
            if not _is_storage_header(head, header, payload):
                raise self._corrupted(
                    name,
                    f"{item.storage_index.fqn!r}: no zip entry data/<n> starts the payload at "
                    f"record offset {payload}; the record is not a torch.save of one tensor",
                )
            if not direct:
                source = _torch.narrow_tensor_by_index(chunk, item.storage_offsets, item.lengths)
                if target.size() != source.size():
                    raise AssertionError(
                        f"req {item.storage_index} mismatch sizes {target.size()} vs "
                        f"{source.size()}"
                    )
                target.copy_(source)
            planner.commit_tensor(item, target)

        return [head, body, tail], finish

    def _where(self, item: ReadItem) -> str:
        info = self.storage_data[item.storage_index]
        offset = list(item.storage_index.offset or ())
        return (
            f"record of {item.storage_index.fqn!r} (chunk at {offset}), bytes "
            f"[{info.offset}, {info.offset + info.length})"
        )

    def _truncated(self, name: str, item: ReadItem) -> CheckpointCorruptedError:
        return self._corrupted(name, f"the file ends inside the {self._where(item)}")

    def _mismatch(
        self, name: str, item: ReadItem, found: int, expected: int
    ) -> CheckpointCorruptedError:
        return self._corrupted(
            name,
            f"crc32c {crc32c_hex(found)} read, {crc32c_hex(expected)} recorded for the "
            f"{self._where(item)} (the file changed after it was written)",
        )


def _is_storage_header(head: bytearray, header: int, payload: int) -> bool:
    if header + _LOCAL_HEADER_SIZE > payload or head[header : header + 4] != _LOCAL_HEADER:
        return False
    if struct.unpack_from("<H", head, header + 8)[0] != 0:  # compressed: not torch.save's
        return False
    name_length, extra_length = struct.unpack_from("<HH", head, header + 26)
    start = header + _LOCAL_HEADER_SIZE
    if start + name_length + extra_length != payload:
        return False
    return _STORAGE_NAME.search(bytes(head[start : start + name_length])) is not None
