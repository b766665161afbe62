"""A sharded model's checkpoint, saved and loaded in place: the glue both strategies call.

The checkpoint protocol (``checkpoint/``) saves and loads a state dict; a strategy holds a
sharded model and its optimizers. This module turns one into the other in both
directions, side by side, so the Trainer and Fabric drive one copy: a save attaches each
packed shard's true chunk and every rank's random streams, a load builds FQN-keyed targets
from the live model, sends a foreign (FSDP2) directory to the full-weights reader, and
applies the loaded optimizer state.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from lightning.fabric.plugins import CheckpointIO
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.optim import Optimizer

from lightning_megatron_fsdp.agreement import Ranks, dcp_failure_message
from lightning_megatron_fsdp.checkpoint import (
    LoadOptions,
    MegatronFSDPCheckpointIO,
    PerRank,
    open_checkpoint,
    read_checkpoint,
)
from lightning_megatron_fsdp.common.exact_resume import RNG_STATES_KEY, rng_states_of
from lightning_megatron_fsdp.errors import (
    CheckpointError,
    CheckpointMismatchError,
    CheckpointSaveError,
)
from lightning_megatron_fsdp.megatron import (
    _megatron,
    attach_uneven_dtensor_metadata,
    ensure_optimizer_state,
)
from lightning_megatron_fsdp.storage import (
    META_FILE,
    LocalDirectories,
    load_weights_only,
    read_regular,
)
from lightning_megatron_fsdp.weights import load_full_weights

__all__ = ["LoadResult", "OptimizerMatcher", "load_into_sharded_model", "save_sharded_checkpoint"]

OptimizerMatcher = Callable[[dict[str, Any], int], list[Optimizer]]
"""The optimizers to fill, in the order the checkpoint saved their states, from its
``meta.pt`` dict and the number of optimizer states it holds; raises
``CheckpointMismatchError`` when they do not fit."""


def save_sharded_checkpoint(
    io: CheckpointIO,
    checkpoint: dict[str, Any],
    filepath: Any,
    model: nn.Module,
    rng_states: Any,
    *,
    where: str,
    storage_options: Any | None = None,
    commit: bool = False,
) -> None:
    """Save ``checkpoint`` with each packed shard's true chunk attached. Collective.

    ``checkpoint`` is Lightning's checkpoint dict: ``"state_dict"`` (FQN-keyed, from
    ``get_model_state_dict``), ``"optimizer_states"`` (FQN-keyed, from
    ``get_optimizer_state_dict``) and the picklable rest; ``rng_states`` is this rank's
    random streams, gathered into rank 0's ``meta.pt``. The path is rank 0's. Attaching is
    rank-local and can fail on one rank alone, so the ranks agree on its outcome before
    the IO's first collective. With ``commit`` the IO's teardown runs after the save, so an
    async save is committed when the call returns (nothing later waits for it).

    Raises:
        CheckpointSaveError: On every rank if any rank fails (naming the failing rank and
            its error); nothing is written.
    """

    def attach() -> None:
        attach_uneven_dtensor_metadata(model, checkpoint.get("state_dict", {}), {})
        for optimizer_state in checkpoint.get("optimizer_states", []):
            attach_uneven_dtensor_metadata(model, {}, optimizer_state)

    # Every rank's random streams, in rank 0's meta.pt: gathered by the save's first round.
    checkpoint[RNG_STATES_KEY] = PerRank(rng_states, combine=rng_states_of)
    with _dcp_failures(CheckpointSaveError, f"{where}: ", "Saving", filepath):
        if isinstance(io, MegatronFSDPCheckpointIO):
            # One round agrees on the path, the attached metadata and the layout.
            io.save_checkpoint(checkpoint, filepath, storage_options, prepare=attach)
        else:  # a wrapper or another plugin: the same steps, a round each
            ranks = Ranks.of()
            path = ranks.broadcast_from_first(str(filepath))
            checkpoint[RNG_STATES_KEY] = rng_states_of(
                ranks.all_gather(checkpoint[RNG_STATES_KEY].value)
            )
            error: Exception | None = None
            try:
                attach()
            except Exception as err:
                error = err
            ranks.raise_together(
                f"{where}: saving checkpoint {path} (attaching chunk metadata)",
                error,
                CheckpointSaveError,
                consequence="nothing was written",
            )
            io.save_checkpoint(checkpoint, path, storage_options=storage_options)
        if commit:
            io.teardown()


@contextlib.contextmanager
def _dcp_failures(
    error_type: type[CheckpointError], prefix: str, action: str, path: Any
) -> Iterator[None]:
    """Raise DCP's ``CheckpointException`` (a ``BaseException``: never let it escape as is)
    as ``error_type``, naming the failing ranks."""
    try:
        yield
    except CheckpointException as err:
        raise error_type(prefix + dcp_failure_message(action, path, err)) from err


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
    io: Any,
    path: str,
    model: nn.Module,
    optimizers: list[Optimizer],
    *,
    weights_only: bool | None,
    strict: bool,
    allow_missing_optimizers: bool,
    match_optimizers: OptimizerMatcher | None = None,
    where: str = "",
) -> LoadResult:
    """Load ``path`` into ``model`` (and ``optimizers``) in place, on every rank.

    With a ``MegatronFSDPCheckpointIO`` (anything with ``load_options`` and
    ``process_group``): three rounds of ours (open, agree, apply); the manifest is parsed
    once (rank 0) and ``meta.pt`` read once per rank, the targets built from it. Another
    checkpoint IO (say, a wrapper) is called through its ``load_checkpoint(path,
    state=...)``, first without targets when ``match_optimizers`` needs ``meta.pt``.

    Args:
        io: The checkpoint IO (``MegatronFSDPCheckpointIO`` or a wrapper of it).
        path: The checkpoint directory (rank 0's is loaded).
        model: The sharded model.
        optimizers: The ``fully_shard_optimizer``-adapted optimizers to fill (none when
            evaluating).
        weights_only: Passed to ``torch.load`` for the non-tensor part.
        strict: Refuse missing and unexpected keys.
        allow_missing_optimizers: Accept a checkpoint without optimizer state although
            ``optimizers`` were passed (they stay fresh).
        match_optimizers: Picks and orders ``optimizers`` by what the checkpoint saved
            (Fabric's keys); it decides about a checkpoint without optimizer state too.
            ``None``: by position.
        where: Names the strategy in errors.

    Returns:
        The loaded checkpoint and whether optimizer state was loaded.

    Raises:
        NotACheckpointError: ``path`` is missing, a file, or incomplete.
        CheckpointMismatchError: The checkpoint does not fit the model or optimizers, or
            it holds no optimizer state and ``allow_missing_optimizers`` is off.
        CheckpointError: Building targets, reading or applying failed on some rank.
    """
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    with _dcp_failures(CheckpointError, f"{where}: " if where else "", "Loading", path):
        options: LoadOptions | None = getattr(io, "load_options", None)
        ranks = Ranks.of(getattr(io, "process_group", None) if options is not None else None)
        if options is not None:
            io.wait()  # an async save in flight commits first
            store = options.store
        else:
            store = LocalDirectories()
        opened = open_checkpoint(path, ranks, store, options)
        if opened.foreign:
            load_full_weights(model, opened.path, optimizers=optimizers, strict=strict)
            meta = load_weights_only(
                read_regular(opened.path, META_FILE),
                source=str(Path(opened.path, META_FILE)),
                trust=weights_only is False,
            )
            return LoadResult(meta, bool(optimizers))
        saved_optimizers = (
            None if opened.manifest is None else len(opened.manifest.optimizer_fingerprints)
        )
        if optimizers and saved_optimizers == 0 and match_optimizers is None:
            if not allow_missing_optimizers:
                raise CheckpointMismatchError(
                    f"Checkpoint {opened.path} holds no optimizer state (it was saved with "
                    "weights_only=True, e.g. by ModelCheckpoint(save_weights_only=True)), so fit() "
                    f"cannot resume the run exactly with its {len(optimizers)} optimizer(s). To "
                    "train on from its weights with fresh optimizer state, set "
                    "strategy.allow_weights_only_resume = True before fit; to evaluate it, use "
                    "trainer.validate/test/predict(ckpt_path=...); to resume exactly, save "
                    "checkpoints with optimizer state."
                )
            optimizers = []
        chosen = optimizers
        error: Exception | None = None

        def targets(meta: dict[str, Any]) -> dict[str, Any]:
            nonlocal chosen
            if optimizers and match_optimizers is not None:
                assert saved_optimizers is not None  # a checkpoint of ours has a manifest
                chosen = match_optimizers(meta, saved_optimizers)
            return _load_targets(model, chosen)

        if options is not None:
            checkpoint = read_checkpoint(
                opened, targets, ranks, options, weights_only=weights_only, strict=strict
            )
        else:
            state: dict[str, Any] = {}
            try:
                meta = {}
                if optimizers and match_optimizers is not None:
                    meta = io.load_checkpoint(
                        str(opened.path), weights_only=weights_only, state=None
                    )
                state = targets(meta)
            except Exception as err:
                error = err
            mismatch = isinstance(error, CheckpointMismatchError)
            ranks.raise_together(
                f"loading checkpoint {opened.path} (building the load targets)",
                error,
                CheckpointMismatchError if mismatch else CheckpointError,
                consequence="nothing was read; the model and optimizers are unchanged",
            )
            checkpoint = io.load_checkpoint(
                str(opened.path), weights_only=weights_only, state=state, strict=strict
            )
        optimizers = chosen
        try:
            for optimizer, optimizer_state in zip(
                optimizers,
                checkpoint.get("optimizer_states", []) if optimizers else [],
                strict=True,
            ):
                set_optimizer_state_dict(model, optimizer, optimizer_state)
            _megatron.sync_compute_weights(model)
        except Exception as err:
            error = err
        ranks.raise_together(
            f"loading checkpoint {opened.path} (applying the loaded state)",
            error,
            CheckpointError,
            consequence="the tensors were loaded but the optimizers may be half restored; do not "
            "train on, load again",
        )
        return LoadResult(checkpoint, bool(optimizers))


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
