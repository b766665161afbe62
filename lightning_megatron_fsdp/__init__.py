"""Train with NVIDIA Megatron-FSDP in PyTorch Lightning, and checkpoint/resume it bit-exactly.

Public names are imported on first use (PEP 562), so the offline console script, which
needs neither Lightning nor megatron-fsdp, does not pay for them. Importing the package
anywhere else imports the strategies at once, which registers ``strategy="megatron_fsdp"``
with the Trainer and with Fabric.
"""

import importlib
import os
import sys
from typing import TYPE_CHECKING

from lightning_megatron_fsdp.lazy_exports import lazy_exports

if TYPE_CHECKING:
    from lightning_megatron_fsdp.checkpoint import MegatronFSDPCheckpointIO
    from lightning_megatron_fsdp.common import (
        MegatronFSDPPrecision,
        clip_sharded_grad_norm_,
        clip_sharded_grad_value_,
    )
    from lightning_megatron_fsdp.errors import (
        CheckpointCorruptedError,
        CheckpointError,
        CheckpointMismatchError,
        CheckpointSaveError,
        NotACheckpointError,
    )
    from lightning_megatron_fsdp.megatron import (
        ShardingMode,
        attach_uneven_dtensor_metadata,
        chunk_metadata_by_fqn,
        cpu_execution_enabled,
        enable_cpu_execution,
        ensure_optimizer_state,
        fsdp_placements,
        full_tensor,
        grad_norm,
        hsdp_placements,
        shard_module,
        sharded_grad_norm,
        sharding_scope,
    )
    from lightning_megatron_fsdp.storage import (
        interrupted_saves,
        is_complete_checkpoint,
        read_manifest,
        resolve_latest_checkpoint,
    )
    from lightning_megatron_fsdp.strategies import MegatronFSDPStrategy
    from lightning_megatron_fsdp.tools import (
        CheckpointInfo,
        TensorInfo,
        consolidate_checkpoint,
        export_lightning_checkpoint,
        inspect_checkpoint,
        load_lightning_module,
        verify_checkpoint,
    )
    from lightning_megatron_fsdp.weights import (
        FullWeightsLoad,
        PretrainedWeights,
        load_full_weights,
    )

__version__ = "0.1.0"

_EXPORTS = {
    "checkpoint": ("MegatronFSDPCheckpointIO",),
    "common": ("MegatronFSDPPrecision", "clip_sharded_grad_norm_", "clip_sharded_grad_value_"),
    "errors": (
        "CheckpointCorruptedError",
        "CheckpointError",
        "CheckpointMismatchError",
        "CheckpointSaveError",
        "NotACheckpointError",
    ),
    "megatron": (
        "ShardingMode",
        "attach_uneven_dtensor_metadata",
        "chunk_metadata_by_fqn",
        "cpu_execution_enabled",
        "enable_cpu_execution",
        "ensure_optimizer_state",
        "fsdp_placements",
        "full_tensor",
        "grad_norm",
        "hsdp_placements",
        "shard_module",
        "sharded_grad_norm",
        "sharding_scope",
    ),
    "storage": (
        "interrupted_saves",
        "is_complete_checkpoint",
        "read_manifest",
        "resolve_latest_checkpoint",
    ),
    "strategies": ("MegatronFSDPStrategy",),
    "tools": (
        "CheckpointInfo",
        "TensorInfo",
        "consolidate_checkpoint",
        "export_lightning_checkpoint",
        "inspect_checkpoint",
        "load_lightning_module",
        "verify_checkpoint",
    ),
    "weights": ("FullWeightsLoad", "PretrainedWeights", "load_full_weights"),
}

# ``__all__`` stays a literal below, for type checkers and linters, as the imports above do.
_, __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

CONSOLE_SCRIPT = "lightning-megatron-fsdp"


def _import_ignoring(module: str, message: str) -> None:
    """Import ``module`` with the one ``UserWarning`` it raises on import that starts with
    ``message`` ignored, by a filter that exists for the import only: any other warning,
    and this one raised later, still shows.

    ``warnings.catch_warnings`` was rejected: on exit it also drops the filters the import
    itself installs (torch's and sympy's, for modules they import lazily).
    """
    from lightning_megatron_fsdp.known_warnings import ignore, stop_ignoring

    added = ignore(message, UserWarning, module)
    try:
        importlib.import_module(module)
    finally:
        stop_ignoring(added)


if os.path.basename(getattr(sys, "argv", [""])[0] or "") != CONSOLE_SCRIPT:
    # megatron-fsdp says on import, without Transformer Engine or Apex (every CPU install),
    # that it falls back to its own kernels: nothing a user can act on.
    _import_ignoring("megatron_fsdp", "Transformer Engine and Apex are not installed")
    # Registers strategy="megatron_fsdp" with the Trainer and with Fabric.
    importlib.import_module(f"{__name__}.strategies.strategy")
    importlib.import_module(f"{__name__}.fabric")

__all__ = [
    "CheckpointCorruptedError",
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointMismatchError",
    "CheckpointSaveError",
    "FullWeightsLoad",
    "MegatronFSDPCheckpointIO",
    "MegatronFSDPPrecision",
    "MegatronFSDPStrategy",
    "NotACheckpointError",
    "PretrainedWeights",
    "ShardingMode",
    "TensorInfo",
    "attach_uneven_dtensor_metadata",
    "chunk_metadata_by_fqn",
    "clip_sharded_grad_norm_",
    "clip_sharded_grad_value_",
    "consolidate_checkpoint",
    "cpu_execution_enabled",
    "enable_cpu_execution",
    "ensure_optimizer_state",
    "export_lightning_checkpoint",
    "fsdp_placements",
    "full_tensor",
    "grad_norm",
    "hsdp_placements",
    "inspect_checkpoint",
    "interrupted_saves",
    "is_complete_checkpoint",
    "load_full_weights",
    "load_lightning_module",
    "read_manifest",
    "resolve_latest_checkpoint",
    "shard_module",
    "sharded_grad_norm",
    "sharding_scope",
    "verify_checkpoint",
]
