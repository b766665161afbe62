"""DCP storage on any fsspec filesystem, with the same CRC32C records and checks as on disk.

:class:`ChecksummingFsspecWriter` and :class:`VerifyingFsspecReader` are the local writer and
reader of :mod:`~lightning_megatron_fsdp.dcp_storage` with their file access pointed at an
fsspec filesystem: each rank uploads its shard objects through the filesystem's own
streaming writer (parts go out as they fill, so memory stays at one part per open object)
and the CRC32C of every record is taken from the bytes as they go out; a load reads each
record with ranged GETs straight into its target and checks it. The objects are byte for
byte what the local writer writes, so a checkpoint copied between a disk and a bucket
loads either way.
"""

from __future__ import annotations

import contextlib
import io
import os
import posixpath
from collections.abc import Callable, Iterator
from typing import Any

from torch.distributed.checkpoint.filesystem import FileSystemBase
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future
from typing_extensions import override

from lightning_megatron_fsdp.checkpoint.checksums import stream_digest
from lightning_megatron_fsdp.checkpoint.errors import NotACheckpointError
from lightning_megatron_fsdp.checkpoint.format import DCP_METADATA_FILE, Manifest
from lightning_megatron_fsdp.checkpoint.object_store import ObjectStore
from lightning_megatron_fsdp.checkpoint.storage import (
    ChecksummingFileSystemWriter,
    Record,
    RecordStream,
    VerifyingFileSystemReader,
    WrittenFile,
)

__all__ = ["ChecksummingFsspecWriter", "VerifyingFsspecReader"]

_PART = 8 << 20
"""Upload part size: an object being written holds at most about two parts in memory
(the filesystem's default, 50 MiB for s3fs, cost four times as much per open object)."""

_RANGE = 32 << 20
"""Largest ranged GET a load issues: a record larger than this is read in pieces, so a
read holds at most this much beyond its target."""


class _FsspecFileSystem(FileSystemBase):
    """DCP's file operations on an fsspec filesystem; write streams CRC32C what passes.

    Paths are the filesystem's own (``bucket/key``). Object stores have no directories,
    so ``mkdir`` creates none.
    """

    def __init__(self, fs: Any, checksum: bool = False) -> None:
        self.fs = fs
        self.checksum = checksum
        self.files: dict[str, WrittenFile] = {}
        self.records: dict[str, dict[int, Record]] = {}

    @override
    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[io.IOBase]:
        path = os.fspath(path)
        if mode != "wb":
            with self.fs.open(path, mode) as stream:
                yield stream
            return
        file = self.fs.open(path, "wb", block_size=_PART)
        stream = RecordStream(file, self.checksum)
        try:
            yield stream
        except BaseException:
            # Abort the upload (a multipart upload would otherwise complete with what was
            # written so far); the object never appears.
            with contextlib.suppress(Exception):
                file.discard()
            with contextlib.suppress(Exception):
                file.closed = True
            raise
        stream.close()
        name = posixpath.basename(path)
        self.files[name] = stream.written()
        self.records[name] = {r.start: r for r in stream.records}

    @override
    def concat_path(self, path: str | os.PathLike[str], suffix: str) -> str:
        return posixpath.join(os.fspath(path), suffix)

    @override
    def init_path(self, path: str | os.PathLike[str], **kwargs: Any) -> str:
        return os.fspath(path)

    @override
    def rename(self, path: str | os.PathLike[str], new_path: str | os.PathLike[str]) -> None:
        self.fs.mv(os.fspath(path), os.fspath(new_path))
        old, new = posixpath.basename(os.fspath(path)), posixpath.basename(os.fspath(new_path))
        if old in self.files:
            self.files[new] = self.files.pop(old)
            self.records[new] = self.records.pop(old)

    @override
    def mkdir(self, path: str | os.PathLike[str]) -> None:
        """Nothing: an object store creates prefixes with their first object."""

    @classmethod
    @override
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False

    @override
    def exists(self, path: str | os.PathLike[str]) -> bool:
        return bool(self.fs.exists(os.fspath(path)))

    @override
    def rm_file(self, path: str | os.PathLike[str]) -> None:
        self.fs.rm_file(os.fspath(path))

    @override
    def ls(self, path: str | os.PathLike[str]) -> list[str]:
        return list(self.fs.ls(os.fspath(path), detail=False))


class ChecksummingFsspecWriter(ChecksummingFileSystemWriter):
    """:class:`~lightning_megatron_fsdp.dcp_storage.ChecksummingFileSystemWriter` writing
    into the prefix ``path`` of ``store``'s filesystem; no file is synced (an object is
    durable once its upload completes).

    Args:
        store: The object store.
        path: The prefix to write into (the filesystem's path, no scheme).
        checksum: Compute CRC32Cs.
        **kwargs: ``FileSystemWriter``'s options (``thread_count``: objects uploaded at
            once per rank).
    """

    def __init__(self, store: ObjectStore, path: str, *, checksum: bool = True, **kwargs: Any):
        kwargs["sync_files"] = False
        super().__init__(path, checksum=checksum, **kwargs)
        self.store = store
        self.fs = _FsspecFileSystem(store.fs, checksum)
        self.path = path

    @override
    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        try:
            return super().write_data(plan, planner)
        except Exception as err:
            raise OSError(
                f"uploading this rank's shard objects to {self.store.url(self.path)} failed: "
                f"{type(err).__name__}: {err}"
            ) from err

    @override
    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        try:
            super().finish(metadata, results)
        except Exception as err:
            raise OSError(
                f"uploading {DCP_METADATA_FILE} to {self.store.url(self.path)} failed: "
                f"{type(err).__name__}: {err}"
            ) from err


class VerifyingFsspecReader(VerifyingFileSystemReader):
    """:class:`~lightning_megatron_fsdp.dcp_storage.VerifyingFileSystemReader` reading the
    checkpoint under the prefix ``path`` of ``store``'s filesystem with ranged GETs.

    Args:
        store: The object store.
        path: The prefix of one complete version (the filesystem's path, no scheme).
        verify: As for the local reader.
        trust_checkpoint: As for the local reader: unpickle ``.metadata`` and byte records
            in full.
    """

    def __init__(
        self, store: ObjectStore, path: str, *, verify: bool = True, trust_checkpoint: bool = False
    ) -> None:
        super().__init__(path, verify=verify, trust_checkpoint=trust_checkpoint)
        self.store = store
        self.fs = _FsspecFileSystem(store.fs)
        self.path = path

    @override
    def _checkpoint_manifest(self) -> Manifest | None:
        if not self._manifest_read:
            self._manifest_read = True
            with contextlib.suppress(NotACheckpointError):
                self._manifest = self.store.read_manifest(self.path)
        return self._manifest

    @override
    def _display(self, name: str) -> str:
        return self.store.url(posixpath.join(self.path, name))

    @override
    def _read_whole(self, name: str) -> bytes:
        self._expected_size(name)  # only files the manifest lists
        return self.store.read_bytes(posixpath.join(self.path, name))

    @override
    def _file_digest(self, name: str, algorithm: str) -> str:
        with self.store.fs.open(posixpath.join(self.path, name), "rb") as file:
            return stream_digest(file, algorithm)

    @override
    @contextlib.contextmanager
    def _opened(self, name: str) -> Iterator[Callable[[list[Any], int], int]]:
        self._expected_size(name)  # only files the manifest lists
        path = posixpath.join(self.path, name)
        fs = self.store.fs

        def read_at(buffers: list[Any], offset: int) -> int:
            views = [memoryview(b).cast("B") for b in buffers]
            views = [v for v in views if v.nbytes]
            total = sum(v.nbytes for v in views)
            done = 0
            while done < total:
                want = min(_RANGE, total - done)
                data = fs.cat_file(path, start=offset + done, end=offset + done + want)
                _scatter(views, done, data)
                done += len(data)
                if len(data) < want:
                    break
            return done

        yield read_at


def _scatter(views: list[memoryview], at: int, data: bytes) -> None:
    """Copy ``data`` into the concatenation of ``views`` starting at byte ``at``."""
    source = memoryview(data)
    for view in views:
        if at >= view.nbytes:
            at -= view.nbytes
            continue
        n = min(view.nbytes - at, source.nbytes)
        view[at : at + n] = source[:n]
        source = source[n:]
        at = 0
        if not source.nbytes:
            return
