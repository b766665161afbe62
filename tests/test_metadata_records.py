"""``.metadata`` read as records holds what DCP's own classes hold.

The offline tools read the index into ``storage.metadata_records`` (no
``torch.distributed.checkpoint`` import); a load reads it into DCP's classes. Both go through
one allow-list and one field check (``storage.safe_unpickling``), so the two readings
must agree field for field on every checkpoint: one this torch wrote (optimizer state, byte
records, our CRC32C annotations), the committed format-1 fixture (two ranks), and the
torch 2.15 fixture (a sixth ``TensorProperties`` field). And the records must carry DCP's
fields, so a torch that adds one fails here first. A hostile ``.metadata`` is refused on
both paths: tests/test_untrusted_checkpoints.py drives ``inspect`` and ``verify`` (records)
and every loader (DCP's classes) through the same attacks.
"""

from __future__ import annotations

import copyreg
import dataclasses
import enum
import io
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint import filesystem as dcp_filesystem
from torch.distributed.checkpoint import metadata as dcp_metadata

from lightning_megatron_fsdp.errors import CheckpointCorruptedError
from lightning_megatron_fsdp.storage import metadata_records
from lightning_megatron_fsdp.storage.safe_unpickling import is_tensor_entry, load_dcp_metadata
from tests.test_untrusted_checkpoints import checkpoints  # noqa: F401 (the fixture)

FIXTURES = Path(__file__).resolve().parent / "fixtures"
# A field this torch's TensorProperties may lack (torch 2.15 added it); compared separately.
STRIDES = "strides"


def _plain(value: Any) -> Any:
    """``value`` as plain data: a record or DCP object becomes its class name (without a
    leading underscore) and every attribute it holds, recursively, ``strides`` aside."""
    if isinstance(value, enum.Enum):
        return ("enum", value.value)
    if isinstance(value, torch.Size):
        return ("Size", tuple(value))
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = sorted((k, _plain(v)) for k, v in vars(value).items() if k != STRIDES)
        return (type(value).__name__.lstrip("_"), tuple(fields))
    if isinstance(value, dict):
        return ("dict", tuple((_plain(k), _plain(v)) for k, v in value.items()))
    if isinstance(value, list | tuple):
        return (type(value).__name__, tuple(_plain(v) for v in value))
    return value


def _both(path: Path) -> tuple[Any, Any]:
    data = (path / ".metadata").read_bytes()
    records = load_dcp_metadata(data, source=".metadata", records=True)
    dcp = load_dcp_metadata(data, source=".metadata")
    return records, dcp


@pytest.mark.parametrize("which", ["intact", "format 1", "torch 2.15"])
def test_records_hold_what_dcp_holds(
    checkpoints: dict[str, Path],  # noqa: F811
    which: str,
) -> None:
    path = {
        "intact": checkpoints["intact"],
        "format 1": FIXTURES / "format1" / "checkpoint",
        "torch 2.15": FIXTURES / "torch215" / "checkpoint",
    }[which]
    records, dcp = _both(path)
    assert type(records) is metadata_records.Metadata
    assert type(dcp) is dcp_metadata.Metadata
    assert _plain(records) == _plain(dcp)
    # Not vacuous: tensors, chunks and storage entries were compared.
    tensors = [e for e in records.state_dict_metadata.values() if is_tensor_entry(e)]
    assert tensors and all(e.chunks for e in tensors)
    assert len(records.storage_data) >= len(tensors)
    # Records index like DCP's: by MetadataIndex, equal keys hash alike.
    for index in dcp.storage_data:
        twin = metadata_records.MetadataIndex(index.fqn, index.offset)
        assert records.storage_data[twin] is not None
    # Both tell tensor entries from byte records the same way.
    assert [is_tensor_entry(e) for e in records.state_dict_metadata.values()] == [
        is_tensor_entry(e) for e in dcp.state_dict_metadata.values()
    ]
    for entry, twin in zip(
        records.state_dict_metadata.values(), dcp.state_dict_metadata.values(), strict=True
    ):
        if is_tensor_entry(entry):
            theirs = getattr(twin.properties, STRIDES, None)
            if theirs is not None:  # a torch whose class has the field
                assert entry.properties.strides == theirs
            if which == "torch 2.15":  # the sixth field is read, not dropped
                assert entry.properties.strides is not None


def test_records_carry_dcps_fields() -> None:
    pairs = [
        (metadata_records.Metadata, dcp_metadata.Metadata),
        (metadata_records.TensorStorageMetadata, dcp_metadata.TensorStorageMetadata),
        (metadata_records.BytesStorageMetadata, dcp_metadata.BytesStorageMetadata),
        (metadata_records.ChunkStorageMetadata, dcp_metadata.ChunkStorageMetadata),
        (metadata_records.TensorProperties, dcp_metadata.TensorProperties),
        (metadata_records.MetadataIndex, dcp_metadata.MetadataIndex),
        (metadata_records.StorageMeta, dcp_metadata.StorageMeta),
        (metadata_records.StorageInfo, dcp_filesystem._StorageInfo),
    ]
    for mine, theirs in pairs:
        names = {f.name for f in dataclasses.fields(theirs)}
        assert {f.name for f in dataclasses.fields(mine)} - {STRIDES} == names - {STRIDES}, mine
    encoding = dcp_metadata._MEM_FORMAT_ENCODING
    assert {e.name: e.value for e in metadata_records.MemoryFormatEncoding} == {
        e.name: e.value for e in encoding
    }


class _CraftedProperties(pickle.Pickler):
    """Pickles DCP metadata with every ``TensorProperties`` state replaced by ``state``."""

    def __init__(self, file: Any, state: tuple[Any, ...]) -> None:
        super().__init__(file, protocol=4)
        self.state = state

    def reducer_override(self, obj: Any) -> Any:
        if type(obj) is dcp_metadata.TensorProperties:
            return (copyreg.__newobj__, (dcp_metadata.TensorProperties,), self.state)
        return NotImplemented


@pytest.mark.parametrize(
    "state",
    [
        (torch.float32, torch.strided, False, dcp_metadata._MEM_FORMAT_ENCODING(0)),
        (torch.float32, torch.strided, False, 0, False),
    ],
    ids=["four fields", "memory format not an encoding"],
)
def test_records_refuse_what_dcps_classes_refuse(
    checkpoints: dict[str, Path],  # noqa: F811
    state: tuple[Any, ...],
) -> None:
    """A crafted ``TensorProperties`` state: unreadable on both paths, the same error."""
    dcp = load_dcp_metadata((checkpoints["intact"] / ".metadata").read_bytes(), source=".metadata")
    buffer = io.BytesIO()
    _CraftedProperties(buffer, state).dump(dcp)
    for records in (True, False):
        with pytest.raises(CheckpointCorruptedError, match=r"\.metadata: not DCP metadata"):
            load_dcp_metadata(buffer.getvalue(), source=".metadata", records=records)
