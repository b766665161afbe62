"""``.metadata`` by key, written beside it, so a load parses no pickle of every record.

``.metadata`` holds a storage entry for every record of every rank: at thousands of ranks it
is hundreds of megabytes of pickle, and unpickling it through the allow-list reader is most
of a load's metadata time, on its critical path (benchmarks/RESULTS.md, "Planning at
scale"). The save therefore also writes the same index cut by key (``.metadata.keys``,
listed in the manifest with its CRC32C like every file): a skeleton (every key with its size
and properties, no chunks, no storage entries; a small pickle, still read through the
allow-list reader) and per key a table of int64 rows, one per chunk: its offsets and sizes
and its record's file, offset, length, transforms and annotation, files and transforms as
indices into lists of strings the keys share. Plain numbers: reading it is a copy, and each
rank checks the rows it uses (``checkpoint.metadata_slices``). A checkpoint without it
(plain DCP, an older version of ours) is read through ``.metadata`` and cut the same way.

          chunk           its record                       its annotation
       offsets sizes  present file offset length transf.  annotated crc32c payload  order
  row  [0, 0]  [4, 8]    1     3     0     640     -1        1      ...   512 1024    0
  row  [4, 0]  [4, 8]    1     9     0     640     -1        1      ...   512 1024    0

The file: ``LMFKEYS1`` and a newline, the header's length (8 bytes, little-endian), the
header (JSON: byte order, files, transforms, ``[key, ndim, rows]`` per key in
``.metadata``'s order, the skeleton's length), the skeleton, then every key's rows.

The chunk columns depend only on the layout, the record columns on the save: the save
keeps the chunk columns of the last layout it cut (DCP's plan cache hands it the same
metadata object while the layout holds) and fills only the record columns afterwards,
placing each record by its index hint (the chunk's position, which the global plan sets),
checked against the chunk's offsets. Both ways give the same bytes (``inspect --verify``
compares the file with ``.metadata``).

Rejected: every rank unpickling ``.metadata`` (its parse on every rank, the file read once
per rank); rank 0 unpickling it and cutting it at load time (every other rank waits for the
parse); a second pickle of DCP's objects per key (as slow to read safely as the first); each
rank sending its own records' columns at the commit (rank 0's pass over the storage entries
would go, for a round's payload that grows with the records and a save protocol that depends
on the index).
"""

from __future__ import annotations

import array
import dataclasses
import json
import sys
from collections.abc import Mapping
from typing import Any

import torch

from lightning_megatron_fsdp.errors import CheckpointCorruptedError
from lightning_megatron_fsdp.storage.safe_unpickling import is_tensor_entry


class Column:
    """A row's record columns, after the chunk's offsets and sizes; ``COUNT`` of them."""

    PRESENT, FILE, OFFSET, LENGTH, TRANSFORMS = range(5)
    ANNOTATED, CRC, PAYLOAD, PAYLOAD_END, BYTEORDER = range(5, 10)
    COUNT = 10


BYTEORDERS = ("little", "big")
RECORD_ATTR = "lmf_record"  # the annotation our writer sets on a storage entry

_MAGIC = b"LMFKEYS1\n"
_ABSENT = (0, 0, 0, 0, -1, 0, -1, -1, -1, -1)


@dataclasses.dataclass(frozen=True)
class KeyTable:
    """One key's chunks and their storage entries, as int64 rows (see the module docstring).

    Attributes:
        ndim: The key's dimensions (0 for bytes).
        rows: ``n`` rows of ``2 * ndim + 10`` native int64: a tensor's chunks in
            ``.metadata``'s order, or a bytes entry's one record.
    """

    ndim: int
    rows: bytes


@dataclasses.dataclass(frozen=True)
class KeyTables:
    """``.metadata`` cut by key: every key's table and the strings they index."""

    keys: dict[str, KeyTable]
    files: tuple[str, ...]
    transforms: tuple[tuple[str, ...], ...]


@dataclasses.dataclass
class _Layout:
    """A layout's chunk columns (see the module docstring): per key its dimensions (-1 for
    bytes: one record, no chunk columns) and its first row among all keys' rows; per tensor
    key its chunks (to check a hint) and their ``[*offsets, *sizes]`` columns."""

    entries: Any  # the state_dict_metadata these came from, held so its identity is unique
    ndims: dict[str, int]
    bases: dict[str, int]
    rows: int
    chunks: dict[str, list[Any]]
    columns: dict[str, torch.Tensor]


_last_layout: list[_Layout] = []  # at most one: the last layout a save cut


def without_chunks(entry: Any) -> Any:
    """A key's entry as the skeleton beside the tables holds it: a tensor's without its
    chunks (its table has them), a byte record's as it is."""
    return dataclasses.replace(entry, chunks=[]) if is_tensor_entry(entry) else entry


def key_tables(metadata: Any, *, cache: bool = False) -> KeyTables:
    """``metadata`` (DCP's classes or ``metadata_records``') cut into tables by key.

    Args:
        metadata: A checked ``Metadata``.
        cache: Keep this layout's chunk columns for the next call with the same
            ``state_dict_metadata`` object (a save's; see the module docstring).
    """
    entries = metadata.state_dict_metadata
    layout = next((x for x in _last_layout if x.entries is entries), None)
    if layout is None:
        layout = _layout_of(entries)
        if cache:
            _last_layout[:] = [layout]
    files: dict[str, int] = {}
    transforms: dict[tuple[str, ...], int] = {}
    positions, values = _record_columns(metadata.storage_data, layout, files, transforms)
    records = torch.tensor(_ABSENT, dtype=torch.int64).repeat(layout.rows, 1)
    if positions:
        found = torch.frombuffer(values, dtype=torch.int64).view(-1, Column.COUNT)
        records[torch.frombuffer(positions, dtype=torch.int64)] = found
    tables = {}
    for key, ndim in layout.ndims.items():
        base = layout.bases[key]
        if ndim < 0:
            present = records[base, Column.PRESENT] == 1
            rows = records[base] if present else records[:0]
            tables[key] = KeyTable(0, rows.numpy().tobytes())
            continue
        chunks = layout.columns[key]
        rows = torch.cat([chunks, records[base : base + len(chunks)]], dim=1)
        tables[key] = KeyTable(ndim, rows.numpy().tobytes())
    return KeyTables(tables, tuple(files), tuple(transforms))


def _record_columns(
    storage: Mapping[Any, Any],
    layout: _Layout,
    files: dict[str, int],
    transforms: dict[tuple[str, ...], int],
) -> tuple[array.array[int], array.array[int]]:
    """For each storage entry of a key's chunk (or a bytes key's record), its row among
    all keys' rows and its record columns (``files`` and ``transforms`` filled as met)."""
    bases, ndims, chunk_lists = layout.bases, layout.ndims, layout.chunks
    lookups: dict[str, dict[tuple[int, ...], int]] = {}
    positions, values = array.array("q"), array.array("q")
    for index, info in storage.items():
        fqn = index.fqn
        base = bases.get(fqn)
        if base is None:
            continue  # an entry of no key is never read
        offset = index.offset
        if ndims[fqn] < 0 or offset is None:
            if ndims[fqn] >= 0 or offset is not None:
                continue  # a tensor's entry without offsets, or the reverse: never read
            row = 0
        else:
            chunks = chunk_lists[fqn]
            row = index.index
            if type(row) is not int or not 0 <= row < len(chunks) or chunks[row].offsets != offset:
                where = lookups.get(fqn)
                if where is None:
                    where = lookups[fqn] = {
                        tuple(c.offsets): i for i, c in reversed(list(enumerate(chunks)))
                    }
                row = where.get(tuple(offset))
                if row is None:
                    continue  # no chunk there: DCP never reads it
        positions.append(base + row)
        file = files.get(info.relative_path)
        if file is None:
            file = files[info.relative_path] = len(files)
        descriptors = getattr(info, "transform_descriptors", None)
        transform = -1
        if descriptors is not None:
            transform = transforms.setdefault(tuple(descriptors), len(transforms))
        annotation = getattr(info, RECORD_ATTR, None)
        if annotation is None:
            values.extend((1, file, info.offset, info.length, transform, 0, -1, -1, -1, -1))
            continue
        payload = annotation.get("payload") or (-1, -1)
        byteorder = annotation.get("byteorder")
        values.extend(
            (
                1,
                file,
                info.offset,
                info.length,
                transform,
                1,
                annotation.get("crc32c", -1),
                payload[0],
                payload[1],
                -1 if byteorder is None else BYTEORDERS.index(byteorder),
            )
        )
    return positions, values


def _layout_of(entries: Mapping[str, Any]) -> _Layout:
    ndims, bases, chunks, columns = {}, {}, {}, {}
    rows = 0
    for key, entry in entries.items():
        bases[key] = rows
        if not is_tensor_entry(entry):
            ndims[key] = -1
            rows += 1
            continue
        ndim = ndims[key] = len(entry.size)
        chunks[key] = entry.chunks
        flat = array.array("q")
        for chunk in entry.chunks:
            flat.extend(chunk.offsets)
            flat.extend(chunk.sizes)
        column = (
            torch.frombuffer(flat, dtype=torch.int64) if flat else torch.zeros(0, dtype=torch.int64)
        )
        columns[key] = column.view(len(entry.chunks), 2 * ndim)
        rows += len(entry.chunks)
    return _Layout(entries, ndims, bases, rows, chunks, columns)


def encode_key_index(skeleton: bytes, tables: KeyTables) -> bytes:
    """The ``.metadata.keys`` file of ``skeleton`` (the pickled skeleton) and ``tables``."""
    header = {
        "byteorder": sys.byteorder,
        "files": list(tables.files),
        "transforms": [list(t) for t in tables.transforms],
        "keys": [
            [key, t.ndim, len(t.rows) // (8 * (2 * t.ndim + Column.COUNT))]
            for key, t in tables.keys.items()
        ],
        "skeleton": len(skeleton),
    }
    text = json.dumps(header, separators=(",", ":")).encode()
    parts = [_MAGIC, len(text).to_bytes(8, "little"), text, skeleton]
    parts += [t.rows for t in tables.keys.values()]
    return b"".join(parts)


def decode_key_index(data: bytes, *, source: str) -> tuple[bytes, KeyTables] | None:
    """The skeleton and tables of a ``.metadata.keys`` file's bytes; ``None`` where it was
    written on a machine of the other byte order (then ``.metadata`` is read instead).

    Only the framing is checked here (lengths, types, every byte accounted for); each
    table's rows are checked where they are used (``MetadataSlices.fill``), the skeleton by
    the allow-list reader.

    Raises:
        CheckpointCorruptedError: If the bytes are not such a file, naming ``source``.
    """

    def refuse(problem: str) -> CheckpointCorruptedError:
        return CheckpointCorruptedError(
            f"{source}: malformed index of .metadata: {problem}. The checkpoint is damaged "
            "or crafted; use another one."
        )

    start = len(_MAGIC) + 8
    if data[: len(_MAGIC)] != _MAGIC or len(data) < start:
        raise refuse(f"it does not start with {_MAGIC!r}")
    length = int.from_bytes(data[len(_MAGIC) : start], "little")
    if length > len(data) - start:
        raise refuse(f"a header of {length} bytes in a file of {len(data)}")
    try:
        header = json.loads(data[start : start + length])
    except (ValueError, RecursionError) as err:
        raise refuse(f"its header is not JSON ({type(err).__name__}: {err})") from err
    if not (
        isinstance(header, dict)
        and header.keys() == {"byteorder", "files", "transforms", "keys", "skeleton"}
        and header["byteorder"] in BYTEORDERS
        and _strings(header["files"])
        and isinstance(header["transforms"], list)
        and all(_strings(t) for t in header["transforms"])
        and _count(header["skeleton"])
        and isinstance(header["keys"], list)
    ):
        raise refuse("its header is malformed")
    at = start + length + header["skeleton"]
    skeleton = data[start + length : at]
    tables = {}
    for entry in header["keys"]:
        if not (
            isinstance(entry, list)
            and len(entry) == 3
            and isinstance(entry[0], str)
            and _count(entry[1])
            and _count(entry[2])
            and entry[0] not in tables
        ):
            raise refuse(f"a key's entry in its header is malformed: {entry!r:.200}")
        key, ndim, count = entry
        end = at + 8 * count * (2 * ndim + Column.COUNT)
        if end > len(data):
            raise refuse(f"{key!r}: its table runs past the end of the file")
        tables[key] = KeyTable(ndim, data[at:end])
        at = end
    if at != len(data):
        raise refuse(f"{len(data) - at} bytes after the last table (expected none)")
    if header["byteorder"] != sys.byteorder:
        return None
    files = tuple(header["files"])
    transforms = tuple(tuple(t) for t in header["transforms"])
    return skeleton, KeyTables(tables, files, transforms)


def _strings(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(s, str) for s in value)


def _count(value: Any) -> bool:
    return type(value) is int and value >= 0
