"""The reader's and writer's passes over the bytes: the reader reads a run of records in
chunks and CRC32Cs each chunk as soon as it is read; the writer hands a local file to the
kernel's writeback while it is still writing it.

Chunks cut records anywhere (inside a zip header, inside a payload read straight into its
target, across two records of one batch), so every chunk size must still load bit-exact
and still catch a flipped byte wherever it lies in any record. Single process, no process
group.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException

from lightning_megatron_fsdp.storage import filesystem
from lightning_megatron_fsdp.storage.filesystem import (
    ChecksummingFileSystemWriter,
    VerifyingFileSystemReader,
)


def _state(seed: int) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(300, 17, generator=generator),
        "e": torch.randn(40, 6, generator=generator).to(torch.bfloat16),
        "i": torch.randint(0, 1 << 40, (1000,), generator=generator),
        "s": torch.randn((), generator=generator),
        "blob": b"some bytes" * (seed + 1),
    }


def _reader(path: Path, chunk: int, batch: int) -> VerifyingFileSystemReader:
    reader = VerifyingFileSystemReader(path)
    reader.read_chunk_bytes = chunk
    reader.batch_bytes = batch
    return reader


def _assert_equal(loaded: dict[str, Any], saved: dict[str, Any]) -> None:
    for key, value in saved.items():
        if isinstance(value, torch.Tensor):
            assert loaded[key].dtype == value.dtype, key
            torch.testing.assert_close(loaded[key], value, rtol=0, atol=0)
        else:
            assert loaded[key] == value, key


@pytest.mark.both_versions
@pytest.mark.parametrize("batch", [0, 1 << 20], ids=["record", "batched"])
@pytest.mark.parametrize("chunk", [0, 7, 4096, 1 << 20], ids=["whole", "7", "4k", "1m"])
def test_records_read_in_chunks_load_bit_exact_and_a_flipped_byte_anywhere_is_caught(
    tmp_path: Path, chunk: int, batch: int
) -> None:
    """Watched failing: with the CRC32C of each chunk's last piece skipped, the clean load
    fails its check; with the comparison removed, the flipped bytes load silently."""
    saved = _state(0)
    dcp.save(saved, storage_writer=ChecksummingFileSystemWriter(tmp_path))
    loaded = _state(1)
    dcp.load(loaded, storage_reader=_reader(tmp_path, chunk, batch))
    _assert_equal(loaded, saved)

    records = FileSystemReader(tmp_path).read_metadata().storage_data
    assert {index.fqn for index in records} == set(saved)
    for index, info in records.items():
        shard = tmp_path / info.relative_path
        clean = shard.read_bytes()
        for at in (0, info.length // 2, info.length - 1):
            damaged = bytearray(clean)
            damaged[info.offset + at] ^= 0x10
            shard.write_bytes(bytes(damaged))
            caught = rf"crc32c [0-9a-f]{{8}} read, .* record of '{index.fqn}'"
            with pytest.raises(CheckpointException, match=caught):
                dcp.load(_state(1), storage_reader=_reader(tmp_path, chunk, batch))
        shard.write_bytes(clean)


@pytest.mark.skipif(filesystem._SYNC_FILE_RANGE is None, reason="no sync_file_range here")
@pytest.mark.parametrize("sync_files", [True, False])
def test_a_local_file_goes_to_writeback_while_it_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sync_files: bool
) -> None:
    """With ``sync_files`` (whose ``fsync`` it gets ahead of), each further
    ``_WRITE_BEHIND`` bytes written are handed to writeback, in order, none twice, none
    past what was written; without it, none. Watched failing with the request removed."""
    requests: list[tuple[int, int]] = []
    real = filesystem._SYNC_FILE_RANGE
    assert real is not None

    def recording(fd: int, offset: int, nbytes: int, flags: int) -> int:
        requests.append((offset, nbytes))
        return real(fd, offset, nbytes, flags)

    monkeypatch.setattr(filesystem, "_SYNC_FILE_RANGE", recording)
    saved = {"w": torch.randn(10 << 20, generator=torch.Generator().manual_seed(0))}  # 40 MiB
    # The first save of a kind of tensor may write its record in one piece (torch.save's
    # own); later ones write it in blocks, each followed by a request when one is due.
    dcp.save(saved, storage_writer=ChecksummingFileSystemWriter(tmp_path / "first"))
    requests.clear()
    writer = ChecksummingFileSystemWriter(tmp_path, sync_files=sync_files)
    dcp.save(saved, storage_writer=writer)
    loaded = {"w": torch.zeros(10 << 20)}
    dcp.load(loaded, storage_reader=VerifyingFileSystemReader(tmp_path))
    torch.testing.assert_close(loaded["w"], saved["w"], rtol=0, atol=0)
    if not sync_files:
        assert requests == []
        return
    size = (tmp_path / "__0_0.distcp").stat().st_size
    assert len(requests) == size // filesystem._WRITE_BEHIND, requests
    end = 0
    for offset, nbytes in requests:
        assert offset == end and nbytes >= filesystem._WRITE_BEHIND, requests
        end = offset + nbytes
    assert end <= size
