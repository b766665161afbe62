"""Inspect and verify a checkpoint offline, without a GPU or a process group: what it holds
(every tensor's global shape, dtype and chunks, epoch, step, versions) and whether it is
whole (chunks tile each tensor exactly once, files and sizes match the manifest, checksums
recomputed), before anyone trusts it.
"""

from __future__ import annotations

import dataclasses
import io
import math
import os
from collections.abc import Mapping
from typing import IO, TYPE_CHECKING, Any

import torch

from lightning_megatron_fsdp.errors import CheckpointCorruptedError, NotACheckpointError
from lightning_megatron_fsdp.storage import (
    DCP_METADATA_FILE,
    DCP_METADATA_KEYS_FILE,
    FORMAT_NAME,
    MANIFEST_FILE,
    MAX_EXAMPLES,
    META_FILE,
    MODEL_PREFIX,
    OPTIMIZER_PREFIX,
    UPSTREAM_FORMAT_NAME,
    UPSTREAM_NOTE,
    FileWindow,
    Location,
    Manifest,
    TensorSpec,
    bytes_digest,
    check_tensor_record,
    count,
    decode_key_index,
    inflate_record,
    is_tensor_entry,
    is_upstream_checkpoint,
    key_tables,
    load_dcp_metadata,
    load_weights_only,
    locate,
    summarise,
    without_chunks,
)

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        TensorStorageMetadata,
    )

__all__ = [
    "MAX_EXAMPLES",
    "MODEL_PREFIX",
    "OPTIMIZER_PREFIX",
    "CheckedCheckpoint",
    "CheckpointInfo",
    "TensorInfo",
    "check_directory",
    "inspect_checkpoint",
    "ordered_keys",
    "summarise",
    "verify_checkpoint",
]


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """One tensor of a checkpoint, as DCP's ``.metadata`` records it.

    Args:
        key: DCP key, e.g. ``state_dict.embed.weight``.
        shape: Global (unsharded) shape.
        dtype: Saved dtype.
        chunks: Number of saved chunks that together tile the tensor.
    """

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    chunks: int

    def __post_init__(self) -> None:
        if any(size < 0 for size in self.shape):
            raise ValueError(f"TensorInfo {self.key!r}: negative size in shape {self.shape}.")
        if self.chunks < 0:
            raise ValueError(f"TensorInfo {self.key!r}: chunks must be >= 0, got {self.chunks}.")

    @property
    def numel(self) -> int:
        """Number of elements of the full tensor."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of the full tensor in its saved dtype."""
        return self.numel * self.dtype.itemsize

    def to_json(self) -> dict[str, Any]:
        """JSON-ready form: key, shape (list), dtype (``"float32"``), chunks."""
        return {
            "key": self.key,
            "shape": list(self.shape),
            "dtype": _dtype_name(self.dtype),
            "chunks": self.chunks,
        }


@dataclasses.dataclass(frozen=True)
class CheckpointInfo:
    """What :func:`inspect_checkpoint` found in a checkpoint directory.

    Args:
        path: The checkpoint directory.
        tensors: Every tensor: model entries in saved state-dict order, then optimizer state.
        objects: DCP keys of non-tensor entries (optimizer hyper-parameters, ...).
        manifest: The parsed ``manifest.json``, ``None`` if missing or unreadable.
        meta: The plain-value entries of ``meta.pt`` (epoch, global_step,
            ``pytorch-lightning_version``, ...), ``None`` if it could not be read safely.
        notes: Human-readable remarks (a missing manifest, an unreadable ``meta.pt``).
        source_format: The format of a directory without a manifest that was recognised
            anyway (megatron-fsdp's own ``save_checkpoint``,
            ``upstream_checkpoint.UPSTREAM_FORMAT_NAME``), else ``None``.
        damaged: One line per file the manifest lists that is missing or has another
            size (compared without reading it); :func:`verify_checkpoint` checks the rest.
    """

    path: Location
    tensors: tuple[TensorInfo, ...]
    objects: tuple[str, ...]
    manifest: Manifest | None
    meta: Mapping[str, Any] | None
    notes: tuple[str, ...] = ()
    source_format: str | None = None
    damaged: tuple[str, ...] = ()

    @property
    def epoch(self) -> int | None:
        """Epoch recorded at save time, from the manifest or else ``meta.pt``."""
        if self.manifest is not None and self.manifest.epoch is not None:
            return self.manifest.epoch
        return (self.meta or {}).get("epoch")

    @property
    def global_step(self) -> int | None:
        """Optimizer steps taken at save time, from the manifest or else ``meta.pt``."""
        if self.manifest is not None and self.manifest.global_step is not None:
            return self.manifest.global_step
        return (self.meta or {}).get("global_step")

    @property
    def world_size(self) -> int | None:
        """Number of ranks that wrote the checkpoint, ``None`` without a manifest."""
        return None if self.manifest is None else self.manifest.world_size

    @property
    def versions(self) -> dict[str, str]:
        """Package versions that wrote the checkpoint (manifest, else ``meta.pt``)."""
        versions = {} if self.manifest is None else dict(self.manifest.versions)
        lightning = (self.meta or {}).get("pytorch-lightning_version")
        if lightning is not None and "lightning" not in versions:
            versions["lightning"] = str(lightning)
        return versions

    def to_json(self) -> dict[str, Any]:
        """JSON-ready summary (what ``lightning-megatron-fsdp inspect --json`` prints)."""
        return {
            "path": str(self.path),
            "format": self.source_format if self.manifest is None else FORMAT_NAME,
            "format_version": None if self.manifest is None else self.manifest.format_version,
            "epoch": self.epoch,
            "global_step": self.global_step,
            "world_size": self.world_size,
            "mesh": None if self.manifest is None else self.manifest.mesh,
            "versions": self.versions,
            "meta": None if self.meta is None else dict(self.meta),
            "tensors": [tensor.to_json() for tensor in self.tensors],
            "objects": list(self.objects),
            "notes": list(self.notes),
            "damaged": list(self.damaged),
        }


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _open(
    checkpoint_dir: Any, storage_options: Mapping[str, Any] | None
) -> tuple[Location, list[str]]:
    return locate(checkpoint_dir, storage_options).loaded_version()


def read_checked(path: Any, name: str, manifest: Manifest | None, *, digest: bool = True) -> bytes:
    """The bytes of ``path/name``, read confined to ``path``; with a manifest, only if
    it lists the file with this size and (``digest``) checksum: nothing that fails them
    is ever unpickled.

    Raises:
        CheckpointCorruptedError: If the manifest does not list it, or it differs.
        FileNotFoundError: If it is missing.
        OSError: If it is a link, FIFO or device, or cannot be read.
    """
    record = None if manifest is None else manifest.files.get(name)
    if manifest is not None and record is None:
        raise CheckpointCorruptedError(
            f"{name}: not listed in {MANIFEST_FILE}; it cannot be checked, so it is not read."
        )
    data = locate(path).read_bytes(name, size=None if record is None else record.size)
    expected = None if record is None or not digest else record.digest()
    if expected is not None and (found := bytes_digest(data, expected[0])) != expected[1]:
        raise CheckpointCorruptedError(
            f"{name}: {expected[0]} {found} on disk, {expected[1]} in the manifest (the file "
            "changed after it was written); it was not unpickled."
        )
    return data


def _naming(name: str, err: OSError) -> str:
    """``err``'s message, prefixed with the file's ``name`` unless it names it already
    (the confined readers' errors give its path)."""
    return str(err) if name in str(err) else f"{name}: {err}"


def _read_metadata(
    path: Any,
    manifest: Manifest | None = None,
    *,
    digest: bool = True,
    trust: bool = False,
    records: bool = False,
) -> Metadata:
    """Parse ``<path>/.metadata`` safely, after its size and checksum (see
    :func:`read_checked`); with ``records``, into ``metadata_records`` (see
    :func:`load_dcp_metadata`).

    Raises:
        CheckpointCorruptedError: If it is missing, differs from the manifest, or does not
            parse as DCP metadata.
    """
    try:
        data = read_checked(path, DCP_METADATA_FILE, manifest, digest=digest)
    except FileNotFoundError as err:
        raise CheckpointCorruptedError(
            f"{DCP_METADATA_FILE}: missing. Every checkpoint has this DCP index of its "
            "tensors; without it no tensor can be located."
        ) from err
    except OSError as err:
        raise CheckpointCorruptedError(_naming(DCP_METADATA_FILE, err)) from err
    return load_dcp_metadata(data, source=DCP_METADATA_FILE, trust=trust, records=records)


def _key_index_problems(
    path: Any,
    manifest: Manifest,
    metadata: Metadata,
    *,
    digest: bool,
    trust: bool,
    records: bool,
) -> list[str]:
    """Whether ``.metadata.keys``, what a load reads instead of ``.metadata``
    (``storage.metadata_index``), says what ``metadata`` says: the same keys, entries and
    chunk tables, cut from ``metadata`` here the way the save cut it."""
    name = DCP_METADATA_KEYS_FILE
    try:
        decoded = decode_key_index(read_checked(path, name, manifest, digest=digest), source=name)
        if decoded is None:
            return []  # written in the other byte order: a load reads .metadata instead
        skeleton = load_dcp_metadata(decoded[0], source=name, trust=trust, records=records)
    except CheckpointCorruptedError as err:
        return [str(err)]
    except OSError as err:
        return [_naming(name, err)]
    tables, expected = decoded[1], key_tables(metadata)
    entries = metadata.state_dict_metadata
    keys = list(entries)
    differ = [
        repr(key)
        for key in dict.fromkeys([*keys, *tables.keys, *skeleton.state_dict_metadata])
        if key not in entries
        or tables.keys.get(key) != expected.keys[key]
        or skeleton.state_dict_metadata.get(key) != without_chunks(entries[key])
    ]
    if tables.files != expected.files or tables.transforms != expected.transforms:
        differ.append("the record files or transforms its tables index")
    if skeleton.storage_data or (skeleton.planner_data, skeleton.version) != (
        metadata.planner_data,
        metadata.version,
    ):
        differ.append("the index's fields besides its keys")
    if not differ:
        return []
    return [
        summarise(
            f"{name}: disagrees with {DCP_METADATA_FILE}, which a load would not read (the "
            "checkpoint is damaged or crafted)",
            differ,
        )
    ]


def _read_meta(
    path: Any, manifest: Manifest | None = None
) -> tuple[dict[str, Any] | None, str | None]:
    """The plain-value top-level entries of ``meta.pt``, or ``None`` and why not.

    ``weights_only=True``: inspecting a checkpoint must not run code from it. Lightning's
    ``hyper_parameters`` may hold arbitrary objects; then the scalars come from the
    manifest alone.
    """
    try:
        data = read_checked(path, META_FILE, manifest)
    except FileNotFoundError:
        return None, f"{META_FILE}: missing."
    except OSError as err:
        raise CheckpointCorruptedError(_naming(META_FILE, err)) from err
    try:
        meta = load_weights_only(data, source=META_FILE)
    except CheckpointCorruptedError as err:
        first_line = (str(err).strip().splitlines() or [""])[0]
        return None, f"{first_line} Epoch and step come from {MANIFEST_FILE} alone."
    if not isinstance(meta, dict):
        return None, f"{META_FILE}: holds a {type(meta).__name__}, expected a dict."
    plain = (bool, int, float, str, type(None))
    return {str(key): value for key, value in meta.items() if isinstance(value, plain)}, None


def _storage_problems(
    metadata: Metadata, sizes: Mapping[str, int], listed: set[str] | None
) -> list[str]:
    """Every stored item lies inside an existing file that the manifest lists.

    A missing file the manifest lists is already reported by ``check_files``.
    """
    missing: dict[str, list[str]] = {}
    past_end: dict[str, list[str]] = {}
    for index, info in metadata.storage_data.items():
        name = info.relative_path
        if name not in sizes:
            if listed is None or name not in listed:
                missing.setdefault(name, []).append(repr(index.fqn))
        elif info.offset < 0 or info.length < 0 or info.offset + info.length > sizes[name]:
            past_end.setdefault(name, []).append(
                f"{index.fqn!r} at bytes [{info.offset}, {info.offset + info.length})"
            )
    problems = [
        summarise(
            f"{name}: missing; {DCP_METADATA_FILE} stores {count(len(keys), 'item')} there", keys
        )
        for name, keys in sorted(missing.items())
    ]
    problems += [
        summarise(
            f"{name}: {count(len(items), 'item')} past its end ({sizes[name]} bytes; truncated)",
            items,
        )
        for name, items in sorted(past_end.items())
    ]
    if listed is not None:
        referenced = {info.relative_path for info in metadata.storage_data.values()}
        problems += [
            f"{name}: {DCP_METADATA_FILE} stores data there but {MANIFEST_FILE} does not list "
            "it, so its size and checksum cannot be checked."
            for name in sorted(referenced - listed)
        ]
    return problems


def _record_problems(path: Any, metadata: Metadata, sizes: Mapping[str, int]) -> list[str]:
    """Every tensor record is a ``torch.save`` zip whose entries are stored uncompressed and
    whose data holds exactly its chunk's bytes (reads each record's zip directory only; a
    stream-transformed record is inflated, in bounded pieces, one at a time).

    A compressed record passes every size and checksum test, yet readers that copy a
    payload directly would take the compressed bytes for the tensor's. A file not in
    ``sizes`` is skipped: its absence is reported already.
    """
    chunks = {
        (fqn, tuple(chunk.offsets)): math.prod(chunk.sizes) * entry.properties.dtype.itemsize
        for fqn, entry in metadata.state_dict_metadata.items()
        if is_tensor_entry(entry)
        for chunk in entry.chunks
    }
    bad: dict[str, list[str]] = {}
    by_file: dict[str, list[tuple[Any, Any, int]]] = {}
    for index, info in metadata.storage_data.items():
        nbytes = chunks.get((index.fqn, tuple(index.offset or ())))
        present = info.relative_path in sizes
        if present and nbytes is not None:
            by_file.setdefault(info.relative_path, []).append((index, info, nbytes))
    for name, records in sorted(by_file.items()):
        try:
            opened = path.open_records(name)
        except OSError as err:
            bad.setdefault(name, []).append(str(err))
            continue
        with opened as source:
            for index, info, nbytes in records:
                window = io.BufferedReader(FileWindow(source, info.offset, info.length))
                try:
                    _check_record(window, index, info, nbytes)
                except CheckpointCorruptedError as err:
                    bad.setdefault(name, []).append(str(err))
    return [
        summarise(f"{name}: not plain torch.save zips ({count(len(lines), 'record')})", lines)
        for name, lines in sorted(bad.items())
    ]


def _check_record(window: IO[bytes], index: Any, info: Any, nbytes: int) -> None:
    """:func:`check_tensor_record` of one record, inflated first when it is stream-transformed.

    Raises:
        CheckpointCorruptedError: If it is not a stored zip of ``nbytes`` of tensor data,
            inflates past what such a zip holds, or names a transform torch lacks.
    """
    descriptors = getattr(info, "transform_descriptors", None)
    if not descriptors:
        check_tensor_record(window, nbytes, source=f"{index.fqn!r}")
        return
    from lightning_megatron_fsdp import _torch  # imports DCP: only for transformed records

    source = (
        f"{index.fqn!r}: the record (chunk at {list(index.offset or ())}), bytes "
        f"[{info.offset}, {info.offset + info.length}), stored through {list(descriptors)}"
    )
    try:
        stream = _torch.transformed_stream(descriptors, window)
    except ValueError as err:
        raise CheckpointCorruptedError(f"{source}: cannot be read back ({err})") from err
    check_tensor_record(inflate_record(stream, nbytes, source=source), nbytes, source=source)


def _overlap(a: ChunkStorageMetadata, b: ChunkStorageMetadata) -> bool:
    return all(
        max(ao, bo) < min(ao + asz, bo + bsz)
        for ao, asz, bo, bsz in zip(a.offsets, a.sizes, b.offsets, b.sizes, strict=True)
    )


def _tiling_problem(key: str, md: TensorStorageMetadata, stored: set[Any]) -> str | None:
    """Why the saved chunks of ``key`` do not tile its global shape exactly once, if so.

    A gap would leave uninitialised memory in a consolidated tensor, and an overlap means
    two writers disagree about who owns which rows; both are corrupt checkpoints.
    """
    shape = tuple(md.size)
    for chunk in md.chunks:
        offsets, sizes = tuple(chunk.offsets), tuple(chunk.sizes)
        if len(offsets) != len(shape) or len(sizes) != len(shape):
            return f"chunk at {offsets} has a different rank than shape {shape}"
        if any(o < 0 or o + n > s for o, n, s in zip(offsets, sizes, shape, strict=True)):
            return f"chunk at offsets {offsets} with sizes {sizes} lies outside shape {shape}"
        if (key, offsets) not in stored:
            return f"chunk at offsets {offsets} has no stored data"
    # Sweep along dim 0: only chunks whose dim-0 ranges meet can overlap, so Megatron-FSDP's
    # row-range chunks cost O(n log n) rather than O(n^2).
    chunks = sorted((c for c in md.chunks if math.prod(c.sizes)), key=lambda c: tuple(c.offsets))
    if not shape and len(chunks) > 1:
        return f"{len(chunks)} chunks for a 0-dim tensor"
    for i, chunk in enumerate(chunks if shape else ()):
        for other in chunks[i + 1 :]:
            if other.offsets[0] >= chunk.offsets[0] + chunk.sizes[0]:
                break
            if _overlap(chunk, other):
                return f"chunks at {tuple(chunk.offsets)} and {tuple(other.offsets)} overlap"
    covered = sum(math.prod(c.sizes) for c in md.chunks)
    if covered != math.prod(shape):
        return f"chunks cover {covered} of its {math.prod(shape)} elements"
    return None


def _tiling_problems(metadata: Metadata) -> list[str]:
    stored = {(index.fqn, tuple(index.offset or ())) for index in metadata.storage_data}
    problems = []
    for key, md in metadata.state_dict_metadata.items():
        if is_tensor_entry(md):
            problem = _tiling_problem(key, md, stored)
            if problem is not None:
                problems.append(f"{DCP_METADATA_FILE}: tensor {key!r}: {problem}.")
        elif (key, ()) not in stored:
            problems.append(f"{DCP_METADATA_FILE}: entry {key!r} has no stored data.")
    return problems


def _metadata_fingerprints(
    metadata: Metadata,
) -> tuple[dict[str, TensorSpec], dict[int, dict[str, TensorSpec]]]:
    """The model and per-optimizer fingerprints ``.metadata`` implies, keyed as in the
    manifest (``fqn``; ``"<fqn>/<state>"``).

    DCP's ``planner_data`` maps each flat key back to its path in the saved dict, e.g.
    ``("optimizer_states", 0, "state", "embed.weight", "exp_avg")``, which splits FQNs
    from state names without guessing at dots.
    """
    paths: Mapping[str, Any] = metadata.planner_data or {}
    model: dict[str, TensorSpec] = {}
    optimizers: dict[int, dict[str, TensorSpec]] = {}
    for key, md in metadata.state_dict_metadata.items():
        spec = (
            TensorSpec(tuple(md.size), _dtype_name(md.properties.dtype))
            if is_tensor_entry(md)
            else TensorSpec(None, None)
        )
        path = tuple(paths.get(key, ()))
        if not path and key.startswith(MODEL_PREFIX):
            path = ("state_dict", key[len(MODEL_PREFIX) :])
        if len(path) >= 2 and path[0] == "state_dict":
            # A nested, non-tensor value (``_extra_state``) is flattened further by DCP.
            model[str(path[1])] = spec if len(path) == 2 else TensorSpec(None, None)
        elif len(path) == 5 and path[0] == "optimizer_states" and path[2] == "state":
            optimizers.setdefault(int(path[1]), {})[f"{path[3]}/{path[4]}"] = spec
    return model, optimizers


def _compare(
    recorded: Mapping[str, TensorSpec], found: Mapping[str, TensorSpec], what: str
) -> list[str]:
    lines = [
        f"{key!r} is {recorded[key].describe() if key in recorded else 'absent'} in "
        f"{MANIFEST_FILE} but {found[key].describe() if key in found else 'absent'} in "
        f"{DCP_METADATA_FILE}"
        for key in sorted(set(recorded) | set(found))
        if recorded.get(key) != found.get(key)
    ]
    if not lines:
        return []
    return [
        summarise(f"{what} fingerprint disagrees with the saved data ({len(lines)} keys)", lines)
    ]


def _fingerprint_problems(manifest: Manifest, metadata: Metadata) -> list[str]:
    """The manifest's fingerprints describe the tensors ``.metadata`` indexes (one save)."""
    model, optimizers = _metadata_fingerprints(metadata)
    problems = _compare(manifest.fingerprint, model, "model")
    for i in range(max(len(manifest.optimizer_fingerprints), max(optimizers, default=-1) + 1)):
        recorded = (
            manifest.optimizer_fingerprints[i] if i < len(manifest.optimizer_fingerprints) else {}
        )
        problems += _compare(recorded, optimizers.get(i, {}), f"optimizer {i}")
    return problems


def ordered_keys(metadata: Metadata, manifest: Manifest | None) -> list[str]:
    """``.metadata``'s keys in state-dict order: model entries, then each optimizer's,
    then the rest. DCP's own order depends on which rank wrote what; the manifest's
    fingerprints keep the order of the state dicts that were saved.
    """
    rank: dict[str, int] = {}
    if manifest is not None:
        for fqn in manifest.fingerprint:
            rank.setdefault(MODEL_PREFIX + fqn, len(rank))
        for i, fingerprint in enumerate(manifest.optimizer_fingerprints):
            for key in fingerprint:
                fqn, _, name = key.rpartition("/")
                rank.setdefault(f"{OPTIMIZER_PREFIX}{i}.state.{fqn}.{name}", len(rank))

    def order(key: str) -> tuple[int, int, str]:
        group = 0 if key.startswith(MODEL_PREFIX) else 1 if key.startswith(OPTIMIZER_PREFIX) else 2
        return (group, rank.get(key, len(rank)), key)

    return sorted(metadata.state_dict_metadata, key=order)


@dataclasses.dataclass
class CheckedCheckpoint:
    """Result of checking a directory: the problems, and whatever parsed along the way."""

    problems: list[str]
    metadata: Metadata | None = None
    manifest: Manifest | None = None


def _holds_checkpoint_files(sizes: Mapping[str, int]) -> bool:
    """Whether a directory holds any file a checkpoint writes (a save that did not finish
    does): without one, it is another directory, and its missing files are no news."""
    return bool({DCP_METADATA_FILE, META_FILE} & sizes.keys()) or any(
        name.endswith(".distcp") for name in sizes
    )


def check_directory(
    path: Any, *, checksums: bool, trust: bool = False, records: bool = False
) -> CheckedCheckpoint:
    """Collect every problem of ``path`` as a checkpoint (see :func:`verify_checkpoint`).

    The parsed metadata is DCP's, ready for ``dcp.load``; with ``records``, plain records
    of the same fields for a caller that only reads it (``metadata_records``: then
    ``torch.distributed.checkpoint`` is not imported).
    """
    path = locate(path)
    try:
        manifest: Manifest | None = path.read_manifest()
    except NotACheckpointError as err:
        if not path.is_dir():
            return CheckedCheckpoint([str(err)])
        manifest, problems = None, [str(err)]
    else:
        problems = []
    sizes = path.sizes()
    if manifest is None and not _holds_checkpoint_files(sizes):
        return CheckedCheckpoint(
            problems
        )  # "not a checkpoint" says it all: no ".metadata: missing"
    listed_missing: set[str] = set()
    if manifest is not None:
        hashed = sorted(manifest.files) if checksums else None
        try:
            problems += path.check_files(manifest, checksum_files=hashed)
        except OSError as err:
            problems.append(f"cannot read a file: {type(err).__name__}: {err}")
        listed_missing = {name for name in manifest.files if name not in sizes}
    metadata = None
    damaged = {problem.partition(":")[0] for problem in problems}
    if DCP_METADATA_FILE not in listed_missing | damaged:  # else check_files said so already
        try:
            metadata = _read_metadata(
                path, manifest, digest=checksums, trust=trust, records=records
            )
        except CheckpointCorruptedError as err:
            problems.append(str(err))
    if metadata is not None:
        listed = None if manifest is None else set(manifest.files)
        stored = _storage_problems(metadata, sizes, listed)
        problems += stored or _record_problems(path, metadata, sizes)
        problems += _tiling_problems(metadata)
        if manifest is not None:
            problems += _fingerprint_problems(manifest, metadata)
        if (
            manifest is not None
            and DCP_METADATA_KEYS_FILE in manifest.files
            and DCP_METADATA_KEYS_FILE not in listed_missing | damaged
        ):
            problems += _key_index_problems(
                path, manifest, metadata, digest=checksums, trust=trust, records=records
            )
    if manifest is None and metadata is not None and is_upstream_checkpoint(metadata):
        # megatron-fsdp's own save_checkpoint writes no manifest or meta.pt by design: keep
        # the checks .metadata allows (storage, tiling), drop "manifest missing".
        return CheckedCheckpoint(problems[1:], metadata, None)
    if manifest is None and META_FILE not in sizes:
        problems.append(f"{META_FILE}: missing; every complete checkpoint has one.")
    return CheckedCheckpoint(problems, metadata, manifest)


def verify_checkpoint(
    checkpoint_dir: str | os.PathLike[str],
    *,
    checksums: bool = True,
    trust_checkpoint: bool = False,
    storage_options: Mapping[str, Any] | None = None,
) -> list[str]:
    """Check a checkpoint's completeness and integrity offline, reading only files.

    Checks that ``manifest.json`` parses; that every file it lists exists with the
    recorded size and (when ``checksums``) digest (CRC32C, or sha256 in format-1
    checkpoints); that ``.metadata`` parses, that every
    item it stores lies inside an existing file the manifest lists, and that every
    tensor's chunks tile its global shape exactly once; and that the manifest's model and
    optimizer fingerprints describe the tensors ``.metadata`` indexes.

    Needs no process group and no GPU. With ``checksums`` it reads every file once.

    Args:
        checkpoint_dir: The checkpoint directory, or a URL (``s3://...``): then the
            newest complete version there (saves that did not finish are not problems:
            they are never loaded; none complete is).
        checksums: Also compare the file digests; sizes are always checked.
        trust_checkpoint: Unpickle ``.metadata`` in full (see :func:`inspect_checkpoint`).
        storage_options: Options of a URL's fsspec filesystem.

    Returns:
        One line per problem, each naming the file (relative to ``checkpoint_dir``) and
        key concerned; empty if the checkpoint is complete and intact.
    """
    path, _ = _open(checkpoint_dir, storage_options)
    return check_directory(path, checksums=checksums, trust=trust_checkpoint, records=True).problems


def inspect_checkpoint(
    checkpoint_dir: str | os.PathLike[str],
    *,
    trust_checkpoint: bool = False,
    storage_options: Mapping[str, Any] | None = None,
) -> CheckpointInfo:
    """Describe a checkpoint: every tensor's global shape, dtype and chunk count, and the
    Lightning metadata (epoch, step, versions, world size).

    Works on an incomplete directory too (a missing manifest becomes a note), as long as
    ``.metadata`` is readable; :func:`verify_checkpoint` checks integrity. Reads
    ``.metadata``, ``manifest.json`` and ``meta.pt`` only, no tensor data; the other
    files' sizes are compared with the manifest's (``CheckpointInfo.damaged``).

    Args:
        checkpoint_dir: The checkpoint directory, or a URL (``s3://...``): then the
            newest complete version, and a note per version saying whether it is
            complete (a save that did not finish shows as INCOMPLETE).
        trust_checkpoint: Unpickle ``.metadata`` in full; by default only DCP's metadata
            types are accepted and nothing from the checkpoint runs.
        storage_options: Options of a URL's fsspec filesystem.

    Returns:
        The description.

    Raises:
        NotACheckpointError: If the directory is missing, or has neither a manifest nor
            ``.metadata``.
        CheckpointCorruptedError: If it has a manifest but no readable ``.metadata``, or
            ``.metadata`` or ``meta.pt`` differ from the manifest's size or checksum
            (then neither is unpickled).
    """
    path, notes = _open(checkpoint_dir, storage_options)
    try:
        manifest: Manifest | None = path.read_manifest()
    except NotACheckpointError as err:
        if not path.is_dir() or DCP_METADATA_FILE not in path.sizes():
            raise
        manifest = None
        notes.append(str(err))
    metadata = _read_metadata(path, manifest, trust=trust_checkpoint, records=True)
    meta, meta_note = _read_meta(path, manifest)
    if meta_note is not None:
        notes.append(meta_note)
    source_format = None
    if manifest is None and is_upstream_checkpoint(metadata):
        # megatron-fsdp's own save_checkpoint writes neither file: its format, not damage.
        source_format, notes = UPSTREAM_FORMAT_NAME, [UPSTREAM_NOTE]
    damaged: list[str] = []
    if manifest is not None:
        damaged = path.check_files(manifest)
    tensors = []
    objects = []
    for key in ordered_keys(metadata, manifest):
        md = metadata.state_dict_metadata[key]
        if is_tensor_entry(md):
            tensors.append(TensorInfo(key, tuple(md.size), md.properties.dtype, len(md.chunks)))
        else:
            objects.append(key)
    return CheckpointInfo(
        path,
        tuple(tensors),
        tuple(objects),
        manifest,
        meta,
        tuple(notes),
        source_format,
        tuple(damaged),
    )
