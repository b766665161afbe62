"""A save reaches the disk in an order a power cut cannot break, and says when it cannot.

``os.fsync`` makes durable what the kernel holds; bytes still in a Python buffer are not
in it, and a rename or a new file is durable only once its directory is synced. Here every
``os.fsync``, ``os.rename``, ``os.replace`` and ``renameat2`` exchange of a real save is
recorded in order (a wrapper around each real call, in this process), and the order is
checked: every file of the checkpoint (``meta.pt`` and ``.metadata`` included) synced at
its final size before the manifest's sync, the staging directory after the manifest's
rename, the parent directory after the checkpoint's rename. A directory sync that fails
fails the save. Single process, no process group: a few seconds.
"""

from __future__ import annotations

import errno
import io
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_megatron_fsdp.checkpoint.io import MegatronFSDPCheckpointIO
from lightning_megatron_fsdp.errors import CheckpointSaveError
from lightning_megatron_fsdp.storage import commit
from lightning_megatron_fsdp.storage.filesystem import ChecksummingFileSystemWriter
from lightning_megatron_fsdp.storage.format import MANIFEST_FILE, META_FILE, read_manifest


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


class _Syscalls:
    """Records, in order, every fsync (the path, its size in the kernel, whether it is a
    directory) and every rename (``os.rename``, ``os.replace``, ``renameat2`` exchanges)
    this process makes, by wrapping the real calls; each still runs. ``fail`` names the
    errno with which the fsync of a path fails instead (``None``: it runs)."""

    def __init__(
        self, monkeypatch: pytest.MonkeyPatch, fail: Callable[[Path], int | None] = lambda p: None
    ) -> None:
        self.events: list[tuple[Any, ...]] = []
        real_fsync, real_rename, real_replace = os.fsync, os.rename, os.replace
        real_exchange = commit._renameat2()

        def fsync(fd: int) -> None:
            path = Path(os.readlink(f"/proc/self/fd/{fd}"))
            status = os.fstat(fd)
            self.events.append(("fsync", path, status.st_size, stat.S_ISDIR(status.st_mode)))
            code = fail(path)
            if code is not None:
                raise OSError(code, f"injected: {os.strerror(code)}", str(path))
            real_fsync(fd)

        def renamer(kind: str, real: Callable[..., None]) -> Callable[..., None]:
            def rename(source: Any, target: Any, *args: Any, **kwargs: Any) -> None:
                self.events.append((kind, _real(source), _real(target)))
                real(source, target, *args, **kwargs)

            return rename

        def exchange(fd: int, source: bytes, fd2: int, target: bytes, flags: int) -> int:
            self.events.append(("exchange", _real(source), _real(target)))
            return int(real_exchange(fd, source, fd2, target, flags))

        monkeypatch.setattr(os, "fsync", fsync)
        monkeypatch.setattr(os, "rename", renamer("rename", real_rename))
        monkeypatch.setattr(os, "replace", renamer("replace", real_replace))
        if real_exchange is not None:
            monkeypatch.setattr(commit, "_renameat2", lambda: exchange)

    def index(self, *event: Any) -> int:
        """Where the last event starting with ``event`` happened (AssertionError if none)."""
        found = [i for i, e in enumerate(self.events) if e[: len(event)] == event]
        assert found, f"no {event} among {self.events}"
        return found[-1]


def _real(path: Any) -> Path:
    return Path(os.path.realpath(os.fsdecode(path)))


def _check_order(calls: _Syscalls, final: Path) -> None:
    """The save that put ``final`` in place synced each of its files at its final size,
    then the manifest, renamed the manifest into place, synced the staging directory,
    renamed the staging directory to ``final``, and synced the parent last."""
    final = _real(final)
    commits = [
        i
        for i, e in enumerate(calls.events)
        if e[0] in ("rename", "exchange") and e[2] == final and e[1].name.startswith(".")
    ]
    assert commits, f"{final} was never renamed into place: {calls.events}"
    committed = commits[-1]
    staging = calls.events[committed][1]
    assert staging.name.startswith(f".{final.name}.tmp-"), staging
    partial = staging / f"{MANIFEST_FILE}.partial"
    manifest_synced = calls.index("fsync", partial)
    assert calls.events[manifest_synced][2] == (final / MANIFEST_FILE).stat().st_size
    manifest_renamed = calls.index("replace", partial, staging / MANIFEST_FILE)
    staging_synced = calls.index("fsync", staging)
    parent_synced = calls.index("fsync", final.parent)
    assert manifest_synced < manifest_renamed < staging_synced < committed < parent_synced, (
        manifest_synced,
        manifest_renamed,
        staging_synced,
        committed,
        parent_synced,
    )
    assert calls.events[staging_synced][3] and calls.events[parent_synced][3]  # directories
    files = [f for f in final.iterdir() if f.name != MANIFEST_FILE]
    assert {META_FILE, ".metadata"} <= {f.name for f in files}, files
    for file in files:
        # .metadata is written as .metadata.tmp, synced, then renamed.
        synced = [
            i
            for i, e in enumerate(calls.events[:manifest_synced])
            if e[0] == "fsync" and e[1] in (staging / file.name, staging / f"{file.name}.tmp")
        ]
        assert synced, f"{file.name} was not synced before the manifest: {calls.events}"
        size = calls.events[synced[-1]][2]
        assert size == file.stat().st_size, f"{file.name}: {size} bytes in the kernel when synced"


@pytest.mark.parametrize("single_file_per_rank", [True, False], ids=["per-rank", "per-item"])
@pytest.mark.parametrize("thread_count", [1, 4])
def test_every_file_is_whole_and_synced_before_the_manifest(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    thread_count: int,
    single_file_per_rank: bool,
) -> None:
    """For 1 and 4 writer threads and both of DCP's file layouts, a first save, an overwrite
    (one exchange) and an overwrite with the two-rename fallback each sync every file of the
    checkpoint (``meta.pt`` and ``.metadata`` included) at its final size before the
    manifest, the staging directory after the manifest's rename, and the parent directory
    after the checkpoint's rename. Without the flush before the sync, the shards' tails are
    still in Python's buffer (a shard's size at its sync is short of its final size)."""

    def writer(path: Any) -> ChecksummingFileSystemWriter:
        return ChecksummingFileSystemWriter(
            path, thread_count=thread_count, single_file_per_rank=single_file_per_rank
        )

    path = tmp_path / "step.ckpt"
    plugin = MegatronFSDPCheckpointIO(storage_writer_factory=writer)
    for exchange in (True, True, False):
        with monkeypatch.context() as patch:
            patch.setattr(commit, "_USE_RENAME_EXCHANGE", exchange)
            calls = _Syscalls(patch)
            plugin.save_checkpoint(_state(), path)
        _check_order(calls, path)
    shards = [file.name for file in path.iterdir() if file.name.endswith(".distcp")]
    if single_file_per_rank:  # one file per writer thread
        assert len(shards) == thread_count, shards
    else:  # one file per item
        assert len(shards) == len(_state()["state_dict"]), shards
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no hidden directory left


@pytest.mark.parametrize("directory", ["staging", "parent"])
def test_a_failing_directory_sync_fails_the_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, directory: str
) -> None:
    """``EIO`` from a directory's fsync fails the save, never silently: before the rename
    the previous checkpoint stays in place; after it, the new one is in place and the
    previous one is kept beside it until the next save. ``EINVAL`` (a filesystem that
    cannot sync directories) is tolerated."""
    path = tmp_path / "step.ckpt"
    plugin = MegatronFSDPCheckpointIO()
    plugin.save_checkpoint({**_state(), "global_step": 1}, path)
    parent = _real(tmp_path)

    def failing(code: int) -> Callable[[Path], int | None]:
        def fail(synced: Path) -> int | None:
            if directory == "parent":
                return code if synced == parent else None
            return code if synced.name.startswith(f".{path.name}.tmp-") else None

        return fail

    with monkeypatch.context() as patch:
        _Syscalls(patch, failing(errno.EINVAL))
        plugin.save_checkpoint({**_state(), "global_step": 2}, path)
    assert read_manifest(path).global_step == 2
    with monkeypatch.context() as patch:
        calls = _Syscalls(patch, failing(errno.EIO))
        with pytest.raises(
            CheckpointSaveError, match=r"failed while committing: .*\[Errno 5\]"
        ) as raised:
            plugin.save_checkpoint({**_state(), "global_step": 3}, path)
    assert any(e[0] == "fsync" and e[3] for e in calls.events)
    hidden = [p for p in tmp_path.iterdir() if p.name != path.name]
    if directory == "staging":
        assert read_manifest(path).global_step == 2  # the rename never happened
        assert hidden == [], hidden
    else:
        assert "holds the new checkpoint, but syncing its directory" in str(raised.value)
        assert read_manifest(path).global_step == 3
        (previous,) = hidden
        assert previous.name.startswith(f".{path.name}.old-"), previous
        assert read_manifest(previous).global_step == 2
    plugin.save_checkpoint({**_state(), "global_step": 4}, path)  # the filesystem is back
    assert [p.name for p in tmp_path.iterdir()] == [path.name]
