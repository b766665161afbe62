"""torch's public ``CheckpointableTensor`` protocol as the route for our chunk metadata where
DCP honours it (torch >= 2.14); the ``__create_chunk_list__``/``__create_write_items__`` hooks
of :mod:`~lightning_megatron_fsdp.megatron.uneven_dtensor` where it does not (2.13).

A plain local tensor that carries ``global_shape``, ``global_offsets``, ``local_offsets`` and
``local_sizes`` is saved and loaded by DCP as shards of that global tensor: what our hooks do
privately. ``DTensor`` does not consult the protocol (it forwards only the hooks), so this
route hands DCP each parameter's local shard, annotated with the chunk the hooks already
carry: rank-local, no collective, and the checkpoint's ``.metadata`` describes the same
chunks, storage keys and planner data, so a checkpoint written through either route loads
through the other. :func:`dcp_view` picks the route for the running torch; every save and
load of sharded state goes through it.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from lightning_megatron_fsdp import _torch
from lightning_megatron_fsdp.megatron.uneven_dtensor import CHUNK_ATTR

__all__ = ["PROTOCOL_AVAILABLE", "as_checkpointable", "dcp_view", "keep_loaded_values"]

PROTOCOL_AVAILABLE = _torch.CHECKPOINTABLE_TENSOR_PROTOCOL


def dcp_view(state: dict[str, Any]) -> dict[str, Any]:
    """What to hand ``dcp.save`` or ``dcp.load`` for ``state`` (prepared by
    :func:`~lightning_megatron_fsdp.attach_uneven_dtensor_metadata`): on a torch whose DCP
    honours the protocol, :func:`as_checkpointable` of it; before, ``state`` itself, whose
    DTensors carry the hooks. After a load, pass both to :func:`keep_loaded_values`."""
    return as_checkpointable(state) if PROTOCOL_AVAILABLE else state


def keep_loaded_values(state: Any, view: Any) -> None:
    """After ``dcp.load(view)`` with ``view = dcp_view(state)``: what DCP assigned into
    ``view``'s containers (values stored as bytes: learning rates, ``step`` counts that are
    not tensors, ...) assigned into ``state``'s. Tensors need nothing: DCP read each into
    its own storage, which ``view``'s shards share. A no-op on the hook route."""
    if view is state:
        return
    items = view.items() if isinstance(view, Mapping) else enumerate(view)
    for key, value in items:
        current = state[key]
        if isinstance(current, DTensor) or value is current:
            continue  # read in place: a DTensor through its annotated shard, a tensor as is
        if (isinstance(current, Mapping) and isinstance(value, Mapping)) or (
            isinstance(current, list) and isinstance(value, list) and len(current) == len(value)
        ):
            keep_loaded_values(current, value)
        elif isinstance(state, (MutableMapping, list)):
            state[key] = value


def as_checkpointable(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """The state dict with each chunk-carrying DTensor replaced by its annotated local shard.

    Call it on state dicts that :func:`~lightning_megatron_fsdp.attach_uneven_dtensor_metadata`
    prepared; pass the result to ``dcp.save`` or ``dcp.load``. Each shard is a view of the
    DTensor's local tensor (a load writes into the model's and optimizer's own storage, and
    nothing is set on their tensors); an empty shard declares no chunk, as the hook route
    plans no write for it. Mappings and lists are copied (a load assigns values read as
    bytes into the copies: :func:`keep_loaded_values`), everything else is shared.

    Raises:
        RuntimeError: If this torch's DCP does not honour the ``CheckpointableTensor``
            protocol (before 2.14).
        KeyError: If a DTensor carries no chunk (``attach_uneven_dtensor_metadata`` did
            not see it): DCP would place it at canonical ``Shard(0)`` offsets.
    """
    if not PROTOCOL_AVAILABLE:
        raise RuntimeError(
            f"torch {torch.__version__}'s DCP does not honour "
            "torch.distributed.checkpoint.CheckpointableTensor (added in torch 2.14). Pass the "
            "DTensor state dicts prepared by attach_uneven_dtensor_metadata to DCP directly "
            "(the hook route)."
        )
    converted: dict[str, Any] = _convert(state_dict, "state_dict")
    return converted


def _convert(value: Any, path: str) -> Any:
    if isinstance(value, DTensor):
        return _annotated_shard(value, path)
    if isinstance(value, Mapping):
        return {key: _convert(item, f"{path}[{key!r}]") for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        converted = [_convert(item, f"{path}[{i}]") for i, item in enumerate(value)]
        return converted if isinstance(value, list) else tuple(converted)
    return value


def _annotated_shard(dtensor: DTensor, where: str) -> torch.Tensor:
    """A view of ``dtensor``'s local shard carrying the protocol's four fields."""
    with torch.no_grad():
        local = dtensor.to_local()
    chunk = getattr(local, CHUNK_ATTR, None)
    if chunk is None:
        raise KeyError(
            f"DTensor {where} carries no Megatron-FSDP chunk: attach_uneven_dtensor_metadata "
            "did not see it, and DCP would place it at canonical Shard(0) offsets. Prepare "
            "the state dicts with attach_uneven_dtensor_metadata first."
        )
    shard = local.view_as(local)
    shard.global_shape = tuple(dtensor.shape)
    if local.numel():
        shard.global_offsets = (tuple(chunk.offsets),)
        shard.local_offsets = ((0,) * local.dim(),)
        shard.local_sizes = (tuple(chunk.sizes),)
    else:
        shard.global_offsets = shard.local_offsets = shard.local_sizes = ()
    return shard
