"""``.metadata`` cut by key gives each rank what the file holds, and no more than it reads.

Rank 0 cuts the checked ``.metadata`` into a skeleton and per-key int64 tables
(``checkpoint.metadata_slices``); each rank rebuilds DCP's objects for its keys. Filled
whole, the cut must give back the file's index field for field (a real save, the same
with ZStandard records, the format-1 and torch 2.15 fixtures); filled for a local chunk, it
must give DCP's load planner the reads it plans from the whole file (synthetic plans of a
packed model at 5 ranks, a chunk that crosses saved ones); and a crafted table must be
refused naming its key, by value, however it travelled. The save writes the cut
(``.metadata.keys``): a load reads it and never ``.metadata`` (2 ranks), refuses a crafted
one on every rank naming the file and key, and falls back to ``.metadata`` without it;
``inspect --verify`` refuses one that disagrees with ``.metadata``; a later save's cut from
the kept layout equals a fresh cut.
"""

from __future__ import annotations

import array
import copy
import dataclasses
import json
import math
import pickle
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, MetadataIndex
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from lightning_megatron_fsdp import _torch
from lightning_megatron_fsdp.checkpoint.metadata_slices import KeyTable, MetadataSlices
from lightning_megatron_fsdp.checkpoint.save_plan import global_save_plan
from lightning_megatron_fsdp.errors import CheckpointCorruptedError, CheckpointError
from lightning_megatron_fsdp.storage import metadata_index
from lightning_megatron_fsdp.storage.format import (
    DCP_METADATA_FILE,
    DCP_METADATA_KEYS_FILE,
    MANIFEST_FILE,
)
from lightning_megatron_fsdp.storage.safe_unpickling import load_dcp_metadata
from lightning_megatron_fsdp.tools.inspection import verify_checkpoint
from tests.shard_facts import assert_same_facts
from tests.test_checkpoint_io import _checkpoint, _portable, _run, _targets, _tensor_facts
from tests.test_metadata_records import FIXTURES, _plain
from tests.test_save_plan import local_plans
from tests.test_untrusted_checkpoints import checkpoints  # noqa: F401 (the fixture)
from tests.untrusted_attacks import reseal


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
    emptied = dataclasses.replace(table, rows=b"")
    with pytest.raises(CheckpointCorruptedError, match=r"'model\.layer\.tall': no chunk of"):
        _assembled(
            _sent(dataclasses.replace(slices, keys={**slices.keys, key: emptied})), {key: None}
        )


def test_writer_names_the_rank_whose_file_holds_a_chunk_and_no_rank_for_a_crafted_table() -> None:
    """``MetadataSlices.writer`` (which rank reads a replicated record) from the tables:
    each chunk's rank by DCP's file name; ``None``, never an error, for what a table cannot
    say (its fill refuses those tables, naming the key)."""
    metadata, _ = _synthetic()
    slices = MetadataSlices.cut(metadata, source="synthetic")
    key = "model.embed.weight"
    chunks = metadata.state_dict_metadata[key].chunks
    expected = {
        tuple(c.offsets): int(
            metadata.storage_data[MetadataIndex(key, c.offsets)].relative_path[2:].split("_")[0]
        )
        for c in chunks
    }
    assert len(set(expected.values())) > 1  # not vacuous: the chunks lie in several files
    assert {o: slices.writer(key, o) for o in expected} == expected
    first = tuple(chunks[0].offsets)
    assert slices.writer(key, (first[0] + 1, first[1])) is None  # no chunk there
    assert slices.writer(key, first[:1]) is None  # another number of dimensions
    assert slices.writer("no.such.key", first) is None
    assert _crafted(slices, key, 0, 4, 0).writer(key, first) is None  # not present
    assert _crafted(slices, key, 0, 5, 1 << 40).writer(key, first) is None  # no such file
    renamed = dataclasses.replace(slices, files=("weights.bin",) * len(slices.files))
    assert renamed.writer(key, first) is None  # not DCP's naming
    table = slices.keys[key]
    short = dataclasses.replace(table, rows=table.rows[:-8])
    assert dataclasses.replace(slices, keys={key: short}).writer(key, first) is None


# ----------------------------------------------------- the index a save writes (.metadata.keys)


def _rewrite_index(path: Path, craft: Any) -> None:
    """``path``'s ``.metadata.keys`` passed through ``craft`` (slices to slices) and
    resealed in the manifest, as an attacker would."""
    index = path / DCP_METADATA_KEYS_FILE
    slices = MetadataSlices.read(index.read_bytes(), source=str(index))
    assert slices is not None
    index.write_bytes(craft(slices).encoded())
    reseal(path)


def _every_row(slices: MetadataSlices, key: str, column: int, value: int) -> MetadataSlices:
    """``slices`` with ``column`` of every row of ``key``'s table set to ``value``."""
    table = slices.keys[key]
    rows = array.array("q", table.rows)
    width = 2 * table.ndim + 10
    for start in range(0, len(rows), width):
        rows[start + column] = value
    return dataclasses.replace(
        slices, keys={**slices.keys, key: dataclasses.replace(table, rows=rows.tobytes())}
    )


def _shortened(slices: MetadataSlices, key: str) -> MetadataSlices:
    table = slices.keys[key]
    short = dataclasses.replace(table, rows=table.rows[:-8])
    return dataclasses.replace(slices, keys={**slices.keys, key: short})


def _narrowed(slices: MetadataSlices, key: str) -> MetadataSlices:
    """``key``'s table framed as rows of one dimension fewer (the file stays well formed)."""
    table = slices.keys[key]
    width = 8 * (2 * (table.ndim - 1) + 10)
    narrow = KeyTable(table.ndim - 1, table.rows[: len(table.rows) // width * width])
    return dataclasses.replace(slices, keys={**slices.keys, key: narrow})


def _widest(path: Path) -> str:
    """The tensor key with the most saved chunks (split across the ranks)."""
    slices = MetadataSlices.read((path / DCP_METADATA_KEYS_FILE).read_bytes(), source="")
    assert slices is not None
    tables = slices.keys.items()
    return max((len(t.rows) // (8 * (2 * t.ndim + 10)), k) for k, t in tables if t.ndim)[1]


def _load_outcome(plugin: Any, path: Path, world_size: int) -> Any:
    """What loading ``path`` into fresh targets gives: the loaded shards, or the error."""
    _, state = _targets(world_size)
    try:
        plugin.load_checkpoint(path, state=state)
    except CheckpointError as err:
        return f"{type(err).__name__}: {err}"
    return _tensor_facts(state)


@_portable
def _loads_through_the_index(rank: int, world_size: int, root: str) -> dict[str, Any]:
    from lightning_megatron_fsdp.checkpoint.io import MegatronFSDPCheckpointIO
    from tests.scripts.fault_injection import trained

    path = Path(root) / "saved.ckpt"
    model, adam = trained(world_size)
    checkpoint = _checkpoint(model, adam, step=7)
    plugin = MegatronFSDPCheckpointIO()
    plugin.save_checkpoint(checkpoint, path)
    facts: dict[str, Any] = {"saved": _tensor_facts(checkpoint)}
    metadata = (path / DCP_METADATA_FILE).read_bytes()
    manifest = (path / MANIFEST_FILE).read_bytes()
    index = (path / DCP_METADATA_KEYS_FILE).read_bytes()
    key = _widest(path)

    def scenario(name: str, change: Any) -> None:
        dist.barrier()
        if rank == 0:
            for name_, data in (
                (DCP_METADATA_FILE, metadata),
                (MANIFEST_FILE, manifest),
                (DCP_METADATA_KEYS_FILE, index),
            ):
                (path / name_).write_bytes(data)
            change()
        dist.barrier()
        facts[name] = _load_outcome(plugin, path, world_size)

    # .metadata's pickle garbled (zeros, its size and manifest record kept): a load that
    # read it would refuse its CRC32C, one that unpickled it unchecked would fail.
    scenario(
        "garbled .metadata", lambda: (path / DCP_METADATA_FILE).write_bytes(bytes(len(metadata)))
    )

    def older() -> None:  # as plain DCP or an older version of ours wrote it
        (path / DCP_METADATA_KEYS_FILE).unlink()
        listed = json.loads(manifest)
        del listed["files"][DCP_METADATA_KEYS_FILE]
        (path / MANIFEST_FILE).write_text(json.dumps(listed))

    scenario("no index", older)
    scenario("short table", lambda: _rewrite_index(path, lambda s: _shortened(s, key)))
    scenario("narrowed", lambda: _rewrite_index(path, lambda s: _narrowed(s, key)))
    scenario("file index", lambda: _rewrite_index(path, lambda s: _every_row(s, key, 5, 1 << 40)))
    facts["key"] = key
    return facts


@pytest.mark.both_versions
def test_a_load_reads_the_index_the_save_wrote_and_refuses_a_crafted_one(
    tmp_path: Path,
) -> None:
    results = _run(_loads_through_the_index, 2, str(tmp_path))
    key = results[0]["key"]
    for facts in results:
        # Bit-exact through the index, .metadata never read; and without the index.
        assert isinstance(facts["garbled .metadata"], dict), facts["garbled .metadata"]
        assert_same_facts(facts["garbled .metadata"], facts["saved"])
        assert_same_facts(facts["no index"], facts["saved"])
        # A crafted index is refused on every rank, naming the file (and the key), not
        # passed over for .metadata.
        framing = re.escape(f"{DCP_METADATA_KEYS_FILE}: malformed index of .metadata: 104 bytes")
        assert re.match(rf"CheckpointCorruptedError: .*{framing}", facts["short table"], re.S)
        where = re.escape(f"{DCP_METADATA_KEYS_FILE}: malformed DCP metadata: {key!r}")
        assert re.match(rf"CheckpointCorruptedError: .*{where}: its table", facts["narrowed"], re.S)
        assert re.match(
            rf"CheckpointCorruptedError: .*{where}: a storage entry", facts["file index"], re.S
        )


def _verified(path: Path) -> list[str]:
    return verify_checkpoint(path)


@pytest.mark.parametrize(
    ("craft", "says"),
    [
        (lambda s, k: _shortened(s, k), "bytes after the last table"),
        (lambda s, k: _narrowed(s, k), "disagrees"),
        (lambda s, k: _every_row(s, k, 5, 1 << 40), "disagrees"),
        (lambda s, k: _every_row(s, k, 2 * s.keys[k].ndim + 2, 4), "disagrees"),  # offset
        (lambda s, k: dataclasses.replace(s, files=("other.distcp",) * len(s.files)), "disagrees"),
    ],
    ids=["table cut short", "table shape", "file index", "record offset", "file names"],
)
def test_verify_refuses_an_index_that_disagrees_with_the_metadata(
    checkpoints: dict[str, Path],  # noqa: F811
    tmp_path: Path,
    craft: Any,
    says: str,
) -> None:
    intact = checkpoints["intact"]
    assert (intact / DCP_METADATA_KEYS_FILE).is_file()  # the save wrote it
    assert _verified(intact) == []
    path = Path(shutil.copytree(intact, tmp_path / "crafted"))
    key = _widest(path)
    _rewrite_index(path, lambda s: craft(s, key))
    problems = _verified(path)
    assert len(problems) == 1, problems
    assert problems[0].startswith(f"{DCP_METADATA_KEYS_FILE}: ") and says in problems[0]
    if says == "disagrees":
        assert repr(key) in problems[0] or "files" in problems[0], problems


def _nested_header(data: bytes) -> bytes:
    """The index with its JSON header replaced by one nested too deep to parse."""
    magic = metadata_index._MAGIC
    header = b"[" * 100_000 + b"]" * 100_000
    return magic + len(header).to_bytes(8, "little") + header + data[len(magic) + 8 :]


@pytest.mark.parametrize(
    ("craft", "says"),
    [
        (lambda data: data + b"\0" * 8, "8 bytes"),
        (_nested_header, "its header is not JSON (RecursionError"),
    ],
    ids=["trailing bytes", "nested header"],
)
def test_verify_refuses_a_malformed_index_naming_it(
    checkpoints: dict[str, Path],  # noqa: F811
    tmp_path: Path,
    craft: Any,
    says: str,
) -> None:
    path = Path(shutil.copytree(checkpoints["intact"], tmp_path / "crafted"))
    data = (path / DCP_METADATA_KEYS_FILE).read_bytes()
    (path / DCP_METADATA_KEYS_FILE).write_bytes(craft(data))
    reseal(path)
    (problem,) = _verified(path)
    assert problem.startswith(f"{DCP_METADATA_KEYS_FILE}: malformed index of .metadata: {says}")


def test_a_later_save_fills_the_cached_layout_as_a_fresh_cut_would() -> None:
    """The save keeps a layout's chunk columns and fills only the record columns: a later
    save's cut (new CRC32Cs, a hint gone stale) equals a fresh cut of the same metadata."""
    metadata, _ = _synthetic()
    first = MetadataSlices.cut(metadata, source="s", cache=True)
    assert metadata_index._last_layout  # kept for the next save
    later = {}
    for index, info in metadata.storage_data.items():
        info = copy.copy(info)
        info.lmf_record = {**info.lmf_record, "crc32c": info.lmf_record["crc32c"] + 7}
        hint = 0 if index.index else index.index  # stale: the row is found by offsets
        later[dataclasses.replace(index, index=hint)] = info
    metadata.storage_data = later
    cached = MetadataSlices.cut(metadata, source="s", cache=True)
    metadata_index._last_layout.clear()
    fresh = MetadataSlices.cut(metadata, source="s")
    assert (cached.keys, cached.files, cached.transforms) == (
        fresh.keys,
        fresh.files,
        fresh.transforms,
    )
    assert cached.keys != first.keys  # not vacuous: the record columns changed
    assert _storage(_assembled(_sent(cached))) == _storage(metadata)


def test_a_skeleton_that_disagrees_with_its_tables_is_refused_naming_the_key() -> None:
    metadata, _ = _synthetic()
    slices = MetadataSlices.cut(metadata, source="s")
    key = "model.layer.tall"
    fewer = dataclasses.replace(slices, keys={k: t for k, t in slices.keys.items() if k != key})
    with pytest.raises(CheckpointCorruptedError, match=rf"'{key}': a key of the skeleton without"):
        fewer.skeleton_metadata(trust=False)
    skeleton = pickle.loads(slices.skeleton)
    skeleton.state_dict_metadata[key] = metadata.state_dict_metadata[key]  # chunks and all
    chunked = dataclasses.replace(slices, skeleton=pickle.dumps(skeleton))
    with pytest.raises(CheckpointCorruptedError, match=rf"'{key}': the skeleton holds chunks"):
        chunked.skeleton_metadata(trust=False)
