"""Checkpoints on object storage (S3 and any fsspec filesystem): URLs, and a commit without rename.

A path such as ``s3://bucket/run/ckpts/last.ckpt`` is a URL: it goes to the fsspec filesystem
of its scheme, never to a local directory named ``s3:``; a scheme whose filesystem is not
installed fails naming what to install. An object store has no directories and no atomic
rename, so a checkpoint ``<name>`` is a prefix holding numbered versions, each written in
full before its ``manifest.json`` (one PUT, the commit record) and found by listing: a reader
takes the newest version whose manifest parses and whose objects all have their recorded
sizes, so a partial save is never taken for a checkpoint and a crash at any point leaves the
previous one loadable. The protocol and the alternatives are in docs/DESIGN.md, "Object
storage".
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import fnmatch
import inspect
import io
import json
import logging
import posixpath
import re
import sys
import threading
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from typing_extensions import override

from lightning_megatron_fsdp.errors import (
    CheckpointError,
    CheckpointSaveError,
    NotACheckpointError,
)
from lightning_megatron_fsdp.storage.checksums import stream_digest
from lightning_megatron_fsdp.storage.commit import reach
from lightning_megatron_fsdp.storage.confined_files import SeekableStream
from lightning_megatron_fsdp.storage.format import (
    DCP_METADATA_FILE,
    MANIFEST_FILE,
    Manifest,
    summarise,
)

__all__ = [
    "CompleteVersion",
    "DeadlineFileSystem",
    "Landing",
    "Listing",
    "ObjectStore",
    "StoreVersion",
    "abort_upload",
    "is_url",
    "local_path",
    "open_store",
    "read_ranges",
    "reads_in_place",
    "unwrapped",
    "url_protocol",
]

log = logging.getLogger(__name__)

_URL_RE = re.compile(r"^(?P<protocol>[A-Za-z][A-Za-z0-9+.\-]*)://")
_LOCAL_PROTOCOLS = ("file", "local")
# Read-ahead of a digest's stream: fsspec's default block is far larger than a checksum needs.
DIGEST_BLOCK_BYTES = 8 << 20
_VERSION_RE = re.compile(r"^v(?P<number>\d{8})-(?P<token>[0-9a-f]{8,32})$")

# What to install for a scheme whose fsspec filesystem is missing.
_INSTALL = {
    "s3": "pip install 'lightning-megatron-fsdp[s3]'",
    "s3a": "pip install 'lightning-megatron-fsdp[s3]'",
    "gs": "pip install gcsfs",
    "gcs": "pip install gcsfs",
    "az": "pip install adlfs",
    "abfs": "pip install adlfs",
    "abfss": "pip install adlfs",
}


def url_protocol(path: Any) -> str | None:
    """The scheme of ``path`` if it is a URL of a non-local filesystem, else ``None``.

    ``file://`` URLs and every ``os.PathLike`` (a ``Path`` has already lost its ``//``) are
    local paths.
    """
    if not isinstance(path, str):
        return None
    match = _URL_RE.match(path)
    if match is None or match["protocol"].lower() in _LOCAL_PROTOCOLS:
        return None
    return match["protocol"].lower()


def is_url(path: Any) -> bool:
    """Whether ``path`` names a location on a non-local fsspec filesystem."""
    return url_protocol(path) is not None


def abort_upload(file: Any) -> None:
    """Abandon an fsspec file open for writing without completing it: ``close()`` would
    complete a multipart upload with what was written so far, so the object is discarded and
    the file marked closed (its finaliser then uploads nothing). Never raises."""
    with contextlib.suppress(Exception):
        file.discard()
    with contextlib.suppress(Exception):
        file.closed = True


def local_path(path: Any) -> Any:
    """``path`` without a ``file://`` scheme (other paths unchanged)."""
    if isinstance(path, str):
        match = _URL_RE.match(path)
        if match is not None and match["protocol"].lower() in _LOCAL_PROTOCOLS:
            return (
                path[match.end() - 1 :]
                if path[match.end() :].startswith("/")
                else path[match.end() :]
            )
    return path


def _filesystem(url: str, storage_options: Mapping[str, Any] | None) -> tuple[Any, str]:
    """fsspec's filesystem for ``url`` and the path inside it.

    Raises:
        ImportError: The scheme's filesystem is not installed; the message names the
            package (or extra) to install.
        ValueError: fsspec knows no filesystem for the scheme.
    """
    import fsspec
    from fsspec.core import url_to_fs

    protocol = url_protocol(url)
    assert protocol is not None, url
    try:
        fsspec.get_filesystem_class(protocol)
    except ImportError as err:
        install = _INSTALL.get(protocol, f"the fsspec implementation of {protocol!r}")
        raise ImportError(
            f"Checkpoint location {url}: the fsspec filesystem for {protocol}:// is not "
            f"installed ({err}). Install it: {install}. (Nothing was written: a URL is never "
            "taken for a local directory.)"
        ) from err
    except ValueError as err:
        raise ValueError(
            f"Checkpoint location {url}: fsspec knows no filesystem for {protocol}:// "
            f"({err}). Use a local path, or a URL of an installed fsspec filesystem "
            "(s3://, gs://, az://, ...)."
        ) from err
    return url_to_fs(url, **dict(storage_options or {}))


@dataclasses.dataclass(frozen=True)
class Listing:
    """What one listing of a prefix showed directly under it."""

    files: dict[str, int]
    """Objects, by name, with their sizes."""
    children: list[str]
    """Names of the "directories" (common prefixes), sorted."""


@dataclasses.dataclass(frozen=True)
class StoreVersion:
    """One save of a checkpoint on an object store: the prefix ``<checkpoint>/v<n>-<token>``."""

    number: int
    token: str
    path: str
    """The prefix, inside the filesystem (no scheme)."""

    @property
    def name(self) -> str:
        return posixpath.basename(self.path)


@dataclasses.dataclass(frozen=True, eq=False)
class CompleteVersion:
    """A complete checkpoint under one prefix as one look at the store found it: its
    manifest, and the listing that showed every object it names at its recorded size.

    A complete version is never written again (a save writes a new version; retiring
    deletes the manifest first), so a load may take these instead of asking the store
    again a moment later."""

    path: str
    manifest: Manifest
    sizes: Mapping[str, int]
    newer: tuple[str, ...]
    """Names of the versions newer than this one, none of them complete."""


def version_name(number: int, token: str) -> str:
    """``v00000007-<token>``: sorts by number as text."""
    return f"v{number:08d}-{token}"


class DeadlineFileSystem:
    """An asynchronous fsspec filesystem whose every request gives up after ``deadline``
    seconds, its retries included; other attributes are the filesystem's own.

    A store that stops answering (a hung or partitioned server: connections accepted,
    nothing answered) keeps a rank in s3fs's and botocore's retries for many minutes while
    its peers' collectives time out, each with an error that blames the network. A request
    past the deadline is cancelled and raises :class:`TimeoutError` naming the object; every
    later request through this wrapper fails at once the same way, so the cleanup that
    follows a failed save (each request of which would wait as long again) is skipped and
    left to the next save, which retires what a failed one left.

    The user's filesystem (fsspec's cached instance) and ``storage_options`` stay untouched
    (docs/DESIGN.md says why botocore's own timeouts were not used).

    Args:
        fs: The filesystem (an ``AsyncFileSystem``; calls of a synchronous one pass through).
        deadline: Seconds one request may take.
        url: Makes an object's path a URL for messages.
    """

    def __init__(self, fs: Any, deadline: float, url: Callable[[str], str]) -> None:
        self.wrapped = fs
        self.deadline = deadline
        self._url = url
        self.unanswered: str | None = None
        """The first request that ran past the deadline, as the error said it."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or "wrapped" not in self.__dict__:
            raise AttributeError(name)  # pickling and copying look these up on a bare object
        attribute = getattr(self.wrapped, name)
        coroutine = coroutine_of(self.wrapped, name)
        if not callable(attribute) or coroutine is None:
            return attribute

        def call(*args: Any, **kwargs: Any) -> Any:
            return self._call(name, coroutine, args, kwargs)

        return call

    def open(
        self, path: str, mode: str = "rb", block_size: int | None = None, **kwargs: Any
    ) -> Any:
        """A file to read whose every read is one ranged ``cat_file`` under the deadline
        (the filesystem's own file reads through the filesystem's loop directly, past any
        deadline: a whole-file read of a stopped store would wait out every retry). Other
        modes, and synchronous filesystems, get the filesystem's own file."""
        if mode != "rb" or coroutine_of(self.wrapped, "cat_file") is None:
            return self.wrapped.open(path, mode, block_size=block_size, **kwargs)
        ranges = _DeadlineReads(self, path, int(self.size(path)))
        return io.BufferedReader(ranges, buffer_size=block_size or _READ_BLOCK)

    def _call(self, name: str, coroutine: Any, args: tuple[Any, ...], kwargs: Any) -> Any:
        from fsspec.asyn import sync
        from fsspec.exceptions import FSTimeoutError

        target = self._target(name, args, kwargs)
        if name == "call_s3" and args:
            name = str(args[0])  # the S3 operation: put_object, upload_part, ...
        self.check_answering(target)
        try:
            return sync(self.wrapped.loop, coroutine, *args, timeout=self.deadline, **kwargs)
        except FSTimeoutError as err:
            raise self.gave_up(target, name) from err

    def check_answering(self, target: str) -> None:
        """Raise at once if an earlier request ran past the deadline (see the class)."""
        if self.unanswered is not None:
            raise TimeoutError(
                f"{target}: not sent, the object store did not answer an earlier request "
                f"({self.unanswered})"
            )

    def gave_up(self, target: str, name: str) -> TimeoutError:
        """The error of the request ``name`` about ``target`` that ran past the deadline;
        every later request fails at once (:meth:`check_answering`)."""
        if self.unanswered is None:
            self.unanswered = (
                f"{target}: the object store did not answer {name} within {self.deadline:g} s "
                "(half the process group's timeout)"
            )
        return TimeoutError(
            f"{self.unanswered}. It is down, stopped or unreachable: check the store "
            "(its endpoint, the network, the server's health) and save or load again; "
            "for a store that is alive but this slow, raise the process group's "
            "timeout (the strategy's `timeout`)"
        )

    def _target(self, name: str, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> str:
        """The URL a request is about (s3fs's ``call_s3``: its bucket and key)."""
        if name == "call_s3" and "Bucket" in kwargs:
            return self._url(posixpath.join(kwargs["Bucket"], kwargs.get("Key", "")))
        path = args[0] if args else kwargs.get("path", "")
        if isinstance(path, (list, tuple)):
            path = f"{path[0]} (and {len(path) - 1} more)" if path else ""
        return self._url(str(path))


_READ_BLOCK = 4 << 20
"""Read-ahead of a file :meth:`DeadlineFileSystem.open` gives, where the caller names none."""


class _DeadlineReads(SeekableStream):
    """One object, read-only and seekable, each read one ranged ``cat_file`` of a
    :class:`DeadlineFileSystem` (so under its deadline)."""

    def __init__(self, fs: DeadlineFileSystem, path: str, size: int) -> None:
        super().__init__()
        self._fs, self._path, self.size = fs, path, size

    @override
    def _end(self) -> int:
        return self.size

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        stop = min(self._position + view.nbytes, self.size)
        if stop <= self._position:
            return 0
        data = self._fs.cat_file(self._path, start=self._position, end=stop)
        view[: len(data)] = data
        self._position += len(data)
        return len(data)


def coroutine_of(fs: Any, name: str) -> Any:
    """The coroutine behind the method ``name`` of an asynchronous fsspec filesystem
    (fsspec's async API: ``cat_file`` runs ``_cat_file`` on the filesystem's loop), or
    ``None``."""
    coroutine = getattr(fs, f"_{name}", None)
    return coroutine if inspect.iscoroutinefunction(coroutine) else None


Landing = tuple[str, int, list[memoryview]]
"""An object's path, the byte to start at, and the buffers its bytes fill, in order (a
range of as many bytes as they hold)."""


def reads_in_place(fs: Any) -> bool:
    """Whether :func:`read_ranges` on ``fs`` receives each GET's body straight into its
    buffers (S3 through s3fs: a GET holds no copy of its range); elsewhere a GET's bytes
    arrive whole from ``cat_file`` and are copied, so a GET in flight holds about twice its
    range."""
    return _get_object(unwrapped(fs)) is not None


def read_ranges(fs: Any, ranges: Iterable[Landing], *, window: int) -> Iterator[int]:
    """Fill each of ``ranges``' buffers, with up to ``window`` ranged GETs in flight at
    once, the next sent as each is handed out; yields how many bytes each range filled,
    in order (short only where the object ended: for the caller to refuse naming it).

    On S3 (s3fs) a GET's body is received straight into its buffers, and a body cut off
    midway (a reset connection, a short body) is requested again from the byte where it
    stopped, up to the filesystem's ``retries`` times; the error then names the object
    and the bytes. Other asynchronous filesystems read each range with ``cat_file`` and
    copy it in; synchronous ones one at a time, in this thread.

    Buffers are written on the filesystem's event loop thread until their range is
    handed out; closing the iterator (or an error) cancels the GETs in flight and, before
    it returns, stops every write into buffers, so the caller may free them. A
    :class:`DeadlineFileSystem`'s deadline applies to each GET, its retries included, and
    a GET past it fails the read (and every later request) with its
    :class:`TimeoutError`.

    Rejected: ``fs.cat_ranges`` (every range in memory at once, twice: the received
    pieces and their join); a thread per range (each needs its own event loop for the
    same client).
    """
    import asyncio

    inner = unwrapped(fs)
    ranges = iter(ranges)
    if window < 1:
        raise ValueError(f"read_ranges: expected a window of at least 1 GET, got {window}")
    get = _get_object(inner) or _cat_file_into(inner)
    if get is None:
        for path, start, buffers in ranges:
            sink = _Sink(buffers, threading.Lock(), inner.unstrip_protocol(path), start)
            sink.write(fs.cat_file(path, start=start, end=start + sink.size))
            yield sink.filled
        return
    deadline = fs.deadline if isinstance(fs, DeadlineFileSystem) else None
    gate = threading.Lock()  # held while a buffer is written; see _Sink
    pending: collections.deque[tuple[str, _Sink, concurrent.futures.Future[int]]] = (
        collections.deque()
    )

    def submit() -> bool:
        taken = next(ranges, None)
        if taken is None:
            return False
        path, start, buffers = taken
        if deadline is not None:
            fs.check_answering(fs._url(path))
        sink = _Sink(buffers, gate, inner.unstrip_protocol(path), start)
        read = get(path, start, sink)
        if deadline is not None:
            read = asyncio.wait_for(read, deadline)
        pending.append((path, sink, asyncio.run_coroutine_threadsafe(read, inner.loop)))
        return True

    try:
        while len(pending) < window and submit():
            pass
        while pending:
            path, _, future = pending[0]  # left in pending until it succeeded: see finally
            try:
                # The caller's own limit too, should the loop not honour the cancellation.
                filled = future.result(timeout=None if deadline is None else deadline + 5)
            except (asyncio.TimeoutError, concurrent.futures.TimeoutError) as err:
                if deadline is None:
                    raise
                raise fs.gave_up(fs._url(path), "cat_file") from err
            pending.popleft()
            submit()
            yield filled
    finally:
        for _, sink, future in pending:
            future.cancel()
            sink.close()


class _Sink:
    """The buffers of one range, filled in order (on the event loop thread); a chunk that
    does not fit is refused.

    Every write holds ``gate`` (shared by the GETs of one :func:`read_ranges`) and
    :meth:`close` takes it too, so once ``close`` returns no write is under way and none
    follows, whether or not the loop has yet honoured the GET's cancellation.
    """

    def __init__(self, buffers: list[Any], gate: threading.Lock, url: str, start: int) -> None:
        self._views = [memoryview(b).cast("B") for b in buffers]
        self.size = sum(view.nbytes for view in self._views)
        self.where = f"{url}: bytes [{start}, {start + self.size})"
        """The object and the range, for errors."""
        self.filled = 0
        self._gate = gate
        self._index = 0
        self._open = True

    def write(self, data: Any) -> None:
        import asyncio

        data = memoryview(data).cast("B")
        with self._gate:
            if not self._open:  # its GET was cancelled while this chunk arrived
                raise asyncio.CancelledError
            if data.nbytes > self.size - self.filled:
                raise ValueError(
                    f"{self.where}: {data.nbytes} bytes received where "
                    f"{self.size - self.filled} were asked (does the store ignore Range?)"
                )
            self.filled += data.nbytes
            while data.nbytes:
                view = self._views[self._index]
                n = min(view.nbytes, data.nbytes)
                view[:n] = data[:n]
                data = data[n:]
                if n == view.nbytes:
                    self._index += 1
                else:
                    self._views[self._index] = view[n:]

    def close(self) -> None:
        with self._gate:
            self._open = False


def _get_object(fs: Any) -> Callable[[str, int, _Sink], Any] | None:
    """s3fs's ranged GET received straight into a :class:`_Sink`, a body cut off midway
    requested again from where it stopped; ``None`` for any other filesystem (and for an
    ``S3FileSystem`` subclass with reads of its own). An answer that is not the range asked
    for (no ``Content-Range`` of it: a store or proxy that ignores ``Range``) is refused
    before a byte of it is written.

    s3fs's own ``cat_file`` retries a cut-off body too, but holds the whole body twice
    (the received pieces, then their join) before a caller can copy it anywhere. The GET
    itself (status, headers, throttling) is retried by botocore and s3fs's ``_call_s3``;
    only reading the body is retried here.
    """
    s3fs = sys.modules.get("s3fs")  # not imported: ``fs`` is no S3FileSystem
    if s3fs is None or not isinstance(fs, s3fs.S3FileSystem):
        return None
    if coroutine_of(type(fs), "cat_file") is not coroutine_of(s3fs.S3FileSystem, "cat_file"):
        return None  # a subclass's own reads (decryption, a cache) are kept
    call_s3 = coroutine_of(fs, "call_s3")
    import asyncio

    from botocore.exceptions import IncompleteReadError
    from s3fs.core import S3_RETRYABLE_ERRORS, version_id_kw

    retryable = (*S3_RETRYABLE_ERRORS, IncompleteReadError)
    attempts = max(1, int(getattr(fs, "retries", 5)))

    async def get(path: str, start: int, sink: _Sink) -> int:
        bucket, key, version = fs.split_path(path)
        failures = 0
        while sink.filled < sink.size:
            at, end = start + sink.filled, start + sink.size
            response = await call_s3(
                "get_object",
                Bucket=bucket,
                Key=key,
                Range=f"bytes={at}-{end - 1}",
                **version_id_kw(version),
            )
            body = response["Body"]
            answered = response.get("ContentRange", "")
            if not answered.startswith(f"bytes {at}-"):
                body.close()
                raise OSError(
                    f"{sink.where}: asked for bytes {at}-{end - 1}, the store answered "
                    f"{answered or 'without a Content-Range (the whole object?)'}. A store "
                    "or proxy that ignores Range requests cannot serve checkpoint loads."
                )
            try:
                while sink.filled < sink.size:
                    data = await body.read(sink.size - sink.filled)
                    if not data:
                        return sink.filled  # the object ends here (its length checked)
                    sink.write(data)
            except retryable as err:
                failures += 1
                if failures >= attempts:
                    raise OSError(
                        f"{sink.where}: reading failed {failures} times (each time the "
                        f"bytes still missing were asked again; the last stopped at byte "
                        f"{start + sink.filled}): "
                        f"{type(err).__name__}: {err}"
                    ) from err
                await asyncio.sleep(min(1.7**failures * 0.1, 15))  # s3fs's backoff
            finally:
                body.close()
        return sink.filled

    return get


def _cat_file_into(fs: Any) -> Callable[[str, int, _Sink], Any] | None:
    """An asynchronous filesystem's ranged ``cat_file``, copied into a :class:`_Sink`;
    ``None`` for a synchronous one."""
    cat_file = coroutine_of(fs, "cat_file")
    if cat_file is None:
        return None

    async def get(path: str, start: int, sink: _Sink) -> int:
        sink.write(await cat_file(path, start=start, end=start + sink.size))
        return sink.filled

    return get


def unwrapped(fs: Any) -> Any:
    """The fsspec filesystem itself, under a :class:`DeadlineFileSystem`."""
    return fs.wrapped if isinstance(fs, DeadlineFileSystem) else fs


class ObjectStore:
    """Checkpoints under one fsspec filesystem: the versioned layout and its commit.

    Layout of the checkpoint ``<prefix>/<name>`` (docs/DESIGN.md, "Object storage")::

        <prefix>/<name>/v00000003-<token>/   a complete save: manifest.json listed last
            .metadata  __0_0.distcp  __1_0.distcp  meta.pt  manifest.json
        <prefix>/<name>/v00000004-<token>/   a save in progress or one that crashed:
            .metadata  __0_0.distcp ...       no manifest.json (or objects missing)

    Paths here are the filesystem's (``bucket/key``, no scheme); :meth:`url` adds it back.

    Args:
        fs: The fsspec filesystem.
        protocol: Its scheme, for URLs in messages and results.
        deadline: Seconds each request of an asynchronous filesystem (s3fs) may take, its
            retries included (:class:`DeadlineFileSystem`); ``None``: the filesystem's own
            timeouts and retries only.
    """

    def __init__(self, fs: Any, protocol: str, *, deadline: float | None = None) -> None:
        self.protocol = protocol
        self.fs = fs if deadline is None else DeadlineFileSystem(fs, deadline, self.url)

    # ------------------------------------------------------------------------ paths

    def url(self, path: str) -> str:
        """``path`` with its scheme, as a user would write it."""
        return f"{self.protocol}://{path.lstrip('/')}"

    @staticmethod
    def join(*parts: str) -> str:
        return posixpath.join(*parts)

    def _refresh(self, path: str) -> None:
        """Drop fsspec's listing cache: another rank or process may have written since."""
        with contextlib.suppress(Exception):
            self.fs.invalidate_cache(path)

    def listing(self, prefix: str) -> Listing:
        """What is directly under ``prefix``: one fresh listing."""
        self._refresh(prefix)
        try:
            entries = self.fs.ls(prefix, detail=True)
        except FileNotFoundError:
            return Listing({}, [])
        files, children = {}, []
        for entry in entries:
            name = posixpath.basename(entry["name"].rstrip("/"))
            if entry.get("type") == "file":
                files[name] = int(entry.get("size") or 0)
            else:
                children.append(name)
        return Listing(files, sorted(children))

    def sizes(self, prefix: str) -> dict[str, int]:
        """Every object directly under ``prefix``, by name, with its size; a fresh listing."""
        return self.listing(prefix).files

    def children(self, prefix: str) -> list[str]:
        """Names of the "directories" (common prefixes) directly under ``prefix``."""
        return self.listing(prefix).children

    def write_bytes(self, path: str, data: Any) -> None:
        """One object, written with one PUT (visible whole or not at all)."""
        self.fs.pipe_file(path, bytes(data))

    def write_objects(self, objects: Mapping[str, bytes]) -> None:
        """Objects by path, each as :meth:`write_bytes` writes it, all sent at once."""
        self.fs.pipe({path: bytes(data) for path, data in objects.items()})

    def read_bytes(self, path: str, *, size: int | None = None) -> bytes:
        """The object ``path``. With its ``size`` known (a manifest's, a listing's), one
        ranged GET: no request for the size first, and no listing fsspec cached consulted
        (another rank's writes since may have made it stale).

        Raises:
            OSError: If the object does not hold exactly ``size`` bytes.
        """
        if not size:  # a Range of an empty object is refused
            return self.fs.cat_file(path)
        data = self.fs.cat_file(path, start=0, end=size + 1)  # one byte more: a longer one
        if len(data) != size:
            raise OSError(
                f"{self.url(path)}: {'more than ' if len(data) > size else ''}"
                f"{min(len(data), size)} bytes stored where {size} were expected (it "
                "changed after it was listed or recorded)."
            )
        return data

    def digest(self, path: str, algorithm: str) -> str:
        """The digest of the object ``path``, streamed in bounded blocks."""
        with self.fs.open(path, "rb", block_size=DIGEST_BLOCK_BYTES) as file:
            return stream_digest(file, algorithm)

    # ------------------------------------------------------------------------ versions

    def versions(self, checkpoint: str, *, listing: Listing | None = None) -> list[StoreVersion]:
        """Every save of ``checkpoint``, complete or not, oldest first (``listing``: one of
        ``checkpoint`` just taken)."""
        found = []
        for name in (listing or self.listing(checkpoint)).children:
            match = _VERSION_RE.match(name)
            if match is not None:
                found.append(
                    StoreVersion(int(match["number"]), match["token"], self.join(checkpoint, name))
                )
        return sorted(found, key=lambda v: (v.number, v.token))

    def read_manifest(self, prefix: str, *, size: int | None = None) -> Manifest:
        """The manifest of the checkpoint files directly under ``prefix`` (``size``: its
        size in a listing just taken, as for :meth:`read_bytes`).

        Raises:
            NotACheckpointError: None there, or it does not parse.
        """
        path = self.join(prefix, MANIFEST_FILE)
        try:
            data = self.read_bytes(path, size=size)
        except FileNotFoundError as err:
            raise NotACheckpointError(self._describe_missing(prefix)) from err
        try:
            return Manifest.from_json(json.loads(data))
        except ValueError as err:
            raise NotACheckpointError(
                f"{self.url(path)} cannot be parsed: {err}. The checkpoint is damaged or was "
                "not written by MegatronFSDPCheckpointIO; use another checkpoint."
            ) from err

    def _describe_missing(self, prefix: str) -> str:
        sizes = self.sizes(prefix)
        if DCP_METADATA_FILE in sizes or any(n.endswith(".distcp") for n in sizes):
            return (
                f"{self.url(prefix)} holds DCP objects but no {MANIFEST_FILE}: a save that did "
                "not finish (the manifest is written last) or plain torch DCP output."
            )
        inside = self.checkpoints_under(prefix)
        if inside:  # ModelCheckpoint's dirpath
            return (
                f"{self.url(prefix)} is a prefix of checkpoints "
                f"({summarise('pass one of them', inside)}), not a checkpoint: it holds no "
                f"{MANIFEST_FILE}."
            )
        return f"{self.url(prefix)} holds no {MANIFEST_FILE}: not a checkpoint."

    def check_files(
        self, prefix: str, manifest: Manifest, *, sizes: Mapping[str, int] | None = None
    ) -> list[str]:
        """One line per object the manifest lists that is missing or has another size;
        ``sizes``: the prefix's listing, if already taken."""
        if sizes is None:
            sizes = self.sizes(prefix)
        problems = []
        for name, record in sorted(manifest.files.items()):
            if name not in sizes:
                problems.append(f"{name}: missing (expected {record.size} bytes)")
            elif sizes[name] != record.size:
                problems.append(
                    f"{name}: {sizes[name]} bytes stored, {record.size} in the manifest"
                )
        return problems

    def _complete(
        self, prefix: str, newer: tuple[str, ...], sizes: dict[str, int] | None = None
    ) -> CompleteVersion | None:
        """``prefix``'s checkpoint (``newer``: the names of the incomplete versions after
        it) if it holds a manifest that parses and every object it lists, at its recorded
        size; else ``None``. One listing (unless ``sizes`` is one just taken), then one GET
        of the manifest it shows."""
        sizes = self.sizes(prefix) if sizes is None else sizes
        if MANIFEST_FILE not in sizes:
            return None
        try:
            manifest = self.read_manifest(prefix, size=sizes[MANIFEST_FILE])
        except NotACheckpointError:
            return None
        if self.check_files(prefix, manifest, sizes=sizes):
            return None
        return CompleteVersion(prefix, manifest, sizes, newer)

    def is_complete(self, prefix: str) -> bool:
        """Whether ``prefix`` holds a manifest that parses and every object it lists, at
        its recorded size."""
        return self._complete(prefix, ()) is not None

    def newest_complete(self, checkpoint: str) -> CompleteVersion | None:
        """The checkpoint to load ``checkpoint`` from: the newest complete version, or
        ``checkpoint`` itself when it holds a complete checkpoint directly (one copied from
        a local disk); ``None`` when there is none."""
        versions = self.versions(checkpoint)
        for index in reversed(range(len(versions))):
            newer = tuple(v.name for v in versions[index + 1 :])
            if (found := self._complete(versions[index].path, newer)) is not None:
                return found
        return self._complete(checkpoint, tuple(v.name for v in versions))

    def locate(self, checkpoint: str) -> str | None:
        """The prefix of :meth:`newest_complete`, or ``None``."""
        found = self.newest_complete(checkpoint)
        return None if found is None else found.path

    def checkpoints_under(self, prefix: str) -> list[str]:
        """Names of the checkpoints directly under ``prefix`` that hold a complete version
        (``ModelCheckpoint``'s ``dirpath`` holds ``last.ckpt``, ...); hidden ones left out."""
        names = [n for n in self.children(prefix) if not n.startswith(".")]
        return sorted(n for n in names if self.locate(self.join(prefix, n)) is not None)

    def require(self, checkpoint: str) -> str:
        """:meth:`locate`, or an error that says what is there.

        Raises:
            NotACheckpointError: If there is no complete version.
        """
        found = self.locate(checkpoint)
        if found is not None:
            return found
        versions = self.versions(checkpoint)
        if versions:
            raise NotACheckpointError(
                f"{self.url(checkpoint)} holds no complete checkpoint: "
                f"{len(versions)} save(s) that did not finish "
                f"({', '.join(v.name for v in versions)}; no {MANIFEST_FILE}, or objects "
                "missing). Load an older checkpoint."
            )
        raise NotACheckpointError(
            f"{self.url(checkpoint)} does not exist or is not a checkpoint (expected "
            f"versions v<n>-<token>/ with a {MANIFEST_FILE}). Check the path."
        )

    def new_version(self, checkpoint: str) -> StoreVersion:
        """The prefix of the next save of ``checkpoint``: one above every existing version,
        so it sorts newest once complete. Rank 0 only (it lists, once).

        Raises:
            CheckpointSaveError: If ``checkpoint`` holds objects that are not ours.
        """
        listing = self.listing(checkpoint)
        self.check_replaceable(checkpoint, listing=listing)
        versions = self.versions(checkpoint, listing=listing)
        number = versions[-1].number + 1 if versions else 1
        token = uuid.uuid4().hex[:16]
        return StoreVersion(number, token, self.join(checkpoint, version_name(number, token)))

    def check_replaceable(self, checkpoint: str, *, listing: Listing | None = None) -> None:
        """Refuse to write into a prefix that holds objects which are not versions of ours
        (``listing``: one of ``checkpoint`` just taken).

        Raises:
            CheckpointSaveError: Naming what is there.
        """
        listing = listing or self.listing(checkpoint)
        loose = [n for n in listing.files if n != MANIFEST_FILE]
        foreign = [n for n in listing.children if not _VERSION_RE.match(n)]
        if foreign or (loose and not self.is_complete(checkpoint)):
            raise CheckpointSaveError(
                f"Refusing to save into {self.url(checkpoint)}: it holds objects that are not "
                f"checkpoint versions written by MegatronFSDPCheckpointIO "
                f"({sorted(loose + foreign)[:5]}). Move them away or save under another name."
            )

    def retire(self, checkpoint: str, keep: str) -> None:
        """Delete every version of ``checkpoint`` but ``keep``, each manifest first (a crash
        halfway leaves an incomplete version, never a damaged complete one), and abort the
        multipart uploads pending under ``checkpoint`` outside ``keep`` (a killed rank's,
        which no one else completes or aborts, and the store keeps and bills). A plain
        checkpoint directly under ``checkpoint`` (copied there) goes the same way.
        Never raises: what cannot be deleted is logged and retired by the next save."""
        try:
            listing = self.listing(checkpoint)
        except Exception as err:
            log.warning("Could not list %s: %s", self.url(checkpoint), err)
            return
        for version in self.versions(checkpoint, listing=listing):
            if version.path != keep:
                self._delete(version.path, retiring=True)
        if listing.files:
            self._delete(checkpoint, names=list(listing.files))
        self._abort_uploads(checkpoint, keep=keep)

    def discard(self, prefix: str) -> None:
        """Delete a save's objects and abort its pending multipart uploads; never raises."""
        self._delete(prefix)
        self._abort_uploads(prefix)

    def _abort_uploads(self, prefix: str, *, keep: str | None = None) -> None:
        """Abort the S3 multipart uploads pending under ``prefix/`` but not under
        ``keep/``; other filesystems have none. Called when no save of the checkpoint is in
        flight (after its commit, or after its save failed on every rank). Never raises."""
        if not hasattr(self.fs, "call_s3"):  # s3fs's raw botocore call
            return
        bucket, key, _ = self.fs.split_path(prefix)
        under, kept = key.rstrip("/") + "/", None
        if keep is not None:
            kept = self.fs.split_path(keep)[1].rstrip("/") + "/"
        try:
            markers: dict[str, str] = {}
            while True:
                listed = self.fs.call_s3(
                    "list_multipart_uploads", Bucket=bucket, Prefix=under, **markers
                )
                for upload in listed.get("Uploads") or []:
                    if kept is None or not upload["Key"].startswith(kept):
                        self.fs.call_s3(
                            "abort_multipart_upload",
                            Bucket=bucket,
                            Key=upload["Key"],
                            UploadId=upload["UploadId"],
                        )
                following = {
                    "KeyMarker": listed.get("NextKeyMarker") or "",
                    "UploadIdMarker": listed.get("NextUploadIdMarker") or "",
                }
                if not listed.get("IsTruncated") or following == markers:
                    return
                markers = following
        except Exception as err:
            log.warning(
                "Could not abort the multipart uploads pending under %s: %s (the next save "
                "of this checkpoint tries again)",
                self.url(prefix),
                err,
            )

    def _delete(
        self, prefix: str, *, names: list[str] | None = None, retiring: bool = False
    ) -> None:
        """Delete ``prefix``'s manifest, then every object under it in one batch, then the
        marker of the "directory" (``names``: only these objects directly under it, the
        manifest among them if there is one, and no marker). Never raises: logs what could
        not go."""
        try:
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm_file(self.join(prefix, MANIFEST_FILE))
            if retiring:
                reach("commit:retiring")
            if names is None:
                self._refresh(prefix)
                found = [path for path in self.fs.find(prefix) if not path.endswith("/")]
            else:
                found = [self.join(prefix, n) for n in names if n != MANIFEST_FILE]
            if found:
                self.fs.rm(found)
            if names is None:
                # Stores that keep directory entries (SeaweedFS's filer, HDFS-like
                # gateways) list an empty prefix until its marker is deleted too; on S3
                # itself this deletes nothing.
                with contextlib.suppress(Exception):
                    self.fs.rm_file(prefix.rstrip("/") + "/")
        except Exception as err:
            log.warning("Could not delete %s: %s", self.url(prefix), err)

    def remove(self, checkpoint: str) -> bool:
        """Delete every version of ``checkpoint``, unless it holds the only complete
        checkpoint of its parent prefix (then keep it and log why).

        Returns:
            Whether it was deleted.

        Raises:
            CheckpointError: If ``checkpoint`` holds objects that are not ours.
        """
        if not self.versions(checkpoint) and not self.sizes(checkpoint):
            return True
        try:
            self.check_replaceable(checkpoint)
        except CheckpointSaveError as err:
            raise CheckpointError(
                f"MegatronFSDPCheckpointIO.remove_checkpoint: refusing to delete "
                f"{self.url(checkpoint)}: {err}"
            ) from err
        if self.locate(checkpoint) is not None:
            parent = posixpath.dirname(checkpoint.rstrip("/"))
            others = [
                self.join(parent, n)
                for n in self.children(parent)
                if self.join(parent, n) != checkpoint.rstrip("/")
            ]
            if not any(self.locate(o) is not None for o in others):
                log.warning(
                    "Not removing %s: it is the only complete checkpoint in %s (the save "
                    "meant to replace it did not complete).",
                    self.url(checkpoint),
                    self.url(parent),
                )
                return False
        for version in reversed(self.versions(checkpoint)):
            self._delete(version.path)
        self._delete(checkpoint)
        self._abort_uploads(checkpoint)
        return True

    # ------------------------------------------------------------------------ lookup

    def manifest_time(self, prefix: str) -> float:
        """When ``prefix``'s manifest was written (the store's clock), in seconds."""
        info = self.fs.info(self.join(prefix, MANIFEST_FILE))
        value = (
            info.get("LastModified")
            or info.get("mtime")
            or info.get("updated")
            or info.get("created")
            or 0
        )
        return value.timestamp() if hasattr(value, "timestamp") else float(value)

    def latest(self, dirpath: str, pattern: str) -> tuple[float, str] | None:
        """The complete checkpoint in ``dirpath`` whose name matches ``pattern`` with the
        newest manifest, as the time it was written (the store's clock) and the
        checkpoint's path (not its version's); ``None`` if there is none."""
        best: tuple[float, str] | None = None
        for name in self.children(dirpath):
            if name.startswith(".") or not fnmatch.fnmatch(name, pattern):
                continue
            checkpoint = self.join(dirpath, name)
            try:
                found = self.newest_complete(checkpoint)
                if found is None:
                    continue
                written = self.manifest_time(found.path)
            except TimeoutError:
                raise  # the store stopped answering: no candidate can be judged
            except (OSError, CheckpointError):
                continue
            if best is None or (written, checkpoint) > best:
                best = (written, checkpoint)
        return best

    def describe(self, checkpoint: str) -> list[str]:
        """One line per version of ``checkpoint``: complete (and loaded) or incomplete
        (one listing of each version, and the manifest of each that has one)."""
        lines = []
        chosen = self.newest_complete(checkpoint)
        for version in self.versions(checkpoint):
            if chosen is not None and version.path == chosen.path:
                sizes, state = dict(chosen.sizes), "complete (the one loaded)"
            else:
                sizes = self.sizes(version.path)
                state = self._state(version.path, sizes)
            lines.append(
                f"{version.name}: {state}; {len(sizes)} objects, {sum(sizes.values())} bytes"
            )
        return lines

    def _state(self, prefix: str, sizes: dict[str, int]) -> str:
        """What :meth:`describe` says of a version that is not the one loaded."""
        if self._complete(prefix, (), sizes) is not None:
            return "complete, superseded (deleted by the next save)"
        if MANIFEST_FILE in sizes:
            return "INCOMPLETE: objects missing or of another size than the manifest says"
        return f"INCOMPLETE: no {MANIFEST_FILE} (a save in progress or one that crashed)"


def open_store(
    url: str, storage_options: Mapping[str, Any] | None = None, *, deadline: float | None = None
) -> tuple[ObjectStore, str]:
    """The :class:`ObjectStore` for ``url`` and the path inside it (no trailing ``/``);
    ``deadline``: as for :class:`ObjectStore`.

    Raises:
        ImportError: The scheme's filesystem is not installed (the message says what to
            install).
        ValueError: fsspec knows no filesystem for the scheme.
    """
    fs, path = _filesystem(url, storage_options)
    protocol = url_protocol(url)
    assert protocol is not None
    return ObjectStore(fs, protocol, deadline=deadline), path.rstrip("/")
