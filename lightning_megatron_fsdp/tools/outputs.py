"""Where an offline export's file goes, so that nobody ever sees half of it: a local path gets
a hidden temporary file next to it, renamed into place once complete; a URL
(``s3://bucket/model.safetensors``) gets the object store's streaming upload, whose parts go
out as they fill (memory stays at about one part) and whose object appears, whole, only when
the upload completes; a failed export aborts it. The exporters write front to back and never
seek, so both take the same writer.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import posixpath
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, Any, Literal

from lightning_megatron_fsdp.storage import (
    StoreCheckpoint,
    StoreLocation,
    abort_upload,
    create_exclusive,
    is_url,
    local_path,
    open_store,
)

__all__ = [
    "Output",
    "StoreObject",
    "check_output",
    "output_location",
    "output_size",
    "write_atomically",
]

_PART = 8 << 20
"""Smallest upload part (S3 takes parts of 5 MiB and up)."""

_MAX_PARTS = 9_000
"""Parts an upload may use: S3 allows 10,000 per object, the rest is slack for writes that
overshoot a part. A known output size raises the part size to fit."""


@dataclasses.dataclass(frozen=True)
class StoreObject(StoreLocation):
    """One object on an object store: :attr:`path` is its key (``bucket/key``)."""

    @property
    def suffix(self) -> str:
        return posixpath.splitext(self.path)[1]


Output = Path | StoreObject
"""An export's destination: a local file or an object."""


def output_location(
    path: str | os.PathLike[str], storage_options: Mapping[str, Any] | None
) -> Output:
    """The destination ``path`` names: a :class:`StoreObject` for a URL, else a ``Path``.

    Raises:
        ImportError: The URL's filesystem is not installed (naming what to install).
        ValueError: fsspec knows no filesystem for the URL's scheme, or the URL names a
            bucket but no object.
    """
    if not is_url(path):
        return Path(local_path(path))
    store, inside = open_store(os.fspath(path), storage_options)
    if "/" not in inside.strip("/"):
        raise ValueError(f"Output {path}: names a bucket, not an object; add a file name.")
    return StoreObject(store, inside)


def output_size(output: Output) -> int:
    """The size of a written output, in bytes."""
    if isinstance(output, StoreObject):
        output.store.fs.invalidate_cache(output.path)
        return int(output.store.fs.size(output.path))
    return output.stat().st_size


def check_output(
    output: Output,
    checkpoint: Any,
    *,
    overwrite: bool,
    who: str = "consolidate_checkpoint",
    checkpoint_prefix: str | None = None,
) -> None:
    """Refuse outputs we must not write, before anything is read or written.

    Args:
        output: The destination.
        checkpoint: The checkpoint being exported (a ``Path`` or a
            :class:`~lightning_megatron_fsdp.storage.object_store.StoreCheckpoint`).
        overwrite: Whether an existing output may be replaced.
        who: The public function, for error messages.
        checkpoint_prefix: For a checkpoint on an object store, the prefix the user named
            (its versions lie under it); no output may go there.

    Raises:
        IsADirectoryError: If the output is a directory (on a store: a prefix with objects).
        FileExistsError: If it exists and ``overwrite`` is false.
        FileNotFoundError: If a local output's directory does not exist.
        ValueError: If it lies inside the checkpoint.
    """
    if isinstance(output, StoreObject):
        found = _found_on_store(output)
        if found == "prefix":
            raise IsADirectoryError(
                f"{who}: output {output} is a prefix holding objects (a directory); expected "
                "the URL of a file."
            )
        if found == "object" and not overwrite:
            raise FileExistsError(
                f"{who}: output {output} already exists; nothing was written. Pass "
                "overwrite=True (--overwrite) to replace it, or choose another name."
            )
        if isinstance(checkpoint, StoreCheckpoint) and checkpoint.store.protocol == (
            output.store.protocol
        ):
            prefix = (checkpoint_prefix or checkpoint.path).rstrip("/") + "/"
            if output.path.startswith(prefix):
                raise ValueError(
                    f"{who}: output {output} lies inside the checkpoint {checkpoint}; a new "
                    "object there would make the checkpoint fail verification and block its "
                    "next save. Write it elsewhere."
                )
        return
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
        isinstance(checkpoint, Path)
        and checkpoint.is_dir()
        and output.parent.resolve() == checkpoint.resolve()
    ):
        raise ValueError(
            f"{who}: output {output} lies inside the checkpoint directory; a "
            "new file there would make the checkpoint fail verification. Write it elsewhere."
        )


def write_atomically(
    output: Output,
    write: Callable[[IO[bytes]], None],
    *,
    overwrite: bool,
    who: str,
    size: int | None = None,
) -> None:
    """Run ``write(stream)``; ``output`` then holds exactly what it wrote, or is untouched.

    A local output: ``write`` gets a new hidden file next to ``output`` (created with
    ``O_EXCL | O_NOFOLLOW`` and only ever used through the descriptor that created it),
    which is fsynced and renamed into place; before the rename, the name must still be that
    file (someone who can write to the folder could otherwise swap in their own). It is
    removed on any error.

    An object: ``write`` gets the filesystem's streaming upload of ``output``; it must
    write front to back, without seeking. Parts go out as they fill; the object appears
    when the upload completes, after ``write`` returned (S3: ``CompleteMultipartUpload``,
    or one ``PUT`` for an output smaller than a part; either is atomic). On any error the
    upload is aborted and nothing appears.

    Args:
        output: The final path or object.
        write: Writes the file.
        overwrite: Replace an output that appeared meanwhile.
        who: The public function, for error messages.
        size: The output's size, if known: an upload's part size grows so that the parts
            fit the store's limit on their number.
    """
    if isinstance(output, StoreObject):
        _upload(output, write, overwrite=overwrite, who=who, size=size)
        return
    temporary = output.parent / f".{output.name}.tmp-{uuid.uuid4().hex[:12]}"
    try:
        with open(create_exclusive(temporary), "w+b") as stream:
            write(stream)
            stream.flush()
            os.fsync(stream.fileno())
            mine, now = os.fstat(stream.fileno()), os.stat(temporary, follow_symlinks=False)
            if (mine.st_dev, mine.st_ino) != (now.st_dev, now.st_ino):
                raise FileExistsError(
                    f"{who}: the temporary file {temporary} was replaced while exporting "
                    "(another process writes to the output folder); nothing was written. "
                    "Export into a folder only you can write to."
                )
        if output.exists() and not overwrite:
            raise FileExistsError(
                f"{who}: output {output} appeared while exporting; nothing "
                "was written. Pass overwrite=True (--overwrite) to replace it."
            )
        os.replace(temporary, output)
    finally:
        with contextlib.suppress(FileNotFoundError):
            temporary.unlink()


def _found_on_store(output: StoreObject) -> Literal["prefix", "object"] | None:
    """What stands at ``output`` on its store now (the filesystem's listing cache dropped
    first): a prefix holding objects, an object, or nothing."""
    fs = output.store.fs
    with contextlib.suppress(Exception):
        fs.invalidate_cache(output.path)
    if fs.isdir(output.path):
        return "prefix"
    return "object" if fs.exists(output.path) else None


def _upload(
    output: StoreObject,
    write: Callable[[IO[bytes]], None],
    *,
    overwrite: bool,
    who: str,
    size: int | None,
) -> None:
    fs = output.store.fs
    part = _PART if size is None else max(_PART, math.ceil(size / _MAX_PARTS))
    file = fs.open(output.path, "wb", block_size=part)
    try:
        write(file)
        if not overwrite and _found_on_store(output) is not None:
            raise FileExistsError(
                f"{who}: output {output} appeared while exporting; nothing was written. "
                "Pass overwrite=True (--overwrite) to replace it."
            )
    except BaseException:
        abort_upload(file)  # never close(): that completes the upload with what was written
        raise
    try:
        file.close()  # completes the upload: the object appears, whole
    except Exception as err:
        with contextlib.suppress(Exception):
            file.discard()
        raise OSError(
            f"{who}: completing the upload of {output} failed: {type(err).__name__}: {err}. "
            "Nothing was written; export again."
        ) from err
