"""DCP storage on any fsspec filesystem, with the same CRC32C records and checks as on disk.

:class:`ChecksummingFsspecWriter` and :class:`VerifyingFsspecReader` are the local writer and
reader of :mod:`~lightning_megatron_fsdp.storage.filesystem` with their file access pointed at
an fsspec filesystem. A save must not need much more memory than the state it writes, so
each rank's shard objects go up in a bounded number of parts at once (on S3 a multipart
upload whose parts hold the tensors' bytes by reference, not copies), the CRC32C of every record
taken from the bytes as they go out; a load must not pay a request per record nor hold
copies of what it reads, so each run of adjacent records is read with a few concurrent
ranged GETs (on S3 received straight into the records' targets) and each record is
checked before it is handed on. The objects are byte for byte what the local writer
writes, so a checkpoint copied between a disk and a bucket loads either way
(docs/DESIGN.md, "Object storage": the mechanism and the alternatives).
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import errno
import functools
import io
import itertools
import math
import os
import posixpath
import sys
import threading
from collections.abc import Iterator, Sequence
from typing import Any

from fsspec.asyn import sync
from torch.distributed.checkpoint.filesystem import FileSystemBase
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
)
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future
from typing_extensions import override

from lightning_megatron_fsdp.errors import NotACheckpointError
from lightning_megatron_fsdp.storage.filesystem import (
    BatchRead,
    ChecksummingFileSystemWriter,
    ReadProgress,
    VerifyingFileSystemReader,
    byte_view,
)
from lightning_megatron_fsdp.storage.format import DCP_METADATA_FILE, Manifest
from lightning_megatron_fsdp.storage.object_store import (
    Landing,
    ObjectStore,
    abort_upload,
    read_ranges,
    reads_in_place,
    unwrapped,
)

__all__ = ["ChecksummingFsspecWriter", "VerifyingFsspecReader"]

_MIN_PART = 5 << 20
"""S3's smallest upload part (but the last): the part size unless an object could need more
than :data:`_MAX_PARTS` of them."""

_MAX_PARTS = 10_000
"""S3's most parts per object."""

_PART_SHARE = 5
"""The parts in flight could hold copies of at most ``1 / _PART_SHARE`` of the bytes the
rank writes (at least one part, at most ``thread_count``), so a save's peak memory stays
close to the rank's resident state even where no record's payload is sent by reference."""

_RANGE = 4 << 20
"""Bytes per ranged GET of a load: consecutive records are read together up to this size,
a larger record in pieces of it."""

_WINDOW = 4
"""The most ranged GETs of a load in flight at once: a GET's latency (the server's seek,
the first byte's round trip) and the checks of the bytes before it overlap the others'
transfers."""

_READ_SHARE = 10
"""Where a GET's bytes arrive whole before they are copied into their buffers (every
filesystem but s3fs: ``object_store.reads_in_place``), each GET in flight holds about twice
its range, so there the GETs in flight hold at most ``1 / _READ_SHARE`` of the bytes a
rank reads (at least one GET, at most :data:`_WINDOW`) and a load's peak memory stays close
to the rank's state. On S3 a GET holds none: its body lands in the targets."""


class _Part(io.RawIOBase):
    """One upload part, read by the client as one file: views the writer keeps (a tensor
    record's payload and its template's bytes, by reference) and, between them, copies of
    everything else. Over plain HTTP aiohttp sends its pieces from the event loop
    (:func:`_send_parts_whole`).

    Every call of the client that sends it starts from its first byte
    (:func:`_rewind_parts`); botocore rewinds it itself between its own attempts."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0
        """How many times the client was called to send it (s3fs's attempts)."""
        self.length = 0
        """Bytes written since it was taken."""
        self._pieces: list[memoryview | bytearray] = []
        """Kept views, and the copies written between them (one buffer per run of them)."""
        self._views: list[memoryview] = []
        self._ends: list[int] = []
        self._at = 0

    def reset(self) -> None:
        """Empty: its views and copies dropped."""
        self._pieces, self._views, self._ends = [], [], []
        self.length = self._at = 0

    def copy(self, view: memoryview) -> None:
        """Append a copy of ``view``'s bytes."""
        if not self._pieces or not isinstance(self._pieces[-1], bytearray):
            self._pieces.append(bytearray())
        self._pieces[-1] += view
        self.length += view.nbytes

    def keep(self, view: memoryview) -> None:
        """Append ``view`` itself (its bytes must not change until the part is sent)."""
        self._pieces.append(view)
        self.length += view.nbytes

    def body(self) -> _Part:
        """The part as a request body: exactly the bytes written since it was taken."""
        self._views = [memoryview(piece) for piece in self._pieces]
        self._ends = list(itertools.accumulate(view.nbytes for view in self._views))
        self._at = 0
        self.calls = 0
        return self

    @override
    def readable(self) -> bool:
        return True

    @override
    def seekable(self) -> bool:
        return True

    def pieces(self) -> Iterator[memoryview]:
        """The bytes from the current position to the end, as views of the pieces (the
        position moves past each as it is taken)."""
        return self._slices(-1)

    def _slices(self, size: int) -> Iterator[memoryview]:
        """The next ``size`` bytes (all that are left if negative), as views; advances."""
        end = self.length if size < 0 else min(self.length, self._at + size)
        index = bisect.bisect_right(self._ends, self._at)
        while self._at < end:
            view = self._views[index]
            start = self._at - (self._ends[index] - view.nbytes)
            piece = view[start : start + end - self._at]
            self._at += piece.nbytes
            index += 1
            yield piece

    @override
    def read(self, size: int | None = -1) -> bytes:
        """Bytes copied once from the pieces (``RawIOBase`` would copy twice)."""
        return b"".join(self._slices(-1 if size is None else size))

    @override
    def readinto(self, buffer: Any) -> int:
        out = byte_view(buffer)
        done = 0
        for piece in self._slices(out.nbytes):
            out[done : done + piece.nbytes] = piece
            done += piece.nbytes
        return done

    @override
    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._at, io.SEEK_END: self.length}[whence]
        self._at = max(0, base + offset)
        return self._at

    @override
    def tell(self) -> int:
        return self._at

    @override
    def close(self) -> None:
        """Kept open: a client may close a body it sent, and s3fs's next call of a
        throttled upload sends the same part again (:func:`_rewind_parts`)."""


_SEND = 256 << 10
"""Bytes of a part handed to aiohttp's writer at a time: what the socket does not take at
once, the event loop's transport may copy (before Python 3.12 it does), so no more than
this is held twice per request."""


@functools.cache
def _send_parts_whole() -> None:
    """Have aiohttp send a :class:`_Part` as the views it holds, from the event loop
    (once per process; aiohttp's public payload registry, for our own type only).

    Without it aiohttp takes a part for a file: it reads it in small pieces, each copied
    and each read on a worker thread, a hop between threads per piece. Another client
    library, or an aiohttp without this registry, still reads the part as a file. Over
    HTTPS botocore's default trailing checksum wraps the part in a chunked body of its own,
    which aiohttp sends as before: this serves plain-HTTP endpoints (an in-cluster store)
    and clients that send checksums only when required.
    """
    try:
        from aiohttp import payload
    except ImportError:
        return

    class PartPayload(payload.Payload):
        """A :class:`_Part` as a request body: its pieces from where the client's attempt
        put it (botocore rewinds it for every attempt), written as they are, the same
        bytes each time aiohttp writes it."""

        def __init__(self, value: _Part, *args: Any, **kwargs: Any) -> None:
            kwargs.setdefault("content_type", "application/octet-stream")
            super().__init__(value, *args, **kwargs)
            self.part = value
            self.start = value.tell()
            self._size = value.length - self.start

        @override
        async def write(self, writer: Any) -> None:
            await self.write_with_length(writer, None)

        @override
        async def write_with_length(self, writer: Any, content_length: int | None) -> None:
            left = self._size if content_length is None else content_length
            self.part.seek(self.start)  # a request aiohttp sends again sends it whole
            for piece in self.part.pieces():
                for at in range(0, min(piece.nbytes, left), _SEND):
                    await writer.write(piece[at : min(at + _SEND, left)])
                left -= piece.nbytes
                if left <= 0:
                    break

        @override
        def decode(self, encoding: str = "utf-8", errors: str = "strict") -> str:
            self.part.seek(self.start)
            return b"".join(self.part.pieces()).decode(encoding, errors)

    payload.register_payload(PartPayload, _Part, order=payload.Order.try_first)


_REWIND_ID = "lightning_megatron_fsdp.rewind_parts"


def _rewind_parts(params: dict[str, Any], **_: Any) -> None:
    """botocore handler, run as each call of an operation starts: a part sent as its body
    goes from its first byte.

    botocore rewinds a body between its own attempts, but s3fs retries a throttled call
    (``SlowDown``, after botocore gave up) with the same body, read to its end by then: the
    server would store an empty object and answer 200. Rejected: a ``bytes`` copy of each
    part (what s3fs's own ``pipe_file`` sends) holds every part's bytes twice; retrying here
    with s3fs's retries turned off would change the user's filesystem.
    """
    body = params.get("Body")
    if isinstance(body, _Part):
        body.seek(0)
        body.calls += 1


class _PartBudget:
    """The upload parts a rank's writer threads may hold at once, and their size.

    A thread takes a part when it starts filling one and gives it back once it is
    uploaded, so the bytes copied for uploads never exceed ``slots * size``.
    """

    def __init__(self, size: int, slots: int) -> None:
        self.size = size
        self.slots = slots
        self._free = threading.BoundedSemaphore(slots)

    @classmethod
    def for_bytes(cls, total: int, threads: int) -> _PartBudget:
        """The budget of a rank writing ``total`` bytes with ``threads`` threads."""
        mib = 1 << 20
        size = max(_MIN_PART, -(-total // (_MAX_PARTS - 1) // mib) * mib)
        slots = max(1, min(threads, total // _PART_SHARE // size))
        return cls(size, slots)

    def take(self) -> _Part:
        """An empty part; waits while every slot is taken."""
        self._free.acquire()
        return _Part()

    def give(self, part: _Part) -> None:
        """``part`` was sent or dropped: its slot is free (and its bytes let go)."""
        part.reset()
        self._free.release()


class _S3Upload(io.RawIOBase):
    """One S3 object written as a multipart upload whose parts are filled here (tensor
    payloads by reference: :meth:`write_kept`) and read by the client as files, each taken
    from ``budget``; an object smaller than one part is one PUT. Nothing is visible before
    :meth:`close`; :meth:`discard` aborts the upload. A failed :meth:`close` leaves the
    upload closed (never tried again by the finaliser): the caller aborts it."""

    def __init__(self, fs: Any, path: str, budget: _PartBudget) -> None:
        super().__init__()
        self._fs = fs
        self._path = path
        self._bucket, self._key, _ = fs.split_path(path)
        self._budget = budget
        _send_parts_whole()
        self._part: _Part | None = None
        self._upload: str | None = None
        self._parts: list[dict[str, Any]] = []

    @override
    def write(self, data: Any) -> int:
        return self._add(byte_view(data), keep=False)

    def write_kept(self, data: Any) -> int:
        """Write ``data`` by reference: an immutable object (``bytes``), or a view that
        keeps its memory alive and whose bytes do not change until :meth:`close`."""
        return self._add(byte_view(data), keep=True)

    def _add(self, view: memoryview, keep: bool) -> int:
        size = view.nbytes
        while view.nbytes:
            if self._part is None:
                self._part = self._budget.take()
            piece = view[: self._budget.size - self._part.length]
            (self._part.keep if keep else self._part.copy)(piece)
            view = view[piece.nbytes :]
            if self._part.length >= self._budget.size:
                self._send()
        return size

    @override
    def writable(self) -> bool:
        return True

    def _send(self) -> None:
        """Upload the part being filled and give its slot back."""
        part, self._part = self._part, None
        assert part is not None
        try:
            if self._upload is None:
                created = self._call("create_multipart_upload")
                self._upload = created["UploadId"]
            number = len(self._parts) + 1
            body = part.body()
            out = self._call("upload_part", UploadId=self._upload, PartNumber=number, Body=body)
            self._parts.append({"PartNumber": number, "ETag": out["ETag"]})
        finally:
            self._budget.give(part)

    def _call(self, method: str, **kwargs: Any) -> Any:
        """``method`` of the bucket's client on this object, its body rewound for every
        call (:func:`_rewind_parts`); a throttled call that gave up says so."""
        fs = self._fs
        sync(fs.loop, fs.set_session)
        client = sync(fs.loop, fs.get_s3, self._bucket)
        client.meta.events.register("before-parameter-build.s3", _rewind_parts, _REWIND_ID)
        try:
            return fs.call_s3(method, Bucket=self._bucket, Key=self._key, **kwargs)
        except Exception as err:
            body = kwargs.get("Body")
            throttled = _throttled(err, self._fs.unstrip_protocol(self._path), method, body)
            if throttled is None:
                raise
            raise throttled from err

    @override
    def close(self) -> None:
        """Complete the upload: the object appears, whole."""
        if self.closed:
            return
        try:
            if self._upload is None:
                part, self._part = self._part, None
                try:
                    self._call("put_object", Body=io.BytesIO() if part is None else part.body())
                finally:
                    if part is not None:
                        self._budget.give(part)
            else:
                if self._part is not None:
                    self._send()
                self._call(
                    "complete_multipart_upload",
                    UploadId=self._upload,
                    MultipartUpload={"Parts": self._parts},
                )
        finally:
            super().close()
        with contextlib.suppress(Exception):
            self._fs.invalidate_cache(self._path)

    def discard(self) -> None:
        """Abort: give the part's slot back, drop the parts uploaded; nothing appears."""
        if self._part is not None:
            part, self._part = self._part, None
            self._budget.give(part)
        if self._upload is not None:
            with contextlib.suppress(Exception):
                self._call("abort_multipart_upload", UploadId=self._upload)
        super().close()


def _throttled(err: BaseException, url: str, method: str, body: Any) -> OSError | None:
    """The error for a call the server kept answering ``503`` (throttled), or ``None``."""
    cause = err.__cause__ if err.__cause__ is not None else err
    response = getattr(cause, "response", None) or {}
    meta = response.get("ResponseMetadata") or {}
    code = (response.get("Error") or {}).get("Code")
    if meta.get("HTTPStatusCode") != 503 and code != "SlowDown":
        return None
    per_call = int(meta.get("RetryAttempts") or 0) + 1
    calls = body.calls if isinstance(body, _Part) and body.calls else 1
    return OSError(
        errno.EBUSY,
        f"the object store throttled the upload of {url}: it answered 503 {code or ''} "
        f"(slow down) to every attempt of {method} ({calls} calls by s3fs, "
        f"{per_call} attempts each by botocore), and the upload gave up. Nothing of this "
        "save was committed. Lower the request rate (fewer ranks or `thread_count` per "
        "rank) or allow more retries (`storage_options`: s3fs's `retries`, botocore's "
        "`config_kwargs={'retries': {'max_attempts': ...}}`).",
    )


def _is_s3(fs: Any) -> bool:
    s3fs = sys.modules.get("s3fs")
    return s3fs is not None and isinstance(unwrapped(fs), s3fs.S3FileSystem)


class _FsspecFileSystem(FileSystemBase):
    """DCP's file operations on an fsspec filesystem (the writer checksums what passes
    through its streams, as on any file system).

    Paths are the filesystem's own (``bucket/key``). Object stores have no directories,
    so ``mkdir`` creates none. On S3 an object is written by :class:`_S3Upload` within
    :attr:`budget`; elsewhere by the filesystem's own buffered writer in parts of the
    budget's size.
    """

    def __init__(self, fs: Any) -> None:
        self.fs = fs
        self.budget = _PartBudget(_MIN_PART, 1)

    @override
    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[io.IOBase]:
        path = os.fspath(path)
        if mode != "wb":
            with self.fs.open(path, mode) as stream:
                yield stream
            return
        if _is_s3(self.fs):
            file: Any = _S3Upload(self.fs, path, self.budget)
        else:
            file = self.fs.open(path, "wb", block_size=self.budget.size)
        try:
            yield file
            file.close()
        except BaseException:
            abort_upload(file)  # the object never appears (nor a part of it)
            raise

    @override
    def concat_path(self, path: str | os.PathLike[str], suffix: str) -> str:
        return posixpath.join(os.fspath(path), suffix)

    @override
    def init_path(self, path: str | os.PathLike[str], **kwargs: Any) -> str:
        return os.fspath(path)

    @override
    def rename(self, path: str | os.PathLike[str], new_path: str | os.PathLike[str]) -> None:
        self.fs.mv(os.fspath(path), os.fspath(new_path))

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


class _NewVersion(_FsspecFileSystem):
    """:class:`_FsspecFileSystem` as a save's writer sees the new version it writes: the
    version's prefix is this save's own (its token), so nothing is there but what this save
    writes, and an object appears whole with its upload. DCP's writer guards against an
    existing checkpoint there (``exists``) and writes ``.metadata`` under a temporary name
    that it then renames; on an object store the first is a request that can only answer
    no, and the rename a copy and a delete of the object. Here nothing exists (so DCP's
    ``finish`` neither finds nor deletes the ``.metadata`` it has just written), and a
    temporary name is the final one, so the rename has nothing to do."""

    @override
    def concat_path(self, path: str | os.PathLike[str], suffix: str) -> str:
        return super().concat_path(path, suffix.removesuffix(".tmp"))

    @override
    def exists(self, path: str | os.PathLike[str]) -> bool:
        return False

    @override
    def rename(self, path: str | os.PathLike[str], new_path: str | os.PathLike[str]) -> None:
        if os.fspath(path) != os.fspath(new_path):
            super().rename(path, new_path)


class ChecksummingFsspecWriter(ChecksummingFileSystemWriter):
    """:class:`~lightning_megatron_fsdp.dcp_storage.ChecksummingFileSystemWriter` writing
    into the prefix ``path`` of ``store``'s filesystem, a save's new version that nothing
    else writes (:class:`_NewVersion`); no file is synced (an object is durable once its
    upload completes).

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
        self._uploads = _NewVersion(store.fs)
        self.fs = self._uploads  # wrapped: its streams checksum what passes
        self.path = path

    @override
    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        self._uploads.budget = _PartBudget.for_bytes(_plan_bytes(plan), self.thread_count)
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

    batch_bytes = _RANGE  # one GET per run of adjacent records: requests cost, bytes less

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

    _listing: dict[str, int] | None = None

    @override
    def _expected_size(self, name: str) -> int | None:
        """The manifest's size; for another writer's DCP checkpoint (no manifest) the
        store's listing's, so a missing object is named before any read."""
        if self._checkpoint_manifest() is not None:
            return super()._expected_size(name)
        if self._listing is None:
            self._listing = self.store.sizes(self.path)
        if name not in self._listing:
            raise self._corrupted(name, f"missing; {DCP_METADATA_FILE} stores data there")
        return self._listing[name]

    @override
    def _display(self, name: str) -> str:
        return self.store.url(posixpath.join(self.path, name))

    @override
    def _file_size(self, name: str) -> int:
        return int(self.store.fs.size(posixpath.join(self.path, name)))

    @override
    def _read_whole(self, name: str) -> bytes:
        size = self._expected_size(name)  # only files the manifest lists
        return self.store.read_bytes(posixpath.join(self.path, name), size=size)

    @override
    def _file_digest(self, name: str, algorithm: str) -> str:
        return self.store.digest(posixpath.join(self.path, name), algorithm)

    @override
    def read_files(self, names: Sequence[str]) -> list[bytes]:
        """As the local reader's, all requested at once where the manifest gives their
        sizes (one byte more each: a longer object is refused, as ``read_bytes`` does)."""
        sizes = [self._expected_size(name) for name in names]
        if not all(sizes):
            return super().read_files(names)
        found = [bytearray(size + 1) for size in sizes]
        wanted = [
            (posixpath.join(self.path, name), 0, [memoryview(data)])
            for name, data in zip(names, found, strict=True)
        ]
        with contextlib.closing(read_ranges(self.store.fs, iter(wanted), window=_WINDOW)) as got:
            for name, size, filled in zip(names, sizes, got, strict=True):
                if filled != size:
                    raise self._corrupted(name, f"{filled} bytes stored where {size} were expected")
        return [bytes(data[:-1]) for data in found]

    @override
    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """The bytes of every file this rank reads, each run of adjacent records as one
        span of ranged GETs of about :data:`_RANGE` bytes (:func:`_cut`) that fill the
        records' buffers (on S3 straight into the targets: see :class:`_Landing`), up to
        :data:`_WINDOW` of them in flight at once across spans and files; each batch's
        records are checked and handed on, in order, once their bytes are there."""
        self.progress = ReadProgress(started=True, total=len(plan.items))
        batches: list[tuple[int, str, list[ReadItem]]] = []  # (span, file, batch)
        spans: list[list[Any]] = []  # [path, start, end] of each run of adjacent records
        for name, items in self._per_file(plan).items():
            self._expected_size(name)  # only files the manifest lists
            path = posixpath.join(self.path, name)
            for batch in self._batches(items):
                start = self.storage_data[batch[0].storage_index].offset
                last = self.storage_data[batch[-1].storage_index]
                if spans and spans[-1][0] == path and spans[-1][2] == start:
                    spans[-1][2] = last.offset + last.length
                else:
                    spans.append([path, start, last.offset + last.length])
                batches.append((len(spans) - 1, name, batch))
        window = _WINDOW
        if not reads_in_place(self.store.fs):
            total = sum(end - start for _, start, end in spans)
            window = max(1, min(_WINDOW, total // _READ_SHARE // (2 * _RANGE)))
        landing = _Landing(self, planner, batches, [tuple(span) for span in spans])
        with contextlib.closing(read_ranges(self.store.fs, landing.ranges(), window=window)) as got:
            while True:
                landing.waiting()
                filled = next(got, None)
                if filled is None:
                    break
                landing.arrived(filled)
        landing.finish()
        done: Future[None] = Future()
        done.set_result(None)
        return done


class _Landing:
    """A rank's batches of records, prepared (their buffers: the targets themselves where a
    record is its target's exact chunk) as the ranged GETs that fill them are sent, and
    each checked and handed on, in order, once every byte of it has arrived.

    Records are prepared in file order, only as far as the GETs sent need (so at most
    ``window`` ranges' worth of buffers are held ahead of the checks); the reader's
    progress names the first record not yet handed on and counts every prepared one after
    it, whose targets may hold unchecked bytes if a read fails.
    """

    def __init__(
        self,
        reader: VerifyingFsspecReader,
        planner: LoadPlanner,
        batches: list[tuple[int, str, list[ReadItem]]],
        spans: list[tuple[str, int, int]],
    ) -> None:
        self._reader, self._planner = reader, planner
        self._batches = iter(batches)
        self._spans = spans
        self._landed = [start for _, start, _ in spans]
        """Per span, the file offset up to which its bytes have arrived."""
        self._prepared: collections.deque[tuple[int, int, BatchRead]] = collections.deque()
        """(span, end offset, batch) of the batches prepared and not yet handed on."""
        self._records = 0
        """Records of :attr:`_prepared`."""
        self._free: collections.deque[memoryview] = collections.deque()
        """Buffers of prepared batches not yet given to a GET, in file order."""
        self._sent: collections.deque[tuple[int, int, int]] = collections.deque()
        """(span, start, end) of each range given to a GET and not yet arrived."""

    def ranges(self) -> Iterator[Landing]:
        """Every span's ranges with the buffers they fill, the batches under each prepared
        as it is taken."""
        for index, (path, start, end) in enumerate(self._spans):
            for _, begin, stop in _cut(path, start, end):
                buffers = self._buffers(stop - begin)
                self._sent.append((index, begin, stop))
                yield path, begin, buffers

    def _buffers(self, size: int) -> list[memoryview]:
        """The next ``size`` bytes of buffers, in file order."""
        taken = []
        while size:
            if not self._free:
                self._prepare_next()
                continue
            view = self._free.popleft()
            if view.nbytes > size:
                self._free.appendleft(view[size:])
                view = view[:size]
            taken.append(view)
            size -= view.nbytes
        return taken

    def _prepare_next(self) -> BatchRead:
        span, name, batch = next(self._batches)
        info = self._reader.storage_data[batch[-1].storage_index]
        self._records += len(batch)
        self._point(batch)
        reading = self._reader._prepare_batch(name, batch, self._planner)
        self._prepared.append((span, info.offset + info.length, reading))
        self._free.extend(view for _, view in reading.pieces if view.nbytes)
        return reading

    def _point(self, batch: list[ReadItem] | None = None) -> None:
        """The progress a failure now reports: the first record not handed on, and every
        prepared one after it."""
        if self._prepared:
            first = self._prepared[0][2].items[0]
        elif batch:
            first = batch[0]
        else:
            return
        progress = self._reader.progress
        progress.current, progress.also = first.dest_index.fqn, self._records - 1

    def waiting(self) -> None:
        """About to wait for the next range."""
        self._point()

    def arrived(self, filled: int) -> None:
        """The oldest range sent filled ``filled`` bytes (fewer than asked: its object ended
        there); check and hand on every batch whose bytes are now all there, and the one
        the object ended inside (which refuses it)."""
        span, start, end = self._sent.popleft()
        self._landed[span] = start + filled
        short = filled < end - start
        while self._prepared:
            at, stop, _ = self._prepared[0]
            if at > span or (at == span and stop > self._landed[span] and not short):
                break
            self._hand_on()

    def _hand_on(self) -> None:
        span, stop, reading = self._prepared.popleft()
        self._records -= len(reading.items)
        got = min(self._landed[span], stop) - reading.start
        reading.checksum(reading.pieces, got)
        self._reader._finish_batch(reading, got, after=self._records)

    def finish(self) -> None:
        """Every range has arrived: hand on what is left (batches of no bytes)."""
        while True:
            try:
                self._prepare_next()
            except StopIteration:
                break
        while self._prepared:
            self._hand_on()


def _cut(path: str, start: int, end: int) -> list[tuple[str, int, int]]:
    """``[start, end)`` of ``path`` in the whole number of about equal ranges nearest to
    :data:`_RANGE` bytes each (at most 1.5 times it): no GET for a few bytes left over."""
    if end <= start:
        return []  # no GET: an empty Range header would fetch the whole object
    count = max(1, round((end - start) / _RANGE))
    bounds = [start + (end - start) * k // count for k in range(count + 1)]
    return [(path, a, b) for a, b in itertools.pairwise(bounds)]


def _plan_bytes(plan: SavePlan) -> int:
    """The tensor bytes ``plan`` writes (byte items, small, are not counted)."""
    total = 0
    for item in plan.items:
        if item.tensor_data is not None:
            sizes = item.tensor_data.chunk.sizes
            total += math.prod(sizes) * item.tensor_data.properties.dtype.itemsize
    return total
