"""Load any checkpoint we can read into a live sharded model: the mirror of a save.

Problem: a resume must recognise what it was handed (our directory, a
``ModelParallelStrategy`` DCP directory, a checkpoint a crash left renamed aside), decide
what to load (optimizer state only when fitting, and only if the checkpoint has it),
build in-place targets from the live model and optimizers, and apply what DCP filled.
Every step can fail on one rank alone, so the ranks must agree before moving on.

How: :func:`load_into_sharded_model` is the one call the strategy makes. Rank 0 restores
an aside copy and peeks at the manifest; the ranks agree on its answer; a foreign
Lightning DCP directory goes through :func:`~lightning_megatron_fsdp.load_full_weights`
(plus its ``meta.pt``); ours goes through the checkpoint IO's validated ``load_checkpoint``
into targets built here, then optimizer hyper-parameters are applied by FQN and compute
weights refreshed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins import CheckpointIO
from torch import nn
from torch.optim import Optimizer

from lightning_megatron_fsdp import _megatron
from lightning_megatron_fsdp.agreement import Ranks
from lightning_megatron_fsdp.manifest import (
    DCP_METADATA_FILE,
    MANIFEST_FILE,
    META_FILE,
    CheckpointError,
    CheckpointMismatchError,
    read_manifest,
    recover_checkpoint,
)
from lightning_megatron_fsdp.object_store import is_url, open_store
from lightning_megatron_fsdp.optimizer_state import ensure_optimizer_state
from lightning_megatron_fsdp.pretrained import load_full_weights
from lightning_megatron_fsdp.uneven_dtensor import attach_uneven_dtensor_metadata

__all__ = ["LoadResult", "load_into_sharded_model"]


@dataclasses.dataclass(frozen=True)
class LoadResult:
    """What a load did.

    Attributes:
        checkpoint: The non-tensor rest of the checkpoint (Lightning's dict), plus the
            filled targets.
        optimizers_loaded: Whether optimizer state was loaded (``False`` for a
            weights-only checkpoint or when no optimizers were passed).
    """

    checkpoint: dict[str, Any]
    optimizers_loaded: bool


def load_into_sharded_model(
    io: CheckpointIO,
    path: str,
    model: nn.Module,
    optimizers: list[Optimizer],
    *,
    weights_only: bool | None,
    strict: bool,
    allow_missing_optimizers: bool,
) -> LoadResult:
    """Load ``path`` into ``model`` (and ``optimizers``) in place, on every rank.

    Args:
        io: The checkpoint IO (``MegatronFSDPCheckpointIO`` or a wrapper of it).
        path: The checkpoint directory (the same on every rank).
        model: The sharded model.
        optimizers: The ``fully_shard_optimizer``-adapted optimizers to fill (none when
            evaluating).
        weights_only: Passed to ``torch.load`` for the non-tensor part.
        strict: Refuse missing and unexpected keys.
        allow_missing_optimizers: Accept a checkpoint without optimizer state although
            ``optimizers`` were passed (they stay fresh).

    Returns:
        The loaded checkpoint and whether optimizer state was loaded.

    Raises:
        NotACheckpointError: ``path`` is missing, a file, or incomplete.
        CheckpointMismatchError: The checkpoint does not fit the model or optimizers, or
            it holds no optimizer state and ``allow_missing_optimizers`` is off.
        CheckpointError: Building targets, reading or applying failed on some rank.
    """
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    ranks = Ranks.of()
    peek = _inspect(path, getattr(io, "storage_options", None)) if ranks.rank == 0 else None
    foreign, saved_optimizers = ranks.broadcast_from_first(peek) or (False, None)
    if foreign:
        load_full_weights(model, path, optimizers=optimizers, strict=strict)
        meta = torch.load(Path(path, META_FILE), map_location="cpu", weights_only=weights_only)
        return LoadResult(meta, bool(optimizers))
    if optimizers and saved_optimizers == 0:
        if not allow_missing_optimizers:
            raise CheckpointMismatchError(
                f"Checkpoint {path} holds no optimizer state (it was saved with "
                "weights_only=True, e.g. by ModelCheckpoint(save_weights_only=True)), so fit() "
                f"cannot resume the run exactly with its {len(optimizers)} optimizer(s). To "
                "train on from its weights with fresh optimizer state, set "
                "strategy.allow_weights_only_resume = True before fit; to evaluate it, use "
                "trainer.validate/test/predict(ckpt_path=...); to resume exactly, save "
                "checkpoints with optimizer state."
            )
        optimizers = []
    state: dict[str, Any] = {}
    error: Exception | None = None
    try:
        state = _load_targets(model, optimizers)
    except Exception as err:
        error = err
    ranks.raise_together(
        f"loading checkpoint {path} (building the load targets)",
        error,
        CheckpointError,
        consequence="nothing was read; the model and optimizers are unchanged",
    )
    checkpoint = io.load_checkpoint(path, weights_only=weights_only, state=state, strict=strict)
    try:
        for optimizer, optimizer_state in zip(
            optimizers, checkpoint.get("optimizer_states", []) if optimizers else [], strict=True
        ):
            set_optimizer_state_dict(model, optimizer, optimizer_state)
        _megatron.sync_compute_weights(model)
    except Exception as err:
        error = err
    ranks.raise_together(
        f"loading checkpoint {path} (applying the loaded state)",
        error,
        CheckpointError,
        consequence="the tensors were loaded but the optimizers may be half restored; do not "
        "train on, load again",
    )
    return LoadResult(checkpoint, bool(optimizers))


def _inspect(path: str, storage_options: Any = None) -> tuple[bool, int | None]:
    """(Is it a foreign Lightning DCP directory, how many optimizers it saved).

    Filesystem work for rank 0 only: restores a checkpoint a crash left renamed aside
    first. An unreadable checkpoint is the IO's to explain (``None`` optimizers). On an
    object store: the newest complete version's manifest (ours only).
    """
    if is_url(path):
        try:
            store, inside = open_store(path, storage_options)
            version = store.locate(inside)
            manifest = None if version is None else store.read_manifest(version)
        except (CheckpointError, OSError, ValueError, ImportError):
            return False, None
        return False, None if manifest is None else len(manifest.optimizer_fingerprints)
    with contextlib.suppress(OSError):
        recover_checkpoint(os.fspath(path))
    if _is_foreign_lightning_dcp(path):
        return True, None
    try:
        return False, len(read_manifest(os.fspath(path)).optimizer_fingerprints)
    except (CheckpointError, OSError, ValueError, TypeError):
        return False, None


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
    from torch.distributed.checkpoint import FileSystemReader

    try:
        keys = FileSystemReader(directory).read_metadata().state_dict_metadata
    except Exception:
        return False
    return any(re.match(r"optimizer_\d+\.", key) for key in keys)


def _load_targets(model: nn.Module, optimizers: list[Optimizer]) -> dict[str, Any]:
    """FQN-keyed state dicts of the live model (and ``optimizers``) for DCP to load into.

    Rank-local. A fresh optimizer first gets all-zero state (``ensure_optimizer_state``),
    equivalent to one that never stepped, so a load works before the first step.
    """
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    model_state = get_model_state_dict(model)
    attach_uneven_dtensor_metadata(model, model_state, {})
    state: dict[str, Any] = {"state_dict": model_state}
    if optimizers:
        for optimizer in optimizers:
            ensure_optimizer_state(optimizer)
        state["optimizer_states"] = [get_optimizer_state_dict(model, o) for o in optimizers]
        for optimizer_state in state["optimizer_states"]:
            attach_uneven_dtensor_metadata(model, {}, optimizer_state)
    return state
