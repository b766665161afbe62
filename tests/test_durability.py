"""A save's files are whole on disk when they are synced.

``os.fsync`` makes durable what the kernel holds; bytes still in a Python buffer are not
in it. A writer that syncs a buffered stream before flushing it leaves the file's tail in
user space, and a power cut then leaves a committed checkpoint whose shards are cut
short. Here every ``os.fsync`` of a real save is watched (a recording wrapper around the
real call, in this process): at each call the file's size as the kernel sees it
(``os.fstat``) must already be its final size, and every file the save leaves in the
checkpoint must have been synced. Single process, no process group: a few seconds.
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_megatron_fsdp.checkpoint.format import MANIFEST_FILE
from lightning_megatron_fsdp.checkpoint.io import MegatronFSDPCheckpointIO
from lightning_megatron_fsdp.checkpoint.storage import ChecksummingFileSystemWriter


def _state() -> dict[str, Any]:
    generator = torch.Generator().manual_seed(0)
    tensors = {f"layer{i}.weight": torch.randn(64 + i, 33, generator=generator) for i in range(6)}
    tensors["scalar"] = torch.tensor(3.0)
    # A byte record (a non-tensor object DCP pickles into the shard file) beside tensors.
    return {
        "state_dict": tensors,
        "loops": {"positions": list(range(500))},
        "buffer": io.BytesIO(b"x" * 1000),
        "global_step": 7,
    }


class _SyncRecorder:
    """Wraps ``os.fsync``: the file's name and its size in the kernel at each call."""

    def __init__(self) -> None:
        self.synced: list[tuple[str, int]] = []
        self._fsync = os.fsync

    def __call__(self, fd: int) -> None:
        name = Path(os.readlink(f"/proc/self/fd/{fd}")).name
        self.synced.append((name, os.fstat(fd).st_size))
        self._fsync(fd)


@pytest.mark.parametrize("single_file_per_rank", [True, False], ids=["per-rank", "per-item"])
@pytest.mark.parametrize("thread_count", [1, 4])
def test_every_file_is_whole_when_synced(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    thread_count: int,
    single_file_per_rank: bool,
) -> None:
    """Each synced file already holds all its bytes in the kernel when ``fsync`` runs, for
    1 and 4 writer threads and both of DCP's file layouts; every shard file, ``.metadata``
    and the manifest are synced. Without the flush before the sync, the shards' tails are
    still in Python's buffer (a shard's size at its sync is short of its final size)."""

    def writer(path: Any) -> ChecksummingFileSystemWriter:
        return ChecksummingFileSystemWriter(
            path, thread_count=thread_count, single_file_per_rank=single_file_per_rank
        )

    recorder = _SyncRecorder()
    monkeypatch.setattr(os, "fsync", recorder)
    path = tmp_path / "step.ckpt"
    MegatronFSDPCheckpointIO(storage_writer_factory=writer).save_checkpoint(_state(), path)
    monkeypatch.undo()

    final = {file.name: file.stat().st_size for file in path.iterdir() if file.is_file()}
    shards = [name for name in final if name.endswith(".distcp")]
    if single_file_per_rank:  # one file per writer thread
        assert len(shards) == thread_count, shards
    else:  # one file per item
        assert len(shards) == len(_state()["state_dict"]), shards
    sizes_at_sync: dict[str, int] = {}
    for name, size in recorder.synced:
        # Written under a temporary name, then renamed into place.
        for suffix in (".tmp", ".partial"):
            name = name.removesuffix(suffix)
        sizes_at_sync[name] = size
    for name, size in final.items():
        if name in (".metadata", MANIFEST_FILE) or name.endswith(".distcp"):
            assert name in sizes_at_sync, f"{name} was never synced: {sorted(sizes_at_sync)}"
        if name in sizes_at_sync:
            assert sizes_at_sync[name] == size, (
                f"{name}: {sizes_at_sync[name]} of {size} bytes in the kernel when synced"
            )
