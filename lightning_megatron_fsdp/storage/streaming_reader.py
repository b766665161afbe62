"""A DCP reader for a local checkpoint already checked, that reads each tensor chunk
straight into its target: an export holds one tensor at a time, never two copies of it.
"""

from __future__ import annotations

import dataclasses
import io
import math
import os
import sys
from pathlib import Path
from typing import IO, Any

import torch
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from lightning_megatron_fsdp import _torch
from lightning_megatron_fsdp.errors import CheckpointCorruptedError
from lightning_megatron_fsdp.storage.confined_files import FileWindow, open_regular
from lightning_megatron_fsdp.storage.filesystem import VerifyingFileSystemReader
from lightning_megatron_fsdp.storage.format import DCP_METADATA_FILE
from lightning_megatron_fsdp.storage.safe_unpickling import check_tensor_record

__all__ = ["StreamingReader", "raw_bytes"]


class StreamingReader(VerifyingFileSystemReader):
    """A reader that reuses parsed metadata and reads chunks into place.

    Checksums were compared before (``check_directory``), so it does not verify again; it opens
    files and bounds records as :class:`VerifyingFileSystemReader` does, and anything it
    does not read itself goes through that reader.

    ``dcp.load`` still plans every read (which stored chunk lands where); only the byte
    copy differs. DCP's reader ``torch.load``s each stored chunk into a new tensor and
    copies it into the target, so a tensor saved whole by one rank costs twice its size.
    Here each chunk's layout is read with ``torch.load(map_location="meta")`` (no data;
    torch reports where the storage bytes start), and the bytes are read with
    ``readinto`` straight into the target's memory. Anything else (a stream transform,
    a dtype change, a non-contiguous region) goes through DCP's own path unchanged.

    It also returns the metadata it was given instead of re-reading ``.metadata``, which
    ``dcp.load`` would otherwise unpickle once per tensor.
    """

    def __init__(self, path: Path, metadata: Metadata, *, trust: bool = False) -> None:
        super().__init__(str(path), verify=False, trust_checkpoint=trust)
        self._metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return self._metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(
                item
            )
        fallback = []
        for relative_path, items in per_file.items():
            try:
                fd = open_regular(self.path, relative_path, size=self._expected_size(relative_path))
            except OSError as err:
                raise self._corrupted(relative_path, str(err)) from err
            with open(fd, "rb") as stream:
                fallback += [item for item in items if not self._read_into(stream, item, planner)]
        if fallback:
            return super().read_data(dataclasses.replace(plan, items=fallback), planner)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _read_into(self, stream: IO[bytes], item: ReadItem, planner: LoadPlanner) -> bool:
        """Read ``item``'s bytes straight into its target; ``False`` if it cannot."""
        info = self.storage_data[item.storage_index]
        if item.type != LoadItemType.TENSOR or info.transform_descriptors:
            return False
        where = f"{os.path.join(self.path, info.relative_path)}: {self._where(item)}"
        chunk = self._chunks.get((item.storage_index.fqn, tuple(item.storage_index.offset or ())))
        if chunk is None:
            raise CheckpointCorruptedError(f"{where}: no such chunk in {DCP_METADATA_FILE}")
        check_tensor_record(
            io.BufferedReader(FileWindow(stream.fileno(), info.offset, info.length)),
            math.prod(chunk[0]) * chunk[1].itemsize,
            source=where,
        )
        view = _torch.create_file_view(stream, info.offset, info.length)
        stored = torch.load(view, map_location="meta", weights_only=True)
        offset = _torch.checkpoint_offset(stored)
        source = _torch.narrow_tensor_by_index(stored, item.storage_offsets, item.lengths)
        target = planner.resolve_tensor(item).detach()
        nbytes = target.numel() * target.element_size()
        if offset is not None and (
            offset + source.storage_offset() * source.element_size() + nbytes > info.length
            or offset < 0
        ):
            raise CheckpointCorruptedError(f"{where}: the tensor data lies outside its record")
        if (
            offset is None
            or sys.byteorder != "little"
            or source.dtype != target.dtype
            or source.shape != target.shape
            or not source.is_contiguous()
            or not target.is_contiguous()
        ):
            return False
        start = info.offset + offset + source.storage_offset() * source.element_size()
        if nbytes:
            stream.seek(start)
            read = stream.readinto(raw_bytes(target))  # type: ignore[attr-defined]
            if read != nbytes:
                raise CheckpointCorruptedError(
                    f"{os.path.join(self.path, info.relative_path)}: {item.storage_index.fqn!r} "
                    f"needs bytes [{start}, {start + nbytes}) but the file ends first; the "
                    "file is truncated."
                )
        planner.commit_tensor(item, target)
        return True


def raw_bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes in native (little-endian) order, without a copy."""
    flat = tensor.contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")
