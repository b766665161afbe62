"""``.metadata`` read once per load and cut by key, so no rank parses the whole index.

``.metadata`` holds a storage entry for every record of every rank: at thousands of ranks
it runs to hundreds of megabytes, and a load in which every rank reads and unpickles it
reads it from shared storage once per rank and puts a full parse on every rank's critical
path. Instead rank 0 reads it (its digest checked against the manifest), unpickles it
through the allow-list reader with every field check, and cuts it into a skeleton (every
key with its size and properties, no chunks, no storage entries) and one slice per key (the
key's chunks and their storage entries), each pickled on its own; the load's first round
hands the slices to every rank. A rank unpickles the skeleton and the slices of the keys
it holds elements of, each through the same allow-list reader and checks, so its work
follows what it reads, not the world size. A key whose local part is empty keeps no
chunks: DCP plans no read for it either way.
"""

from __future__ import annotations

import dataclasses
import pickle
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.tensor import DTensor
from typing_extensions import override

from lightning_megatron_fsdp import _torch
from lightning_megatron_fsdp.storage import load_dcp_metadata

__all__ = ["MetadataSlices", "SlicedLoadPlanner"]


@dataclasses.dataclass(frozen=True)
class MetadataSlices:
    """A checked ``.metadata``, cut by key (see the module docstring).

    Attributes:
        source: The file, for messages.
        skeleton: The metadata with every tensor's chunk list empty and no storage entries,
            pickled.
        keys: Per key, a metadata of that key alone with its chunks and storage entries,
            pickled.
    """

    source: str
    skeleton: bytes
    keys: dict[str, bytes]

    @classmethod
    def cut(cls, metadata: Metadata, *, source: str) -> MetadataSlices:
        """Cut ``metadata`` (read and checked by the allow-list reader) by key."""
        entries = metadata.state_dict_metadata
        records: dict[str, dict[Any, Any]] = {key: {} for key in entries}
        for index, info in metadata.storage_data.items():
            if index.fqn in records:  # an entry of no key is never read
                records[index.fqn][index] = info
        skeleton = {
            key: dataclasses.replace(entry, chunks=[])
            if isinstance(entry, TensorStorageMetadata)
            else entry
            for key, entry in entries.items()
        }
        common = dataclasses.replace(metadata, state_dict_metadata=skeleton, storage_data={})
        return cls(
            source,
            pickle.dumps(common, protocol=pickle.HIGHEST_PROTOCOL),
            {
                key: pickle.dumps(
                    Metadata({key: entry}, storage_data=records[key]),
                    protocol=pickle.HIGHEST_PROTOCOL,
                )
                for key, entry in entries.items()
            },
        )

    def skeleton_metadata(self, *, trust: bool) -> Metadata:
        """The skeleton, through the allow-list reader and its checks.

        Raises:
            CheckpointCorruptedError: As ``load_dcp_metadata``.
        """
        return load_dcp_metadata(self.skeleton, source=self.source, trust=trust)

    def fill(self, metadata: Metadata, key: str, *, trust: bool) -> None:
        """Give ``key``'s entry in ``metadata`` (a skeleton) its chunks and storage entries,
        through the allow-list reader and its checks.

        Raises:
            CheckpointCorruptedError: As ``load_dcp_metadata``.
        """
        blob = self.keys.get(key)
        if blob is None:
            return
        part = load_dcp_metadata(blob, source=self.source, trust=trust)
        metadata.state_dict_metadata[key] = part.state_dict_metadata[key]
        metadata.storage_data.update(part.storage_data)


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
    skeleton's entries of the keys this rank holds elements of get their chunks."""

    def __init__(self, slices: MetadataSlices, *, trust: bool, allow_partial_load: bool) -> None:
        super().__init__(allow_partial_load=allow_partial_load)
        self.slices = slices
        self.trust = trust

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
                    self.slices.fill(metadata, key, trust=self.trust)
