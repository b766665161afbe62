"""Fabric's checkpoint state (a dict of modules, optimizers and the rest) as Lightning's
checkpoint dict and back, so a Fabric checkpoint is the format the Trainer strategy, the
checkpoint IO and the offline tools read (docs/DESIGN.md, "Fabric").
"""

from __future__ import annotations

from typing import Any

import lightning
from torch import nn
from torch.optim import Optimizer

from lightning_megatron_fsdp import _lightning
from lightning_megatron_fsdp.common import RNG_STATES_KEY
from lightning_megatron_fsdp.errors import CheckpointMismatchError
from lightning_megatron_fsdp.megatron import _megatron

__all__ = [
    "FABRIC_KEYS",
    "FabricState",
    "restore_rest",
    "saved_optimizer_order",
    "split_state",
    "to_checkpoint",
]

#: Key (in ``meta.pt``) of ``{"model": key, "optimizers": [keys], "added": [keys]}``: the
#: user's keys of the model and optimizers, and the keys the save added for the Trainer.
FABRIC_KEYS = "megatron_fsdp_fabric"
_TRAINER_KEYS = ("pytorch-lightning_version", "lr_schedulers")
_RESERVED = ("state_dict", "optimizer_states", RNG_STATES_KEY, FABRIC_KEYS)


class FabricState:
    """Fabric's state dict, sorted: the one sharded model, the optimizers, the rest.

    Attributes:
        model_key: The user's key of the sharded model.
        model: The sharded model.
        optimizers: ``(key, optimizer)`` in the state's order.
        rest: Every other entry, by key.
    """

    def __init__(self, model_key: str, model: nn.Module) -> None:
        self.model_key = model_key
        self.model = model
        self.optimizers: list[tuple[str, Optimizer]] = []
        self.rest: dict[str, Any] = {}


def split_state(state: dict[str, Any], where: str, action: str) -> FabricState:
    """Sort ``state`` (already unwrapped by Fabric) into model, optimizers and the rest.

    Raises:
        ValueError: No sharded model, or more than one module, or a key our format uses
            itself (naming it).
    """
    modules = [(k, v) for k, v in state.items() if isinstance(v, nn.Module)]
    sharded = [(k, v) for k, v in modules if _is_sharded(v)]
    if len(sharded) != 1 or len(modules) != 1:
        found = ", ".join(f"{k!r} ({type(v).__name__})" for k, v in modules) or "none"
        raise ValueError(
            f"{where}: {action} needs exactly one module set up by this strategy in the state "
            f"(found modules: {found}). Pass it as {{'model': model, 'optimizer': "
            "optimizer, ...}} after `model = fabric.setup_module(model)` or "
            "`fabric.setup(model, optimizer)`; save other models to other paths."
        )
    result = FabricState(*sharded[0])
    for key, value in state.items():
        if key in _RESERVED:
            raise ValueError(
                f"{where}: the state key {key!r} is used by the checkpoint format itself "
                f"(reserved: {', '.join(map(repr, _RESERVED))}); rename that entry."
            )
        if value is result.model:
            continue
        if isinstance(value, Optimizer):
            result.optimizers.append((key, value))
        else:
            result.rest[key] = value
    return result


def _is_sharded(module: nn.Module) -> bool:
    return any(_megatron.is_sharded_parameter(p) for p in module.parameters())


def to_checkpoint(
    state: FabricState, model_state: dict[str, Any], optimizer_states: list[dict[str, Any]]
) -> dict[str, Any]:
    """Lightning's checkpoint dict for ``state``: what the checkpoint IO saves.

    Stateful entries (a ``StatefulDataLoader``, a scheduler) are saved as their
    ``state_dict()``, everything else as it is (pickled into ``meta.pt``).
    """
    checkpoint: dict[str, Any] = {
        key: value.state_dict() if isinstance(value, _lightning.Stateful) else value
        for key, value in state.rest.items()
    }
    added = [key for key in _TRAINER_KEYS if key not in checkpoint]
    defaults = {"pytorch-lightning_version": lightning.__version__, "lr_schedulers": []}
    checkpoint.update({key: defaults[key] for key in added})
    checkpoint[FABRIC_KEYS] = {
        "model": state.model_key,
        "optimizers": [key for key, _ in state.optimizers],
        "added": added,
    }
    checkpoint["state_dict"] = model_state
    checkpoint["optimizer_states"] = optimizer_states
    return checkpoint


def saved_optimizer_order(
    meta: dict[str, Any], state: FabricState, saved_count: int, path: str, where: str, strict: bool
) -> list[Optimizer]:
    """The user's optimizers in the order the checkpoint saved their states.

    A Fabric checkpoint records the saving state's keys in ``meta.pt``: optimizers are
    matched by key, in any order. A Trainer checkpoint has no keys: they are matched by
    position. A checkpoint without optimizer state fills none, which only ``strict=False``
    accepts.

    Args:
        meta: The checkpoint's ``meta.pt``.
        state: The state being loaded.
        saved_count: How many optimizer states the checkpoint holds (its manifest).
        path: The checkpoint, for messages.
        where: Who loads, for messages.
        strict: Whether a checkpoint without optimizer state is refused.

    Raises:
        CheckpointMismatchError: The keys, or their count, differ (naming both sets).
    """
    optimizers = dict(state.optimizers)
    record = meta.get(FABRIC_KEYS)
    saved_keys = record.get("optimizers") if isinstance(record, dict) else None
    if saved_count == 0 and not strict:
        return []
    if saved_keys is None:  # a Trainer's checkpoint
        if saved_count == len(optimizers):
            return list(optimizers.values())
        saved = f"{saved_count} optimizer state(s) (saved by the Trainer, matched by position)"
        fix = "Pass as many, in the order of the LightningModule's configure_optimizers()"
    elif sorted(saved_keys) == sorted(optimizers) and len(saved_keys) == saved_count:
        return [optimizers[key] for key in saved_keys]
    else:
        saved = f"{saved_count} optimizer state(s) under the keys {sorted(saved_keys)}"
        fix = "Load with the keys the checkpoint was saved with"
    raise CheckpointMismatchError(
        f"{where}: checkpoint {path} holds {saved}, but the state passed optimizers under "
        f"{sorted(optimizers)}. {fix}{'' if saved_count else _NO_OPTIMIZER_STATE_HINT}."
    )


_NO_OPTIMIZER_STATE_HINT = " (strict=False loads it and leaves the optimizers as they are)"


def restore_rest(
    meta: dict[str, Any], state: dict[str, Any], fabric_state: FabricState, strict: bool
) -> dict[str, Any]:
    """Put the saved non-tensor entries back into ``state``; return the ones not asked for.

    As Fabric's strategies do: a Stateful object (a loader, a scheduler) gets
    ``load_state_dict``, any other entry is replaced in ``state``. Our format's own keys
    (weights, optimizer states, random states, this record, the Trainer keys the save
    added) are never returned.

    Raises:
        KeyError: With ``strict``, for a requested key the checkpoint does not hold.
    """
    record = meta.get(FABRIC_KEYS) if isinstance(meta.get(FABRIC_KEYS), dict) else {}
    hidden = set(_RESERVED) | set(record.get("added", []))
    remainder = {k: v for k, v in meta.items() if k not in hidden}
    requested = list(fabric_state.rest)
    _lightning.validate_keys_for_strict_loading(requested, remainder.keys(), strict=strict)
    for key in requested:
        if key not in remainder:
            continue
        value = remainder.pop(key)
        target = state[key]
        if isinstance(target, _lightning.Stateful):
            target.load_state_dict(value)
        else:
            state[key] = value
    return remainder
