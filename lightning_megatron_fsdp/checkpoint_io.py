"""``MegatronFSDPCheckpointIO``: sharded, atomic, verified checkpoints for Megatron-FSDP.

Problem: Lightning's default checkpoint plugin ``torch.save``\\ s one dict from rank 0,
which would need every sharded parameter gathered onto one rank; and a checkpoint written
by many ranks can be half written, overwritten halfway, or loaded into a model it does not
fit, and DCP only notices the last of these while it is already reading tensor data.

How (the format is in :mod:`lightning_megatron_fsdp.manifest` and docs/DESIGN.md):

* Save. Before anything is written, the ranks agree on what they save: each sends a
  digest of its state's layout (every key, every tensor's global shape and dtype), so a
  rank whose model or optimizer state differs fails the save on every rank instead of
  writing a checkpoint no rank can load. Every rank then writes only its own shards with
  DCP (the chunk hooks of ``uneven_dtensor`` put each packed shard at its true offset);
  rank 0 writes the non-tensor rest of Lightning's dict to ``meta.pt``. All of it goes
  into a hidden sibling ``.<name>.tmp-<token>``. The writer
  (:class:`~lightning_megatron_fsdp.dcp_storage.ChecksummingFileSystemWriter`) CRC32Cs
  every record as its bytes go out. Once DCP returns, every rank's data and ``.metadata``
  are on disk (DCP's final step gathers every rank's write result before rank 0 writes
  ``.metadata``); rank 0 gathers each rank's file sizes and CRC32Cs, writes
  ``manifest.json`` last and commits: one atomic ``renameat2(RENAME_EXCHANGE)`` of the
  hidden directory with ``<name>`` (two renames where the filesystem refuses it; a crash
  between them is repaired by :func:`~lightning_megatron_fsdp.manifest.recover_checkpoint`),
  then the previous checkpoint and stale hidden siblings are deleted (docs/DESIGN.md,
  "Commit"). ``<name>`` therefore always holds a complete checkpoint, the previous one or
  the new one. Rank 0 broadcasts the outcome, so every rank returns or raises together.
* Load. Before any tensor is read, every rank checks the manifest, file sizes, the
  layout fingerprint against the targets, and reads and verifies ``meta.pt``; the ranks
  all-gather their problems and raise the same error. ``dcp.load`` then reads with a
  :class:`~lightning_megatron_fsdp.dcp_storage.VerifyingFileSystemReader`: ``.metadata``
  verified before DCP plans, each record read straight into its target and CRC32C-checked
  (format-1 sha256 checkpoints: file by file, first). A failure after the first write
  raises on every rank naming what each rank had written (docs/DESIGN.md, "Atomic load");
  ``atomic_load=True`` reads into CPU copies first, so any failure leaves every target as
  it was, for one more copy of the rank's shards in memory. DCP reshards by global offset.
* Async save. Each rank copies its shards to CPU memory itself (DCP's ``DefaultStager``
  fails on packed shards, see :func:`_stage`), into the previous async save's copies
  (:class:`_StagingBuffers`), keeping the chunk hooks; one background thread of lowered
  CPU priority runs ``dcp.save`` on them over a dedicated gloo group and commits as above.
  ``dcp.async_save`` rejected: docs/DESIGN.md, "Async save" (thread and process kinds).
* Lost peers. A rank that dies (or hangs) makes its peers' next collective fail (at the
  latest after the process group's timeout); every collective of a save or load turns
  that into a :class:`CheckpointSaveError` / :class:`CheckpointError` naming the phase,
  and the hidden directory never becomes a checkpoint.

Alternatives rejected:
    * A marker file instead of renames: a reader must know to look for it, and Lightning's
      ``last*`` lookup and ``os.path.exists`` checks do not.
    * Hashing the files after writing and again before loading (format 1): two extra
      passes over every byte.
    * Verifying every file before loading so that a corrupt record never reaches a target:
      one more full read of the checkpoint; ``atomic_load=True`` gives the stronger
      guarantee for memory instead.
    * Committing from DCP's ``finish`` on rank 0: it runs before the other ranks have
      hashed their files, and a failure there is not reported to the other ranks.
    * Restoring a snapshot after a failed in-place load: the copy ``atomic_load=True``
      costs, and a rank that dies mid-read cannot restore anything.
    * Comparing the ranks' full fingerprints on every save: a digest per rank suffices;
      the full lists are gathered only to explain a mismatch.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import hashlib
import io
import json
import logging
import os
import posixpath
import re
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter
from typing_extensions import override

from lightning_megatron_fsdp.agreement import (
    LOST_PEER_HINT,
    PeerLostError,
    Ranks,
    dcp_failure_message,
    describe,
)
from lightning_megatron_fsdp.checkpoint_parts import (
    _exchange,
    _fill,
    _layout_disagreement,
    _layout_summary,
    _lower_thread_priority,
    _SaveJob,
    _split_checkpoint,
    _stage,
    _StagingBuffers,
    _timeout_of,
    _versions,
    _write_meta,
)
from lightning_megatron_fsdp.checksums import bytes_digest, crc32c_hex, file_digest, stream_digest
from lightning_megatron_fsdp.dcp_storage import (
    ChecksummingFileSystemWriter,
    VerifyingFileSystemReader,
)
from lightning_megatron_fsdp.fsspec_storage import ChecksummingFsspecWriter, VerifyingFsspecReader
from lightning_megatron_fsdp.load_checks import (
    _LOAD_ERRORS,
    _aftermath,
    _fingerprint_problems,
    _state_shape_error,
    agree_before_reading,
)
from lightning_megatron_fsdp.manifest import (
    ASIDE,
    DCP_METADATA_FILE,
    DELETING,
    MANIFEST_FILE,
    META_FILE,
    STAGING,
    CheckpointCorruptedError,
    CheckpointError,
    CheckpointMismatchError,
    CheckpointSaveError,
    FileRecord,
    Manifest,
    NotACheckpointError,
    check_files,
    check_replaceable,
    finite_int_or_none,
    fsync_path,
    hidden_path,
    is_complete_checkpoint,
    mesh_info,
    model_fingerprint,
    optimizer_fingerprint,
    parse_hidden_name,
    read_manifest,
    recover_checkpoint,
    remove_tree,
    report_interrupted_saves,
    resolve_latest_checkpoint,
)
from lightning_megatron_fsdp.object_store import StoreCheckpoint, is_url, local_path, open_store

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

log = logging.getLogger(__name__)

StorageWriterFactory = Callable[[Path], StorageWriter]
"""Builds the DCP writer for a save, given the hidden directory it must write into."""

StorageReaderFactory = Callable[[Path], StorageReader]
"""Builds the DCP reader for a load, given the checkpoint directory."""

# DCP's FileSystemWriter names rank r's files __<r>_<n>.distcp.
_DISTCP_RE = r"__{rank}_\d+\.distcp"
_FAULT_HOOK: Callable[[str], None] | None = None
"""Test seam: when set, called with the name of each commit step as it is reached.

Fault-injection tests raise or kill the process at one commit step (no ``StorageWriter``
reaches those). Points, in order: ``"commit:hashed"`` (every rank, its files' sizes and digests
collected, before the gather), ``"commit:manifest"`` (rank 0, before writing ``manifest.json``),
``"commit:publish"`` (rank 0, manifest written, before the rename), ``"commit:aside"``
(rank 0, two-rename fallback only: the previous checkpoint renamed aside, the new one not
yet in place) and ``"commit:replaced"`` (rank 0, the new checkpoint in place, the previous
one not yet deleted). ``None`` in production.
"""

_USE_RENAME_EXCHANGE = True
"""Commit with one ``renameat2(RENAME_EXCHANGE)`` where the OS supports it; tests set this
to ``False`` to exercise the two-rename fallback that other systems use."""


def _fault(point: str) -> None:
    if _FAULT_HOOK is not None:
        _FAULT_HOOK(point)


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
            :meth:`poll` or :meth:`teardown`.
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
        storage_options: Options of the fsspec filesystem of a URL path (``s3://...``,
            ``gs://...``): passed to its constructor (for s3fs: ``endpoint_url``, ``key``,
            ``secret``, ``client_kwargs``, ...); the filesystem's own configuration (for S3
            the ``AWS_*`` variables) applies without them. Local paths ignore them.

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
        storage_options: Mapping[str, Any] | None = None,
    ) -> None:
        for name, value in (
            ("async_save", async_save),
            ("verify_checksums", verify_checksums),
            ("write_checksums", write_checksums),
            ("atomic_load", atomic_load),
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
        self.storage_options = dict(storage_options or {})
        self.async_save = async_save
        self.verify_checksums = verify_checksums
        self.write_checksums = write_checksums
        self.process_group = process_group
        self.storage_writer_factory = storage_writer_factory
        self.thread_count = thread_count
        self.storage_reader_factory = storage_reader_factory
        self.atomic_load = atomic_load
        self._in_flight: concurrent.futures.Future[None] | None = None
        self._in_flight_path: Path | None = None
        self._committer: concurrent.futures.ThreadPoolExecutor | None = None
        self._background_group: dist.ProcessGroup | None = None
        self._staging = _StagingBuffers()  # the async save's CPU copies, reused

    # ----------------------------------------------------------------------------- save

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: str | os.PathLike[str], storage_options: Any = None
    ) -> None:
        """Save ``checkpoint`` as a directory at ``path``, atomically. Collective.

        Args:
            checkpoint: Lightning's checkpoint dict: ``"state_dict"`` (FQN -> DTensor or
                tensor, chunk hooks attached), optional ``"optimizer_states"`` (a list of
                FQN-keyed optimizer state dicts) and any picklable rest.
            path: Final path of the checkpoint directory; the same on every rank.
            storage_options: ``None``, or ``{"storage_writer_factory": factory}`` to
                override the plugin's writer for this save.

        Raises:
            CheckpointSaveError: On every rank, naming the failing rank(s), if any rank
                fails; the previous checkpoint at ``path`` (if any) is left as it was.
                With ``async_save``, also the error of the previous background save.
        """
        self.wait()
        comm = Ranks.of(self.process_group)
        final = self._location(path)
        try:
            job, tensors, writer = self._prepare_save(checkpoint, final, storage_options, comm)
        except PeerLostError as err:
            raise CheckpointSaveError(
                f"Saving checkpoint {final} failed before any tensor was written: {err}. The "
                "previous checkpoint there, if any, is untouched."
            ) from err
        if not self.async_save:
            metadata = self._run_dcp_save(
                job,
                comm,
                lambda: dcp.save(tensors, storage_writer=writer, process_group=comm.group),
            )
            self._commit(job, metadata, comm, writer)
            return
        try:
            background = self._background_comm(comm)
        except Exception as err:
            self._discard(final, job.staging, comm)
            raise CheckpointSaveError(
                f"Saving checkpoint {final} failed starting the background save on rank "
                f"{comm.rank}: {describe(err)}. The previous checkpoint there, if any, is "
                "untouched."
            ) from err
        if self._committer is None:
            self._committer = concurrent.futures.ThreadPoolExecutor(
                max_workers=1,
                thread_name_prefix="lmf-checkpoint-save",
                initializer=_lower_thread_priority,
            )
        self._in_flight = self._committer.submit(
            self._finish_background, job, tensors, background, writer
        )
        self._in_flight_path = final

    def _prepare_save(
        self, checkpoint: Any, final: Path, storage_options: Any, comm: Ranks
    ) -> tuple[_SaveJob, dict[str, Any], StorageWriter]:
        """Check and set up a save on every rank; all ranks go on, or all raise.

        Every check that can fail on one rank (the checkpoint's shape, the options, the
        target name, rank 0's ``meta.pt``, the ranks agreeing on the layout) runs before
        one gather of the outcome, so no rank enters DCP's collectives alone.

        Raises:
            CheckpointSaveError: Naming each failing rank and its error, or the ranks
                whose state differs from rank 0's; rank 0's hidden directory is removed.
            PeerLostError: If a peer is gone.
        """
        # Agree on the staging location first: a hidden directory, or the next version's prefix.
        token, staging, error = comm.broadcast_from_first(
            self._plan_staging(final) if comm.rank == 0 else None
        )
        if error is not None:
            raise CheckpointSaveError(
                f"Saving checkpoint {final} failed before anything was written, on rank 0: {error}"
            )
        store = final.store if isinstance(final, StoreCheckpoint) else None
        job = writer = None
        tensors: dict[str, Any] = {}
        error: str | None = None
        digest: str | None = None
        try:
            tensors, meta = _split_checkpoint(checkpoint)
            layout = _layout_summary(tensors)
            digest = hashlib.sha256(json.dumps(layout, sort_keys=True).encode()).hexdigest()
            job = _SaveJob(
                final,
                staging,
                token,
                self.write_checksums,
                self._manifest_fields(checkpoint, tensors, comm),
                store=store,
            )
            if comm.rank == 0:
                if store is None:
                    check_replaceable(final)
                    job.staging.mkdir(parents=True)
                job.written[META_FILE] = _write_meta(job.file(META_FILE), meta, job)
            factory = self._writer_factory(storage_options)
            writer = factory(job.staging) if factory else self._default_writer(job)
            if self.async_save:
                tensors = self._staging.stage(tensors)
        except Exception as err:
            error = f"rank {comm.rank}: {describe(err)}"
        try:
            gathered = comm.all_gather((error, digest))
            errors = [e for e, _ in gathered if e is not None]
            if not errors and len({d for _, d in gathered}) > 1:
                # Rare and fatal: now gather the full layouts to say exactly what differs.
                layouts = comm.all_gather(_layout_summary(tensors))
                errors = _layout_disagreement(layouts)
        except PeerLostError:
            self._discard(final, staging, comm)
            raise
        if errors:
            self._discard(final, staging, comm)
            raise CheckpointSaveError(
                f"Saving checkpoint {final} failed before any tensor was written; the "
                "previous checkpoint there, if any, is untouched:\n  " + "\n  ".join(errors)
            )
        assert job is not None and writer is not None
        return job, tensors, writer

    def _location(self, path: str | os.PathLike[str]) -> Path | StoreCheckpoint:
        """A local checkpoint directory (absolute), or a checkpoint on an object store for
        a URL (never a local directory named ``s3:``)."""
        if is_url(path):
            store, inside = open_store(os.fspath(path), self.storage_options)
            return StoreCheckpoint(store, inside)
        return Path(os.path.abspath(os.fspath(local_path(path))))

    @staticmethod
    def _plan_staging(final: Path | StoreCheckpoint) -> tuple[str, Any, str | None]:
        """(token, staging location, error) of a new save; rank 0 (on a store it lists)."""
        token = uuid.uuid4().hex
        if not isinstance(final, StoreCheckpoint):
            return token, hidden_path(final, STAGING, token), None
        try:
            version = final.store.new_version(final.path)
        except Exception as err:
            return token, None, describe(err)
        return version.token, version.path, None

    @staticmethod
    def _discard(final: Path | StoreCheckpoint, staging: Any, comm: Ranks) -> None:
        """Rank 0 deletes a save's staging location (every rank may call this); never raises."""
        if comm.rank != 0 or staging is None:
            return
        if isinstance(final, StoreCheckpoint):
            final.store.discard(staging)
            return
        with contextlib.suppress(OSError):
            remove_tree(staging)

    @staticmethod
    def _drop_staging(job: _SaveJob) -> None:
        """Delete what a failed save wrote (rank 0); never raises."""
        if job.store is not None:
            job.store.discard(job.staging)
            return
        with contextlib.suppress(OSError):
            remove_tree(job.staging)

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

    def _default_writer(self, job: _SaveJob) -> StorageWriter:
        if job.store is not None:
            return ChecksummingFsspecWriter(
                job.store,
                job.staging,
                checksum=self.write_checksums,
                thread_count=self.thread_count,
            )
        return ChecksummingFileSystemWriter(
            job.staging, checksum=self.write_checksums, thread_count=self.thread_count
        )

    def _manifest_fields(
        self, checkpoint: Mapping[str, Any], tensors: Mapping[str, Any], comm: Ranks
    ) -> dict[str, Any]:
        return {
            "fingerprint": model_fingerprint(tensors["state_dict"]),
            "optimizer_fingerprints": [
                optimizer_fingerprint(o) for o in tensors.get("optimizer_states", [])
            ],
            "world_size": comm.world_size,
            "mesh": mesh_info(tensors),
            "versions": dict(_versions()),
            "global_step": finite_int_or_none(checkpoint.get("global_step")),
            "epoch": finite_int_or_none(checkpoint.get("epoch")),
        }

    def _background_comm(self, comm: Ranks) -> Ranks:
        """A gloo group of the same ranks for the background thread's collectives.

        Its own group, even when the default group is gloo already: collectives issued
        from two threads on one group are matched by issue order, which differs per rank.
        Created once, on the first async save (collective: every rank is here).
        """
        if comm.group is None:
            return comm
        if self._background_group is None:
            ranks = dist.get_process_group_ranks(comm.group)
            self._background_group = dist.new_group(
                ranks=ranks,
                backend="gloo",
                timeout=_timeout_of(comm.group),
                use_local_synchronization=len(ranks) != dist.get_world_size(),
            )
        return Ranks(self._background_group, comm.rank, comm.world_size)

    def _run_dcp_save(self, job: _SaveJob, comm: Ranks, save: Callable[[], Metadata]) -> Metadata:
        """Run a DCP save, turning its failure into a ``CheckpointSaveError``.

        DCP gathers every rank's failure and raises ``CheckpointException`` (a
        ``BaseException``) on all ranks, after every rank's writes have stopped, so rank 0
        can delete the hidden directory safely.
        """
        try:
            return save()
        except (CheckpointException, Exception) as err:
            if comm.rank == 0:
                self._drop_staging(job)
            message = (
                dcp_failure_message("Saving", job.final, err)
                if isinstance(err, CheckpointException)
                else f"Saving checkpoint {job.final} failed on rank {comm.rank}: {describe(err)}"
                f"\nDCP reports each rank's own errors as one CheckpointException, so this "
                f"error most likely means {LOST_PEER_HINT}."
            )
            raise CheckpointSaveError(
                message + "\nThe previous checkpoint there, if any, is untouched."
            ) from err

    def _finish_background(
        self, job: _SaveJob, tensors: dict[str, Any], comm: Ranks, writer: StorageWriter
    ) -> None:
        """The background thread's whole save: DCP's write over the background group, then
        the commit."""
        metadata = self._run_dcp_save(
            job,
            comm,
            lambda: dcp.save(tensors, storage_writer=writer, process_group=comm.group),
        )
        self._commit(job, metadata, comm, writer)

    def _commit(
        self, job: _SaveJob, metadata: Metadata, comm: Ranks, writer: StorageWriter
    ) -> None:
        """Gather sizes and digests, write the manifest and rename into place; every rank
        learns how it went.

        Raises:
            CheckpointSaveError: On every rank if any rank failed to describe its files or
                rank 0 failed to commit; the hidden directory is then deleted.
        """
        error, records = None, {}
        try:
            records = self._local_records(job, comm.rank, writer)
            _fault("commit:hashed")
        except Exception as err:
            error = f"rank {comm.rank}: {describe(err)}"
        try:
            gathered = comm.all_gather((error, records))
        except PeerLostError as err:
            if comm.rank == 0:
                self._drop_staging(job)
            raise CheckpointSaveError(
                f"Saving checkpoint {job.final} failed before the commit: {err}. The previous "
                "checkpoint there, if any, is untouched."
            ) from err
        outcome = None
        errors = [e for e, _ in gathered if e is not None]
        if errors:
            outcome = "\n  ".join(errors)
            if comm.rank == 0:
                self._drop_staging(job)
        elif comm.rank == 0:
            try:
                files: dict[str, FileRecord] = {}
                for _, rank_records in gathered:
                    files.update(rank_records)
                self._check_claims(job, files, metadata)
                manifest = Manifest(files=files, **job.manifest_fields)
                _fault("commit:manifest")
                self._write_manifest(job, manifest)
                _fault("commit:publish")
                self._publish(job)
            except Exception as err:
                outcome = describe(err)
                self._drop_staging(job)
        try:
            outcome = comm.broadcast_from_first(outcome)
        except PeerLostError as err:
            if comm.rank == 0 and outcome is None:
                raise CheckpointError(
                    f"Checkpoint {job.final} was saved and committed, but the other ranks "
                    f"could not be told: {err}."
                ) from err
            if comm.rank == 0:
                raise CheckpointSaveError(
                    f"Saving checkpoint {job.final} failed while committing: {outcome}\nThe "
                    f"previous checkpoint there, if any, is untouched. Also, {err}."
                ) from err
            raise CheckpointSaveError(
                f"Saving checkpoint {job.final}: contact with rank 0 was lost while it "
                f"committed ({err}). {job.final.name} holds the previous or the new "
                "checkpoint, complete either way (load_checkpoint and "
                "resolve_latest_checkpoint restore it if a crash left it renamed aside); "
                "its manifest's global_step tells which."
            ) from err
        if outcome is not None:
            raise CheckpointSaveError(
                f"Saving checkpoint {job.final} failed while committing: {outcome}\nThe "
                "previous checkpoint there, if any, is untouched."
            )

    @staticmethod
    def _local_records(job: _SaveJob, rank: int, writer: StorageWriter) -> dict[str, FileRecord]:
        """Size and CRC32C of the files this rank wrote: its shards; rank 0 also the rest.

        Taken from the bytes as they were written (:class:`ChecksummingFileSystemWriter`,
        ``meta.pt``); a file written by another writer, or whose size on disk is not what
        was written, is read back and hashed.
        """
        pattern = re.compile(_DISTCP_RE.format(rank=rank))
        stored = _stored_sizes(job)
        names = sorted(n for n in stored if pattern.fullmatch(n))
        if rank == 0:
            names += [DCP_METADATA_FILE, META_FILE]
        hashed = writer.written_files() if isinstance(writer, ChecksummingFileSystemWriter) else {}
        records = {}
        for name in names:
            if name not in stored:
                raise FileNotFoundError(
                    f"{name} is missing from {job.staging} after it was written"
                )
            size = stored[name]
            if not job.write_checksums:
                records[name] = FileRecord(size)
                continue
            known = job.written.get(name)
            if known is None and name in hashed and hashed[name].crc32c is not None:
                known = FileRecord(hashed[name].size, crc32c=crc32c_hex(hashed[name].crc32c))
            if known is not None and known.size == size:
                records[name] = known
            else:
                records[name] = FileRecord(size, crc32c=_stored_digest(job, name))
        return records

    @staticmethod
    def _check_claims(job: _SaveJob, files: Mapping[str, FileRecord], metadata: Metadata) -> None:
        """Every file on disk was claimed by a rank, and every file DCP indexed exists.

        Raises:
            RuntimeError: Otherwise: DCP's file naming changed, or a writer misbehaved.
        """
        on_disk = set(_stored_sizes(job))
        unclaimed = sorted(on_disk - set(files))
        storage = getattr(metadata, "storage_data", None) or {}
        indexed = {
            info.relative_path for info in storage.values() if hasattr(info, "relative_path")
        }
        missing = sorted(indexed - set(files))
        if unclaimed or missing:
            raise RuntimeError(
                f"the files on disk do not match what the ranks wrote: unclaimed {unclaimed}, "
                f"indexed by .metadata but not written {missing}. Expected DCP's "
                "__<rank>_<n>.distcp naming; use torch's FileSystemWriter."
            )

    @staticmethod
    def _write_manifest(job: _SaveJob, manifest: Manifest) -> None:
        if job.store is not None:
            # One PUT: the object appears whole or not at all, so it is the commit record.
            job.store.write_bytes(job.file(MANIFEST_FILE), manifest.dumps().encode())
            return
        staging = job.staging
        partial = staging / f"{MANIFEST_FILE}.partial"
        with open(partial, "w", encoding="utf-8") as file:
            file.write(manifest.dumps())
            file.flush()
            os.fsync(file.fileno())
        os.replace(partial, staging / MANIFEST_FILE)
        fsync_path(staging)

    @staticmethod
    def _publish(job: _SaveJob) -> None:
        """Put the finished hidden directory in place (see the module docstring).

        Raises:
            CheckpointSaveError: If ``<name>`` exists and is not replaceable.
            OSError: If the rename failed; ``<name>`` then holds the previous checkpoint.
            Once the new checkpoint is in place nothing raises: leftovers are logged.
        """
        final = job.final
        if isinstance(final, StoreCheckpoint):
            # Committed by the manifest; retiring the previous versions only frees space.
            _fault("commit:replaced")
            final.store.retire(final.path, keep=job.staging)
            return
        if final.exists() or final.is_symlink():
            check_replaceable(final)
            if not _exchange(job.staging, final, use_exchange=_USE_RENAME_EXCHANGE):
                aside = hidden_path(final, ASIDE, job.token)
                os.rename(final, aside)
                try:
                    _fault("commit:aside")
                    os.rename(job.staging, final)
                except BaseException:
                    os.rename(aside, final)
                    raise
        else:
            os.rename(job.staging, final)
        # Committed: from here on only space can be lost, so nothing may fail the save.
        try:
            _fault("commit:replaced")
            fsync_path(final.parent)
            for sibling in list(final.parent.iterdir()):
                hidden = parse_hidden_name(sibling.name)
                if hidden is not None and hidden[0] == final.name:
                    try:
                        remove_tree(sibling)
                    except OSError as err:
                        log.warning("Could not delete stale %s: %s", sibling, err)
        except Exception as err:
            log.warning(
                "Checkpoint %s is committed, but cleaning up after it failed: %s",
                final,
                describe(err),
            )

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
            self._staging.release()
            if self._committer is not None:
                self._committer.shutdown(wait=True)
                self._committer = None
            # The background group and thread belong to this stage (the default group lives
            # on); a later stage's first async save builds fresh ones.
            group, self._background_group = self._background_group, None
            if group is not None and dist.is_initialized():
                with contextlib.suppress(Exception):
                    dist.destroy_process_group(group)

    # ----------------------------------------------------------------------------- load

    @override
    def load_checkpoint(
        self,
        path: str | os.PathLike[str],
        map_location: Any = None,
        weights_only: bool | None = None,
        *,
        state: dict[str, Any] | None = None,
        strict: bool = True,
    ) -> dict[str, Any]:
        """Validate the checkpoint at ``path`` against ``state``, then load into it. Collective.

        Args:
            path: The checkpoint directory; the same on every rank. If a crash left it
                renamed aside (see the module docstring), it is restored first.
            map_location: ``torch.load``'s ``map_location`` for ``meta.pt``.
            weights_only: ``torch.load``'s ``weights_only`` for ``meta.pt``.
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
        comm = Ranks.of(self.process_group)
        requested = final = self._location(path)
        located: tuple[str | None, str | None] | None = None
        if comm.rank == 0:
            if isinstance(final, StoreCheckpoint):
                located = _locate_version(final)
            else:
                try:
                    if recover_checkpoint(final):
                        log.warning(
                            "Restored %s, which an interrupted save had renamed aside.", final
                        )
                except OSError as err:
                    log.warning("Could not restore %s from a renamed-aside copy: %s", final, err)
                report_interrupted_saves(final.parent, log)
        try:
            # Nobody looks at the path before recovery is done; on a store, rank 0 has chosen
            # the version every rank reads.
            located = comm.broadcast_from_first(located)
            reader, problems = None, []
            if isinstance(requested, StoreCheckpoint):
                assert located is not None
                version, missing = located
                if version is None:
                    problems = [(_LOAD_ERRORS.index(NotACheckpointError), str(missing))]
                else:
                    final = StoreCheckpoint(requested.store, version)
            if not problems:
                try:
                    reader = (self.storage_reader_factory or self._default_reader)(final)
                except Exception as err:
                    problems = [(_LOAD_ERRORS.index(CheckpointError), describe(err))]
            if reader is not None:
                problems, meta = self._validate(
                    final, state, strict, comm, map_location, weights_only, reader
                )
        except PeerLostError as err:
            raise CheckpointError(
                f"Loading checkpoint {final} failed before any tensor was read: {err}. The "
                "targets are unchanged."
            ) from err
        agree_before_reading(comm, final, problems)
        manifest = (
            final.read_manifest() if isinstance(final, StoreCheckpoint) else read_manifest(final)
        )
        if (saved := manifest.world_size) != (ranks := comm.world_size):
            log.info("Loading %s, saved by %d ranks, on %d: DCP reshards.", final, saved, ranks)
        assert reader is not None
        if isinstance(reader, VerifyingFileSystemReader):
            reader.expect(manifest, verify=self.verify_checksums)
        loaded: dict[str, Any] = {}
        if state is not None:
            targets = {k: state[k] for k in ("state_dict", "optimizer_states") if k in state}
            # Tied entries are one object in both: _stage copies them once, _fill copies twice.
            into = _stage(targets) if self.atomic_load else targets
            try:
                dcp.load(
                    into,
                    storage_reader=reader,
                    planner=DefaultLoadPlanner(allow_partial_load=not strict),
                    process_group=comm.group,
                )
            except (CheckpointException, Exception) as err:
                raise self._load_failure(final, err, reader, comm) from err
            if self.atomic_load:
                with torch.no_grad():
                    _fill(targets, into)
            loaded = targets
        return {**meta, **loaded}

    def _default_reader(self, final: Path | StoreCheckpoint) -> StorageReader:
        if isinstance(final, StoreCheckpoint):
            return VerifyingFsspecReader(final.store, final.path, verify=self.verify_checksums)
        return VerifyingFileSystemReader(final, verify=self.verify_checksums)

    def _load_failure(
        self, final: Path, err: BaseException, reader: StorageReader, comm: Ranks
    ) -> CheckpointError:
        """The error every rank raises when ``dcp.load`` failed: DCP's per-rank errors, and
        what the targets now hold on each rank.

        Without ``atomic_load`` the ranks all-gather how far their readers got (one more
        collective, bounded by the group's timeout; a lost peer is reported as unknown),
        so every rank states the same partial state.
        """
        if isinstance(err, CheckpointException):
            message = dcp_failure_message("Loading", final, err)
            failures = [exc for exc, _ in err.failures.values()]
        else:
            message = (
                f"Loading checkpoint {final} failed on rank {comm.rank}: {describe(err)}\n"
                "DCP reports each rank's own errors as one CheckpointException, so this "
                f"error most likely means {LOST_PEER_HINT}."
            )
            failures = [err]
        corrupted = all(isinstance(e, CheckpointCorruptedError) for e in failures)
        error = CheckpointCorruptedError if corrupted else CheckpointError
        if corrupted:
            message += (
                "\nThe files differ from what the save recorded: load an older complete "
                "checkpoint, or restore these files from an intact copy (check it offline with "
                f"`lightning-megatron-fsdp inspect --verify {final}`)."
            )
        if self.atomic_load:
            return error(f"{message}\nThe targets are unchanged (atomic_load).")
        progress = reader.progress if isinstance(reader, VerifyingFileSystemReader) else None
        try:
            states = comm.all_gather(None if progress is None else dataclasses.asdict(progress))
        except PeerLostError:
            states = [None] * comm.world_size
            states[comm.rank] = None if progress is None else dataclasses.asdict(progress)
        return error(f"{message}\n{_aftermath(final, states)}")

    def _validate(
        self,
        final: Path,
        state: dict[str, Any] | None,
        strict: bool,
        comm: Ranks,
        map_location: Any,
        weights_only: bool | None,
        reader: StorageReader,
    ) -> tuple[list[tuple[int, str]], dict[str, Any]]:
        """This rank's problems with loading ``final`` into ``state``, as (kind, text),
        and the checkpoint's ``meta.pt`` (empty if it could not be read).

        Sizes always; with ``verify_checksums``, ``meta.pt``'s digest on every rank (it is
        read here anyway) and, unless ``reader`` verifies as it reads, this rank's share
        of the other files' digests.
        """
        kind = {cls: i for i, cls in enumerate(_LOAD_ERRORS)}
        if state is not None:
            shape_error = _state_shape_error(state)
            if shape_error:
                return [(kind[TypeError], shape_error)], {}
        remote = isinstance(final, StoreCheckpoint)
        try:
            manifest = final.read_manifest() if remote else read_manifest(final)
        except NotACheckpointError as err:
            return [(kind[NotACheckpointError], str(err))], {}
        share = None
        if self.verify_checksums and not isinstance(reader, VerifyingFileSystemReader):
            hashed = sorted(
                n for n, r in manifest.files.items() if r.digest() is not None and n != META_FILE
            )
            share = hashed[comm.rank :: comm.world_size]
        try:
            if remote:
                damaged = final.check_files(manifest, checksum_files=share)
                data = None if damaged else final.read_bytes(META_FILE)
            else:
                damaged = check_files(final, manifest, checksum_files=share)
                data = None if damaged else (final / META_FILE).read_bytes()
        except OSError as err:
            damaged, data = [f"cannot read a file: {describe(err)}"], None
        digest = manifest.files[META_FILE].digest() if self.verify_checksums else None
        if data is not None and digest is not None:
            found = bytes_digest(data, digest[0])
            if found != digest[1]:
                damaged.append(
                    f"{META_FILE}: {digest[0]} {found} on disk, {digest[1]} in the manifest "
                    "(the file changed after it was written)"
                )
        problems = [(kind[CheckpointCorruptedError], line) for line in damaged]
        if state is not None:
            problems += [
                (kind[CheckpointMismatchError], line)
                for line in _fingerprint_problems(manifest, state, strict)
            ]
        meta: dict[str, Any] = {}
        if not damaged and data is not None:
            try:
                meta = torch.load(
                    io.BytesIO(data), map_location=map_location, weights_only=weights_only
                )
            except Exception as err:
                problems.append(
                    (
                        kind[CheckpointError],
                        f"{META_FILE}: torch.load(weights_only={weights_only}) failed: "
                        f"{describe(err)}. If it holds objects the weights-only unpickler "
                        "refuses and you trust the checkpoint, load with weights_only=False.",
                    )
                )
        return problems, meta

    # ----------------------------------------------------------------------------- remove

    @override
    def remove_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Delete a checkpoint directory; a missing path is not an error. Not collective.

        The directory is first renamed to a hidden ``.<name>.del-<token>``, so a crash
        halfway through the deletion never leaves a damaged checkpoint under its name. On
        an object store each version's manifest goes first, and the only complete
        checkpoint under the parent prefix is kept (a warning says so).
        A symbolic link is unlinked, its target kept. Only global rank 0 acts (Lightning
        calls this on rank 0 only).

        Raises:
            CheckpointError: If ``path`` is not one of our checkpoints (a directory with a
                manifest) or hidden directories: nothing else is deleted.
        """
        if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
            return
        location = self._location(path)
        if isinstance(location, StoreCheckpoint):
            # Lightning removes the checkpoint a new save replaces right after that save
            # returns, and an async save may still be writing: once it has committed (or
            # failed), the store keeps the checkpoint if no other complete one is left. The
            # save's error stays for wait()/poll(): every rank must see it there.
            if self._in_flight is not None:
                concurrent.futures.wait([self._in_flight])
            location.store.remove(location.path)
            return
        target = location
        if self._in_flight is not None and self._in_flight_path == target:
            # Let the background save commit first, or it would re-create the directory.
            # Its error stays for wait()/poll(): every rank must see it there.
            concurrent.futures.wait([self._in_flight])
        if target.is_symlink():  # e.g. Lightning's save_last="link": only the link goes
            target.unlink()
            return
        if not target.exists():
            return
        hidden = parse_hidden_name(target.name)
        ours = target.is_dir()
        if ours and hidden is None:
            try:
                read_manifest(target)
            except NotACheckpointError:
                ours = False
        if not ours:
            raise CheckpointError(
                f"MegatronFSDPCheckpointIO.remove_checkpoint: refusing to delete {target}: it "
                "is not a checkpoint written by this plugin (expected a directory with a "
                "manifest.json, or a hidden .<name>.tmp-/.old-/.del-<token> directory). "
                "Delete it by hand if it is really unwanted."
            )
        if hidden is None:
            trash = hidden_path(target, DELETING, uuid.uuid4().hex)
            os.rename(target, trash)
            fsync_path(target.parent)
            target = trash
        remove_tree(target)


def _stored_sizes(job: _SaveJob) -> dict[str, int]:
    """Every file of the staging location by name, with its size (one listing)."""
    if job.store is not None:
        return job.store.sizes(job.staging)
    return {p.name: p.stat().st_size for p in job.staging.iterdir()}


def _stored_digest(job: _SaveJob, name: str) -> str:
    """The CRC32C of a file as stored, read back (files another writer wrote)."""
    if job.store is not None:
        with job.store.fs.open(job.file(name), "rb") as file:
            return stream_digest(file, "crc32c")
    return file_digest(job.file(name), "crc32c")


def _locate_version(final: StoreCheckpoint) -> tuple[str | None, str | None]:
    """(the prefix of ``final``'s newest complete version, or ``None`` and why); rank 0.

    Saves newer than the one chosen that did not finish are logged: they are never loaded,
    and the next save of this checkpoint deletes them.
    """
    store = final.store
    try:
        version = store.require(final.path)
    except (CheckpointError, OSError) as err:
        return None, describe(err) if isinstance(err, OSError) else str(err)
    newer = [v.name for v in store.versions(final.path) if v.path > version]
    if newer:
        log.warning(
            "%s: loading %s; newer save(s) %s did not finish (no manifest) and are ignored.",
            final,
            posixpath.basename(version),
            ", ".join(newer),
        )
    return version, None
