"""A save's three phases: the ranks agree on what they save, DCP writes, rank 0 commits.

Lightning hands the plugin one dict mixing sharded DTensors, plain tensors and Python
objects. DCP writes the tensors, each rank only its own shards, into a staging location of
the :class:`~lightning_megatron_fsdp.storage.commit.CheckpointStore`; rank 0 writes the
non-tensor rest to ``meta.pt``; the manifest is written last and the store publishes the
directory. Every rank-local check happens before the first of our three collective rounds,
so a rank whose state differs fails the save on every rank before anything is written
(docs/DESIGN.md, "Save path").
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.storage import StorageWriter

from lightning_megatron_fsdp import _torch
from lightning_megatron_fsdp.agreement import (
    LOST_PEER_HINT,
    PeerLostError,
    Ranks,
    dcp_failure_message,
    describe,
)
from lightning_megatron_fsdp.checkpoint.copies import StagingBuffers
from lightning_megatron_fsdp.checkpoint.metadata_slices import MetadataSlices
from lightning_megatron_fsdp.checkpoint.save_plan import global_save_plan
from lightning_megatron_fsdp.errors import CheckpointError, CheckpointSaveError
from lightning_megatron_fsdp.megatron import dcp_view
from lightning_megatron_fsdp.storage import (
    DCP_METADATA_FILE,
    DCP_METADATA_KEYS_FILE,
    META_FILE,
    CheckpointStorage,
    CheckpointStore,
    ChecksummingFileSystemWriter,
    FileRecord,
    Manifest,
    TensorSpec,
    crc32c,
    crc32c_hex,
    data_file_rank,
    finite_int_or_none,
    listed,
    mesh_info,
    model_fingerprint,
    optimizer_fingerprint,
    package_versions,
    reach,
)

__all__ = [
    "PendingSave",
    "PerRank",
    "SaveOptions",
    "StorageWriterFactory",
    "begin_save",
    "commit_save",
    "layout_disagreement",
    "layout_summary",
    "split_checkpoint",
    "write_save",
]

StorageWriterFactory = Callable[[Path], StorageWriter]
"""Builds the DCP writer for a save, given the staging directory it must write into."""


@dataclasses.dataclass(frozen=True)
class PerRank:
    """A value every rank contributes to the checkpoint's non-tensor part.

    Put it at the top level of the checkpoint dict: the save gathers every rank's
    ``value`` in its first round (no collective of its own) and ``meta.pt`` holds
    ``combine([value of rank 0, value of rank 1, ...])`` under the same key.
    """

    value: Any
    combine: Callable[[list[Any]], Any] = list


@dataclasses.dataclass(frozen=True, kw_only=True)
class SaveOptions:
    """How a save writes; the plugin's options."""

    store: CheckpointStore
    """Where the checkpoint is staged and published."""
    storage: CheckpointStorage
    """The DCP writer of the store's staging location."""
    write_checksums: bool = True
    """Record the CRC32C of every record and file."""
    thread_count: int = 1
    """Writer threads per rank of the default writer."""
    writer_factory: StorageWriterFactory | None = None
    """The DCP writer; ``storage``'s when ``None``."""

    def writer(self, staging: Any) -> StorageWriter:
        """The DCP writer for ``staging``."""
        if self.writer_factory is not None:
            return self.writer_factory(staging)
        return self.storage.writer(
            staging, checksum=self.write_checksums, thread_count=self.thread_count
        )


@dataclasses.dataclass
class PendingSave:
    """A save the ranks agreed on, not yet written or committed."""

    final: Any
    staging: Any
    token: str
    options: SaveOptions
    tensors: dict[str, Any]
    writer: StorageWriter
    manifest_fields: dict[str, Any] | None = None
    """Rank 0: the manifest's fields other than ``files``."""
    meta: bytes | None = None
    """Rank 0: ``meta.pt``'s bytes."""
    problem: str | None = None
    """A failure of this rank after the agreement, reported in the commit round."""
    plan_key: str | None = None
    """Names the agreed layout: DCP reuses its plans across saves of one layout."""


@dataclasses.dataclass(frozen=True)
class _Proposal:
    """What each rank sends in the save's first round."""

    path: str
    token: str
    digest: str | None
    per_rank: dict[str, Any]


def split_checkpoint(checkpoint: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split Lightning's checkpoint dict into DCP's tensor part and ``meta.pt``'s rest.

    Raises:
        TypeError: If the dict does not have the shape the strategy promises.
    """
    if not isinstance(checkpoint, Mapping):
        raise TypeError(f"checkpoint must be a dict, got {type(checkpoint).__name__}.")
    model = checkpoint.get("state_dict")
    if not isinstance(model, Mapping):
        raise TypeError(
            "checkpoint['state_dict'] must be an FQN-keyed model state dict (from "
            f"get_model_state_dict), got {type(model).__name__}."
        )
    tensors: dict[str, Any] = {"state_dict": model}
    if "optimizer_states" in checkpoint:
        optimizers = checkpoint["optimizer_states"]
        if not isinstance(optimizers, (list, tuple)) or not all(
            isinstance(o, Mapping) for o in optimizers
        ):
            raise TypeError(
                "checkpoint['optimizer_states'] must be a list of FQN-keyed optimizer state "
                f"dicts (from get_optimizer_state_dict), got {optimizers!r:.200}."
            )
        tensors["optimizer_states"] = list(optimizers)
    meta = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
    return tensors, meta


def layout_summary(tensors: Mapping[str, Any]) -> dict[str, str]:
    """Every leaf of the state to save, DCP-flattened (``state_dict.<fqn>``,
    ``optimizer_states.<i>.state.<fqn>.<name>``, ...), with its global shape and dtype.

    Rank-local; identical on every rank that saves the same model and optimizer state.
    Non-tensor values count by key only (``lr`` may be a float or a tensor).
    """
    summary: dict[str, str] = {}

    def visit(value: Any, path: tuple[str, ...]) -> None:
        if isinstance(value, Mapping):
            for key, item in value.items():
                visit(item, (*path, str(key)))
        elif isinstance(value, list) and any(isinstance(v, (Mapping, list)) for v in value):
            for index, item in enumerate(value):
                visit(item, (*path, str(index)))
        else:
            summary[".".join(path)] = TensorSpec.of(value).describe()

    visit(tensors, ())
    return summary


def layout_disagreement(layouts: list[dict[str, str]]) -> list[str]:
    """Say how each rank's layout differs from rank 0's (see :func:`layout_summary`)."""
    reference, lines = layouts[0], []
    for rank, layout in enumerate(layouts[1:], start=1):
        extra = sorted(set(layout) - set(reference))
        lacking = sorted(set(reference) - set(layout))
        differ = sorted(k for k in set(layout) & set(reference) if layout[k] != reference[k])
        if extra:
            lines.append(f"rank {rank} has {len(extra)} key(s) rank 0 has not: {listed(extra, 10)}")
        if lacking:
            lines.append(
                f"rank {rank} lacks {len(lacking)} key(s) of rank 0: {listed(lacking, 10)}"
            )
        lines += [
            f"rank {rank} {key!r}: {layout[key]}, rank 0: {reference[key]}" for key in differ[:10]
        ]
    lines.append(
        "The ranks disagree on the state to save. Every rank must pass the same keys with "
        "the same global shapes and dtypes: build the same model on every rank, and give "
        "every optimizer state for every parameter (ensure_optimizer_state) before saving."
    )
    return lines


def begin_save(
    checkpoint: Any,
    path: str | os.PathLike[str],
    ranks: Ranks,
    options: SaveOptions,
    *,
    prepare: Callable[[], None] | None = None,
    copies: StagingBuffers | None = None,
) -> PendingSave:
    """Round 1: every rank checks and prepares its part, then the ranks agree.

    One all-gather carries rank 0's path and staging token (so every rank writes one
    checkpoint even if their paths differ), every rank's outcome, a digest of its state's
    layout and its :class:`PerRank` values. Only when the digests differ do the ranks
    gather their full layouts, to say what differs.

    Args:
        checkpoint: Lightning's checkpoint dict.
        path: The checkpoint's final path; rank 0's is used.
        ranks: The ranks that save together.
        options: How to write.
        prepare: Rank-local work to run first (its failure fails the save on every rank).
        copies: Stage the tensors into these CPU copies (an async save).

    Raises:
        CheckpointSaveError: On every rank, naming each failing rank, or the ranks whose
            state differs from rank 0's; rank 0's staging location is removed.
        PeerLostError: If a peer is gone.
    """
    final = options.store.location(path)
    token = uuid.uuid4().hex
    tensors: dict[str, Any] = {}
    meta: dict[str, Any] = {}
    error: str | None = None
    digest: str | None = None
    fields: dict[str, Any] | None = None
    own: dict[str, Any] = {}
    try:
        if prepare is not None:
            prepare()
        tensors, meta = split_checkpoint(checkpoint)
        own = {k: v.value for k, v in meta.items() if isinstance(v, PerRank)}
        layout = layout_summary(tensors)
        digest = hashlib.sha256(json.dumps(layout, sort_keys=True).encode()).hexdigest()
        if ranks.rank == 0:
            fields = _manifest_fields(checkpoint, tensors, ranks.world_size)
            _pickled({k: v for k, v in meta.items() if k not in own})  # fails here, not later
            token = options.store.check_target(final, token)
        if copies is not None:
            tensors = copies.stage(tensors)
    except Exception as err:
        error = f"rank {ranks.rank}: {describe(err)}"
    try:
        outcomes = ranks.exchange(_Proposal(str(final), token, digest, own), error)
        gathered = outcomes.payloads
        errors = outcomes.error_texts
        if not errors and len({p.digest for p in gathered}) > 1:
            # Rare and fatal: now gather the full layouts to say exactly what differs.
            errors = layout_disagreement(ranks.all_gather(layout_summary(tensors)))
    except PeerLostError:
        if ranks.rank == 0:
            options.store.discard(final, token)
        raise
    if errors:
        if ranks.rank == 0:
            options.store.discard(final, token)
        where = f" on rank(s) {outcomes.failed}" if outcomes.failed else ""
        raise CheckpointSaveError(
            f"Saving checkpoint {gathered[0].path} failed{where} before any tensor was written; "
            "the previous checkpoint there, if any, is untouched:\n  " + "\n  ".join(errors)
        )
    final, token = options.store.location(gathered[0].path), gathered[0].token
    staging = options.store.staging_path(final, token)
    pending = PendingSave(final, staging, token, options, tensors, _FailedWriter(None))
    pending.plan_key = f"lightning_megatron_fsdp:{ranks.world_size}:{gathered[0].digest}"
    if ranks.rank == 0:
        pending.manifest_fields = fields
        try:
            # Created only now that every rank is in this save: no hidden directory appears
            # while a peer may still be looking at the parent after the previous save.
            options.store.stage(final, token)
            for key in own:
                meta[key] = meta[key].combine([p.per_rank[key] for p in gathered])
            pending.meta = _pickled(meta)
        except Exception as err:
            pending.problem = f"rank 0: {describe(err)}"
    try:
        pending.writer = options.writer(staging)
    except Exception as err:
        # DCP's planning gathers this failure from every rank: no round of ours needed.
        pending.writer = _FailedWriter(err)
    return pending


def write_save(pending: PendingSave, ranks: Ranks) -> Metadata:
    """DCP writes every rank's shards and rank 0's ``.metadata`` (DCP's collectives only).

    Raises:
        CheckpointSaveError: On every rank (DCP gathers every rank's failure, after every
            rank's writes have stopped, so rank 0 removes the staging location safely).
    """
    try:
        return dcp.save(
            dcp_view(pending.tensors),
            storage_writer=pending.writer,
            planner=_torch.caching_save_planner(
                pending.plan_key or "lightning_megatron_fsdp", global_save_plan
            ),
            process_group=ranks.group,
        )
    except (CheckpointException, Exception) as err:
        if ranks.rank == 0:
            pending.options.store.discard(pending.final, pending.token)
        if isinstance(err, CheckpointException):
            message = dcp_failure_message("Saving", pending.final, err)
        else:  # a failed collective (a lost or hung peer): say how far this rank got
            writer = pending.writer
            wrote = isinstance(writer, ChecksummingFileSystemWriter) and any(
                name != DCP_METADATA_FILE for name in writer.written_files()
            )
            where = (
                "after this rank wrote its shard files"
                if wrote
                else "before this rank's shard files were all written"
            )
            message = (
                f"Saving checkpoint {pending.final} failed on rank {ranks.rank} during DCP's "
                f"save, {where}: {describe(err)}\nDCP reports each rank's own errors as one "
                f"CheckpointException, so this error most likely means {LOST_PEER_HINT}."
            )
        raise CheckpointSaveError(
            message + "\nThe previous checkpoint there, if any, is untouched."
        ) from err


def commit_save(pending: PendingSave, metadata: Metadata, ranks: Ranks) -> None:
    """Rounds 2 and 3: gather every rank's files, rank 0 publishes, every rank learns how.

    Raises:
        CheckpointSaveError: On every rank if any rank failed to describe its files or rank
            0 failed to commit; the staging location is then removed.
        CheckpointError: On rank 0 when the checkpoint was committed but the other ranks
            could not be told.
    """
    store, final = pending.options.store, pending.final
    error, records, stored = pending.problem, {}, set()
    if error is None:
        try:
            records, stored = _local_records(pending, ranks.rank, metadata)
            reach("commit:hashed")
        except Exception as err:
            error = f"rank {ranks.rank}: {describe(err)}"
    try:
        outcomes = ranks.exchange(records, error)
    except PeerLostError as err:
        if ranks.rank == 0:
            store.discard(final, pending.token)
        raise CheckpointSaveError(
            f"Saving checkpoint {final} failed before the commit: {err}. The previous "
            "checkpoint there, if any, is untouched."
        ) from err
    outcome = None
    if outcomes.failed:
        outcome = "\n  ".join(outcomes.error_texts)
        if ranks.rank == 0:
            store.discard(final, pending.token)
    elif ranks.rank == 0:
        try:
            files: dict[str, FileRecord] = {}
            for rank_records in outcomes.payloads:
                files.update(rank_records)
            _check_claims(stored, files, metadata)
            assert pending.manifest_fields is not None
            manifest = Manifest(files=files, **pending.manifest_fields)
            store.publish(final, pending.staging, manifest, pending.token)
        except Exception as err:
            outcome = describe(err)
            store.discard(final, pending.token)
    try:
        outcome = ranks.broadcast_from_first(outcome)
    except PeerLostError as err:
        if ranks.rank == 0 and outcome is None:
            raise CheckpointError(
                f"Checkpoint {final} was saved and committed, but the other ranks could not "
                f"be told: {err}."
            ) from err
        if ranks.rank == 0:
            raise CheckpointSaveError(
                f"Saving checkpoint {final} failed while committing: {outcome}\nThe previous "
                f"checkpoint there, if any, is untouched. Also, {err}."
            ) from err
        raise CheckpointSaveError(
            f"Saving checkpoint {final}: contact with rank 0 was lost while it committed "
            f"({err}). {final.name} holds the previous or the new checkpoint, complete either "
            "way (load_checkpoint and resolve_latest_checkpoint restore it if a crash left it "
            "renamed aside); its manifest's global_step tells which."
        ) from err
    if outcome is not None:
        raise CheckpointSaveError(
            f"Saving checkpoint {final} failed while committing: {outcome}\nThe previous "
            "checkpoint there, if any, is untouched."
        )


def _manifest_fields(
    checkpoint: Mapping[str, Any], tensors: Mapping[str, Any], world_size: int
) -> dict[str, Any]:
    return {
        "fingerprint": model_fingerprint(tensors["state_dict"]),
        "optimizer_fingerprints": [
            optimizer_fingerprint(o) for o in tensors.get("optimizer_states", [])
        ],
        "world_size": world_size,
        "mesh": mesh_info(tensors),
        "versions": dict(package_versions()),
        "global_step": finite_int_or_none(checkpoint.get("global_step")),
        "epoch": finite_int_or_none(checkpoint.get("epoch")),
    }


def _pickled(meta: dict[str, Any]) -> bytes:
    buffer = io.BytesIO()
    torch.save(meta, buffer)
    return buffer.getvalue()


def _local_records(
    pending: PendingSave, rank: int, metadata: Metadata
) -> tuple[dict[str, FileRecord], set[str]]:
    """Size and CRC32C of the files this rank wrote: its shards; rank 0 also the rest,
    ``meta.pt`` and, beside a ``.metadata`` of records in files, its cut by key
    (``.metadata.keys``, what a load reads instead: ``checkpoint.metadata_slices``); and
    the names of every file in the staging location, as one listing showed them after
    this rank's writes (on rank 0, after every rank's: DCP's ``finish`` came last).

    Taken from the bytes as they were written (:class:`ChecksummingFileSystemWriter`,
    ``meta.pt``): the writer's figures are the truth, the store's size is checked against
    them, never adopted. Only a file written by another writer is read back and hashed.

    Raises:
        CheckpointSaveError: A file's stored size is not what its writer wrote (an upload
            retried with a spent body stores fewer bytes and succeeds).
    """
    staging, checksum = pending.staging, pending.options.write_checksums
    store = pending.options.store
    written: dict[str, FileRecord] = {}
    if rank == 0:
        assert pending.meta is not None
        extra = {META_FILE: pending.meta}
        if isinstance(pending.writer, ChecksummingFileSystemWriter):
            cut = MetadataSlices.cut(metadata, source=DCP_METADATA_FILE, cache=True)
            extra[DCP_METADATA_KEYS_FILE] = cut.encoded()
        store.write_files(staging, extra)
        for name, data in extra.items():
            digest = crc32c_hex(crc32c(data)) if checksum else None
            written[name] = FileRecord(size=len(data), crc32c=digest)
    stored = store.sizes(staging)
    names = sorted(n for n in stored if data_file_rank(n) == rank)
    if rank == 0:
        names += [DCP_METADATA_FILE, *written]
    writer = pending.writer
    hashed = writer.written_files() if isinstance(writer, ChecksummingFileSystemWriter) else {}
    records = {}
    for name in names:
        if name not in stored:
            raise FileNotFoundError(f"{name} is missing from {staging} after it was written")
        size = stored[name]
        known = written.get(name)
        if known is None and name in hashed:
            crc = hashed[name].crc32c
            known = FileRecord(hashed[name].size, crc32c=None if crc is None else crc32c_hex(crc))
        if known is not None and known.size != size:
            raise CheckpointSaveError(
                f"{name} in {staging} holds {size} bytes after it was written, but its "
                f"writer wrote {known.size}: the store kept something else than what was "
                "sent. Not committed; check the storage (or the network) and save again."
            )
        if not checksum:
            records[name] = FileRecord(size)
        elif known is not None and known.crc32c is not None:
            records[name] = known
        else:
            records[name] = FileRecord(size, crc32c=store.digest(staging, name, "crc32c"))
    return records, set(stored)


def _check_claims(on_disk: set[str], files: Mapping[str, FileRecord], metadata: Metadata) -> None:
    """Every file in the staging location was claimed by a rank, and every file DCP
    indexed exists.

    Raises:
        RuntimeError: Otherwise: DCP's file naming changed, or a writer misbehaved.
    """
    unclaimed = sorted(on_disk - set(files))
    storage = getattr(metadata, "storage_data", None) or {}
    indexed = {info.relative_path for info in storage.values() if hasattr(info, "relative_path")}
    missing = sorted(indexed - set(files))
    if unclaimed or missing:
        raise RuntimeError(
            f"the files on disk do not match what the ranks wrote: unclaimed {unclaimed}, "
            f"indexed by .metadata but not written {missing}. Expected DCP's "
            "__<rank>_<n>.distcp naming; use torch's FileSystemWriter."
        )


class _FailedWriter(StorageWriter):
    """Stands in for a writer this rank could not build: DCP's planning raises its error,
    and DCP reports it on every rank."""

    def __init__(self, error: BaseException | None) -> None:
        self.error = error

    def _fail(self) -> Any:
        raise RuntimeError(f"building the storage writer failed: {describe(self.error)}") from (
            self.error
        )

    def reset(self, checkpoint_id: Any = None) -> None:
        """Nothing to reset."""

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return True

    def storage_meta(self) -> StorageMeta | None:
        return None

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._fail()

    def prepare_local_plan(self, plan: Any) -> Any:
        return self._fail()

    def prepare_global_plan(self, plans: Any) -> Any:
        return self._fail()

    def write_data(self, plan: Any, planner: Any) -> Any:
        return self._fail()

    def finish(self, metadata: Any, results: Any) -> None:
        self._fail()
