"""Recognise checkpoints written by megatron-fsdp's own ``save_checkpoint`` (0.7 and later).

Problem: ``megatron_fsdp.experimental.checkpoint.save_checkpoint(model, optimizer, dir)``
writes a plain DCP directory, ``dcp.save({"model": get_model_state_dict(model),
"optimizer": get_optimizer_state_dict(model, optimizer)})`` with megatron's gather-based
chunk metadata attached, so its keys are::

    model.<fqn>                               parameters and buffers
    optimizer.state.<fqn>.<name>              e.g. exp_avg, exp_avg_sq, step
    optimizer.param_groups.<g>.<name>         hyper-parameters (non-tensor)

There is no ``manifest.json`` and no ``meta.pt``. Read as any DCP directory, its model
keys keep a ``model.`` prefix that matches no FQN and its optimizer state is not found, and
``inspect``/``verify`` report the missing manifest as damage.

How: DCP records, for each flat key, its path in the saved (nested) dict
(``Metadata.planner_data``). In this format every path starts with ``"model"`` or
``"optimizer"`` and has at least two parts, e.g. ``("model", "embed.weight")`` or
``("optimizer", "state", "embed.weight", "exp_avg")``. A plain ``dcp.save`` of
``model.state_dict()`` whose module has a child named ``model`` also has ``model.``
keys, but one-part paths (``("model.layer.weight",)``), so the two are not confused. The
keys are mapped to the internal convention of :mod:`~lightning_megatron_fsdp.pretrained`
(FQNs, and ``optimizer_states.0.`` for the one optimizer).

Alternatives rejected:
    * Matching key prefixes alone: ambiguous with a state dict whose first module is
      ``model`` (a LightningModule's ``self.model``), as above.
    * Importing ``megatron_fsdp.experimental.checkpoint``: it only exists from 0.7 on,
      and reading the format needs nothing from it; a 0.6.1 install reads it too.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata

__all__ = ["FORMAT_NAME", "NOTE", "internal_keys", "is_upstream_checkpoint"]

#: What ``inspect`` reports as the format of such a directory.
FORMAT_NAME = "megatron-fsdp save_checkpoint"

#: The remark ``inspect`` prints instead of "manifest.json missing".
NOTE = (
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
