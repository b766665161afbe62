"""The fsspec backend of a :class:`~lightning_megatron_fsdp.storage.location.Location`
(:class:`StoreLocation`: a checkpoint, a prefix or an object on any fsspec filesystem) and
the two routers between it and the local backend: :func:`locate`, which makes a path or URL
its location, and the plugin's commit router (:class:`ObjectStores`), which sends a URL to
the versioned layout of :class:`~lightning_megatron_fsdp.storage.object_store.ObjectStore`
and any other path to the local directories.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import posixpath
from collections.abc import Callable, Iterator, Mapping
from datetime import timedelta
from pathlib import Path
from typing import IO, Any

from lightning_megatron_fsdp.errors import CheckpointCorruptedError, NotACheckpointError
from lightning_megatron_fsdp.storage.commit import reach
from lightning_megatron_fsdp.storage.format import (
    MANIFEST_FILE,
    Manifest,
    check_digests,
    summarise,
)
from lightning_megatron_fsdp.storage.location import LocalLocation, Location
from lightning_megatron_fsdp.storage.object_store import (
    CompleteVersion,
    ObjectStore,
    abort_upload,
    is_url,
    local_path,
    open_store,
)

__all__ = [
    "ObjectStores",
    "RangedObject",
    "StoreCommit",
    "StoreLocation",
    "locate",
    "request_deadline",
]

log = logging.getLogger(__name__)

RECORD_BLOCK = 64 << 10
"""Read-ahead of the object a record's zip structure is read from: one GET covers a zip
directory, another the local header at the record's start."""

_PART = 8 << 20
"""Smallest part of an upload (S3 takes parts of 5 MiB and up)."""

_MAX_PARTS = 9_000
"""Parts an upload may use: S3 allows 10,000 per object, the rest is slack for writes that
overshoot a part. A known output size raises the part size to fit."""


_RANGE = 32 << 20
"""Largest ranged GET of :class:`RangedObject`: a larger read goes in pieces, so a read
holds at most this much beyond the bytes it returns."""


class RangedObject:
    """:class:`~lightning_megatron_fsdp.storage.location.ByteRanges` of one object: each
    read is ranged GETs of at most :data:`_RANGE` bytes; nothing is downloaded whole."""

    def __init__(self, location: StoreLocation) -> None:
        self.location = location
        self.size = location.size()

    def read(self, start: int, stop: int) -> bytearray:
        out = bytearray(max(stop - start, 0))
        done = 0
        while done < len(out):
            want = min(_RANGE, len(out) - done)
            data = self.location.read_range(start + done, start + done + want)
            if not data:
                raise OSError(
                    f"{self.location} ends at byte {start + done}; bytes up to {stop} were "
                    "expected (a truncated upload?)."
                )
            out[done : done + len(data)] = data
            done += len(data)
        return out

    def close(self) -> None:
        """Nothing is held open between reads."""


@dataclasses.dataclass(frozen=True)
class StoreLocation(Location):
    """A :class:`~lightning_megatron_fsdp.storage.location.Location` on an fsspec
    filesystem: a checkpoint (or one version of it), a prefix of checkpoints, or one object;
    ``str()`` is its URL."""

    store: ObjectStore
    path: str
    """The key or prefix inside the filesystem (no scheme, no trailing ``/``)."""
    found: CompleteVersion | None = dataclasses.field(default=None, compare=False, repr=False)
    """The complete checkpoint :meth:`StoreCommit.resolve` found here: its manifest and
    listing answer this location's :meth:`read_manifest` and :meth:`check_files` (a
    complete version never changes), which spares a load's ranks asking again."""

    @classmethod
    def from_url(
        cls,
        url: str | os.PathLike[str],
        storage_options: Mapping[str, Any] | None,
        *,
        deadline: float | None = None,
    ) -> StoreLocation:
        """The location ``url`` names on its fsspec filesystem (with ``storage_options``;
        ``deadline``: seconds each request may take, see
        :class:`~lightning_megatron_fsdp.storage.object_store.ObjectStore`).

        Raises:
            ImportError: The URL's filesystem is not installed (naming what to install).
            ValueError: fsspec knows no filesystem for the URL's scheme.
        """
        store, inside = open_store(os.fspath(url), storage_options, deadline=deadline)
        return cls(store, inside)

    def __str__(self) -> str:
        return self.store.url(self.path)

    @property
    def name(self) -> str:
        return posixpath.basename(self.path)

    @property
    def suffix(self) -> str:
        return posixpath.splitext(self.path)[1]

    def key(self, name: str) -> str:
        """The path of ``name`` under this prefix, inside the filesystem."""
        return posixpath.join(self.path, name)

    def file(self, name: str) -> str:
        return f"{self}/{name}"

    def _fresh(self) -> Any:
        """The filesystem, its listing cache of this location dropped (another process
        may have written since)."""
        fs = self.store.fs
        with contextlib.suppress(Exception):
            fs.invalidate_cache(self.path)
        return fs

    def exists(self) -> bool:
        return bool(self._fresh().exists(self.path))

    def is_file(self) -> bool:
        return bool(self._fresh().isfile(self.path))

    def is_dir(self) -> bool:
        return bool(self._fresh().isdir(self.path))

    def size(self) -> int:
        return int(self._fresh().size(self.path))

    def open(self, *, block_size: int | None = None) -> Any:
        if block_size is None:
            return self.store.fs.open(self.path, "rb")
        return self.store.fs.open(self.path, "rb", block_size=block_size)

    def read_range(self, start: int, stop: int) -> bytes:
        return bytes(self.store.fs.cat_file(self.path, start=start, end=stop))

    def ranges(self) -> RangedObject:
        return RangedObject(self)

    def sizes(self) -> dict[str, int]:
        return self.store.sizes(self.path)

    def read_manifest(self) -> Manifest:
        """See :meth:`ObjectStore.read_manifest`."""
        if self.found is not None:
            return self.found.manifest
        return self.store.read_manifest(self.path)

    def read_bytes(self, name: str, *, size: int | None = None) -> bytes:
        """Raises: CheckpointCorruptedError: If the object has another size than ``size``."""
        stored = self.sizes().get(name)
        if stored is None:
            raise FileNotFoundError(f"{name}: no such object under {self}")
        if size is not None and stored != size:
            raise CheckpointCorruptedError(
                f"{name}: {stored} bytes stored, {size} in the manifest; it was not read."
            )
        return self.store.read_bytes(self.key(name), size=stored)

    def open_records(self, name: str) -> Any:
        """A stream whose read-ahead is :data:`RECORD_BLOCK`: only the zip headers and
        directory of each record are read, in small ranged GETs, never its payload."""
        return self.store.fs.open(self.key(name), "rb", block_size=RECORD_BLOCK)

    def digest(self, name: str, algorithm: str) -> str:
        """The digest of the object ``name``, streamed."""
        return self.store.digest(self.key(name), algorithm)

    def check_files(
        self, manifest: Manifest, *, checksum_files: list[str] | None = None
    ) -> list[str]:
        """As :func:`~lightning_megatron_fsdp.storage.format.check_files`: sizes from one
        listing, then the digests of ``checksum_files``, each object read once."""
        sizes = None
        if self.found is not None:
            self._fresh()  # for this rank's reads: what its fsspec listed before the look
            sizes = self.found.sizes
        problems = self.store.check_files(self.path, manifest, sizes=sizes)
        if checksum_files and not problems:
            problems += check_digests(
                manifest, checksum_files, self.digest, where="stored", kind="object"
            )
        return problems

    def loaded_version(self) -> tuple[StoreLocation, list[str]]:
        """The newest complete version of the checkpoint (the one a load takes), with one
        note per version, complete or not."""
        store, inside = self.store, self.path
        versions = store.versions(inside)
        if not versions and not store.sizes(inside) and not store.fs.isfile(inside):
            inside_checkpoints = store.checkpoints_under(inside)
            if inside_checkpoints:  # ModelCheckpoint's dirpath
                raise NotACheckpointError(
                    f"{self} is a prefix of checkpoints "
                    f"({summarise('pass one of them', inside_checkpoints)}), not a checkpoint."
                )
            raise NotACheckpointError(
                f"{self} does not exist: no object has this prefix. Check the URL."
            )
        version = store.locate(inside)
        notes = [f"version {line}" for line in store.describe(inside)]
        return StoreLocation(store, inside if version is None else version), notes

    def checkpoints_inside(self) -> list[str]:
        if self.store.locate(self.path) is not None:
            return []
        return self.store.checkpoints_under(self.path)

    def latest(
        self, pattern: str, *, on_restored: Callable[[str], Any] | None = None
    ) -> tuple[float, StoreLocation] | None:
        """Nothing is ever renamed aside on a store: a crash leaves an incomplete newer
        version, which is skipped."""
        found = self.store.latest(self.path, pattern)
        if found is None:
            return None
        written, checkpoint = found
        return written, StoreLocation(self.store, checkpoint)

    def reader(self, *, verify: bool, trust_checkpoint: bool) -> Any:
        from lightning_megatron_fsdp.storage.fsspec_storage import VerifyingFsspecReader

        return VerifyingFsspecReader(
            self.store, self.path, verify=verify, trust_checkpoint=trust_checkpoint
        )

    def checked_reader(self, metadata: Any, *, trust_checkpoint: bool) -> Any:
        """The fsspec reader, which reads each tensor record with ranged GETs straight
        into its target."""
        reader = self.reader(verify=False, trust_checkpoint=trust_checkpoint)
        reader.use_metadata(metadata)
        return reader

    def writer(self, *, checksum: bool, thread_count: int) -> Any:
        from lightning_megatron_fsdp.storage.fsspec_storage import ChecksummingFsspecWriter

        return ChecksummingFsspecWriter(
            self.store, self.path, checksum=checksum, thread_count=thread_count
        )

    def absolute(self) -> StoreLocation:
        return self

    def returned(self) -> str:
        return str(self)

    def check_output(self, checkpoint: Any, *, overwrite: bool, who: str) -> None:
        """No output may go under the prefix of ``checkpoint`` (its versions lie there): a
        new object would make it fail verification and block its next save."""
        if "/" not in self.path.strip("/"):
            raise ValueError(f"Output {self}: names a bucket, not an object; add a file name.")
        if self.is_dir():
            raise IsADirectoryError(
                f"{who}: output {self} is a prefix holding objects (a directory); expected "
                "the URL of a file."
            )
        if not overwrite and self.exists():
            raise FileExistsError(
                f"{who}: output {self} already exists; nothing was written. Pass "
                "overwrite=True (--overwrite) to replace it, or choose another name."
            )
        if (
            isinstance(checkpoint, StoreLocation)
            and checkpoint.store.protocol == self.store.protocol
            and self.path.startswith(checkpoint.path.rstrip("/") + "/")
        ):
            raise ValueError(
                f"{who}: output {self} lies inside the checkpoint {checkpoint}; a new "
                "object there would make the checkpoint fail verification and block its "
                "next save. Write it elsewhere."
            )

    @contextlib.contextmanager
    def _unseen(
        self, who: str, size: int | None, before_publish: Callable[[], None]
    ) -> Iterator[IO[bytes]]:
        """The filesystem's streaming upload: parts go out as they fill (memory stays at
        about one part); the object appears, whole, when the upload completes (S3:
        ``CompleteMultipartUpload``, or one ``PUT`` below a part), and a failed write
        aborts it."""
        fs = self.store.fs
        part = _PART if size is None else max(_PART, math.ceil(size / _MAX_PARTS))
        existed = self.exists()
        if existed:
            before_publish()  # refuse before uploading anything
        file = fs.open(self.path, "wb", block_size=part)
        # A filesystem that shows a file while it is written (memory://) cannot tell a
        # concurrent writer's object from ours; a failed write deletes what it showed.
        shown = not existed and self.exists()
        try:
            yield file
            if not shown:
                before_publish()
        except BaseException:
            abort_upload(file)  # never close(): that completes the upload with what was written
            if shown:
                with contextlib.suppress(Exception):
                    fs.rm_file(self.path)
            raise
        try:
            file.close()  # completes the upload: the object appears, whole
        except Exception as err:
            with contextlib.suppress(Exception):
                file.discard()
            raise OSError(
                f"{who}: completing the upload of {self} failed: {type(err).__name__}: "
                f"{err}. Nothing was written; export again."
            ) from err


class StoreCommit:
    """:class:`~lightning_megatron_fsdp.storage.commit.CheckpointStore` on an object store,
    for :class:`StoreLocation` only: a save writes a new version, its manifest last (one
    PUT: the commit), then retires the previous ones; nothing is ever renamed."""

    def staging_path(self, final: StoreLocation, token: str) -> StoreLocation:
        return StoreLocation(final.store, final.key(token))

    def check_target(self, final: StoreLocation, token: str) -> str:
        """Refuse a prefix holding objects that are not ours, and pick the next version
        (rank 0 lists); its name is the save's token.

        Raises:
            CheckpointSaveError: If the target holds something a save must not replace.
        """
        return final.store.new_version(final.path).name

    def stage(self, final: StoreLocation, token: str) -> StoreLocation:
        """Nothing to create: a prefix appears with its first object."""
        return self.staging_path(final, token)

    def discard(self, final: StoreLocation, token: str) -> None:
        final.store.discard(final.key(token))

    def publish(
        self, final: StoreLocation, staging: StoreLocation, manifest: Manifest, token: str
    ) -> None:
        """Write the manifest (one PUT: the commit), then retire the previous versions
        (never raises once the manifest is written).

        A manifest PUT that timed out may still reach the store later, and nothing guards
        against it: a version is complete only when its manifest parses *and* every object
        it lists is there at its recorded size, and a version's objects are its own save's
        (its token), checked against what their writers wrote before the manifest was
        built. So a late manifest makes either an incomplete version (its objects already
        deleted: skipped, retired by the next save) or exactly the checkpoint this save
        wrote, complete and newest (a load takes it; the next save retires it). The failed
        save's cleanup needs no ordering against it (after our own timeout it is skipped
        anyway, left to the next save). The error says so
        (``tests/test_object_store_pause.py`` lands one late).
        """
        reach("commit:manifest")
        try:
            final.store.write_bytes(staging.key(MANIFEST_FILE), manifest.dumps().encode())
        except TimeoutError as err:
            raise TimeoutError(
                f"{err}. The manifest may still reach the store later: then {staging}, "
                "complete as this save wrote it, becomes the newest version and a load "
                "takes it; the next save retires it"
            ) from err
        # Committed: a reader now takes this version; the rest only frees space.
        reach("commit:replaced")
        final.store.retire(final.path, keep=staging.path)

    def recover(self, final: StoreLocation) -> bool:
        """Nothing to restore: a crash leaves an incomplete newer version, which
        :meth:`resolve` skips and the next save retires."""
        return False

    def resolve(self, final: StoreLocation) -> StoreLocation:
        """The newest complete version (``final`` itself when there is none, whose
        :meth:`read_manifest` then says why)."""
        found = final.store.newest_complete(final.path)
        if found is None:
            return final
        if found.newer:
            log.warning(
                "%s: loading %s; newer save(s) %s did not finish (no manifest, or objects "
                "missing) and are ignored; the next save of it deletes them.",
                final,
                posixpath.basename(found.path),
                ", ".join(found.newer),
            )
        return StoreLocation(final.store, found.path, found=found)

    def removal_waits(self, final: StoreLocation, saving: Any) -> bool:
        """Always: Lightning removes the checkpoint a new one replaces right after starting
        it, and the store keeps the only complete checkpoint of a prefix."""
        return True

    def remove(self, final: StoreLocation) -> None:
        final.store.remove(final.path)

    def write_files(self, staging: StoreLocation, files: Mapping[str, bytes]) -> None:
        staging.store.write_objects({staging.key(name): data for name, data in files.items()})

    def sizes(self, location: StoreLocation) -> dict[str, int]:
        return location.sizes()

    def digest(self, location: StoreLocation, name: str, algorithm: str) -> str:
        return location.digest(name, algorithm)

    def read_manifest(self, location: StoreLocation) -> Manifest:
        """Raises: NotACheckpointError: Saying what is there instead."""
        try:
            return location.read_manifest()
        except NotACheckpointError:
            if location.store.versions(location.path):
                location.store.require(location.path)  # raises, listing the versions
            raise

    def check_files(
        self,
        location: StoreLocation,
        manifest: Manifest,
        *,
        checksum_files: list[str] | None = None,
    ) -> list[str]:
        return location.check_files(manifest, checksum_files=checksum_files)

    def read_bytes(self, location: StoreLocation, name: str) -> bytes:
        size = None if location.found is None else location.found.sizes.get(name)
        return location.store.read_bytes(location.key(name), size=size)


def locate(
    path: str | os.PathLike[str] | Location,
    storage_options: Mapping[str, Any] | None = None,
    *,
    deadline: float | None = None,
) -> Location:
    """The :class:`Location` ``path`` names: a URL's on its fsspec filesystem (with
    ``storage_options``; ``deadline``: seconds each request may take, see
    :class:`~lightning_megatron_fsdp.storage.object_store.ObjectStore`), any other path a
    local one (``file://`` stripped, not made absolute). A location is returned as it is.

    Raises:
        ImportError: The URL's filesystem is not installed (naming what to install).
        ValueError: fsspec knows no filesystem for the URL's scheme.
    """
    if isinstance(path, Location):
        return path
    if is_url(path):
        return StoreLocation.from_url(path, storage_options, deadline=deadline)
    return LocalLocation(Path(local_path(os.fspath(path))))


def request_deadline(group_timeout: timedelta | None) -> float | None:
    """Seconds each request to an object store may take, its retries included, for ranks
    whose collectives time out after ``group_timeout`` (``None``: no group, no deadline):
    half of it, so a rank whose request gives up still reaches the next collective before
    its peers there time out, and every rank raises the same error."""
    return None if group_timeout is None else group_timeout.total_seconds() / 2


class ObjectStores:
    """The plugin's :class:`~lightning_megatron_fsdp.storage.commit.CheckpointStore`:
    URLs go to :class:`StoreCommit` (the versioned layout of :class:`ObjectStore`), every
    other path to ``local`` (the exchange-rename commit of
    :class:`~lightning_megatron_fsdp.storage.commit.LocalDirectories`).

    The backend is chosen once per location (:meth:`location` makes it; :meth:`_of` routes
    by it), so a save or load never mixes the two.

    Args:
        local: The backend of local paths.
        storage_options: Options of the fsspec filesystem of a URL (``endpoint_url``,
            ``key``, ...); the filesystem's own configuration applies without them.
        group_timeout: The timeout of the collectives of the ranks that save and load
            (``None``: no group), asked when a URL is opened. Each request to the store
            then gives up after half of it: a rank whose request fails reaches the next
            collective before its peers, waiting there since it began, time out, and every
            rank raises the same error.
    """

    def __init__(
        self,
        local: Any,
        storage_options: Mapping[str, Any] | None = None,
        *,
        group_timeout: Callable[[], timedelta | None] | None = None,
    ) -> None:
        self.local = local
        self.storage_options = dict(storage_options or {})
        self.group_timeout = group_timeout
        self.stores = StoreCommit()

    def location(self, path: str | os.PathLike[str]) -> Any:
        """A :class:`StoreLocation` for a URL (never a local directory named ``s3:``);
        else the local backend's location (``file://`` stripped).

        Raises:
            ImportError: The URL's filesystem is not installed (naming what to install).
            ValueError: fsspec knows no filesystem for the URL's scheme.
        """
        if isinstance(path, StoreLocation):
            return path
        if not is_url(path):
            return self.local.location(local_path(path))
        timeout = None if self.group_timeout is None else self.group_timeout()
        return StoreLocation.from_url(
            path, self.storage_options, deadline=request_deadline(timeout)
        )

    def _of(self, location: Any) -> Any:
        """The commit backend of a location :meth:`location` made."""
        return self.stores if isinstance(location, StoreLocation) else self.local

    def staging_path(self, final: Any, token: str) -> Any:
        return self._of(final).staging_path(final, token)

    def check_target(self, final: Any, token: str) -> str:
        return str(self._of(final).check_target(final, token))

    def stage(self, final: Any, token: str) -> Any:
        return self._of(final).stage(final, token)

    def discard(self, final: Any, token: str) -> None:
        self._of(final).discard(final, token)

    def publish(self, final: Any, staging: Any, manifest: Manifest, token: str) -> None:
        self._of(final).publish(final, staging, manifest, token)

    def recover(self, final: Any) -> bool:
        return bool(self._of(final).recover(final))

    def resolve(self, final: Any) -> Any:
        return self._of(final).resolve(final)

    def removal_waits(self, final: Any, saving: Any) -> bool:
        return bool(self._of(final).removal_waits(final, saving))

    def remove(self, final: Any) -> None:
        self._of(final).remove(final)

    def write_files(self, staging: Any, files: Mapping[str, bytes]) -> None:
        self._of(staging).write_files(staging, files)

    def sizes(self, location: Any) -> dict[str, int]:
        return dict(self._of(location).sizes(location))

    def digest(self, location: Any, name: str, algorithm: str) -> str:
        return str(self._of(location).digest(location, name, algorithm))

    def read_manifest(self, location: Any) -> Manifest:
        return self._of(location).read_manifest(location)

    def check_files(
        self, location: Any, manifest: Manifest, *, checksum_files: list[str] | None = None
    ) -> list[str]:
        return list(
            self._of(location).check_files(location, manifest, checksum_files=checksum_files)
        )

    def read_bytes(self, location: Any, name: str) -> bytes:
        return bytes(self._of(location).read_bytes(location, name))
