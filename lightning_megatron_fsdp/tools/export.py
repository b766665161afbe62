"""Offline export of a checkpoint to one file (safetensors or ``torch.save``, chosen by the
suffix), at any world size, without a process group, a GPU or memory for the whole model:
:func:`consolidate_checkpoint` checks the checkpoint, then streams one full tensor at a time
into the output, front to back, so that the output can be a local file (renamed into place
when complete) or an object on a store (a streaming upload that completes when the file is
whole: the output location's ``write_atomically``); the checkpoint can be on either too.
The writers and checks here are shared with :mod:`lightning_checkpoint`.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import json
import math
import os
import struct
import sys
import warnings
import zipfile
import zlib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import IO, Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    TensorStorageMetadata,
)

from lightning_megatron_fsdp import _torch
from lightning_megatron_fsdp.errors import CheckpointCorruptedError, NotACheckpointError
from lightning_megatron_fsdp.storage import (
    DCP_METADATA_FILE,
    MANIFEST_FILE,
    MAX_EXAMPLES,
    Location,
    SeekableStream,
    VerifyingFileSystemReader,
    count,
    locate,
    raw_bytes,
    summarise,
)
from lightning_megatron_fsdp.tools.inspection import (
    MODEL_PREFIX,
    OPTIMIZER_PREFIX,
    CheckedCheckpoint,
    check_directory,
    ordered_keys,
)

__all__ = [
    "ExportEntry",
    "TorchFile",
    "TreePlace",
    "consolidate_checkpoint",
    "load_object",
    "parse_dtype",
    "refuse_problems",
    "select_entries",
    "write_export",
    "write_torch",
]

"""DCP key prefix of model tensors; stripped in consolidated output."""

"""DCP (and consolidated output) key prefix of optimizer state, ``optimizer_states.<i>.``."""

_DTYPE_ALIASES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
}

_TORCH_SUFFIXES = (".pt", ".pth", ".bin")
_SAFETENSORS_SUFFIX = ".safetensors"

_SAFETENSORS_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint64: "U64",
    torch.uint32: "U32",
    torch.uint16: "U16",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.complex64: "C64",
}

_WRITE_BLOCK = 8 << 20


# ---------------------------------------------------------------------------------------
# Reading and checking a checkpoint directory (manifest.py owns the manifest itself)
# ---------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------
# Consolidation
# ---------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ExportEntry:
    """One output entry: the DCP key it comes from and the name and dtype it gets."""

    key: str
    name: str
    metadata: TensorStorageMetadata | BytesStorageMetadata
    dtype: torch.dtype | None  # output dtype; None for non-tensor entries

    def __post_init__(self) -> None:
        if (self.dtype is None) != isinstance(self.metadata, BytesStorageMetadata):
            raise AssertionError(
                f"ExportEntry {self.key!r}: dtype must be set exactly for tensors."
            )

    @property
    def shape(self) -> tuple[int, ...]:
        assert isinstance(self.metadata, TensorStorageMetadata)
        return tuple(self.metadata.size)

    @property
    def nbytes(self) -> int:
        assert self.dtype is not None
        return math.prod(self.shape) * self.dtype.itemsize


def parse_dtype(
    dtype: torch.dtype | str | None, who: str = "consolidate_checkpoint"
) -> torch.dtype | None:
    """The output dtype ``dtype`` names (a ``torch.dtype`` or an alias such as ``"bf16"``),
    or ``None`` to keep the saved dtypes; a ``ValueError`` naming ``who`` otherwise."""
    if dtype is None or dtype in _DTYPE_ALIASES.values():
        return dtype  # type: ignore[return-value]
    if isinstance(dtype, str) and dtype.lower() in _DTYPE_ALIASES:
        return _DTYPE_ALIASES[dtype.lower()]
    raise ValueError(
        f"{who}: dtype={dtype!r} is not supported; expected None (keep the "
        f"saved dtypes), torch.float32/bfloat16/float16, or one of {sorted(_DTYPE_ALIASES)}."
    )


def _output_format(output: Location) -> str:
    suffix = output.suffix.lower()
    if suffix == _SAFETENSORS_SUFFIX:
        return "safetensors"
    if suffix in _TORCH_SUFFIXES:
        return "torch"
    raise ValueError(
        f"consolidate_checkpoint: output {output} has suffix {output.suffix!r}; expected "
        f"{_SAFETENSORS_SUFFIX} for safetensors or one of {', '.join(_TORCH_SUFFIXES)} for "
        "torch.save. The suffix chooses the format."
    )


def refuse_problems(checked: CheckedCheckpoint, checkpoint: Location, who: str) -> None:
    """Raise one error listing every problem :func:`check_directory` found, if any.

    Raises:
        NotACheckpointError: Without a readable manifest.
        CheckpointCorruptedError: For a damaged checkpoint.
    """
    if not checked.problems:
        return
    inside = checkpoint.checkpoints_inside()
    if inside and checked.manifest is None:  # ModelCheckpoint's dirpath: one line says it
        raise NotACheckpointError(
            f"{who}: {checkpoint} is a directory of checkpoints "
            f"({summarise('pass one of them', inside)}), not a checkpoint. Nothing was written."
        )
    if checked.manifest is None and checked.metadata is None and len(checked.problems) == 1:
        # Not a checkpoint at all (a path that does not exist, a file, an empty directory):
        # the one problem says what it is, and `inspect --verify` would only repeat it.
        raise NotACheckpointError(f"{who}: {checked.problems[0]} Nothing was written.")
    listing = "\n".join(f"  - {problem}" for problem in checked.problems)
    error = NotACheckpointError if checked.manifest is None else CheckpointCorruptedError
    raise error(
        f"{who}: {checkpoint} is not a complete, intact lightning-megatron-fsdp checkpoint "
        f"({count(len(checked.problems), 'problem')}):\n{listing}\nNothing was written. "
        f"Point at a complete checkpoint directory (one that has {MANIFEST_FILE}), or run "
        f"`lightning-megatron-fsdp inspect --verify {checkpoint}` for details."
    )


def select_entries(
    checked: CheckedCheckpoint,
    dtype: torch.dtype | None,
    *,
    include_optimizer: bool,
    path: Location,
    strip_prefix: str | None = None,
    who: str = "consolidate_checkpoint",
) -> list[ExportEntry]:
    """The entries to export, in state-dict order, with their output names and dtypes.

    With ``strip_prefix``, only model entries under it are exported, renamed without it;
    a warning lists the others.
    """
    metadata = checked.metadata
    if metadata is None:
        raise AssertionError("select_entries: a checked checkpoint has parsed metadata.")
    entries = []
    outside: list[str] = []
    for key in ordered_keys(metadata, checked.manifest):
        md = metadata.state_dict_metadata[key]
        if key.startswith(MODEL_PREFIX):
            name = key[len(MODEL_PREFIX) :]
            if strip_prefix is not None:
                if not name.startswith(strip_prefix):
                    outside.append(name)
                    continue
                name = name[len(strip_prefix) :]
            cast = dtype
        elif include_optimizer and key.startswith(OPTIMIZER_PREFIX):
            # Optimizer state keeps its saved dtype: rounding Adam's moments or step count
            # to bf16 would change what a resumed optimizer does.
            name, cast = key, None
        else:
            continue
        if isinstance(md, TensorStorageMetadata):
            saved = md.properties.dtype
            out = cast if cast is not None and saved.is_floating_point else saved
            entries.append(ExportEntry(key, name, md, out))
        else:
            entries.append(ExportEntry(key, name, md, None))
    if strip_prefix is not None and not any(e.key.startswith(MODEL_PREFIX) for e in entries):
        heads = sorted({name.partition(".")[0] + "." for name in outside})
        raise ValueError(
            f"{who}: strip_prefix={strip_prefix!r} matches no model key of {path}; its keys "
            f"start with {heads[:5]}. Pass the attribute path of the inner module, e.g. "
            f"{heads[0] if heads else 'model.'!r}."
        )
    if outside:
        shown = ", ".join(repr(name) for name in outside[:MAX_EXAMPLES])
        more = f" and {len(outside) - MAX_EXAMPLES} more" if len(outside) > MAX_EXAMPLES else ""
        warnings.warn(
            f"{who}: {len(outside)} model entries of {path} lie outside strip_prefix="
            f"{strip_prefix!r} and are left out: {shown}{more}.",
            UserWarning,
            stacklevel=3,
        )
    if not any(e.key.startswith(MODEL_PREFIX) for e in entries):
        raise NotACheckpointError(
            f"{path.file(DCP_METADATA_FILE)}: no model tensors (keys starting with "
            f"{MODEL_PREFIX!r}); expected a checkpoint written by MegatronFSDPCheckpointIO."
        )
    if include_optimizer and not any(e.key.startswith(OPTIMIZER_PREFIX) for e in entries):
        raise ValueError(
            f"{path.file(DCP_METADATA_FILE)}: no optimizer state (keys starting with "
            f"{OPTIMIZER_PREFIX!r}); the checkpoint was saved weights-only. Export without "
            "optimizer state (drop --optimizer)."
        )
    names = [e.name for e in entries]
    if len(set(names)) != len(names):
        clash = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(
            f"{who}: output keys {clash[:3]} would appear twice (a model "
            f"FQN starting with {OPTIMIZER_PREFIX!r}); export without include_optimizer."
        )
    return entries


@contextlib.contextmanager
def _quiet_no_dist() -> Iterator[None]:
    """Silence DCP's warning that there is no process group: that is the point here; and
    raise the reader's own error rather than DCP's wrapper of it (a ``BaseException``)."""
    from torch.distributed.checkpoint.api import CheckpointException

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is .*", category=UserWarning)
        try:
            yield
        except CheckpointException as err:
            failures = [failure for failure, _ in err.failures.values()]
            if failures and isinstance(failures[0], Exception):
                raise failures[0] from err
            raise CheckpointCorruptedError(f"reading the checkpoint failed: {err}") from err


def _load_tensor(reader: VerifyingFileSystemReader, entry: ExportEntry) -> torch.Tensor:
    """Read one full tensor, in its saved dtype, from its chunks: the only full copy.

    Every chunk is read straight into place (``storage.StreamingReader``), so this costs
    the tensor's size and no transient copy.
    """
    assert isinstance(entry.metadata, TensorStorageMetadata)
    target = torch.empty(entry.shape, dtype=entry.metadata.properties.dtype)
    with _quiet_no_dist():
        dcp.load({entry.key: target}, storage_reader=reader, no_dist=True)
    return target


def _write_tensor(stream: IO[bytes], tensor: torch.Tensor, dtype: torch.dtype) -> int:
    """Append ``tensor`` cast to ``dtype`` to ``stream``; return the CRC-32 of its bytes.

    Casts and writes in blocks of about ``_WRITE_BLOCK`` bytes, so a cast never holds a
    second full copy of the tensor.
    """
    flat = tensor.reshape(-1)
    step = max(1, _WRITE_BLOCK // max(tensor.element_size(), dtype.itemsize))
    crc = 0
    for start in range(0, flat.numel(), step):
        block = raw_bytes(flat[start : start + step].to(dtype))
        if stream.write(block) != len(block):
            raise OSError(f"short write to {getattr(stream, 'name', stream)}")
        crc = zlib.crc32(block, crc)
    return crc


def load_object(reader: VerifyingFileSystemReader, entry: ExportEntry) -> Any:
    """The non-tensor object saved under ``entry.key``, read alone through ``reader``."""
    holder: dict[str, Any] = {entry.key: None}
    with _quiet_no_dist():
        dcp.load(holder, storage_reader=reader, no_dist=True)
    return holder[entry.key]


class SafetensorsFile:
    """A safetensors file planned before any tensor is read (its header, hence its size,
    known), then written front to back, one tensor in memory at a time.

    Format: ``<u64 little-endian N><N bytes of JSON header><data>``; the header maps each
    name to ``{"dtype", "shape", "data_offsets": [begin, end]}`` relative to the data, and
    ``__metadata__`` to string pairs. Offsets must tile the data exactly.

    Raises:
        ValueError: If a tensor's dtype or an object cannot be stored in safetensors.
    """

    def __init__(self, entries: list[ExportEntry], objects: dict[str, Any]) -> None:
        if sys.byteorder != "little":
            raise NotImplementedError("safetensors export needs a little-endian machine.")
        tensors = [e for e in entries if e.dtype is not None]
        # Largest element first: with an 8-byte-aligned header every tensor is then aligned
        # to its element size, which zero-copy loaders expect.
        tensors.sort(key=lambda e: -e.dtype.itemsize)  # type: ignore[union-attr]
        header: dict[str, Any] = {}
        offset = 0
        for entry in tensors:
            assert entry.dtype is not None
            code = _SAFETENSORS_DTYPES.get(entry.dtype)
            if code is None:
                raise ValueError(
                    f"consolidate_checkpoint: tensor {entry.key!r} has dtype {entry.dtype}, "
                    "which safetensors cannot store; export to .pt instead."
                )
            header[entry.name] = {
                "dtype": code,
                "shape": list(entry.shape),
                "data_offsets": [offset, offset + entry.nbytes],
            }
            offset += entry.nbytes
        metadata = {"format": "pt"}
        for name, value in objects.items():
            try:
                metadata[name] = json.dumps(value)
            except (TypeError, ValueError) as err:
                raise ValueError(
                    f"consolidate_checkpoint: entry {name!r} is a {type(value).__name__}, "
                    "which neither safetensors nor its JSON metadata can hold; export to .pt "
                    "instead."
                ) from err
        header["__metadata__"] = metadata
        encoded = json.dumps(header, separators=(",", ":")).encode("utf-8")
        self._header = encoded + b" " * (-len(encoded) % 8)
        self._tensors = tensors
        self.size = 8 + len(self._header) + offset
        """The file's size in bytes."""

    def write(self, stream: IO[bytes], reader: VerifyingFileSystemReader) -> None:
        """Write the file to ``stream`` (any writable stream: it is never sought)."""
        stream.write(struct.pack("<Q", len(self._header)))
        stream.write(self._header)
        for entry in self._tensors:
            assert entry.dtype is not None
            _write_tensor(stream, _load_tensor(reader, entry), entry.dtype)


TreePlace = tuple[Any, ...]
"""Where a tensor sits in a nested checkpoint tree: the keys (dict) and indices (list)
from the root, e.g. ``("state_dict", "embed.weight")``."""


def _at(tree: Any, place: TreePlace) -> Any:
    for key in place:
        tree = tree[key]
    return tree


class _Skeleton(SeekableStream):
    """A file in memory that keeps the bytes written to it and only the extent of those
    sought over: what ``torch.save`` under ``skip_data`` writes (the pickle, zip headers and
    directory) in a few KiB, whatever the tensors' size. The holes read as zeros.
    """

    def __init__(self) -> None:
        super().__init__()
        self._starts: list[int] = []
        self._pieces: list[bytearray] = []
        self._position = 0
        self.size = 0

    def _end(self) -> int:
        return self.size

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        if view.nbytes:
            self._put(self._position, view)
        self._position += view.nbytes
        self.size = max(self.size, self._position)
        return view.nbytes

    def _put(self, at: int, view: memoryview) -> None:
        i = bisect.bisect_right(self._starts, at) - 1
        if i >= 0 and at <= self._starts[i] + len(self._pieces[i]):  # in or after piece i
            piece = self._pieces[i]
            piece[at - self._starts[i] : at - self._starts[i] + view.nbytes] = view
        else:
            i += 1
            self._starts.insert(i, at)
            self._pieces.insert(i, bytearray(view))
        if (
            i + 1 < len(self._starts)
            and self._starts[i] + len(self._pieces[i]) > self._starts[i + 1]
        ):
            raise AssertionError(
                "torch.save skeleton: a write reached bytes written before; torch's "
                "serialization changed in a way this exporter does not support."
            )

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        n = max(0, min(view.nbytes, self.size - self._position))
        view[:n] = bytes(n)
        for start, piece in zip(self._starts, self._pieces, strict=True):
            lo, hi = max(start, self._position), min(start + len(piece), self._position + n)
            if lo < hi:
                view[lo - self._position : hi - self._position] = piece[lo - start : hi - start]
        self._position += n
        return n

    def written(self, start: int, stop: int) -> bytes:
        """Bytes ``[start, stop)``, which must all have been written (no hole).

        Raises:
            AssertionError: If a hole lies inside (torch's format changed).
        """
        covered = 0
        for piece_start, piece in zip(self._starts, self._pieces, strict=True):
            covered += max(0, min(piece_start + len(piece), stop) - max(piece_start, start))
        if covered != stop - start:
            raise AssertionError(
                f"torch.save skeleton: bytes [{start}, {stop}) are not all written: a tensor "
                "inside an object other than a dict, list or tuple, or torch's serialization "
                "changed in a way this exporter does not support."
            )
        self.seek(start)
        return self.read(stop - start)

    def patch(self, at: int, data: bytes) -> None:
        """Overwrite written bytes at ``at``."""
        self.written(at, at + len(data))
        self.seek(at)
        self.write(data)


class TorchFile:
    """A ``torch.save`` file of ``tree`` planned before any tensor is read (its layout,
    hence its size, known), then written front to back, one tensor in memory at a time.

    ``tree`` is any picklable nest of dicts and lists; at each place of ``places`` it will
    hold that entry's full tensor (whatever is there now is replaced); tensors it already
    holds (``meta.pt``'s random states, a callback's ``kth_value``) are written as they
    are. ``torch.save`` under ``skip_data`` writes the pickle and reserves each storage's
    record (for the entries from fake tensors: no memory) into a :class:`_Skeleton`;
    ``torch.load(map_location="meta")`` of it reports each storage's byte offset.
    :meth:`write` copies the skeleton to the output with each storage's bytes in its
    record, and the zip CRC-32 that ``skip_data`` leaves at zero, computed while the bytes
    go out, in the data descriptor and the central directory that follow them (torch's
    zip writer puts no CRC before the data).
    """

    def __init__(self, tree: dict[str, Any], places: list[tuple[ExportEntry, TreePlace]]) -> None:
        skeleton = _Skeleton()
        with _torch.fake_tensor_mode():
            for entry, place in places:
                assert entry.dtype is not None
                _at(tree, place[:-1])[place[-1]] = torch.empty(entry.shape, dtype=entry.dtype)
        with torch.serialization.skip_data(materialize_fake_tensors=True):
            torch.save(tree, skeleton)
        for _, place in places:  # drop the fakes: the caller's tree holds no tensor of ours
            _at(tree, place[:-1])[place[-1]] = None
        skeleton.seek(0)
        # Our own skeleton, whose objects came out of the checkpoint already unpickled.
        placed = torch.load(skeleton, map_location="meta", weights_only=False)
        records: dict[int, ExportEntry | torch.Tensor] = {}
        for entry, place in places:
            stored = _at(placed, place)
            offset = _torch.checkpoint_offset(stored)
            if offset is None or stored.untyped_storage().nbytes() != entry.nbytes:
                raise AssertionError(
                    f"torch.save skeleton: record of {entry.name!r} has offset {offset} and "
                    f"{stored.untyped_storage().nbytes()} bytes, expected {entry.nbytes}; "
                    "torch's serialization changed in a way this exporter does not support."
                )
            records[offset] = entry
        for held, stored in _tensor_pairs(tree, placed):
            offset = _torch.checkpoint_offset(stored)
            if offset is None:
                raise AssertionError(
                    "torch.save skeleton: a tensor's record has no offset; torch's "
                    "serialization changed in a way this exporter does not support."
                )
            records.setdefault(offset, held)
        self._skeleton = skeleton
        self._records = sorted(records.items(), key=lambda r: (r[0], _nbytes(r[1])))
        self._crc_places = _crc_places(skeleton, {o for o, r in self._records if _nbytes(r)})
        self.size = skeleton.size
        """The file's size in bytes."""

    def write(self, stream: IO[bytes], reader: VerifyingFileSystemReader) -> None:
        """Write the file to ``stream`` (any writable stream: it is never sought)."""
        position = 0
        for offset, record in self._records:
            stream.write(self._skeleton.written(position, offset))
            if isinstance(record, ExportEntry):
                assert record.dtype is not None
                crc = _write_tensor(stream, _load_tensor(reader, record), record.dtype)
            else:
                crc = _write_tensor(stream, _storage_bytes(record), torch.uint8)
            for at in self._crc_places.get(offset, ()) if _nbytes(record) else ():
                self._skeleton.patch(at, struct.pack("<I", crc))
            position = offset + _nbytes(record)
        stream.write(self._skeleton.written(position, self._skeleton.size))


def _nbytes(record: ExportEntry | torch.Tensor) -> int:
    """Bytes of a record's payload: an entry's tensor, or a held tensor's whole storage."""
    if isinstance(record, ExportEntry):
        return record.nbytes
    return int(record.untyped_storage().nbytes())


def _storage_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The whole storage of ``tensor`` (what ``torch.save`` writes), as CPU bytes."""
    storage = tensor.untyped_storage().cpu()
    return torch.empty(0, dtype=torch.uint8).set_(storage)


def _tensor_pairs(tree: Any, placed: Any) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Each tensor ``tree`` holds in its dicts, lists and tuples, with its counterpart
    in ``placed``, the same tree loaded back from the skeleton. (A tensor inside another
    object is not reached: its record then stays a hole, which :meth:`_Skeleton.written`
    refuses to copy.)"""
    if isinstance(tree, torch.Tensor):
        if isinstance(placed, torch.Tensor):
            yield tree, placed
    elif isinstance(tree, Mapping) and isinstance(placed, Mapping):
        for key, value in tree.items():
            if key in placed:
                yield from _tensor_pairs(value, placed[key])
    elif isinstance(tree, list | tuple) and isinstance(placed, list | tuple):
        for value, loaded in zip(tree, placed, strict=False):
            yield from _tensor_pairs(value, loaded)


def write_torch(
    stream: IO[bytes],
    tree: dict[str, Any],
    places: list[tuple[ExportEntry, TreePlace]],
    reader: VerifyingFileSystemReader,
) -> None:
    """Write ``tree`` to ``stream`` as a ``torch.save`` file, one tensor in memory at a
    time (:class:`TorchFile`)."""
    TorchFile(tree, places).write(stream, reader)


def _crc_places(skeleton: _Skeleton, data_offsets: set[int]) -> dict[int, list[int]]:
    """Where the CRC-32 of each record whose data starts at one of ``data_offsets`` goes:
    its data descriptor (``PK\\x07\\x08``, crc, sizes) right after the payload and its
    central directory entry (offset 16). Both follow the payload in the file.

    Raises:
        AssertionError: If a record keeps its CRC in the local header, before the data
            (torch's zip writer sets general-purpose flag bit 3), or is not found.
    """
    skeleton.seek(0)
    archive = zipfile.ZipFile(skeleton)  # type: ignore[arg-type]
    position = archive.start_dir
    places: dict[int, list[int]] = {}
    for info in archive.infolist():
        central = skeleton.written(position, position + 46)
        if central[:4] != b"PK\x01\x02":
            raise AssertionError(f"zip central directory entry expected at {position}.")
        name_len, extra_len, comment_len = struct.unpack("<3H", central[28:34])
        local = skeleton.written(info.header_offset, info.header_offset + 30)
        local_name_len, local_extra_len = struct.unpack("<2H", local[26:30])
        data_offset = info.header_offset + 30 + local_name_len + local_extra_len
        if data_offset in data_offsets:
            descriptor = data_offset + info.file_size
            if not info.flag_bits & 0x08 or (
                skeleton.written(descriptor, descriptor + 4) != b"PK\x07\x08"
            ):
                raise AssertionError(
                    f"zip record {info.filename} has no data descriptor after its data; "
                    "torch's zip writer changed in a way this exporter does not support."
                )
            places[data_offset] = [descriptor + 4, position + 16]
        position += 46 + name_len + extra_len + comment_len
    if set(places) != data_offsets:
        raise AssertionError(
            f"zip records at offsets {sorted(data_offsets - set(places))} not found."
        )
    return places


def consolidate_checkpoint(
    checkpoint_dir: str | os.PathLike[str],
    output_path: str | os.PathLike[str],
    dtype: torch.dtype | str | None = None,
    *,
    include_optimizer: bool = False,
    strip_prefix: str | None = None,
    overwrite: bool = False,
    verify_checksums: bool = True,
    trust_checkpoint: bool = False,
    storage_options: Mapping[str, Any] | None = None,
) -> Path | str:
    """Write a checkpoint's full, unsharded tensors to one ``.safetensors`` or ``.pt`` file.

    Runs offline in one process: no process group (it issues no collective, so it is also
    safe on one rank of a running job), no GPU. Streams tensor by tensor, so peak memory
    is about the largest tensor (casts run in small blocks), whatever the model
    size. Nothing is written unless the whole export succeeds: the data goes to a hidden
    temporary file next to ``output_path``, which is renamed into place at the end and
    removed on any error. Either side may be a URL (``s3://...``, any fsspec filesystem):
    a checkpoint there is read with ranged GETs (its newest complete version, as a load
    takes it), and an output there is a streaming upload, whose object appears only when
    the upload completes (``Location.write_atomically``).

    The output's keys are the model FQNs, so ``model.load_state_dict(torch.load(path))``
    (or ``safetensors.torch.load_file``) loads it into the unsharded model; see the module
    docstring for tied weights and the optimizer layout. With ``strip_prefix="model."``
    the keys are those of the module the LightningModule holds as ``self.model``, so its
    own ``load_state_dict``, or Hugging Face ``from_pretrained`` of a directory holding the
    file as ``model.safetensors`` next to the model's ``config.json``, takes it as is. A
    tied parameter is written under each of its FQNs, as that module's ``state_dict()``
    has it; the checkpoint does not record ties, so none is dropped (Hugging Face
    ``save_pretrained`` writes a tie once, and ``from_pretrained`` accepts both forms).
    For a Lightning ``load_from_checkpoint`` file, see
    :func:`~lightning_megatron_fsdp.export_lightning_checkpoint`.

    Args:
        checkpoint_dir: A checkpoint directory written by ``MegatronFSDPCheckpointIO``,
            or its URL.
        output_path: Output file or URL; ``.safetensors`` writes safetensors, ``.pt``,
            ``.pth`` or ``.bin`` writes a ``torch.save`` file.
        dtype: Cast floating-point model tensors to this dtype (``torch.bfloat16`` or
            ``"bf16"``, ``"fp16"``, ``"fp32"``); ``None`` keeps the saved dtypes.
            Integer tensors and optimizer state are never cast.
        include_optimizer: Also export optimizer state under ``optimizer_states.<i>.``.
        strip_prefix: Export only the model entries whose FQN starts with this prefix
            (ending in ``"."``, e.g. ``"model."``), without it; a ``UserWarning`` lists
            the entries left out. Not with ``include_optimizer``: optimizer state is keyed
            by the LightningModule's FQNs.
        overwrite: Replace an existing ``output_path``.
        verify_checksums: Check every file's digest against the manifest first. On by
            default although it reads the checkpoint twice: a flipped bit inside a shard
            leaves sizes and structure intact and would be exported silently. Sizes,
            completeness and chunk tiling are always checked.
        trust_checkpoint: Unpickle ``.metadata`` and byte records in full. By default
            nothing from the checkpoint is run (see the README, "Untrusted checkpoints").
        storage_options: Options of a URL's fsspec filesystem (both sides); without them
            the filesystem's own configuration applies (for s3fs the ``AWS_*`` variables).

    Returns:
        ``output_path`` as a ``Path``; a URL as the string given.

    Raises:
        NotACheckpointError: If the directory has no readable manifest (not a complete
            checkpoint written by ``MegatronFSDPCheckpointIO``), or a URL names nothing;
            the message lists every problem found.
        ImportError: If a URL's filesystem is not installed (naming what to install).
        CheckpointCorruptedError: If files are missing, truncated or fail their checksum,
            or ``.metadata`` disagrees with them or with the manifest; the message lists
            each problem and the file it concerns.
        FileExistsError: If ``output_path`` exists and ``overwrite`` is false.
        FileNotFoundError: If the output's directory does not exist.
        IsADirectoryError: If ``output_path`` is a directory (a prefix holding objects).
        OSError: If a read or the upload fails.
        ValueError: For an unsupported suffix or ``dtype``, an output inside the
            checkpoint, an entry the output format cannot hold, or a ``strip_prefix``
            that is malformed, matches no model key, or comes with ``include_optimizer``.
    """
    who = "consolidate_checkpoint"
    named = locate(checkpoint_dir, storage_options)
    output = locate(output_path, storage_options)
    out_dtype = parse_dtype(dtype)
    output.check_output(named, overwrite=overwrite, who=who)  # first: a directory has no suffix
    output_format = _output_format(output)
    _check_strip_prefix(strip_prefix, include_optimizer=include_optimizer)
    checkpoint, _ = named.loaded_version()
    checked = check_directory(checkpoint, checksums=verify_checksums, trust=trust_checkpoint)
    refuse_problems(checked, checkpoint, who)
    entries = select_entries(
        checked,
        out_dtype,
        include_optimizer=include_optimizer,
        path=checkpoint,
        strip_prefix=strip_prefix,
    )
    assert checked.metadata is not None  # select_entries checked it
    reader = checkpoint.checked_reader(checked.metadata, trust_checkpoint=trust_checkpoint)
    objects = {e.name: load_object(reader, e) for e in entries if e.dtype is None}
    file: SafetensorsFile | TorchFile
    if output_format == "safetensors":
        for entry in entries:
            if entry.dtype is None and entry.key.startswith(MODEL_PREFIX):
                raise ValueError(
                    f"{who}: model entry {entry.key!r} is a "
                    f"{type(objects[entry.name]).__name__}, not a tensor; safetensors holds "
                    "only tensors. Export to .pt instead."
                )
        file = SafetensorsFile(entries, objects)
    else:
        tree = {e.name: objects.get(e.name) for e in entries}
        file = TorchFile(tree, [(e, (e.name,)) for e in entries if e.dtype is not None])
    write_export(output, file, reader, overwrite=overwrite, who=who)
    return output.returned()


def write_export(
    output: Location,
    file: SafetensorsFile | TorchFile,
    reader: VerifyingFileSystemReader,
    *,
    overwrite: bool,
    who: str,
) -> None:
    """Stream ``file`` to ``output`` atomically, its tensors read through ``reader``."""
    output.write_atomically(
        lambda stream: file.write(stream, reader),
        overwrite=overwrite,
        who=who,
        size=file.size,
    )


def _check_strip_prefix(strip_prefix: str | None, *, include_optimizer: bool) -> None:
    """Refuse a malformed ``strip_prefix``, before anything is read.

    Raises:
        TypeError: If it is not a str.
        ValueError: If it is empty, does not end in ``"."``, or comes with optimizer state.
    """
    if strip_prefix is None:
        return
    if not isinstance(strip_prefix, str):
        raise TypeError(
            f"consolidate_checkpoint: strip_prefix must be a str such as 'model.', got "
            f"{strip_prefix!r}."
        )
    if not strip_prefix.endswith(".") or not strip_prefix.strip("."):
        example = strip_prefix.rstrip(".") + "." if strip_prefix.strip(".") else "model."
        raise ValueError(
            f"consolidate_checkpoint: strip_prefix={strip_prefix!r} must be a module path "
            f"ending in '.', e.g. {example!r}; otherwise the stripped keys would start "
            "inside a name."
        )
    if include_optimizer:
        raise ValueError(
            f"consolidate_checkpoint: strip_prefix={strip_prefix!r} with include_optimizer: "
            "optimizer state is keyed by the LightningModule's parameter names, which the "
            "stripped file no longer has. Export the weights with strip_prefix and the "
            "optimizer state without it (or use export_lightning_checkpoint)."
        )
