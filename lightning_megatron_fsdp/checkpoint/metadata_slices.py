"""``.metadata`` read once per load and cut by key, so no rank parses the whole index.

``.metadata`` holds a storage entry for every record of every rank: at thousands of ranks
it runs to hundreds of megabytes, and a load in which every rank reads and unpickles it
reads it from shared storage once per rank and puts a full parse on every rank's critical
path. Instead rank 0 reads the index the save wrote beside it, ``.metadata.keys``
(``storage.metadata_index``: a skeleton, every key with its size and properties, no chunks,
no storage entries, pickled, and one int64 table per key; its digest checked against the
manifest), or, for a checkpoint without one, unpickles ``.metadata`` through the allow-list
reader with every field check and cuts it the same way. The load's first round hands the
cut to every rank. A rank unpickles the skeleton through the allow-list reader and, for each
key it holds elements of, selects in one tensor operation the rows whose chunks overlap what
it loads (the only chunks DCP's load planner reads: DCP tests each saved chunk against
each local one the same way), builds DCP's objects for those alone and runs the allow-list
reader's field checks on them. Its work follows what it reads, not the world size, though
a packed buffer split across every rank gives some keys a chunk per rank. A key whose
local part is empty keeps no chunks: DCP plans no read for it either way.

Rejected: per-key pickles of DCP's objects, unpickled by every rank through the allow-list
reader (each rank rebuilt every chunk of its keys, a chunk per rank for a packed buffer, so
its time grew with the world size); checking every row of a key's table by value on every
rank (whole-table tensor operations cost more than the few rows a rank builds).
"""

from __future__ import annotations

import dataclasses
import math
import pickle
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.tensor import DTensor
from typing_extensions import override

from lightning_megatron_fsdp import _torch
from lightning_megatron_fsdp.errors import CheckpointCorruptedError
from lightning_megatron_fsdp.storage import (
    BYTEORDERS,
    RECORD_ATTR,
    Column,
    KeyTable,
    KeyTables,
    check_dcp_metadata,
    data_file_rank,
    decode_key_index,
    encode_key_index,
    key_tables,
    load_dcp_metadata,
    without_chunks,
)

__all__ = ["KeyTable", "MetadataSlices", "SlicedLoadPlanner"]


@dataclasses.dataclass(frozen=True)
class MetadataSlices:
    """A checked ``.metadata``, cut by key (see the module docstring).

    Attributes:
        source: The file, for messages.
        skeleton: The metadata with every tensor's chunk list empty and no storage entries,
            pickled.
        keys: Per key, its table.
        files: The record files the tables index.
        transforms: The transform descriptors the tables index.
    """

    source: str
    skeleton: bytes
    keys: dict[str, KeyTable]
    files: tuple[str, ...]
    transforms: tuple[tuple[str, ...], ...]

    @classmethod
    def cut(cls, metadata: Metadata, *, source: str, cache: bool = False) -> MetadataSlices:
        """Cut ``metadata`` (read and checked by the allow-list reader, or a save's) by
        key; with ``cache``, keeping the layout's chunk columns for the next save
        (``storage.metadata_index.key_tables``)."""
        tables = key_tables(metadata, cache=cache)
        skeleton = {key: without_chunks(e) for key, e in metadata.state_dict_metadata.items()}
        common = dataclasses.replace(metadata, state_dict_metadata=skeleton, storage_data={})
        return cls(
            source,
            pickle.dumps(common, protocol=pickle.HIGHEST_PROTOCOL),
            tables.keys,
            tables.files,
            tables.transforms,
        )

    @classmethod
    def read(cls, data: bytes, *, source: str) -> MetadataSlices | None:
        """The cut a save wrote (``.metadata.keys``' bytes, checked against the manifest);
        ``None`` where it was written in the other byte order.

        Raises:
            CheckpointCorruptedError: If the file is malformed, naming it.
        """
        decoded = decode_key_index(data, source=source)
        if decoded is None:
            return None
        skeleton, tables = decoded
        return cls(source, skeleton, tables.keys, tables.files, tables.transforms)

    def encoded(self) -> bytes:
        """This cut as the ``.metadata.keys`` file."""
        return encode_key_index(self.skeleton, KeyTables(self.keys, self.files, self.transforms))

    def skeleton_metadata(self, *, trust: bool) -> Metadata:
        """The skeleton, through the allow-list reader and its checks.

        Raises:
            CheckpointCorruptedError: As ``load_dcp_metadata``.
        """
        metadata = load_dcp_metadata(self.skeleton, source=self.source, trust=trust)
        entries = metadata.state_dict_metadata
        if entries.keys() != self.keys.keys():
            odd = sorted(entries.keys() ^ self.keys.keys())[0]
            raise self._malformed(odd, "a key of the skeleton without a table, or the reverse")
        if metadata.storage_data:
            key = next(iter(metadata.storage_data)).fqn
            raise self._malformed(key, "the skeleton holds storage entries")
        for key, entry in entries.items():
            if getattr(entry, "chunks", None):
                raise self._malformed(key, "the skeleton holds chunks")
        return metadata

    def fill(
        self,
        metadata: Metadata,
        key: str,
        local: Sequence[ChunkStorageMetadata] | None = None,
    ) -> None:
        """Give ``key``'s entry in ``metadata`` (a skeleton) its chunks that overlap
        ``local`` (all of them for ``None``) and their storage entries, checked as the
        allow-list reader checks them.

        Raises:
            CheckpointCorruptedError: If the table or what it describes is malformed,
                naming ``key``.
        """
        table = self.keys.get(key)
        if table is None:
            return
        entry = metadata.state_dict_metadata.get(key)
        tensor = isinstance(entry, TensorStorageMetadata)
        if not tensor and not isinstance(entry, BytesStorageMetadata):
            raise self._malformed(key, "a table for a key the skeleton does not hold")
        ndim = len(entry.size) if tensor else 0
        width = 2 * ndim + Column.COUNT
        if (
            type(table) is not KeyTable
            or table.ndim != ndim
            or not isinstance(table.rows, bytes)
            or len(table.rows) % (8 * width)
            or (not tensor and len(table.rows) != 8 * width)
        ):
            raise self._malformed(key, "its table of chunks is malformed")
        if tensor and not table.rows and math.prod(entry.size):
            raise self._malformed(key, f"no chunk of its {list(entry.size)} elements")
        rows = torch.frombuffer(bytearray(table.rows), dtype=torch.int64).view(-1, width)
        if tensor and local is not None and ndim:
            rows = rows[_overlapping(rows, local, ndim)]
        chunks = []
        storage = {}
        for row in rows.tolist():
            offsets = None
            if tensor:
                offsets = torch.Size(row[:ndim])
                chunks.append(ChunkStorageMetadata(offsets, torch.Size(row[ndim : 2 * ndim])))
            record = row[2 * ndim :]
            if record[Column.PRESENT] not in (0, 1):
                raise self._malformed(key, "its table of chunks is malformed")
            if record[Column.PRESENT]:
                storage[MetadataIndex(key, offsets)] = self._storage_info(key, record)
        filled = dataclasses.replace(entry, chunks=chunks) if tensor else entry
        # What the allow-list reader checks of these chunks and entries.
        check_dcp_metadata(
            Metadata({key: filled}, storage_data=storage),
            source=self.source,
            check_planner_data=False,
        )
        metadata.state_dict_metadata[key] = filled
        metadata.storage_data.update(storage)

    def writer(self, key: str, offsets: Sequence[int]) -> int | None:
        """The rank whose record file holds ``key``'s chunk at ``offsets`` (by DCP's file
        names); ``None`` where the table holds no such record. A hint of where a record
        lies, for choosing which rank reads it, never of what is read: the table is
        checked where a rank builds DCP's entries from it (:meth:`fill`)."""
        table = self.keys.get(key)
        ndim = len(offsets)
        width = 2 * ndim + Column.COUNT
        if (
            type(table) is not KeyTable
            or table.ndim != ndim
            or not isinstance(table.rows, bytes)
            or not table.rows
            or len(table.rows) % (8 * width)
        ):
            return None
        rows = torch.frombuffer(bytearray(table.rows), dtype=torch.int64).view(-1, width)
        at = (rows[:, :ndim] == torch.tensor(list(offsets), dtype=torch.int64)).all(dim=1)
        found = (at & (rows[:, 2 * ndim + Column.PRESENT] == 1)).nonzero()
        if not len(found):
            return None
        file = int(rows[int(found[0]), 2 * ndim + Column.FILE])
        return data_file_rank(self.files[file]) if 0 <= file < len(self.files) else None

    def _storage_info(self, key: str, record: list[int]) -> Any:
        """The storage entry ``record`` (a row's record columns) describes."""
        if not (
            0 <= record[Column.FILE] < len(self.files)
            and -1 <= record[Column.TRANSFORMS] < len(self.transforms)
            and record[Column.ANNOTATED] in (0, 1)
            and -1 <= record[Column.BYTEORDER] < len(BYTEORDERS)
            and (record[Column.ANNOTATED] or record[Column.CRC : Column.BYTEORDER + 1] == [-1] * 4)
        ):
            raise self._malformed(key, "a storage entry is malformed")
        info = _torch.storage_info(
            self.files[record[Column.FILE]], record[Column.OFFSET], record[Column.LENGTH]
        )
        if record[Column.TRANSFORMS] >= 0:
            info.transform_descriptors = list(self.transforms[record[Column.TRANSFORMS]])
        if record[Column.ANNOTATED]:
            annotation: dict[str, Any] = {}
            if record[Column.CRC] != -1:
                annotation["crc32c"] = record[Column.CRC]
            if record[Column.PAYLOAD] != -1 or record[Column.PAYLOAD_END] != -1:
                annotation["payload"] = [record[Column.PAYLOAD], record[Column.PAYLOAD_END]]
            if record[Column.BYTEORDER] != -1:
                annotation["byteorder"] = BYTEORDERS[record[Column.BYTEORDER]]
            setattr(info, RECORD_ATTR, annotation)
        return info

    def _malformed(self, key: str, problem: str) -> CheckpointCorruptedError:
        return CheckpointCorruptedError(
            f"{self.source}: malformed DCP metadata: {key!r}: {problem}. The checkpoint is "
            "damaged or crafted; use another one."
        )


def _overlapping(
    rows: torch.Tensor, local: Sequence[ChunkStorageMetadata], ndim: int
) -> torch.Tensor:
    """Which ``rows`` hold a chunk that overlaps one of ``local`` (DCP's test of a saved
    chunk against a local one: overlapping along every dimension)."""
    if not local:
        return torch.zeros(len(rows), dtype=torch.bool)
    wanted = torch.tensor([[*c.offsets, *c.sizes] for c in local], dtype=torch.int64)
    start, size = rows[:, None, :ndim], rows[:, None, ndim : 2 * ndim]
    lo, extent = wanted[None, :, :ndim], wanted[None, :, ndim:]
    return ((start < lo + extent) & (lo < start + size)).all(dim=2).any(dim=1)


def _holds_elements(value: Any) -> bool:
    """Whether this rank holds any element of ``value`` (anything not a tensor counts)."""
    if isinstance(value, DTensor):
        return _torch.local_tensor(value).numel() > 0
    if isinstance(value, torch.Tensor):
        return value.numel() > 0
    return True


class SlicedLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, given the skeleton of :class:`MetadataSlices` by the
    reader: before DCP plans this rank's reads (and the reader checks its records), the
    skeleton's entries of the keys this rank holds elements of get the chunks that overlap
    what this rank loads of them."""

    def __init__(self, slices: MetadataSlices, *, allow_partial_load: bool) -> None:
        super().__init__(allow_partial_load=allow_partial_load)
        self.slices = slices

    @override
    def set_up_planner(
        self,
        state_dict: dict[str, Any],
        metadata: Metadata | None = None,
        is_coordinator: bool = False,
    ) -> None:
        super().set_up_planner(state_dict, metadata, is_coordinator)
        if metadata is not None:
            flat: Mapping[str, Any] = self.state_dict
            for key, value in flat.items():
                if _holds_elements(value):
                    local = _torch.local_chunks(value) if isinstance(value, torch.Tensor) else None
                    self.slices.fill(metadata, key, local)
