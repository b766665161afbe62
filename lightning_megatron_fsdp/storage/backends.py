"""Which DCP writer and reader move a checkpoint's bytes: the save and load phases ask a
:class:`CheckpointStorage` for them and never name a backend, as they ask the
:class:`~lightning_megatron_fsdp.storage.commit.CheckpointStore` for the commit. The
plugin's own, :class:`LocationStorage`, takes them from the location
(:func:`~lightning_megatron_fsdp.storage.location.locate`): each backend's location gives
its writer and reader, so a backend is one module and nothing here chooses by type. A
user's own pair plugs in through the plugin's factories (docs/DESIGN.md, "Object storage")."""

from __future__ import annotations

from typing import Any, Protocol

from torch.distributed.checkpoint.storage import StorageReader, StorageWriter

from lightning_megatron_fsdp.storage.store_location import locate

__all__ = ["CheckpointStorage", "LocationStorage"]


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


class LocationStorage:
    """The plugin's storage, the partner of ``store_location.ObjectStores``: the DCP writer
    and reader the location itself gives
    (:meth:`~lightning_megatron_fsdp.storage.location.Location.writer`, ``reader``), so a
    backend brings its own and nothing here names one."""

    def writer(self, staging: Any, *, checksum: bool, thread_count: int) -> StorageWriter:
        return locate(staging).writer(checksum=checksum, thread_count=thread_count)

    def reader(self, location: Any, *, verify: bool, trust_checkpoint: bool) -> StorageReader:
        return locate(location).reader(verify=verify, trust_checkpoint=trust_checkpoint)
