"""Offline export of a checkpoint to one file (safetensors or ``torch.save``, chosen by the
suffix), at any world size, without a process group, a GPU or memory for the whole model:
:func:`consolidate_checkpoint` checks the checkpoint, then streams one full tensor at a time
into the output, which appears by an atomic rename. The writers and checks here are shared
with :mod:`lightning_checkpoint`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import math
import os
import struct
import sys
import uuid
import warnings
import zipfile
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from lightning_megatron_fsdp import _torch
from lightning_megatron_fsdp.checkpoint.confined_files import (
    FileWindow,
    create_exclusive,
    open_regular,
)
from lightning_megatron_fsdp.checkpoint.errors import CheckpointCorruptedError, NotACheckpointError
from lightning_megatron_fsdp.checkpoint.format import DCP_METADATA_FILE, MANIFEST_FILE
from lightning_megatron_fsdp.checkpoint.safe_unpickling import check_tensor_record
from lightning_megatron_fsdp.checkpoint.storage import VerifyingFileSystemReader
from lightning_megatron_fsdp.tools.inspection import (
    MAX_EXAMPLES,
    MODEL_PREFIX,
    OPTIMIZER_PREFIX,
    CheckedCheckpoint,
    check_directory,
    ordered_keys,
    summarise,
)

__all__ = [
    "ExportEntry",
    "StreamingReader",
    "TreePlace",
    "check_output",
    "checkpoints_inside",
    "consolidate_checkpoint",
    "load_object",
    "parse_dtype",
    "refuse_problems",
    "select_entries",
    "write_atomically",
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


class StreamingReader(VerifyingFileSystemReader):
    """A reader that reuses parsed metadata and reads chunks into place.

    Checksums were compared before (``check_directory``), so it does not verify again; it opens
    files and bounds records as :class:`VerifyingFileSystemReader` does, and anything it
    does not read itself goes through that reader.

    ``dcp.load`` still plans every read (which stored chunk lands where); only the byte
    copy differs. DCP's reader ``torch.load``s each stored chunk into a new tensor and
    copies it into the target, so a tensor saved whole by one rank costs twice its size.
    Here each chunk's layout is read with ``torch.load(map_location="meta")`` (no data;
    torch reports where the storage bytes start), and the bytes are read with
    ``readinto`` straight into the target's memory. Anything else (a stream transform,
    a dtype change, a non-contiguous region) goes through DCP's own path unchanged.

    It also returns the metadata it was given instead of re-reading ``.metadata``, which
    ``dcp.load`` would otherwise unpickle once per tensor.
    """

    def __init__(self, path: Path, metadata: Metadata, *, trust: bool = False) -> None:
        super().__init__(str(path), verify=False, trust_checkpoint=trust)
        self._metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return self._metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(
                item
            )
        fallback = []
        for relative_path, items in per_file.items():
            try:
                fd = open_regular(self.path, relative_path, size=self._expected_size(relative_path))
            except OSError as err:
                raise self._corrupted(relative_path, str(err)) from err
            with open(fd, "rb") as stream:
                fallback += [item for item in items if not self._read_into(stream, item, planner)]
        if fallback:
            return super().read_data(dataclasses.replace(plan, items=fallback), planner)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _read_into(self, stream: IO[bytes], item: ReadItem, planner: LoadPlanner) -> bool:
        """Read ``item``'s bytes straight into its target; ``False`` if it cannot."""
        info = self.storage_data[item.storage_index]
        if item.type != LoadItemType.TENSOR or info.transform_descriptors:
            return False
        where = f"{os.path.join(self.path, info.relative_path)}: {self._where(item)}"
        chunk = self._chunks.get((item.storage_index.fqn, tuple(item.storage_index.offset or ())))
        if chunk is None:
            raise CheckpointCorruptedError(f"{where}: no such chunk in {DCP_METADATA_FILE}")
        check_tensor_record(
            io.BufferedReader(FileWindow(stream.fileno(), info.offset, info.length)),
            math.prod(chunk[0]) * chunk[1].itemsize,
            source=where,
        )
        view = _torch.create_file_view(stream, info.offset, info.length)
        stored = torch.load(view, map_location="meta", weights_only=True)
        offset = getattr(stored.untyped_storage(), "_checkpoint_offset", None)
        source = _torch.narrow_tensor_by_index(stored, item.storage_offsets, item.lengths)
        target = planner.resolve_tensor(item).detach()
        nbytes = target.numel() * target.element_size()
        if offset is not None and (
            offset + source.storage_offset() * source.element_size() + nbytes > info.length
            or offset < 0
        ):
            raise CheckpointCorruptedError(f"{where}: the tensor data lies outside its record")
        if (
            offset is None
            or sys.byteorder != "little"
            or source.dtype != target.dtype
            or source.shape != target.shape
            or not source.is_contiguous()
            or not target.is_contiguous()
        ):
            return False
        start = info.offset + offset + source.storage_offset() * source.element_size()
        if nbytes:
            stream.seek(start)
            read = stream.readinto(_raw_bytes(target))  # type: ignore[attr-defined]
            if read != nbytes:
                raise CheckpointCorruptedError(
                    f"{os.path.join(self.path, info.relative_path)}: {item.storage_index.fqn!r} "
                    f"needs bytes [{start}, {start + nbytes}) but the file ends first; the "
                    "file is truncated."
                )
        planner.commit_tensor(item, target)
        return True


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


def _output_format(output: Path) -> str:
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


def check_output(
    output: Path, checkpoint: Path, *, overwrite: bool, who: str = "consolidate_checkpoint"
) -> None:
    """Refuse outputs we must not write, before anything is read or written."""
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
    if checkpoint.is_dir() and output.parent.resolve() == checkpoint.resolve():
        raise ValueError(
            f"{who}: output {output} lies inside the checkpoint directory; a "
            "new file there would make the checkpoint fail verification. Write it elsewhere."
        )


def refuse_problems(checked: CheckedCheckpoint, checkpoint: Path, who: str) -> None:
    """Raise one error listing every problem :func:`check_directory` found, if any.

    Raises:
        NotACheckpointError: Without a readable manifest.
        CheckpointCorruptedError: For a damaged checkpoint.
    """
    if not checked.problems:
        return
    listing = "\n".join(f"  - {problem}" for problem in checked.problems)
    inside = checkpoints_inside(checkpoint)
    hint = (
        f"{checkpoint} is a directory of checkpoints ({summarise('pass one of them', inside)})"
        if inside and checked.manifest is None
        else f"Point at a complete checkpoint directory (one that has {MANIFEST_FILE}), or "
        f"run `lightning-megatron-fsdp inspect --verify {checkpoint}` for details"
    )
    error = NotACheckpointError if checked.manifest is None else CheckpointCorruptedError
    raise error(
        f"{who}: {checkpoint} is not a complete, intact "
        f"lightning-megatron-fsdp checkpoint ({len(checked.problems)} problems):\n"
        f"{listing}\nNothing was written. {hint}."
    )


def checkpoints_inside(path: Path) -> list[str]:
    """Complete checkpoints directly inside ``path`` (by name), if ``path`` is not one.

    A user who points at ``ModelCheckpoint``'s ``dirpath`` instead of one checkpoint in
    it gets their names in the error.
    """
    if not path.is_dir() or (path / MANIFEST_FILE).exists():
        return []
    with os.scandir(path) as children:
        names = [c.name for c in children if c.is_dir() and not c.name.startswith(".")]
    return sorted(name for name in names if (path / name / MANIFEST_FILE).is_file())


def write_atomically(
    output: Path, write: Callable[[IO[bytes]], None], *, overwrite: bool, who: str
) -> None:
    """Run ``write(stream)`` on a new hidden file next to ``output``, fsync it, rename it
    into place; remove it on any error, so ``output`` is either complete or untouched.

    The file is created with ``O_EXCL | O_NOFOLLOW`` and only ever used through the
    descriptor that created it; before the rename, the name must still be that file
    (someone who can write to the folder could otherwise swap in their own).

    Args:
        output: The final path.
        write: Writes (and may seek and re-read) the open temporary file it is given.
        overwrite: Replace an ``output`` that appeared meanwhile.
        who: The public function, for error messages.
    """
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


def select_entries(
    checked: CheckedCheckpoint,
    dtype: torch.dtype | None,
    *,
    include_optimizer: bool,
    path: Path,
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
            f"{path / DCP_METADATA_FILE}: no model tensors (keys starting with "
            f"{MODEL_PREFIX!r}); expected a checkpoint written by MegatronFSDPCheckpointIO."
        )
    if include_optimizer and not any(e.key.startswith(OPTIMIZER_PREFIX) for e in entries):
        raise ValueError(
            f"{path / DCP_METADATA_FILE}: no optimizer state (keys starting with "
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


def _load_tensor(reader: StreamingReader, entry: ExportEntry) -> torch.Tensor:
    """Read one full tensor, in its saved dtype, from its chunks: the only full copy.

    Every chunk is read straight into place (:class:`StreamingReader`), so this costs
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
        block = _raw_bytes(flat[start : start + step].to(dtype))
        if stream.write(block) != len(block):
            raise OSError(f"short write to {getattr(stream, 'name', stream)}")
        crc = zlib.crc32(block, crc)
    return crc


def load_object(reader: StreamingReader, entry: ExportEntry) -> Any:
    """The non-tensor object saved under ``entry.key``, read alone through ``reader``."""
    holder: dict[str, Any] = {entry.key: None}
    with _quiet_no_dist():
        dcp.load(holder, storage_reader=reader, no_dist=True)
    return holder[entry.key]


def _raw_bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes in native (little-endian) order, without a copy."""
    flat = tensor.contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


def _write_safetensors(
    stream: IO[bytes], entries: list[ExportEntry], reader: StreamingReader, objects: dict[str, Any]
) -> None:
    """Stream ``entries`` into ``stream`` in the safetensors format.

    Format: ``<u64 little-endian N><N bytes of JSON header><data>``; the header maps each
    name to ``{"dtype", "shape", "data_offsets": [begin, end]}`` relative to the data, and
    ``__metadata__`` to string pairs. Offsets must tile the data exactly.
    """
    if sys.byteorder != "little":
        raise NotImplementedError("safetensors export needs a little-endian machine.")
    tensors = [e for e in entries if e.dtype is not None]
    # Largest element first: with an 8-byte-aligned header every tensor is then aligned to
    # its element size, which zero-copy loaders expect.
    tensors.sort(key=lambda e: -e.dtype.itemsize)  # type: ignore[union-attr]
    header: dict[str, Any] = {}
    offset = 0
    for entry in tensors:
        assert entry.dtype is not None
        code = _SAFETENSORS_DTYPES.get(entry.dtype)
        if code is None:
            raise ValueError(
                f"consolidate_checkpoint: tensor {entry.key!r} has dtype {entry.dtype}, which "
                "safetensors cannot store; export to .pt instead."
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
                f"consolidate_checkpoint: entry {name!r} is a {type(value).__name__}, which "
                "neither safetensors nor its JSON metadata can hold; export to .pt instead."
            ) from err
    header["__metadata__"] = metadata
    encoded = json.dumps(header, separators=(",", ":")).encode("utf-8")
    encoded += b" " * (-len(encoded) % 8)
    stream.write(struct.pack("<Q", len(encoded)))
    stream.write(encoded)
    for entry in tensors:
        assert entry.dtype is not None
        _write_tensor(stream, _load_tensor(reader, entry), entry.dtype)


TreePlace = tuple[Any, ...]
"""Where a tensor sits in a nested checkpoint tree: the keys (dict) and indices (list)
from the root, e.g. ``("state_dict", "embed.weight")``."""


def _at(tree: Any, place: TreePlace) -> Any:
    for key in place:
        tree = tree[key]
    return tree


def write_torch(
    stream: IO[bytes],
    tree: dict[str, Any],
    places: list[tuple[ExportEntry, TreePlace]],
    reader: StreamingReader,
) -> None:
    """Write ``tree`` to the new, empty file ``stream`` as a ``torch.save`` file, one
    tensor in memory at a time.

    ``tree`` is any picklable nest of dicts and lists; at each place of ``places`` it will
    hold that entry's full tensor (whatever is there now is replaced). ``torch.save``
    under ``skip_data`` writes the pickle and reserves each tensor's record from fake
    tensors (no memory). ``torch.load(map_location="meta")`` of that skeleton reports each
    storage's byte offset, where the real bytes are then written. The zip CRC-32 that
    ``skip_data`` leaves at zero is computed while writing and patched in.
    """
    with _torch.fake_tensor_mode():
        for entry, place in places:
            assert entry.dtype is not None
            _at(tree, place[:-1])[place[-1]] = torch.empty(entry.shape, dtype=entry.dtype)
    with torch.serialization.skip_data(materialize_fake_tensors=True):
        torch.save(tree, stream)
    for _, place in places:  # drop the fakes: the caller's tree holds no tensor of ours
        _at(tree, place[:-1])[place[-1]] = None
    # Our own file, read back through the descriptor that wrote it (never by name), whose
    # objects came out of the checkpoint already unpickled.
    stream.flush()
    stream.seek(0)
    placed = torch.load(stream, map_location="meta", weights_only=False)
    crc_by_offset: dict[int, int] = {}
    for entry, place in places:
        assert entry.dtype is not None
        meta_tensor = _at(placed, place)
        storage = meta_tensor.untyped_storage()
        offset = getattr(storage, "_checkpoint_offset", None)
        if offset is None or storage.nbytes() != entry.nbytes:
            raise AssertionError(
                f"torch.save skeleton: record of {entry.name!r} has offset {offset} and "
                f"{storage.nbytes()} bytes, expected {entry.nbytes}; torch's serialization "
                "changed in a way this exporter does not support."
            )
        stream.seek(offset)
        crc = _write_tensor(stream, _load_tensor(reader, entry), entry.dtype)
        if entry.nbytes:
            crc_by_offset[offset] = crc
    _patch_zip_crcs(stream, crc_by_offset)


def _patch_zip_crcs(stream: IO[bytes], crc_by_offset: dict[int, int]) -> None:
    """Write each record's CRC-32 into its data descriptor and central directory entry.

    torch's zip writer sets general-purpose flag bit 3, so the CRC lives in the data
    descriptor after the payload (``PK\\x07\\x08``, crc, sizes) and in the central
    directory entry (offset 16), not in the local header.
    """
    stream.seek(0)
    archive = zipfile.ZipFile(stream)  # type: ignore[arg-type]
    position = archive.start_dir
    remaining = dict(crc_by_offset)
    for info in archive.infolist():
        stream.seek(position)
        central = stream.read(46)
        if central[:4] != b"PK\x01\x02":
            raise AssertionError(f"zip central directory entry expected at {position}.")
        name_len, extra_len, comment_len = struct.unpack("<3H", central[28:34])
        stream.seek(info.header_offset)
        local = stream.read(30)
        local_name_len, local_extra_len = struct.unpack("<2H", local[26:30])
        data_offset = info.header_offset + 30 + local_name_len + local_extra_len
        crc = remaining.pop(data_offset, None)
        if crc is not None:
            if info.flag_bits & 0x08:
                stream.seek(data_offset + info.file_size)
                if stream.read(4) != b"PK\x07\x08":
                    raise AssertionError(f"zip data descriptor of {info.filename} not found.")
                stream.write(struct.pack("<I", crc))
            else:
                stream.seek(info.header_offset + 14)
                stream.write(struct.pack("<I", crc))
            stream.seek(position + 16)
            stream.write(struct.pack("<I", crc))
        position += 46 + name_len + extra_len + comment_len
    if remaining:
        raise AssertionError(f"zip records at offsets {sorted(remaining)} not found.")


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
) -> Path:
    """Write a checkpoint's full, unsharded tensors to one ``.safetensors`` or ``.pt`` file.

    Runs offline in one process: no process group (it issues no collective, so it is also
    safe on one rank of a running job), no GPU. Streams tensor by tensor, so peak memory
    is about the largest tensor (casts run in small blocks), whatever the model
    size. Nothing is written unless the whole export succeeds: the data goes to a hidden
    temporary file next to ``output_path``, which is renamed into place at the end and
    removed on any error.

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
        checkpoint_dir: A checkpoint directory written by ``MegatronFSDPCheckpointIO``.
        output_path: Output file; ``.safetensors`` writes safetensors, ``.pt``, ``.pth``
            or ``.bin`` writes a ``torch.save`` file.
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

    Returns:
        ``output_path`` as a ``Path``.

    Raises:
        NotACheckpointError: If the directory has no readable manifest (not a complete
            checkpoint written by ``MegatronFSDPCheckpointIO``); the message lists every
            problem found.
        CheckpointCorruptedError: If files are missing, truncated or fail their checksum,
            or ``.metadata`` disagrees with them or with the manifest; the message lists
            each problem and the file it concerns.
        FileExistsError: If ``output_path`` exists and ``overwrite`` is false.
        FileNotFoundError: If the output's directory does not exist.
        IsADirectoryError: If ``output_path`` is a directory.
        ValueError: For an unsupported suffix or ``dtype``, an output inside the
            checkpoint, an entry the output format cannot hold, or a ``strip_prefix``
            that is malformed, matches no model key, or comes with ``include_optimizer``.
    """
    who = "consolidate_checkpoint"
    checkpoint = Path(checkpoint_dir)
    output = Path(output_path)
    out_dtype = parse_dtype(dtype)
    output_format = _output_format(output)
    _check_strip_prefix(strip_prefix, include_optimizer=include_optimizer)
    check_output(output, checkpoint, overwrite=overwrite)
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
    reader = StreamingReader(checkpoint, checked.metadata, trust=trust_checkpoint)
    objects = {e.name: load_object(reader, e) for e in entries if e.dtype is None}
    if output_format == "safetensors":
        for entry in entries:
            if entry.dtype is None and entry.key.startswith(MODEL_PREFIX):
                raise ValueError(
                    f"{who}: model entry {entry.key!r} is a "
                    f"{type(objects[entry.name]).__name__}, not a tensor; safetensors holds "
                    "only tensors. Export to .pt instead."
                )

    def write(stream: IO[bytes]) -> None:
        if output_format == "safetensors":
            _write_safetensors(stream, entries, reader, objects)
        else:
            tree = {e.name: objects.get(e.name) for e in entries}
            places = [(e, (e.name,)) for e in entries if e.dtype is not None]
            write_torch(stream, tree, places, reader)

    write_atomically(output, write, overwrite=overwrite, who=who)
    return output


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
