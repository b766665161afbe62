"""torch's public ``CheckpointableTensor`` protocol as a second route for our chunk metadata.

torch 2.14 made public what our ``__create_chunk_list__``/``__create_write_items__`` hooks
(:mod:`~lightning_megatron_fsdp.megatron.uneven_dtensor`) do privately: a plain local tensor that
carries ``global_shape``, ``global_offsets``, ``local_offsets`` and ``local_sizes`` is saved
and loaded by DCP as shards of that global tensor. ``DTensor`` does not consult the protocol
(it forwards only the hooks), so this route hands DCP each parameter's local shard, annotated
with the chunk the hooks already carry: rank-local, no collective, and the checkpoint's
``.metadata`` is the hook route's (the same chunks, storage keys and planner data), so a
checkpoint written through either route loads through the other. Where torch lacks the
protocol (2.13) only the hook route exists, and :func:`as_checkpointable` says so.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from lightning_megatron_fsdp.megatron.uneven_dtensor import CHUNK_ATTR

try:  # torch >= 2.14
    from torch.distributed.checkpoint import CheckpointableTensor
except ImportError:  # torch 2.13: the hooks are the only route
    CheckpointableTensor = None  # type: ignore[assignment,misc]

__all__ = ["PROTOCOL_AVAILABLE", "as_checkpointable"]

PROTOCOL_AVAILABLE = CheckpointableTensor is not None


def as_checkpointable(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """The state dict with each chunk-carrying DTensor replaced by its annotated local shard.

    Call it on state dicts that :func:`~lightning_megatron_fsdp.attach_uneven_dtensor_metadata`
    prepared; pass the result to ``dcp.save`` or ``dcp.load``. Each shard is a view of the
    DTensor's local tensor (a load writes into the model's and optimizer's own storage, and
    nothing is set on their tensors); an empty shard declares no chunk, as the hook route
    plans no write for it. Mappings are copied, everything else is shared.

    Raises:
        RuntimeError: If this torch has no ``CheckpointableTensor`` protocol (before 2.14).
        KeyError: If a DTensor carries no chunk (``attach_uneven_dtensor_metadata`` did
            not see it): DCP would place it at canonical ``Shard(0)`` offsets.
    """
    if not PROTOCOL_AVAILABLE:
        raise RuntimeError(
            f"torch {torch.__version__} has no torch.distributed.checkpoint.CheckpointableTensor "
            "(added in torch 2.14). Pass the DTensor state dicts prepared by "
            "attach_uneven_dtensor_metadata to DCP directly (the hook route)."
        )
    return _convert(state_dict, "state_dict")


def _convert(value: Mapping[str, Any], path: str) -> dict[str, Any]:
    converted: dict[str, Any] = {}
    for key, item in value.items():
        where = f"{path}[{key!r}]"
        if isinstance(item, DTensor):
            converted[key] = _annotated_shard(item, where)
        elif isinstance(item, Mapping):
            converted[key] = _convert(item, where)
        else:
            converted[key] = item
    return converted


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
