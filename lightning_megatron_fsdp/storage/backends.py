"""Which DCP writer and reader move a checkpoint's bytes, chosen in one place: the save and
load phases ask a :class:`CheckpointStorage` for them and never name a backend, as they ask
the :class:`~lightning_megatron_fsdp.storage.commit.CheckpointStore` for the commit. A
second backend plugs in as a store for its commit and a storage for its bytes, both handed
to the plugin's options (docs/DESIGN.md, "Object storage").
"""

from __future__ import annotations

from typing import Any, Protocol

from torch.distributed.checkpoint.storage import StorageReader, StorageWriter

from lightning_megatron_fsdp.storage.filesystem import (
    ChecksummingFileSystemWriter,
    VerifyingFileSystemReader,
)
from lightning_megatron_fsdp.storage.store_location import StoreLocation

__all__ = ["CheckpointStorage", "FilesAndObjects"]


class CheckpointStorage(Protocol):
    """The DCP writer and reader of a location a ``CheckpointStore`` gave."""

    def writer(self, staging: Any, *, checksum: bool, thread_count: int) -> StorageWriter:
        """The writer of a save into ``staging`` (the store's staging location).

        Args:
            staging: Where every rank writes.
            checksum: Record the CRC32C of every record and file.
            thread_count: Writer threads per rank.
        """
        ...

    def reader(self, location: Any, *, verify: bool, trust_checkpoint: bool) -> StorageReader:
        """The reader of a load from ``location`` (the store's resolved checkpoint).

        Args:
            location: The checkpoint to read.
            verify: Check every record read against its CRC32C.
            trust_checkpoint: Unpickle ``.metadata`` and byte records in full.
        """
        ...


class FilesAndObjects:
    """The plugin's storage, the partner of ``store_location.ObjectStores``: an object-store
    location (:class:`StoreLocation`) through fsspec, any other through the local
    filesystem's writer and reader."""

    def writer(self, staging: Any, *, checksum: bool, thread_count: int) -> StorageWriter:
        if isinstance(staging, StoreLocation):
            return staging.writer(checksum=checksum, thread_count=thread_count)
        return ChecksummingFileSystemWriter(staging, checksum=checksum, thread_count=thread_count)

    def reader(self, location: Any, *, verify: bool, trust_checkpoint: bool) -> StorageReader:
        if isinstance(location, StoreLocation):
            return location.reader(verify=verify, trust_checkpoint=trust_checkpoint)
        return VerifyingFileSystemReader(location, verify=verify, trust_checkpoint=trust_checkpoint)
