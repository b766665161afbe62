"""``MegatronFSDPCheckpointIO``: the Lightning plugin over the checkpoint protocol.

Lightning's default checkpoint plugin ``torch.save``\\ s one dict from rank 0, which would
need every sharded parameter gathered onto one rank. This plugin keeps Lightning's small
surface (save, load, remove, teardown) and hands each call to the protocol's phases:
:mod:`~lightning_megatron_fsdp.checkpoint.save`, :mod:`~lightning_megatron_fsdp.checkpoint.load`
and :mod:`~lightning_megatron_fsdp.storage.commit`. It owns what outlives one call: the
options, the async save's thread, gloo group and CPU copies (docs/DESIGN.md, "Async save").
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import sys
import threading
from collections.abc import Callable, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from typing_extensions import override

from lightning_megatron_fsdp import _torch
from lightning_megatron_fsdp.agreement import PeerLostError, Ranks, describe
from lightning_megatron_fsdp.checkpoint.copies import StagingBuffers
from lightning_megatron_fsdp.checkpoint.load import (
    LoadOptions,
    StorageReaderFactory,
    open_checkpoint,
    read_checkpoint,
)
from lightning_megatron_fsdp.checkpoint.save import (
    PendingSave,
    SaveOptions,
    StorageWriterFactory,
    begin_save,
    commit_save,
    write_save,
)
from lightning_megatron_fsdp.errors import (
    CheckpointCorruptedError,
    CheckpointError,
    CheckpointMismatchError,
    CheckpointSaveError,
    NotACheckpointError,
)
from lightning_megatron_fsdp.storage import (
    CheckpointStorage,
    CheckpointStore,
    ChecksummingFileSystemWriter,
    LocalDirectories,
    LocationStorage,
    ObjectStores,
    VerifyingFileSystemReader,
    is_complete_checkpoint,
    read_manifest,
    resolve_latest_checkpoint,
)

__all__ = [
    "CheckpointCorruptedError",
    "CheckpointError",
    "CheckpointMismatchError",
    "CheckpointSaveError",
    "ChecksummingFileSystemWriter",
    "MegatronFSDPCheckpointIO",
    "NotACheckpointError",
    "StorageReaderFactory",
    "StorageWriterFactory",
    "VerifyingFileSystemReader",
    "is_complete_checkpoint",
    "read_manifest",
    "resolve_latest_checkpoint",
]

_BACKGROUND_NICE = 10
"""Nice increment of the async-save thread (Linux: per thread). Training keeps the core
when both want it; the save still progresses (weight 110 against 1024 under CFS)."""


def _lower_thread_priority() -> None:
    """Lower the calling thread's CPU priority by :data:`_BACKGROUND_NICE` where the OS
    allows it per thread (Linux; no privilege needed); elsewhere a no-op."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            tid = threading.get_native_id()
            os.setpriority(
                os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + _BACKGROUND_NICE
            )


class MegatronFSDPCheckpointIO(CheckpointIO):
    """Lightning checkpoint plugin that saves and loads Megatron-FSDP state with DCP.

    ``save_checkpoint`` and ``load_checkpoint`` are collective: every rank of the process
    group calls them with the same path, from the thread that runs training (do not wrap
    this plugin in Lightning's ``AsyncCheckpointIO``, whose thread would interleave our
    collectives with training's; use ``async_save=True``). ``remove_checkpoint`` is not
    collective: Lightning calls it on rank 0 only, and only global rank 0 touches the
    filesystem. The caller attaches the ``uneven_dtensor`` chunk hooks to every
    Megatron-FSDP DTensor it passes (``MegatronFSDPStrategy`` does).

    Args:
        async_save: Write in the background (``dcp.save`` on a thread of lowered CPU
            priority); ``save_checkpoint`` returns once the shards are copied to CPU
            memory, into the previous async save's copy (held until :meth:`teardown`:
            one CPU copy of the rank's state). At most one save is in flight; its error
            surfaces at the next ``save_checkpoint``, ``load_checkpoint``, :meth:`wait`,
            :meth:`poll` (``MegatronFSDPStrategy`` polls before every training batch) or
            :meth:`teardown`.
        verify_checksums: On load, check ``meta.pt`` and ``.metadata`` against their
            CRC32C before DCP plans, and every record against its CRC32C as it is read
            (records no rank reads are not checked; ``inspect --verify`` checks every
            byte). Records without a CRC32C of their own (format-1 checkpoints, files of
            another writer): each rank checks every file it reads, whole, before any rank
            reads a record. With a reader other than a :class:`VerifyingFileSystemReader`:
            every file before reading, split across ranks. Sizes are always checked;
            without checksums a flipped bit in tensor data loads silently.
        write_checksums: On save, record the CRC32C of every record (in ``.metadata``)
            and of every file (in the manifest), computed as the bytes are written; no
            file is read back. Sizes are always recorded.
        process_group: Group of the ranks that save and load together; the default group
            when ``None``. Its timeout bounds every collective of a save or load.
        storage_writer_factory: Builds the DCP writer for a save from the hidden directory
            it must write into; a :class:`ChecksummingFileSystemWriter` when ``None``. It
            must write DCP's file names (``__<rank>_<n>.distcp``, ``.metadata``) into that
            directory. Files another writer wrote are read back to hash them.
        thread_count: Writer threads per rank for the default writer.
        storage_reader_factory: Builds the DCP reader for a load from the checkpoint
            directory; a :class:`VerifyingFileSystemReader` when ``None``.
        atomic_load: ``False`` (default): read each record straight into its target.
            Every check that needs no tensor bytes (manifest, sizes, fingerprint,
            ``meta.pt``, ``.metadata``) passes on every rank before any rank writes into
            a target; a failure after that (a record failing its CRC32C, an I/O error, a
            lost peer) raises on every rank saying how many records each rank had
            written, and the rest keep their previous values. ``True``: read into CPU
            copies of the targets and write them into the targets only once every rank
            has read all its data, so any failure leaves the model and optimizers as they
            were, for one more CPU copy of this rank's shards during the load.
        trust_checkpoint: Unpickle the checkpoint's pickles in full: ``.metadata``, DCP
            byte records, and ``meta.pt`` unless ``weights_only`` is given. By default
            nothing from a checkpoint runs (an allow-list unpickler and
            ``weights_only=True``) and every file is opened confined to its directory.
        storage_options: Options of the fsspec filesystem of a URL path (``s3://...``,
            ``gs://...``), passed to its constructor (for s3fs: ``endpoint_url``, ``key``,
            ``secret``, ``client_kwargs``, ...). Without them the filesystem's own
            configuration applies (for S3 the standard ``AWS_*`` variables and files).
            A URL is never a local directory: one whose filesystem is not installed
            fails naming what to install (``pip install 'lightning-megatron-fsdp[s3]'``).

    Raises:
        TypeError: If an option has the wrong type.
        ValueError: If ``thread_count`` is below 1.
    """

    def __init__(
        self,
        *,
        async_save: bool = False,
        verify_checksums: bool = True,
        write_checksums: bool = True,
        process_group: dist.ProcessGroup | None = None,
        storage_writer_factory: StorageWriterFactory | None = None,
        thread_count: int = 1,
        storage_reader_factory: StorageReaderFactory | None = None,
        atomic_load: bool = False,
        trust_checkpoint: bool = False,
        storage_options: Mapping[str, Any] | None = None,
    ) -> None:
        for name, value in (
            ("async_save", async_save),
            ("verify_checksums", verify_checksums),
            ("write_checksums", write_checksums),
            ("atomic_load", atomic_load),
            ("trust_checkpoint", trust_checkpoint),
        ):
            if not isinstance(value, bool):
                raise TypeError(f"MegatronFSDPCheckpointIO: {name} must be a bool, got {value!r}.")
        if storage_writer_factory is not None and not callable(storage_writer_factory):
            raise TypeError(
                "MegatronFSDPCheckpointIO: storage_writer_factory must be a callable "
                f"Path -> StorageWriter, got {storage_writer_factory!r}."
            )
        if storage_reader_factory is not None and not callable(storage_reader_factory):
            raise TypeError(
                "MegatronFSDPCheckpointIO: storage_reader_factory must be a callable "
                f"Path -> StorageReader, got {storage_reader_factory!r}."
            )
        if not isinstance(thread_count, int) or isinstance(thread_count, bool):
            raise TypeError(
                f"MegatronFSDPCheckpointIO: thread_count must be an int, got {thread_count!r}."
            )
        if thread_count < 1:
            raise ValueError(
                f"MegatronFSDPCheckpointIO: thread_count must be >= 1, got {thread_count}."
            )
        if storage_options is not None and not isinstance(storage_options, Mapping):
            raise TypeError(
                "MegatronFSDPCheckpointIO: storage_options must be a mapping of fsspec "
                f"filesystem options (e.g. {{'endpoint_url': ...}}), got {storage_options!r:.200}."
            )
        self.async_save = async_save
        self.verify_checksums = verify_checksums
        self.write_checksums = write_checksums
        self.process_group = process_group
        self.storage_writer_factory = storage_writer_factory
        self.thread_count = thread_count
        self.storage_reader_factory = storage_reader_factory
        self.atomic_load = atomic_load
        self.trust_checkpoint = trust_checkpoint
        self._in_flight: concurrent.futures.Future[None] | None = None
        self._in_flight_path: Path | None = None
        self._committer: concurrent.futures.ThreadPoolExecutor | None = None
        self._background_group: dist.ProcessGroup | None = None
        self._copies = StagingBuffers()  # the async save's CPU copies, reused
        self.storage_options = dict(storage_options or {})
        self.store: CheckpointStore = ObjectStores(
            LocalDirectories(), self.storage_options, group_timeout=self._group_timeout
        )
        self.storage: CheckpointStorage = LocationStorage()  # the location's writer and reader

    def _group_timeout(self) -> timedelta | None:
        """The timeout of the group that saves and loads (``None`` without one): bounds
        each request to an object store (``ObjectStores``)."""
        return Ranks.of(self.process_group).timeout

    @property
    def load_options(self) -> LoadOptions:
        """How this plugin loads (the strategy's load path reads it)."""
        return LoadOptions(
            store=self.store,
            storage=self.storage,
            verify_checksums=self.verify_checksums,
            atomic_load=self.atomic_load,
            reader_factory=self.storage_reader_factory,
            trust_checkpoint=self.trust_checkpoint,
        )

    # ----------------------------------------------------------------------------- save

    @override
    def save_checkpoint(
        self,
        checkpoint: dict[str, Any],
        path: str | os.PathLike[str],
        storage_options: Any = None,
        *,
        prepare: Callable[[], None] | None = None,
    ) -> None:
        """Save ``checkpoint`` as a directory at ``path``, atomically. Collective.

        Args:
            checkpoint: Lightning's checkpoint dict: ``"state_dict"`` (FQN -> DTensor or
                tensor, chunk hooks attached), optional ``"optimizer_states"`` (a list of
                FQN-keyed optimizer state dicts) and any picklable rest.
            path: Final path of the checkpoint directory; the same on every rank.
            storage_options: ``None``, or ``{"storage_writer_factory": factory}`` to
                override the plugin's writer for this save.
            prepare: Rank-local work to run before the ranks agree (the strategy attaches
                chunk metadata here); its failure on one rank fails the save on every rank
                in the same round.

        Raises:
            CheckpointSaveError: On every rank, naming the failing rank(s), if any rank
                fails; the previous checkpoint at ``path`` (if any) is left as it was.
                With ``async_save``, also the error of the previous background save.
        """
        self.wait()
        ranks = Ranks.of(self.process_group)
        try:
            factory, bad_options = self._writer_factory(storage_options), None
        except TypeError as err:  # agreed on like any rank-local failure
            factory, bad_options = None, err

        def prepare_all() -> None:
            if bad_options is not None:
                raise bad_options
            if prepare is not None:
                prepare()

        options = SaveOptions(
            store=self.store,
            storage=self.storage,
            write_checksums=self.write_checksums,
            thread_count=self.thread_count,
            writer_factory=factory or self.storage_writer_factory,
        )
        try:
            pending = begin_save(
                checkpoint,
                path,
                ranks,
                options,
                prepare=prepare_all,
                copies=self._copies if self.async_save else None,
            )
        except PeerLostError as err:
            raise CheckpointSaveError(
                f"Saving checkpoint {path} failed before any tensor was written: {err}. The "
                "previous checkpoint there, if any, is untouched."
            ) from err
        if not self.async_save:
            commit_save(pending, write_save(pending, ranks), ranks)
            return
        try:
            background = self._background_ranks(ranks)
        except Exception as err:
            if ranks.rank == 0:
                options.store.discard(pending.final, pending.token)
            raise CheckpointSaveError(
                f"Saving checkpoint {pending.final} failed starting the background save on rank "
                f"{ranks.rank}: {describe(err)}. The previous checkpoint there, if any, is "
                "untouched."
            ) from err
        if self._committer is None:
            self._committer = concurrent.futures.ThreadPoolExecutor(
                max_workers=1,
                thread_name_prefix="lmf-checkpoint-save",
                initializer=_lower_thread_priority,
            )
        # The current CUDA device is per thread (a new thread's is device 0). The writer's
        # copy-ahead loader (torch's) syncs a stream of the current device: on a rank whose
        # device is another, that would create a second CUDA context, on device 0.
        device = torch.cuda.current_device() if torch.cuda.is_initialized() else None
        self._in_flight = self._committer.submit(
            self._finish_background, pending, background, device
        )
        self._in_flight_path = pending.final

    @staticmethod
    def _finish_background(pending: PendingSave, ranks: Ranks, cuda_device: int | None) -> None:
        """The background thread's part: DCP's write over the background group, the commit,
        with ``cuda_device`` (the training thread's) as the thread's current CUDA device."""
        with contextlib.nullcontext() if cuda_device is None else torch.cuda.device(cuda_device):
            commit_save(pending, write_save(pending, ranks), ranks)

    def _writer_factory(self, storage_options: Any) -> StorageWriterFactory | None:
        if storage_options is None:
            return self.storage_writer_factory
        if (
            not isinstance(storage_options, Mapping)
            or set(storage_options) != {"storage_writer_factory"}
            or not callable(storage_options["storage_writer_factory"])
        ):
            raise TypeError(
                "MegatronFSDPCheckpointIO.save_checkpoint: storage_options must be None or "
                "{'storage_writer_factory': callable(Path) -> StorageWriter}, got "
                f"{storage_options!r:.200}."
            )
        return storage_options["storage_writer_factory"]

    def _background_ranks(self, ranks: Ranks) -> Ranks:
        """A gloo group of the same ranks for the background thread's collectives.

        Its own group, even when the default group is gloo already: collectives issued
        from two threads on one group are matched by issue order, which differs per rank.
        Created once, on the first async save (collective: every rank is here).
        """
        if ranks.group is None:
            return ranks
        if self._background_group is None:
            members = dist.get_process_group_ranks(ranks.group)
            self._background_group = dist.new_group(
                ranks=members,
                backend="gloo",
                timeout=_torch.group_timeout(ranks.group),
                use_local_synchronization=len(members) != dist.get_world_size(),
            )
        return Ranks(self._background_group, ranks.rank, ranks.world_size)

    # ----------------------------------------------------------------------------- async

    def wait(self) -> None:
        """Block until the in-flight background save (if any) is committed.

        Raises:
            CheckpointSaveError: If that save failed (reported once).
        """
        future, self._in_flight = self._in_flight, None
        if future is not None:
            future.result()

    def poll(self) -> bool:
        """Return whether no save is in flight, without blocking; cheap enough per step.

        Rank-local: ranks may observe completion a step apart. A failure is reported to
        every rank by the commit, so each rank raises it at its next ``poll``; a rank that
        is already in the next collective then fails by the process group's timeout.

        Raises:
            CheckpointSaveError: If the background save finished and failed (reported once).
        """
        if self._in_flight is None:
            return True
        if not self._in_flight.done():
            return False
        self.wait()
        return True

    @override
    def teardown(self) -> None:
        """Wait for the last background save and stop the commit thread.

        Raises:
            CheckpointSaveError: If that save failed.
        """
        try:
            self.wait()
        finally:
            self._copies.release()
            if self._committer is not None:
                self._committer.shutdown(wait=True)
                self._committer = None
            # The background group and thread belong to this stage (the default group lives
            # on); a later stage's first async save builds fresh ones.
            group, self._background_group = self._background_group, None
            if group is not None and dist.is_initialized():
                with contextlib.suppress(Exception):
                    dist.destroy_process_group(group)

    @override
    def load_checkpoint(
        self,
        path: str | os.PathLike[str],
        map_location: Any = "cpu",
        weights_only: bool | None = None,
        *,
        state: dict[str, Any] | None = None,
        strict: bool = True,
    ) -> dict[str, Any]:
        """Validate the checkpoint at ``path`` against ``state``, then load into it. Collective.

        Args:
            path: The checkpoint directory; the same on every rank. If a crash left it
                renamed aside (see the module docstring), it is restored first.
            map_location: ``torch.load``'s ``map_location`` for ``meta.pt``; CPU by
                default, as Lightning's ``TorchCheckpointIO`` (``None``: where they were
                saved, rank 0's device).
            weights_only: For ``meta.pt``; ``None``: ``not trust_checkpoint``.
            state: Targets, filled in place: ``{"state_dict": model_sd}`` plus
                ``"optimizer_states": [osd, ...]`` unless loading weights only. ``None``
                reads only the non-tensor part.
            strict: Refuse target keys missing from the checkpoint and checkpoint keys
                missing from the target. ``False`` leaves missing target keys at their
                current values and ignores extra checkpoint keys; shapes and dtypes of
                keys on both sides must agree either way.

        Returns:
            The non-tensor part of the checkpoint, plus ``"state_dict"`` and (unless
            weights only) ``"optimizer_states"``: the filled targets.

        Raises:
            NotACheckpointError: ``path`` is not a complete checkpoint directory.
            CheckpointCorruptedError: Files are missing or truncated, or a file or record
                fails its checksum.
            CheckpointMismatchError: The fingerprint differs from the targets; the message
                lists every missing, unexpected, reshaped and retyped key.
            TypeError: ``state`` is malformed.
            CheckpointError: ``meta.pt`` cannot be unpickled (for example with
                ``weights_only=True``); or DCP failed reading, naming the failing
                rank(s); or a peer was lost.
            All of these are raised on every rank together. Every failure found before
            DCP reads tensor data (everything above except a record's checksum, an I/O
            error or a lost peer while reading) leaves every target unchanged; a later
            one leaves them unchanged with ``atomic_load=True``, and otherwise says what
            each rank had already written into them.
        """
        self.wait()
        self.store.location(path)  # a URL whose filesystem is missing fails on every rank
        ranks = Ranks.of(self.process_group)
        options = self.load_options
        # Without targets nothing reads .metadata: rank 0 need not either.
        opened = open_checkpoint(path, ranks, options.store, options if state is not None else None)
        return read_checkpoint(
            opened,
            state,
            ranks,
            options,
            map_location=map_location,
            weights_only=weights_only,
            strict=strict,
        )

    # ----------------------------------------------------------------------------- remove

    @override
    def remove_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Delete a checkpoint directory; a missing path is not an error. Not collective.

        The directory is first renamed to a hidden ``.<name>.del-<token>``, so a crash
        halfway through the deletion never leaves a damaged checkpoint under its name. On
        an object store each version's manifest goes first, and the only complete
        checkpoint under its prefix is kept (with a warning).
        A symbolic link is unlinked, its target kept. Only global rank 0 acts (Lightning
        calls this on rank 0 only).

        Raises:
            CheckpointError: If ``path`` is not one of our checkpoints (a directory with a
                manifest) or hidden directories: nothing else is deleted.
        """
        if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
            return
        target = self.store.location(path)
        if self._in_flight is not None and self.store.removal_waits(target, self._in_flight_path):
            # Let the background save commit first where the store says so (a save of
            # this checkpoint would re-create it; an object store keeps the only complete
            # checkpoint). Its error stays for wait()/poll(): every rank must see it there.
            concurrent.futures.wait([self._in_flight])
        self.store.remove(target)
