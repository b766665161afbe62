"""DCP's ``.metadata`` classes as plain records, for readers that never hand it to DCP.

``inspect`` and ``inspect --verify`` only read a checkpoint's index, yet DCP's metadata
classes live in ``torch.distributed.checkpoint``, whose package import pulls in DTensor,
``torch.fx`` and sympy, which these commands otherwise never import. These records carry
the same fields under the same names (and unpickle from the same pickle state), so code
that reads a ``Metadata`` reads them alike; ``checkpoint.safe_unpickling`` maps DCP's
pickled class names to them when a caller asks for records, through the same allow-list
and field checks. They are not DCP's classes: whatever passes the metadata on to DCP (a
load, ``consolidate``) reads torch's.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

import torch

__all__ = [
    "BytesStorageMetadata",
    "ChunkStorageMetadata",
    "MemoryFormatEncoding",
    "Metadata",
    "MetadataIndex",
    "StorageInfo",
    "StorageMeta",
    "TensorProperties",
    "TensorStorageMetadata",
    "layout_by_name",
]


@dataclasses.dataclass
class ChunkStorageMetadata:
    """One saved chunk of a tensor: where it starts and how large it is."""

    offsets: torch.Size
    sizes: torch.Size


class MemoryFormatEncoding(enum.Enum):
    """How DCP pickles ``TensorProperties.memory_format`` (``metadata._MEM_FORMAT_ENCODING``)."""

    TORCH_CONTIGUOUS_FORMAT = 0
    TORCH_CHANNELS_LAST = 1
    TORCH_PRESERVE_FORMAT = 2


_MEMORY_FORMATS = {
    MemoryFormatEncoding.TORCH_CONTIGUOUS_FORMAT: torch.contiguous_format,
    MemoryFormatEncoding.TORCH_CHANNELS_LAST: torch.channels_last,
    MemoryFormatEncoding.TORCH_PRESERVE_FORMAT: torch.preserve_format,
}


def layout_by_name(name: str) -> torch.layout:
    """The torch layout named ``name`` (``"torch.strided"``), as a pickled layout names it
    (``serialization._get_layout``): a lookup among torch's layout constants, nothing else.

    Raises:
        ValueError: If torch has no layout of that name.
    """
    for value in vars(torch).values():
        if isinstance(value, torch.layout) and str(value) == name:
            return value
    raise ValueError(f"no torch layout is named {name!r}")


@dataclasses.dataclass
class TensorProperties:
    """A tensor's dtype and the deprecated fields DCP still pickles; ``strides`` is the
    sixth field a newer torch adds (``None`` where the checkpoint has five)."""

    dtype: torch.dtype
    layout: torch.layout = torch.strided
    requires_grad: bool = False
    memory_format: torch.memory_format = torch.contiguous_format
    pin_memory: bool = False
    strides: Any = None

    def __setstate__(self, state: Any) -> None:
        fields = tuple(state)
        if len(fields) not in (5, 6):
            raise ValueError(f"TensorProperties holds {len(fields)} fields, expected 5 or 6")
        self.dtype, self.layout, self.requires_grad, encoding, self.pin_memory = fields[:5]
        self.strides = fields[5] if len(fields) > 5 else None
        if not isinstance(encoding, MemoryFormatEncoding):
            raise ValueError(f"TensorProperties: {encoding!r} is no memory-format encoding")
        self.memory_format = _MEMORY_FORMATS[encoding]


@dataclasses.dataclass
class TensorStorageMetadata:
    """A tensor entry: its properties, global shape and saved chunks."""

    properties: TensorProperties
    size: torch.Size
    chunks: list[ChunkStorageMetadata]


@dataclasses.dataclass
class BytesStorageMetadata:
    """A non-tensor entry (a ``torch.save`` byte record)."""


@dataclasses.dataclass
class StorageMeta:
    """Where and by which save the checkpoint was written."""

    checkpoint_id: Any = None
    save_id: str | None = None
    load_id: str | None = None
    modules: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Metadata:
    """The index: every entry's metadata, the planner's key paths, where each item lies."""

    state_dict_metadata: dict[str, TensorStorageMetadata | BytesStorageMetadata]
    planner_data: Any = None
    storage_data: Any = None
    storage_meta: StorageMeta | None = None
    version: str | None = None


@dataclasses.dataclass(frozen=True)
class MetadataIndex:
    """The key of a stored item: the entry's name and, for a tensor chunk, its offsets.
    Hashes and compares like DCP's (``index`` is a hint, left out of both)."""

    fqn: str
    offset: torch.Size | None = None
    index: int | None = dataclasses.field(default=None, hash=False, compare=False)


@dataclasses.dataclass
class StorageInfo:
    """Where a stored item lies (``filesystem._StorageInfo``): file, offset, length; a
    record annotation this package writes rides along as an attribute."""

    relative_path: str
    offset: int
    length: int
    transform_descriptors: Any = None
