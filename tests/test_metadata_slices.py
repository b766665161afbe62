"""``.metadata`` cut by key gives each rank what the file holds, and no more than it reads.

Rank 0 cuts the checked ``.metadata`` into a skeleton and per-key int64 tables
(``checkpoint.metadata_slices``); each rank rebuilds DCP's objects for its keys. Filled
whole, the cut must give back the file's index field for field (a real save, the same
with ZStandard records, the format-1 and torch 2.15 fixtures); filled for a local chunk, it
must give DCP's load planner the reads it plans from the whole file (synthetic plans of a
packed model at 5 ranks, a chunk that crosses saved ones); and a crafted table must be
refused naming its key, by value, however it travelled.
"""

from __future__ import annotations

import array
import dataclasses
import math
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from lightning_megatron_fsdp import _torch
from lightning_megatron_fsdp.checkpoint.metadata_slices import MetadataSlices
from lightning_megatron_fsdp.checkpoint.save_plan import global_save_plan
from lightning_megatron_fsdp.errors import CheckpointCorruptedError
from lightning_megatron_fsdp.storage.safe_unpickling import load_dcp_metadata
from tests.test_metadata_records import FIXTURES, _plain
from tests.test_save_plan import local_plans
from tests.test_untrusted_checkpoints import checkpoints  # noqa: F401 (the fixture)


def _sent(slices: MetadataSlices) -> MetadataSlices:
    """``slices`` as the first round's broadcast hands them to a rank."""
    return pickle.loads(pickle.dumps(slices))


def _assembled(slices: MetadataSlices, local: dict[str, Any] | None = None) -> Metadata:
    """The skeleton, filled for every key (whole), or for ``local``'s keys with their local
    chunks (``None``: whole)."""
    metadata = slices.skeleton_metadata(trust=False)
    for key in metadata.state_dict_metadata if local is None else local:
        slices.fill(metadata, key, None if local is None else local[key])
    return metadata


def _info(info: Any) -> tuple[Any, ...]:
    """A storage entry as the fields a reader reads (unset ``transform_descriptors`` reads
    as ``None``)."""
    fields = ("relative_path", "offset", "length", "transform_descriptors", "lmf_record")
    return tuple(_plain(getattr(info, field, None)) for field in fields)


def _storage(metadata: Metadata) -> dict[Any, Any]:
    """The storage entries by what DCP looks them up by (the index hint aside)."""
    return {(i.fqn, i.offset): _info(info) for i, info in metadata.storage_data.items()}


@pytest.mark.parametrize("which", ["intact", "zstd", "format 1", "torch 2.15"])
def test_the_cut_filled_whole_is_the_metadata(
    checkpoints: dict[str, Path],  # noqa: F811
    which: str,
) -> None:
    path = {
        "intact": checkpoints["intact"],
        "zstd": checkpoints["zstd"],
        "format 1": FIXTURES / "format1" / "checkpoint",
        "torch 2.15": FIXTURES / "torch215" / "checkpoint",
    }[which]
    metadata = load_dcp_metadata((path / ".metadata").read_bytes(), source=".metadata")
    assembled = _assembled(_sent(MetadataSlices.cut(metadata, source=".metadata")))
    assert _plain(assembled.state_dict_metadata) == _plain(metadata.state_dict_metadata)
    assert _storage(assembled) == _storage(metadata)
    assert assembled.planner_data == metadata.planner_data
    # Not vacuous: chunks and annotated (or, for zstd, transformed) records came through.
    infos = list(assembled.storage_data.values())
    assert infos and any(getattr(i, "lmf_record", None) for i in infos) == (which != "format 1")
    if which == "zstd":
        assert any(getattr(i, "transform_descriptors", None) for i in infos)


def _synthetic(world: int = 5) -> tuple[Metadata, list[Any]]:
    """The checked ``.metadata`` of ``test_save_plan``'s packed model at ``world`` ranks
    (a record per chunk, annotated as our writer does), and the global plan."""
    global_plan, metadata = global_save_plan(local_plans(world))
    storage = {}
    for rank, plan in enumerate(global_plan):
        offset = 0
        for item in plan.items:
            data = item.tensor_data
            length = 512 + (math.prod(data.chunk.sizes) * 4 if data else 7)
            info = _torch.storage_info(f"__{rank}_0.distcp", offset, length)
            info.lmf_record = {"crc32c": rank, "payload": [512, length], "byteorder": "little"}
            storage[item.index] = info
            offset += length
    metadata.storage_data = storage
    return load_dcp_metadata(pickle.dumps(metadata), source="synthetic"), global_plan


def _reads(metadata: Metadata, key: str, local: list[ChunkStorageMetadata]) -> list[Any]:
    items = create_read_items_for_chunk_list(key, metadata.state_dict_metadata[key], local)
    return sorted(
        (
            tuple(i.storage_index.offset),
            tuple(i.storage_offsets),
            tuple(i.dest_offsets),
            tuple(i.lengths),
            _info(metadata.storage_data[i.storage_index]),
        )
        for i in items
    )


@pytest.mark.both_versions
def test_a_rank_gets_the_chunks_it_reads_and_dcp_plans_the_same_reads() -> None:
    metadata, _ = _synthetic()
    slices = _sent(MetadataSlices.cut(metadata, source="synthetic"))
    key = "model.embed.weight"  # 50 rows, a chunk of rows per rank
    local = [ChunkStorageMetadata(torch.Size((3, 2)), torch.Size((20, 5)))]
    assembled = _assembled(slices, {key: local})
    assert _reads(assembled, key, local) == _reads(metadata, key, local)
    built = assembled.state_dict_metadata[key].chunks
    every = metadata.state_dict_metadata[key].chunks
    # Not vacuous: the local rows cross saved chunks, and only those were built.
    assert 1 < len(built) < len(every)
    assert {tuple(c.offsets) for c in built} == {i[0] for i in _reads(metadata, key, local)}
    assert {i.fqn for i in assembled.storage_data} == {key}  # no other key's records
    # An empty local part plans nothing; a key it does not hold builds nothing.
    empty = _assembled(slices, {key: []})
    assert empty.state_dict_metadata[key].chunks == [] and not empty.storage_data


def _crafted(slices: MetadataSlices, key: str, row: int, column: int, value: int) -> Any:
    table = slices.keys[key]
    rows = array.array("q", table.rows)
    rows[row * (2 * table.ndim + 10) + column] = value
    return dataclasses.replace(
        slices, keys={**slices.keys, key: dataclasses.replace(table, rows=rows.tobytes())}
    )


@pytest.mark.both_versions
@pytest.mark.parametrize(
    ("column", "value", "says"),
    [
        (0, 49, "a chunk at \\[49, 0\\] reaches past its shape"),
        (2, 1 << 62, "reaches past its shape"),
        (1, -1, "offsets or sizes are malformed"),
        (4, 2, "its table of chunks is malformed"),  # present: neither 0 nor 1
        (5, 1 << 40, "a storage entry is malformed"),  # a file index past the names
        (7, 100, "a shape larger than its bytes on disk"),
        (10, 1 << 33, "CRC32C is not a 32-bit int"),
        (11, -5, "payload offsets are malformed"),
        (13, 2, "a storage entry is malformed"),  # no byte order
    ],
)
def test_a_crafted_table_is_refused_naming_the_key(column: int, value: int, says: str) -> None:
    metadata, _ = _synthetic()
    slices = MetadataSlices.cut(metadata, source="synthetic")
    key = "optim.exp_avg.head.weight"
    crafted = _sent(_crafted(slices, key, 1, column, value))
    with pytest.raises(CheckpointCorruptedError, match=rf"'optim\.exp_avg\.head\.weight'.*{says}"):
        _assembled(crafted, {key: None})
    _assembled(_sent(slices))  # the intact slices fill


@pytest.mark.both_versions
def test_a_crafted_file_name_or_table_shape_is_refused_naming_the_key() -> None:
    metadata, _ = _synthetic()
    slices = MetadataSlices.cut(metadata, source="synthetic")
    key = "model.layer.tall"
    outside = dataclasses.replace(slices, files=("../outside",) * len(slices.files))
    with pytest.raises(CheckpointCorruptedError, match=r"'model\.layer\.tall'.*not a plain file"):
        _assembled(_sent(outside), {key: None})
    table = slices.keys[key]
    cut_short = dataclasses.replace(table, rows=table.rows[:-8])
    with pytest.raises(CheckpointCorruptedError, match=r"'model\.layer\.tall': its table"):
        _assembled(
            _sent(dataclasses.replace(slices, keys={**slices.keys, key: cut_short})), {key: None}
        )
