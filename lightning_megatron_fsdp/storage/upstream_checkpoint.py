"""Recognise checkpoints written by megatron-fsdp's own ``save_checkpoint`` (0.7 and later: a
DCP directory without manifest, keys under ``model.`` and ``optimizer.``) by the planner
paths DCP records, and map their keys to the package's internal convention, so loading,
inspecting and verifying them work.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata

__all__ = ["UPSTREAM_FORMAT_NAME", "UPSTREAM_NOTE", "internal_keys", "is_upstream_checkpoint"]

#: What ``inspect`` reports as the format of such a directory.
UPSTREAM_FORMAT_NAME = "megatron-fsdp save_checkpoint"

#: The remark ``inspect`` prints instead of "manifest.json missing".
UPSTREAM_NOTE = (
    "written by megatron_fsdp.experimental.checkpoint.save_checkpoint (keys model.<fqn>, "
    "optimizer.state.<fqn>.<name>): no manifest.json or meta.pt, so no checksums, epoch "
    "or step. Load it with init_weights_from= / load_full_weights (weights, and optimizer "
    "state for the same optimizer)."
)

_MODEL, _OPTIMIZER = "model", "optimizer"
# The internal key prefix of optimizer 0 (pretrained._OPTIMIZER_PREFIX).
_INTERNAL_OPTIMIZER = "optimizer_states.0."


def _paths(metadata: Metadata) -> Mapping[str, Any]:
    paths = getattr(metadata, "planner_data", None)
    return paths if isinstance(paths, Mapping) else {}


def is_upstream_checkpoint(metadata: Metadata) -> bool:
    """Whether DCP ``metadata`` describes a ``save_checkpoint`` directory (see module doc)."""
    paths = _paths(metadata)
    keys = metadata.state_dict_metadata
    if not keys or any(key not in paths for key in keys):
        return False
    has_model = False
    for key in keys:
        path = tuple(paths[key])
        if len(path) < 2 or path[0] not in (_MODEL, _OPTIMIZER):
            return False
        has_model = has_model or path[0] == _MODEL
    return has_model


def internal_keys(metadata: Metadata) -> dict[str, str]:
    """Map internal keys (FQNs; ``optimizer_states.0.<rest>``) to the directory's DCP keys.

    Args:
        metadata: DCP metadata for which :func:`is_upstream_checkpoint` holds.

    Returns:
        ``{internal key: DCP key}`` for every entry.
    """
    mapping: dict[str, str] = {}
    for key in metadata.state_dict_metadata:
        head, _, rest = key.partition(".")
        if head == _MODEL:
            mapping[rest] = key
        else:
            mapping[_INTERNAL_OPTIMIZER + rest] = key
    return mapping
