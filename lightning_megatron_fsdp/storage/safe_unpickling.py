"""Read a checkpoint's pickles without running code from them.

A checkpoint holds three kinds of pickle: DCP's ``.metadata`` (torch's reader calls
``pickle.load`` on it), Lightning's ``meta.pt`` and DCP's byte records (torch's planner
``torch.load``\\ s them with ``weights_only=False``). Any of them can run arbitrary code
when unpickled in full, so a downloaded or shared checkpoint could take over the machine
that merely inspects it. Here ``.metadata`` goes through an allow-list unpickler (DCP's
metadata classes and the few torch values they hold) and its fields are type-checked
afterwards; a reader that never hands the index to DCP (the offline tools) gets it as
``checkpoint.metadata_records`` instead of DCP's classes, through the same allow-list and
checks, and so never imports ``torch.distributed.checkpoint``. ``meta.pt`` and byte
records go through ``torch.load(weights_only=True)``, after their zip entries are checked
to be stored uncompressed. A record written through a DCP stream transform (torch's
ZStandard extension) is inflated in bounded pieces and never past what its chunk needs, so
a small crafted frame cannot make the reader allocate gigabytes. A trusted checkpoint that
needs more passes
``trust_checkpoint=True`` (``--trust-checkpoint``), which every refusal names. The
allow-list and its reasoning are in docs/DESIGN.md, "Untrusted checkpoints".
"""

from __future__ import annotations

import dataclasses
import functools
import io
import math
import os
import pathlib
import pickle
import re
import types
import zipfile
from collections import OrderedDict
from typing import IO, TYPE_CHECKING, Any

import torch

from lightning_megatron_fsdp.errors import CheckpointCorruptedError
from lightning_megatron_fsdp.storage import metadata_records
from lightning_megatron_fsdp.storage.confined_files import check_plain_name

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata

__all__ = [
    "BYTE_RECORD_LIMIT",
    "TENSOR_RECORD_FRAMING",
    "TRUST_HINT",
    "check_dcp_metadata",
    "check_stored_zip",
    "check_tensor_record",
    "inflate_record",
    "is_tensor_entry",
    "load_dcp_metadata",
    "load_weights_only",
    "safe_byte_record",
]

TRUST_HINT = (
    "Only if you trust where the checkpoint comes from, pass trust_checkpoint=True "
    "(--trust-checkpoint on the command line; PretrainedWeights(path, weights_only=False) "
    "for init_weights_from; weights_only=False for fabric.load_raw, and for fabric.load's "
    "meta.pt) to unpickle it in full: that runs any code it holds."
)

# A planner path indexes lists by these ints (optimizer and parameter-group numbers); a
# larger one would make a nested list of that length.
_MAX_PATH_INDEX = 1 << 20
_DATA_ENTRY = re.compile(r"(?:^|/)data/\d+$")

TENSOR_RECORD_FRAMING = 64 << 10
"""What a tensor record may hold besides its chunk's bytes: ``torch.save`` of one tensor
adds its pickle, the zip's headers and directory and alignment padding (about 1.5 KiB)."""

BYTE_RECORD_LIMIT = 16 << 20
"""The most a stream-transformed byte record (one pickled Python value) may inflate to,
unless the checkpoint is trusted: ``.metadata`` records no size for byte records."""

_INFLATE_PIECE = 1 << 20

_METADATA = "torch.distributed.checkpoint.metadata"
# The DCP names a ``.metadata`` pickle may reference, by (module, name), each with the name
# of what it becomes: the ``metadata_records`` class of that name, or DCP's own class.
_DCP_NAMES: dict[tuple[str, str], str] = {
    (_METADATA, "Metadata"): "Metadata",
    (_METADATA, "TensorStorageMetadata"): "TensorStorageMetadata",
    (_METADATA, "BytesStorageMetadata"): "BytesStorageMetadata",
    (_METADATA, "ChunkStorageMetadata"): "ChunkStorageMetadata",
    (_METADATA, "TensorProperties"): "TensorProperties",
    (_METADATA, "MetadataIndex"): "MetadataIndex",
    (_METADATA, "StorageMeta"): "StorageMeta",
    (_METADATA, "_MEM_FORMAT_ENCODING"): "MemoryFormatEncoding",
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): "StorageInfo",
    ("torch.serialization", "_get_layout"): "layout_by_name",
}


def _properties_class(properties: type) -> type:
    """What a pickled ``TensorProperties`` becomes: ``properties``, or, where it predates
    the ``strides`` field (DCP's class before torch 2.15), one that also reads checkpoints
    of the torch that added it."""
    if "strides" in {field.name for field in dataclasses.fields(properties)}:
        return properties

    class _NewerTensorProperties(properties):  # type: ignore[misc, valid-type]
        """``TensorProperties`` as a newer torch pickles them, with a sixth field
        (``strides``): the extra field, which this torch does not use, is dropped, and the
        object becomes a plain ``TensorProperties``."""

        def __setstate__(self, state: Any) -> None:
            properties.__setstate__(self, tuple(state)[:5])
            self.__class__ = properties

    return _NewerTensorProperties


@functools.cache
def _types(records: bool) -> types.SimpleNamespace:
    """What each of :data:`_DCP_NAMES` becomes, by its name there: ``metadata_records``
    (imports nothing more), or DCP's own classes (imports ``torch.distributed.checkpoint``)."""
    if records:
        return types.SimpleNamespace(
            **{name: getattr(metadata_records, name) for name in _DCP_NAMES.values()}
        )
    from torch.distributed.checkpoint import metadata as dcp_metadata

    from lightning_megatron_fsdp import _torch

    private = _torch.dcp_metadata_private_types()
    if not private.keys() <= _DCP_NAMES.keys():
        raise AssertionError(f"_torch names DCP types {set(private) - set(_DCP_NAMES)} unlisted")
    return types.SimpleNamespace(
        **{
            name: private[key] if key in private else getattr(dcp_metadata, key[1])
            for key, name in _DCP_NAMES.items()
        }
    )


@functools.cache
def _allowed(records: bool) -> dict[tuple[str, str], Any]:
    """The allow-list: DCP's names (resolved as :func:`_types` says) and the few torch,
    ``pathlib`` and builtin values DCP's metadata holds."""
    resolved = _types(records)
    allowed = {key: getattr(resolved, name) for key, name in _DCP_NAMES.items()}
    allowed[(_METADATA, "TensorProperties")] = _properties_class(resolved.TensorProperties)
    allowed[("torch", "Size")] = torch.Size
    for name, value in vars(torch).items():
        if isinstance(value, torch.dtype | type(torch.strided) | type(torch.contiguous_format)):
            allowed[("torch", name)] = value
    for cls in (pathlib.PurePosixPath, pathlib.PosixPath, pathlib.PureWindowsPath):
        allowed[("pathlib", cls.__name__)] = cls
    allowed[("collections", "OrderedDict")] = OrderedDict
    allowed[("builtins", "set")] = set
    allowed[("builtins", "frozenset")] = frozenset
    return allowed


class _Refused(pickle.UnpicklingError):
    """The allow-list refused what the pickle names (``trust`` would unpickle it), as
    opposed to bytes that are no pickle at all (``trust`` would not help)."""


class _MetadataUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` that resolves the allow-listed globals as ``allowed`` says and
    refuses every other one, unless ``trust`` (then it resolves them as ``pickle`` does)."""

    def __init__(self, data: bytes, allowed: dict[tuple[str, str], Any], *, trust: bool) -> None:
        super().__init__(io.BytesIO(data))
        self._allowed = allowed
        self._trust = trust

    def find_class(self, module: str, name: str) -> Any:
        found = self._allowed.get((module, name))
        if found is not None:
            return found
        if self._trust:
            return super().find_class(module, name)
        raise _Refused(
            f"it references {module}.{name}, which is not among the DCP metadata types "
            "this library accepts from a checkpoint"
        )

    def persistent_load(self, pid: Any) -> Any:
        raise _Refused("it holds a persistent id, which DCP metadata never has")


def load_dcp_metadata(
    data: bytes, *, source: str, trust: bool = False, records: bool = False
) -> Metadata:
    """Unpickle DCP's ``.metadata`` without running code from it, then check its fields.

    Args:
        data: The file's bytes (already checked against the manifest, when there is one).
        source: The file, for error messages.
        trust: Unpickle in full (any global the pickle names) instead; the fields are
            checked either way, except ``planner_data``.
        records: Build ``metadata_records``' classes instead of DCP's, for a reader that
            never hands the metadata to DCP; ``torch.distributed.checkpoint`` is then not
            imported. The same names are allowed and the same fields checked.

    Returns:
        The metadata; every field has the type DCP's readers rely on, every storage entry
        names a plain file, and every tensor chunk's record holds at least its bytes.

    Raises:
        CheckpointCorruptedError: If it references anything outside the allow-list (the
            message names it and ``trust_checkpoint``), does not unpickle, or a field is
            malformed.
    """
    try:
        metadata = _MetadataUnpickler(data, _allowed(records), trust=trust).load()
    except _Refused as err:
        raise CheckpointCorruptedError(
            f"{source}: refused to unpickle: {err}. Nothing from it was run. {TRUST_HINT}"
        ) from err
    except Exception as err:  # truncated or garbled pickles raise anything
        raise CheckpointCorruptedError(
            f"{source}: not DCP metadata ({type(err).__name__}: {err}); the file is corrupt "
            "or was not written by torch.distributed.checkpoint."
        ) from err
    check_dcp_metadata(metadata, source=source, records=records, check_planner_data=not trust)
    return metadata


def check_dcp_metadata(
    metadata: Any, *, source: str, records: bool = False, check_planner_data: bool = True
) -> None:
    """The field checks :func:`load_dcp_metadata` makes of what it unpickled, for a
    metadata built otherwise (of DCP's classes, or ``records``' ones).

    Raises:
        CheckpointCorruptedError: If a field is malformed, naming it.
    """
    problem = _metadata_problem(metadata, _types(records), check_planner_data=check_planner_data)
    if problem is not None:
        raise CheckpointCorruptedError(
            f"{source}: malformed DCP metadata: {problem}. The checkpoint is damaged or "
            "crafted; use another one."
        )


def is_tensor_entry(entry: Any) -> bool:
    """Whether ``entry``, a value of the ``state_dict_metadata`` of what
    :func:`load_dcp_metadata` returned, describes a tensor (else a byte record), whichever
    classes it was read into. Imports nothing that its argument's classes did not."""
    if isinstance(entry, metadata_records.TensorStorageMetadata):
        return True
    if isinstance(entry, metadata_records.BytesStorageMetadata):
        return False
    return isinstance(entry, _types(False).TensorStorageMetadata)


def _is_int(value: Any, low: int = 0, high: int | None = None) -> bool:
    return type(value) is int and value >= low and (high is None or value <= high)


def _is_size(value: Any) -> bool:
    return isinstance(value, torch.Size | tuple | list) and all(_is_int(v) for v in value)


def _metadata_problem(
    metadata: Any, dcp: types.SimpleNamespace, *, check_planner_data: bool
) -> str | None:
    """What is wrong with an unpickled ``Metadata``'s fields (of the classes ``dcp``
    holds), or ``None``."""
    if type(metadata) is not dcp.Metadata:
        return f"it holds a {type(metadata).__name__}, expected DCP's Metadata"
    if not isinstance(metadata.state_dict_metadata, dict):
        return "state_dict_metadata is not a dict"
    tensors: dict[tuple[str, tuple[int, ...]], int] = {}
    for key, entry in metadata.state_dict_metadata.items():
        if not isinstance(key, str):
            return f"a state_dict_metadata key is a {type(key).__name__}, expected str"
        if type(entry) is dcp.BytesStorageMetadata:
            continue
        if type(entry) is not dcp.TensorStorageMetadata:
            return f"{key!r} is a {type(entry).__name__}, expected tensor or bytes metadata"
        properties = entry.properties
        if type(properties) is not dcp.TensorProperties or not isinstance(
            properties.dtype, torch.dtype
        ):
            return f"{key!r}: its properties carry no torch dtype"
        if not _is_size(entry.size) or not isinstance(entry.chunks, list):
            return f"{key!r}: its size or chunk list is malformed"
        for chunk in entry.chunks:
            if (
                type(chunk) is not dcp.ChunkStorageMetadata
                or not _is_size(chunk.offsets)
                or not _is_size(chunk.sizes)
                or not len(chunk.offsets) == len(chunk.sizes) == len(entry.size)
            ):
                return f"{key!r}: a chunk's offsets or sizes are malformed"
            if any(
                o + s > n for o, s, n in zip(chunk.offsets, chunk.sizes, entry.size, strict=True)
            ):
                return f"{key!r}: a chunk at {list(chunk.offsets)} reaches past its shape"
            nbytes = math.prod(chunk.sizes) * properties.dtype.itemsize
            tensors[(key, tuple(chunk.offsets))] = nbytes
    if not isinstance(metadata.storage_data, dict):
        return "storage_data is not a dict (not written by a FileSystemWriter)"
    for index, info in metadata.storage_data.items():
        if (
            type(index) is not dcp.MetadataIndex
            or not isinstance(index.fqn, str)
            or not (index.offset is None or _is_size(index.offset))
            or not (index.index is None or _is_int(index.index))
        ):
            return "a storage_data key is not a well-formed MetadataIndex"
        if type(info) is not dcp.StorageInfo:
            return f"{index.fqn!r}: its storage entry is a {type(info).__name__}"
        try:
            check_plain_name(info.relative_path, what=f"{index.fqn!r}'s file")
        except OSError as err:
            return str(err).split(" (a path")[0]
        if not _is_int(info.offset) or not _is_int(info.length):
            return f"{index.fqn!r}: its record offset or length is not a non-negative int"
        transforms = getattr(info, "transform_descriptors", None)
        if transforms is not None and not (
            isinstance(transforms, list | tuple) and all(isinstance(t, str) for t in transforms)
        ):
            return f"{index.fqn!r}: its transform descriptors are malformed"
        problem = _annotation_problem(getattr(info, "lmf_record", None))
        if problem is not None:
            return f"{index.fqn!r}: {problem}"
        nbytes = tensors.get((index.fqn, tuple(index.offset or ())))
        if nbytes is not None and not transforms and info.length < nbytes:
            return (
                f"{index.fqn!r} claims a chunk of {nbytes} bytes at {list(index.offset or ())} "
                f"in a record of {info.length} bytes (a shape larger than its bytes on disk)"
            )
    if check_planner_data and not _planner_data_ok(metadata.planner_data):
        return (
            "planner_data is not a map of keys to paths of strings and small ints "
            f"(indices up to {_MAX_PATH_INDEX})"
        )
    meta = metadata.storage_meta
    if meta is not None and (
        type(meta) is not dcp.StorageMeta
        or not all(
            v is None or isinstance(v, str | os.PathLike)
            for v in (meta.checkpoint_id, meta.save_id, meta.load_id)
        )
        or not (isinstance(meta.modules, list) and all(isinstance(m, str) for m in meta.modules))
    ):
        return "storage_meta is malformed"
    if metadata.version is not None and not isinstance(metadata.version, str):
        return "version is not a str"
    return None


def _annotation_problem(annotation: Any) -> str | None:
    if annotation is None:
        return None
    if not isinstance(annotation, dict) or not all(isinstance(k, str) for k in annotation):
        return "its record annotation is not a dict"
    if "crc32c" in annotation and not _is_int(annotation["crc32c"], 0, 0xFFFFFFFF):
        return "its record CRC32C is not a 32-bit int"
    payload = annotation.get("payload")
    if payload is not None and not (
        isinstance(payload, list | tuple) and len(payload) == 2 and all(_is_int(v) for v in payload)
    ):
        return "its record's payload offsets are malformed"
    if "byteorder" in annotation and annotation["byteorder"] not in ("little", "big"):
        return "its record's byte order is malformed"
    return None


def _planner_data_ok(planner_data: Any) -> bool:
    if planner_data is None:
        return True
    if not isinstance(planner_data, dict):
        return False
    for key, path in planner_data.items():
        if not isinstance(key, str) or not isinstance(path, tuple | list):
            return False
        for part in path:
            if not (isinstance(part, str) or _is_int(part, 0, _MAX_PATH_INDEX)):
                return False
    return True


def check_stored_zip(file: IO[bytes], *, source: str) -> list[zipfile.ZipInfo]:
    """The entries of the ``torch.save`` zip in ``file``, each checked to be stored as is.

    A compressed entry would make torch inflate it (a small file, a large allocation) and
    readers that copy an entry's bytes directly would take the compressed bytes as data.

    Raises:
        CheckpointCorruptedError: If it is no zip, or an entry is compressed.
    """
    try:
        with zipfile.ZipFile(file) as archive:
            entries = archive.infolist()
    except (zipfile.BadZipFile, ValueError, OSError, EOFError) as err:
        raise CheckpointCorruptedError(
            f"{source}: not a torch.save zip ({type(err).__name__}: {err})."
        ) from err
    for entry in entries:
        if entry.compress_type != zipfile.ZIP_STORED or entry.compress_size != entry.file_size:
            raise CheckpointCorruptedError(
                f"{source}: zip entry {entry.filename!r} is compressed (method "
                f"{entry.compress_type}, {entry.compress_size} bytes stored for "
                f"{entry.file_size}); torch.save never compresses, so the file is crafted. "
                "Use another checkpoint."
            )
    return entries


def check_tensor_record(file: IO[bytes], nbytes: int, *, source: str) -> None:
    """Check a tensor record's zip before ``torch.load``: every entry stored, and its
    tensor data entries hold exactly ``nbytes`` (the chunk's bytes ``.metadata`` claims).

    Raises:
        CheckpointCorruptedError: Otherwise.
    """
    entries = check_stored_zip(file, source=source)
    stored = sum(e.file_size for e in entries if _DATA_ENTRY.search(e.filename))
    if stored != nbytes:
        raise CheckpointCorruptedError(
            f"{source}: the record stores {stored} bytes of tensor data, but .metadata "
            f"claims a chunk of {nbytes} bytes. Use another checkpoint."
        )


def inflate_record(
    stream: IO[bytes], nbytes: int | None, *, source: str, trust: bool = False
) -> io.BytesIO:
    """The plain bytes of a stream-transformed record, read from ``stream`` (the transform's
    output) in pieces of at most 1 MiB, never more than one byte past the record's bound:
    a tensor record's chunk bytes ``nbytes`` plus :data:`TENSOR_RECORD_FRAMING`; a byte
    record's (``nbytes`` ``None``) :data:`BYTE_RECORD_LIMIT`, or none when ``trust``.

    Args:
        stream: The transform's output over the record's stored bytes.
        nbytes: The chunk's bytes ``.metadata`` claims; ``None`` for a byte record.
        source: The record (file, place, key), for errors.
        trust: The checkpoint is trusted (byte records are then unbounded).

    Returns:
        The bytes, positioned at 0.

    Raises:
        CheckpointCorruptedError: If the record inflates past its bound (nothing further
            was inflated), or the transform fails on it.
    """
    if nbytes is not None:
        limit: int | None = nbytes + TENSOR_RECORD_FRAMING
        needs = f"a record of its {nbytes}-byte chunk holds"
    else:
        limit = None if trust else BYTE_RECORD_LIMIT
        needs = "a byte record may hold (trust_checkpoint=True lifts this bound)"
    plain = io.BytesIO()
    while limit is None or plain.tell() <= limit:
        want = _INFLATE_PIECE if limit is None else min(_INFLATE_PIECE, limit + 1 - plain.tell())
        try:
            piece = stream.read(want)
        except Exception as err:  # a garbled frame raises whatever the transform raises
            raise CheckpointCorruptedError(
                f"{source}: cannot be inflated ({type(err).__name__}: {err}). The "
                "checkpoint is damaged or crafted: use another one."
            ) from err
        if not piece:  # b"" at the end (None: a raw stream with nothing now, taken as the end)
            break
        plain.write(piece)
    if limit is not None and plain.tell() > limit:
        raise CheckpointCorruptedError(
            f"{source}: inflates past the {limit} bytes {needs}; it was not inflated "
            "further. The checkpoint is damaged or crafted (a decompression bomb): use "
            "another one."
        )
    plain.seek(0)
    return plain


def load_weights_only(
    data: bytes, *, source: str, trust: bool = False, map_location: Any = "cpu"
) -> Any:
    """``torch.load(weights_only=True)`` of a checkpoint's ``torch.save`` bytes, after
    :func:`check_stored_zip`; with ``trust``, ``weights_only=False``.

    Raises:
        CheckpointCorruptedError: If it is compressed, or the weights-only unpickler
            refuses it (the message names ``trust_checkpoint``).
    """
    check_stored_zip(io.BytesIO(data), source=source)
    try:
        return torch.load(io.BytesIO(data), map_location=map_location, weights_only=not trust)
    except Exception as err:  # UnpicklingError, RuntimeError, ... depending on content
        first = (str(err).strip().splitlines() or [""])[0]
        hint = "" if trust else f" Nothing from it was run. {TRUST_HINT}"
        raise CheckpointCorruptedError(
            f"{source}: torch.load(weights_only={not trust}) failed "
            f"({type(err).__name__}: {first}).{hint}"
        ) from err


def safe_byte_record(data: bytes, *, source: str, trust: bool = False) -> bytes:
    """A DCP byte record as bytes that DCP's planner may unpickle in full.

    DCP's ``DefaultLoadPlanner.load_bytes`` calls ``torch.load(weights_only=False)``: the
    record is loaded here with ``weights_only=True`` and saved again, so the planner only
    ever unpickles what this process wrote. With ``trust`` the bytes pass as they are.
    """
    if trust:
        return data
    value = load_weights_only(data, source=source)
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()
