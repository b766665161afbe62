"""Our DCP writer and reader take what torch's ``FileSystemWriter``/``FileSystemReader`` take.

Run against torch's own DCP file-system tests with our classes swapped in, three things
failed: the reader refused ``_extension_registry`` (so torch's stream-extension tests,
Rot13 and ZStandard, could not load), neither class took torch's options positionally, and
a writer whose ``fs`` was replaced (torch's flush-count test does that) crashed the save.
Here each of those runs through our classes with torch's own extension classes, and the
round trips are bit-exact. Single process, no process group.
"""

from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._extension import ExtensionRegistry, ZStandard
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.testing._internal.distributed.checkpoint_utils import (
    Rot13Example,
    get_test_extension_registry,
)

from lightning_megatron_fsdp.storage.checksums import crc32c
from lightning_megatron_fsdp.storage.filesystem import (
    ChecksummingFileSystemWriter,
    VerifyingFileSystemReader,
)

_CORRUPTED = r"CheckpointCorruptedError: .*__0_0\.distcp: crc32c"  # DCP wraps the error


class _Blob:
    """A stateful object DCP writes as a byte record (torch's tests use the same shape)."""

    def __init__(self, value: bytes) -> None:
        self.state = {"blob": value}

    def state_dict(self) -> dict[str, Any]:
        return self.state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.state = state_dict


def _state(seed: int) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(seed)
    state: dict[str, Any] = {
        f"layer{i}.weight": torch.randn(17 + i, 9, generator=generator) for i in range(5)
    }
    state["embedding"] = torch.randn(40, 6, generator=generator).to(torch.bfloat16)
    state["blob"] = _Blob(b"SomeBlobForTesting" if seed == 0 else b"")
    return state


def _assert_equal(loaded: dict[str, Any], saved: dict[str, Any]) -> None:
    assert loaded.keys() == saved.keys()
    for key, value in saved.items():
        if isinstance(value, torch.Tensor):
            torch.testing.assert_close(loaded[key], value, rtol=0, atol=0)
        else:
            assert loaded[key].state == value.state, key


def test_options_are_taken_positionally_as_by_torch(tmp_path: Path) -> None:
    positional = (False, False, 3, 1234, False, True, [Rot13Example()])
    ours = ChecksummingFileSystemWriter(tmp_path, *positional)
    theirs = FileSystemWriter(tmp_path, *positional)
    for name in ("single_file_per_rank", "sync_files", "thread_count", "per_thread_copy_ahead"):
        assert getattr(ours, name) == getattr(theirs, name), name
    assert ours.overwrite is theirs.overwrite is True
    assert [type(e) for e in ours.transforms.extensions] == [Rot13Example]
    registry = get_test_extension_registry()
    reader = VerifyingFileSystemReader(tmp_path, registry)
    assert reader.transforms.extension_registry is registry
    assert reader.verify is True


@pytest.mark.parametrize("thread_count", [1, 2])
def test_rot13_extension_round_trips_through_our_writer_and_reader(
    tmp_path: Path, thread_count: int
) -> None:
    saved = _state(0)
    writer = ChecksummingFileSystemWriter(
        tmp_path, thread_count=thread_count, _extensions=[Rot13Example()]
    )
    dcp.save(saved, storage_writer=writer)
    # The extension ran: no shard file holds the blob's bytes as written.
    shards = sorted(tmp_path.glob("*.distcp"))
    assert shards and not any(b"SomeBlobForTesting" in p.read_bytes() for p in shards)
    for reader in (
        VerifyingFileSystemReader(tmp_path, _extension_registry=get_test_extension_registry()),
        FileSystemReader(tmp_path, _extension_registry=get_test_extension_registry()),
    ):
        loaded = _state(1)
        dcp.load(loaded, storage_reader=reader)
        _assert_equal(loaded, saved)


def test_rot13_checkpoint_of_torchs_writer_loads_through_our_reader(tmp_path: Path) -> None:
    saved = _state(0)
    dcp.save(saved, storage_writer=FileSystemWriter(tmp_path, _extensions=[Rot13Example()]))
    loaded = _state(1)
    reader = VerifyingFileSystemReader(tmp_path, get_test_extension_registry())
    dcp.load(loaded, storage_reader=reader)
    _assert_equal(loaded, saved)


def test_rot13_record_checksums_cover_the_stored_bytes(tmp_path: Path) -> None:
    """With an extension, each record's CRC32C is of the bytes on disk (after the
    transform), so a flipped stored byte is caught before the transform reads it."""
    saved = _state(0)
    writer = ChecksummingFileSystemWriter(tmp_path, _extensions=[Rot13Example()])
    dcp.save(saved, storage_writer=writer)
    shard = tmp_path / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointException, match=_CORRUPTED):
        dcp.load(
            _state(1),
            storage_reader=VerifyingFileSystemReader(tmp_path, get_test_extension_registry()),
        )


@pytest.mark.parametrize("thread_count", [1, 2])
def test_zstandard_extension_round_trips(tmp_path: Path, thread_count: int) -> None:
    assert ZStandard.is_available(), "zstandard (the test extra) is not installed"
    saved = _state(0)
    writer = ChecksummingFileSystemWriter(
        tmp_path, thread_count=thread_count, _extensions=[ZStandard()]
    )
    dcp.save(saved, storage_writer=writer)
    loaded = _state(1)
    dcp.load(loaded, storage_reader=VerifyingFileSystemReader(tmp_path, ExtensionRegistry()))
    _assert_equal(loaded, saved)


class _TrackingFileSystem(FileSystem):
    """A user's replacement file system (like torch's flush-count test): counts the
    streams it opened and the flushes on each."""

    def __init__(self) -> None:
        super().__init__()
        self.flushes: dict[str, int] = {}

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[io.IOBase]:
        with super().create_stream(path, mode) as stream:
            name = Path(path).name
            self.flushes.setdefault(name, 0)
            flush = stream.flush

            def tracking_flush() -> None:
                self.flushes[name] += 1
                flush()

            stream.flush = tracking_flush  # type: ignore[method-assign]
            yield stream


@pytest.mark.parametrize("thread_count", [1, 2])
def test_a_replaced_file_system_is_used_and_still_checksummed(
    tmp_path: Path, thread_count: int
) -> None:
    """A replaced ``writer.fs`` writes every file, and the writer still records each
    file's and each record's CRC32C (the replacement is wrapped, not bypassed)."""
    saved = _state(0)
    writer = ChecksummingFileSystemWriter(tmp_path, thread_count=thread_count)
    tracking = _TrackingFileSystem()
    writer.fs = tracking
    dcp.save(saved, storage_writer=writer)
    on_disk = {p.name for p in tmp_path.iterdir()}
    assert on_disk == {".metadata", *(n for n in tracking.flushes if n.endswith(".distcp"))}
    # Each file flushed a few times (before its fsync, and when closed), never once per
    # record: the same count for a file of 7 records as for .metadata's one.
    shards = [n for n in on_disk if n.endswith(".distcp")]
    assert tracking.flushes[".metadata.tmp"] <= 3, tracking.flushes
    assert all(tracking.flushes[n] <= 3 for n in shards), tracking.flushes
    written = writer.written_files()
    assert set(written) == on_disk
    for name, file in written.items():
        data = (tmp_path / name).read_bytes()
        assert (file.size, file.crc32c) == (len(data), crc32c(data)), name
    loaded = _state(1)
    dcp.load(loaded, storage_reader=VerifyingFileSystemReader(tmp_path))
    _assert_equal(loaded, saved)
    # The records' CRC32Cs were recorded through the replacement: a flipped byte is caught.
    shard = tmp_path / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[-20] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointException, match=_CORRUPTED):
        dcp.load(_state(1), storage_reader=VerifyingFileSystemReader(tmp_path))


class _OpenCountingFileSystem(FileSystem):
    """A user's replacement file system for a reader: counts the streams read through it."""

    def __init__(self) -> None:
        super().__init__()
        self.opened: list[str] = []

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[io.IOBase]:
        self.opened.append(f"{Path(path).name}:{mode}")
        with super().create_stream(path, mode) as stream:
            yield stream


def test_a_replaced_reader_file_system_is_read_through_and_verified(tmp_path: Path) -> None:
    """A replaced ``reader.fs`` (torch's reader reads through it) serves ``.metadata`` and
    every shard file, the load is bit-exact, and a flipped byte still fails its CRC32C."""
    saved = _state(0)
    dcp.save(saved, storage_writer=ChecksummingFileSystemWriter(tmp_path, thread_count=2))
    reader = VerifyingFileSystemReader(tmp_path)
    counting = _OpenCountingFileSystem()
    reader.fs = counting
    loaded = _state(1)
    dcp.load(loaded, storage_reader=reader)
    _assert_equal(loaded, saved)
    shards = sorted(p.name for p in tmp_path.glob("*.distcp"))
    assert sorted(counting.opened) == sorted([".metadata:rb", *(f"{n}:rb" for n in shards)])
    shard = tmp_path / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[-20] ^= 0x01
    shard.write_bytes(bytes(data))
    reader = VerifyingFileSystemReader(tmp_path)
    reader.fs = _OpenCountingFileSystem()
    with pytest.raises(CheckpointException, match=_CORRUPTED):
        dcp.load(_state(1), storage_reader=reader)
