"""A load's phases, the mirror of a save: open, check and agree, read, apply.

A resume must recognise what it was handed (our directory, a ``ModelParallelStrategy`` DCP
directory, one a crashed commit left renamed aside), refuse a checkpoint that does not fit
the model or whose files were damaged before any rank reads tensor data, read each rank's
records straight into the live targets, and apply what was read. Every step can fail on one
rank alone, so each ends in an agreement; there are three collective rounds of ours: rank 0
opens the checkpoint for everyone, the ranks agree on their checks, and on applying
(docs/DESIGN.md, "Load path").
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata
from torch.distributed.checkpoint.storage import StorageReader

from lightning_megatron_fsdp.agreement import (
    LOST_PEER_HINT,
    PeerLostError,
    Problem,
    Ranks,
    dcp_failure_message,
    describe,
)
from lightning_megatron_fsdp.checkpoint.copies import fill, stage
from lightning_megatron_fsdp.checkpoint.metadata_slices import MetadataSlices, SlicedLoadPlanner
from lightning_megatron_fsdp.checkpoint.replicated_reads import SavedLayout, plan_replicated_reads
from lightning_megatron_fsdp.errors import (
    CheckpointCorruptedError,
    CheckpointError,
    CheckpointMismatchError,
    NotACheckpointError,
    traveling_class,
)
from lightning_megatron_fsdp.megatron import (
    dcp_view,
    keep_loaded_values,
)
from lightning_megatron_fsdp.storage import (
    DCP_METADATA_FILE,
    DCP_METADATA_KEYS_FILE,
    MANIFEST_FILE,
    META_FILE,
    CheckpointStorage,
    CheckpointStore,
    Manifest,
    ReadProgress,
    VerifyingFileSystemReader,
    bytes_digest,
    compare_fingerprints,
    load_weights_only,
    model_fingerprint,
    optimizer_fingerprint,
)

__all__ = [
    "LoadOptions",
    "OpenedCheckpoint",
    "StorageReaderFactory",
    "TargetsFactory",
    "open_checkpoint",
    "read_checkpoint",
]

log = logging.getLogger(__name__)

StorageReaderFactory = Callable[[Path], StorageReader]
"""Builds the DCP reader for a load, given the checkpoint directory."""

TargetsFactory = Callable[[dict[str, Any]], dict[str, Any]]
"""Builds a load's targets from the checkpoint's ``meta.pt`` dict (a caller whose targets
depend on what was saved: Fabric orders its optimizers by the keys saved there)."""

_META_FOR_ALL_BYTES = 1 << 20
"""The largest ``meta.pt`` rank 0 reads for every rank (:func:`_read_metadata_once`)."""

# The classes a load's problems raise, most fundamental first (``Ranks.agree``).
_LOAD_PRECEDENCE: tuple[type[Exception], ...] = (
    TypeError,
    NotACheckpointError,
    CheckpointCorruptedError,
    CheckpointMismatchError,
    CheckpointError,  # meta.pt does not unpickle
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoadOptions:
    """How a load reads; the plugin's options."""

    store: CheckpointStore
    """Where checkpoints live (recovery of a crashed commit)."""
    storage: CheckpointStorage
    """The DCP reader of the store's locations."""
    verify_checksums: bool = True
    """Check ``meta.pt``, ``.metadata`` and every record read against their CRC32C."""
    atomic_load: bool = False
    """Read into CPU copies and write the targets only once every rank has read all."""
    reader_factory: StorageReaderFactory | None = None
    """The DCP reader; ``storage``'s when ``None``."""
    trust_checkpoint: bool = False
    """Unpickle ``.metadata``, byte records and (``weights_only=None``) ``meta.pt`` in full."""

    def reader(self, path: Any) -> StorageReader:
        """The DCP reader for the checkpoint at ``path``."""
        if self.reader_factory is not None:
            return self.reader_factory(path)
        return self.storage.reader(
            path, verify=self.verify_checksums, trust_checkpoint=self.trust_checkpoint
        )


@dataclasses.dataclass(frozen=True)
class OpenedCheckpoint:
    """What rank 0 found at a checkpoint path, as every rank learns it.

    Attributes:
        path: Rank 0's absolute path.
        manifest: The parsed manifest, or ``None``.
        problem: Why there is no manifest: a :class:`NotACheckpointError`, or a
            :class:`CheckpointError` where the store did not answer.
        foreign: A ``ModelParallelStrategy`` (FSDP2) DCP directory.
        slices: ``.metadata`` as rank 0 read and checked it, cut by key; ``None`` where
            each rank's reader reads it (a reader of the user's, or none to read).
        metadata_error: Why rank 0 could not read ``.metadata`` (the problem every rank
            reports, its class carried by category).
        meta: ``meta.pt``'s bytes as rank 0 read them, for every rank (each checks them
            as it reads them); ``None`` where each rank reads it.
    """

    path: Any
    manifest: Manifest | None
    problem: Problem | None
    foreign: bool
    slices: MetadataSlices | None = None
    metadata_error: Problem | None = None
    meta: bytes | None = None


def open_checkpoint(
    path: str | os.PathLike[str],
    ranks: Ranks,
    store: CheckpointStore,
    options: LoadOptions | None = None,
) -> OpenedCheckpoint:
    """Round 1: rank 0 repairs what a crashed commit left, parses the manifest and, given
    ``options``, ``.metadata`` (each once, for every rank; ``.metadata`` cut by key, see
    ``checkpoint.metadata_slices``) and recognises a foreign directory; every rank gets its
    findings.

    Raises:
        CheckpointError: If a peer was lost.
    """
    found = None
    if ranks.rank == 0:
        manifest, problem, foreign, final = None, None, False, None
        try:
            final = store.location(path)
            store.recover(final)
            final = store.resolve(final)
            manifest = store.read_manifest(final)
        except NotACheckpointError as err:
            problem = Problem(NotACheckpointError, str(err))
        except TimeoutError as err:  # a store that did not answer: not "not a checkpoint"
            problem = Problem(CheckpointError, describe(err))
        except (OSError, ValueError, ImportError) as err:  # an unreachable store, say
            problem = Problem(NotACheckpointError, f"{path}: {describe(err)}")
        if isinstance(final, Path):
            foreign = manifest is None and _is_foreign_lightning_dcp(final)
        slices, metadata_error, meta = None, None, None
        if manifest is not None and options is not None:
            slices, metadata_error, meta = _read_metadata_once(final, manifest, options)
        found = OpenedCheckpoint(
            final if final is not None else path,
            manifest,
            problem,
            foreign,
            slices,
            metadata_error,
            meta,
        )
    try:
        opened = ranks.broadcast_from_first(found)
    except PeerLostError as err:
        raise CheckpointError(
            f"Loading checkpoint {path} failed before any tensor was read: {err}. The "
            "targets are unchanged."
        ) from err
    assert isinstance(opened, OpenedCheckpoint)
    return opened


def _read_metadata_once(
    final: Any, manifest: Manifest, options: LoadOptions
) -> tuple[MetadataSlices | None, Problem | None, bytes | None]:
    """Rank 0's ``.metadata`` cut by key, through the load's reader (digests checked
    against ``manifest``): the cut the save wrote (``.metadata.keys``) where the manifest
    lists it, read at once with ``meta.pt`` (every rank's otherwise: on a store, a request
    of every rank to one object), else ``.metadata`` cut here; ``(None, None, None)`` for
    a reader of the user's."""
    try:
        reader = options.reader(final)
        if not isinstance(reader, VerifyingFileSystemReader):
            return None, None, None
        reader.expect(manifest, verify=options.verify_checksums)
        if DCP_METADATA_KEYS_FILE in manifest.files:
            names = [DCP_METADATA_KEYS_FILE, META_FILE]
            if manifest.files[META_FILE].size > _META_FOR_ALL_BYTES:
                names.pop()
            found = reader.read_files(names)
            data = reader.check_digest(DCP_METADATA_KEYS_FILE, found[0])
            meta = found[1] if len(found) > 1 else None
            slices = MetadataSlices.read(data, source=f"{final}/{DCP_METADATA_KEYS_FILE}")
            if slices is not None:
                return slices, None, meta
        metadata = reader.read_metadata()
        return MetadataSlices.cut(metadata, source=f"{final}/{DCP_METADATA_FILE}"), None, None
    except CheckpointError as err:
        return None, Problem(traveling_class(type(err), CheckpointError), str(err)), None
    except Exception as err:
        problem = Problem(CheckpointError, f"reading {DCP_METADATA_FILE}: {describe(err)}")
        return None, problem, None


def read_checkpoint(
    opened: OpenedCheckpoint,
    state: dict[str, Any] | TargetsFactory | None,
    ranks: Ranks,
    options: LoadOptions,
    *,
    map_location: Any = "cpu",
    weights_only: bool | None = None,
    strict: bool = True,
) -> dict[str, Any]:
    """Round 2, then DCP's read: every rank checks, the ranks agree, DCP reads into ``state``.

    Args:
        opened: From :func:`open_checkpoint`.
        state: Targets (``{"state_dict": ..., "optimizer_states": [...]}``), filled in
            place; or a function that builds them from ``meta.pt``'s dict, called once
            ``meta.pt`` is read and checked, its failure agreed on in this round (rank-local
            preparation such as building the targets); ``None`` reads only the non-tensor
            part.
        ranks: The ranks that load together.
        options: How to read.
        map_location: ``torch.load``'s, for ``meta.pt``: CPU by default, as Lightning's
            ``TorchCheckpointIO`` loads (not rank 0's device, where it saved them).
        weights_only: ``torch.load``'s, for ``meta.pt``.
        strict: Refuse missing and unexpected keys.

    Returns:
        ``meta.pt``'s dict plus the filled targets.

    Raises:
        See ``MegatronFSDPCheckpointIO.load_checkpoint``.
    """
    final = opened.path
    reader: StorageReader | None = None
    saved: SavedLayout | None = None
    meta: dict[str, Any] = {}
    problems: list[Problem] = []
    if opened.manifest is None:
        problems.append(opened.problem or Problem(NotACheckpointError, f"{final}: no manifest"))
    else:
        try:
            reader = options.reader(final)
        except Exception as err:
            problems.append(Problem(CheckpointError, describe(err)))
        if (failed := opened.metadata_error) is not None:
            problems.append(failed)
        elif opened.slices is not None and isinstance(reader, VerifyingFileSystemReader):
            try:
                skeleton = opened.slices.skeleton_metadata(trust=options.trust_checkpoint)
                reader.use_metadata(skeleton)
                saved = _saved_layout(opened.slices, skeleton, opened.manifest, ranks)
            except CheckpointError as err:
                problems.append(Problem(CheckpointCorruptedError, str(err)))
        if reader is not None:
            found, meta, state = _validate(
                final,
                opened.manifest,
                state,
                strict,
                ranks,
                map_location,
                weights_only,
                reader,
                options,
                opened.meta,
            )
            problems += found
    # Staged before the agreement round, which carries the replica groups' digests.
    targets: dict[str, Any] = {}
    into: dict[str, Any] = {}
    if not problems and state is not None and not callable(state):
        targets = {k: state[k] for k in ("state_dict", "optimizer_states") if k in state}
        # Tied entries are one object in both: stage copies them once, fill copies twice.
        try:
            into = stage(targets) if options.atomic_load else targets
        except Exception as err:  # memory for the copies, say: agreed on like the rest
            problems.append(Problem(CheckpointError, f"staging the targets: {describe(err)}"))
    shared = plan_replicated_reads(into, saved, ranks)  # rank-local
    every = _agree_before_reading(ranks, final, problems, shared.digests)
    manifest = opened.manifest
    assert manifest is not None and reader is not None and not callable(state)
    if (saved_ranks := manifest.world_size) != ranks.world_size:
        log.info(
            "Loading %s, saved by %d ranks, on %d: DCP reshards.",
            final,
            saved_ranks,
            ranks.world_size,
        )
    if isinstance(reader, VerifyingFileSystemReader):
        reader.expect(manifest, verify=options.verify_checksums)
    loaded: dict[str, Any] = {}
    if state is not None:
        # Each replicated record read by one replica (checkpoint.replicated_reads).
        replicated = shared.settle(every)
        # Rank-local; the targets carry every chunk (_load_targets).
        view = dcp_view(replicated.state)
        try:
            dcp.load(
                view,
                storage_reader=reader,
                planner=(
                    SlicedLoadPlanner(opened.slices, allow_partial_load=not strict)
                    if opened.slices is not None and isinstance(reader, VerifyingFileSystemReader)
                    else DefaultLoadPlanner(allow_partial_load=not strict)
                ),
                process_group=ranks.group,
            )
        except (CheckpointException, Exception) as err:
            raise _load_failure(final, err, reader, ranks, options.atomic_load) from err
        keep_loaded_values(into, view)
        try:
            replicated.share(f"Loading checkpoint {final}", trust=options.trust_checkpoint)
        except CheckpointError as err:  # a lost peer, or values that would not load
            kept = "unchanged" if options.atomic_load else "partly loaded; load again"
            raise CheckpointError(
                f"Loading checkpoint {final} failed sending replicated tensors and byte "
                f"records to the other ranks: {err}. The targets are {kept}."
            ) from err
        if options.atomic_load:
            with torch.no_grad():
                fill(targets, into)
        loaded = targets
    return {**meta, **loaded}


def _saved_layout(
    slices: MetadataSlices, skeleton: Metadata, manifest: Manifest, ranks: Ranks
) -> SavedLayout:
    """The checkpoint's keys, those stored as byte records, and, where the load runs on as
    many ranks as the save (so the writers' ranks are the load's), which rank wrote each
    record: each replicated record is read by its writer, among that rank's own."""
    byte_keys = {
        key
        for key, entry in skeleton.state_dict_metadata.items()
        if isinstance(entry, BytesStorageMetadata)
    }
    writer = slices.writer if manifest.world_size == ranks.world_size else None
    return SavedLayout(set(slices.keys), byte_keys, writer)


def _validate(
    final: Any,
    manifest: Manifest,
    state: dict[str, Any] | TargetsFactory | None,
    strict: bool,
    ranks: Ranks,
    map_location: Any,
    weights_only: bool | None,
    reader: StorageReader,
    options: LoadOptions,
    meta_read: bytes | None,
) -> tuple[list[Problem], dict[str, Any], dict[str, Any] | None]:
    """This rank's problems with loading ``final`` into ``state``, the checkpoint's
    ``meta.pt`` (empty if it could not be read), and the targets (built here from
    ``meta.pt`` when ``state`` is a :data:`TargetsFactory`).

    Sizes always (on a store, those of rank 0's look at the version that
    ``open_checkpoint`` found complete); with ``verify_checksums``, ``meta.pt``'s digest on
    every rank (it is read here, unless rank 0 read it for all: ``meta_read``) and, unless
    ``reader`` verifies as it reads, this rank's share of the other files' digests.
    """
    if state is not None and not callable(state):
        shape_error = _state_shape_error(state)
        if shape_error:
            return [Problem(TypeError, shape_error)], {}, state
    share = None
    if options.verify_checksums and not isinstance(reader, VerifyingFileSystemReader):
        hashed = sorted(
            n for n, r in manifest.files.items() if r.digest() is not None and n != META_FILE
        )
        share = hashed[ranks.rank :: ranks.world_size]
    try:
        damaged = options.store.check_files(final, manifest, checksum_files=share)
        data = meta_read
        if damaged:
            data = None
        elif data is None:
            data = options.store.read_bytes(final, META_FILE)
    except OSError as err:
        damaged, data = [f"cannot read a file: {describe(err)}"], None
    digest = manifest.files[META_FILE].digest() if options.verify_checksums else None
    if data is not None and digest is not None:
        found = bytes_digest(data, digest[0])
        if found != digest[1]:
            damaged.append(
                f"{META_FILE}: {digest[0]} {found} on disk, {digest[1]} in the manifest "
                "(the file changed after it was written)"
            )
    problems = [Problem(CheckpointCorruptedError, line, "damaged") for line in damaged]
    meta: dict[str, Any] = {}
    if not damaged and data is not None:
        trust = options.trust_checkpoint if weights_only is None else not weights_only
        try:
            meta = load_weights_only(data, source=META_FILE, trust=trust, map_location=map_location)
        except CheckpointError as err:
            problems.append(Problem(CheckpointError, str(err)))
    if callable(state):
        if problems:  # the targets depend on meta.pt, which these problems refuse
            return problems, meta, None
        try:
            state = state(meta)
        except CheckpointMismatchError as err:
            return [Problem(CheckpointMismatchError, str(err), "optimizers")], meta, None
        except Exception as err:
            text = f"building the load targets failed on rank(s) [{ranks.rank}]: {describe(err)}"
            return [Problem(CheckpointError, text)], meta, None
        shape_error = _state_shape_error(state)
        if shape_error:
            return [Problem(TypeError, shape_error)], meta, state
    if state is not None:
        problems += _fingerprint_problems(manifest, state, strict)
    return problems, meta, state


def _load_failure(
    final: Any, err: BaseException, reader: StorageReader, ranks: Ranks, atomic_load: bool
) -> CheckpointError:
    """The error every rank raises when ``dcp.load`` failed: DCP's per-rank errors, and
    what the targets now hold on each rank.

    Without ``atomic_load`` the ranks all-gather how far their readers got (one more
    collective, on this failure path only; a lost peer is reported as unknown), so every
    rank states the same partial state.
    """
    if isinstance(err, CheckpointException):
        message = dcp_failure_message("Loading", final, err)
        failures = [exc for exc, _ in err.failures.values()]
    else:
        message = (
            f"Loading checkpoint {final} failed on rank {ranks.rank}: {describe(err)}\n"
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
    if atomic_load:
        return error(f"{message}\nThe targets are unchanged (atomic_load).")
    progress = reader.progress if isinstance(reader, VerifyingFileSystemReader) else None
    try:
        states = ranks.all_gather(None if progress is None else dataclasses.asdict(progress))
    except PeerLostError:
        states = [None] * ranks.world_size
        states[ranks.rank] = None if progress is None else dataclasses.asdict(progress)
    return error(f"{message}\n{_aftermath(final, states)}")


def _state_shape_error(state: Any) -> str | None:
    if not isinstance(state, Mapping) or not isinstance(state.get("state_dict"), Mapping):
        return (
            "state must be {'state_dict': model_state_dict, 'optimizer_states': [...]} "
            f"(optimizer_states optional), got {state!r:.200}"
        )
    optimizers = state.get("optimizer_states", [])
    if not isinstance(optimizers, (list, tuple)) or not all(
        isinstance(o, Mapping) for o in optimizers
    ):
        return (
            "state['optimizer_states'] must be a list of optimizer state dicts, got "
            f"{optimizers!r:.200}"
        )
    return None


def _fingerprint_problems(
    manifest: Manifest, state: Mapping[str, Any], strict: bool
) -> list[Problem]:
    problems = compare_fingerprints(
        manifest.fingerprint, model_fingerprint(state["state_dict"]), what="model", strict=strict
    )
    if "optimizer_states" not in state:
        return problems
    targets, saved = state["optimizer_states"], manifest.optimizer_fingerprints
    if targets and not saved:
        problems.append(
            Problem(
                CheckpointMismatchError,
                f"the checkpoint holds no optimizer state (it was saved weights-only), but "
                f"{len(targets)} optimizer state dict(s) were given to fill. Load weights only: "
                "leave 'optimizer_states' out of state (the strategy's weights-only load).",
                "optimizers",
            )
        )
    elif len(targets) != len(saved):
        problems.append(
            Problem(
                CheckpointMismatchError,
                f"the checkpoint holds state for {len(saved)} optimizer(s), but {len(targets)} "
                "optimizer state dict(s) were given; configure the same optimizers as when "
                "saving",
                "optimizers",
            )
        )
    else:
        for i, (fingerprint, target) in enumerate(zip(saved, targets, strict=True)):
            problems += compare_fingerprints(
                fingerprint, optimizer_fingerprint(target), what=f"optimizer {i}", strict=strict
            )
    return problems


def _agree_before_reading(
    comm: Ranks, final: Any, problems: list[Problem], digests: Any
) -> list[Any]:
    """Raise, identically on every rank, the problems all ranks found; else return every
    rank's replica ``digests`` (carried by the same round).

    Through the one agreement helper (:meth:`~lightning_megatron_fsdp.agreement.Ranks.agree`):
    a summary line first, then every problem with the ranks that saw it where not all did,
    then what to do. Nothing has been read at this point, so every error says so.

    Args:
        comm: The ranks of the load.
        final: The checkpoint.
        problems: This rank's problems, each carrying the class it raises.
        digests: This rank's replica groups' digests (``ReplicaPlan.digests``).

    Raises:
        TypeError | NotACheckpointError | CheckpointCorruptedError | CheckpointMismatchError
        | CheckpointError: The most fundamental class of the problems found;
            ``CheckpointError`` also when the ranks could not agree (a lost peer).
    """
    return comm.agree(
        problems,
        heading=f"Cannot load checkpoint {final}",
        precedence=_LOAD_PRECEDENCE,
        advice={cls: text.format(final=final) for cls, text in _LOAD_ADVICE.items()},
        lost_peer_error=CheckpointError,
        attached=digests,
    )


def _aftermath(final: Any, states: list[dict[str, Any] | None]) -> str:
    """What the targets hold after a failed in-place load, from each rank's reader
    progress (``None``: unknown, another reader or a lost rank)."""
    if all(s is not None and not s["started"] for s in states):
        return (
            "Nothing was loaded: no rank had begun reading tensor data. The targets are unchanged."
        )
    lines = []
    for rank, state in enumerate(states):
        if state is None:
            lines.append(f"  rank {rank}: unknown (another storage reader, or the rank was lost)")
        else:
            progress = ReadProgress(**state)
            lines.append(f"  rank {rank}: {progress.describe()}")
    verb = "may be" if any(state is None for state in states) else "are"
    return (
        f"The targets {verb} partly loaded (atomic_load=False): each rank's reader wrote "
        "records into its targets in order, and the rest keep their previous values:\n"
        + "\n".join(lines)
        + f"\nLoad {final} again once it is intact, or another complete checkpoint, before "
        "training on (atomic_load=True keeps the targets unchanged on any failure, for one "
        "more copy of the shards in memory)."
    )


_LOAD_ADVICE: dict[type[Exception], str] = {
    CheckpointCorruptedError: (
        "Nothing was loaded. The files differ from what the save recorded: load an older "
        "complete checkpoint, or restore these files from an intact copy (check it offline "
        "with `lightning-megatron-fsdp inspect --verify {final}`)."
    ),
    CheckpointMismatchError: (
        "Nothing was loaded. Build the model and optimizers the checkpoint was saved from "
        "(strict=False tolerates missing and unexpected keys, not other shapes or dtypes)."
    ),
    CheckpointError: "Nothing was loaded: no rank had read tensor data; the targets are unchanged.",
}


def _is_foreign_lightning_dcp(path: str) -> bool:
    """Whether ``path`` is a ``ModelParallelStrategy`` (FSDP2) checkpoint directory.

    Recognised positively, never by what is missing: DCP's ``.metadata`` and Lightning's
    ``meta.pt`` without our manifest, *and* Lightning's ``optimizer_<i>.`` keys, which our
    format never writes (ours are ``optimizer_states.<i>.``). So a checkpoint of ours whose
    manifest was lost or not yet copied still goes to our loader, which refuses it as
    incomplete instead of loading it unchecked.
    """
    directory = Path(path)
    if not (
        (directory / DCP_METADATA_FILE).is_file()
        and (directory / META_FILE).is_file()
        and not (directory / MANIFEST_FILE).exists()
    ):
        return False
    try:
        reader = VerifyingFileSystemReader(directory, verify=False)
        keys = reader.read_metadata().state_dict_metadata
    except Exception:
        return False
    return any(re.match(r"optimizer_\d+\.", key) for key in keys)
