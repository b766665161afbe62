"""Train with NVIDIA Megatron-FSDP in PyTorch Lightning, and checkpoint/resume it bit-exactly.

Public names are imported on first use (PEP 562), so the offline console script, which
needs neither Lightning nor megatron-fsdp, does not pay for them. Importing the package
anywhere else imports the strategies at once, which registers ``strategy="megatron_fsdp"``
with the Trainer and with Fabric.
"""

import importlib
import os
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lightning_megatron_fsdp.checkpoint.commit import (
        interrupted_saves,
        resolve_latest_checkpoint,
    )
    from lightning_megatron_fsdp.checkpoint.errors import (
        CheckpointCorruptedError,
        CheckpointError,
        CheckpointMismatchError,
        CheckpointSaveError,
        NotACheckpointError,
    )
    from lightning_megatron_fsdp.checkpoint.format import is_complete_checkpoint, read_manifest
    from lightning_megatron_fsdp.checkpoint.io import MegatronFSDPCheckpointIO
    from lightning_megatron_fsdp.megatron.cpu_execution import (
        cpu_execution_enabled,
        enable_cpu_execution,
    )
    from lightning_megatron_fsdp.megatron.gather import full_tensor, grad_norm, sharded_grad_norm
    from lightning_megatron_fsdp.megatron.optimizer_state import ensure_optimizer_state
    from lightning_megatron_fsdp.megatron.sharding import (
        fsdp_placements,
        hsdp_placements,
        shard_module,
        sharding_scope,
    )
    from lightning_megatron_fsdp.megatron.sharding_modes import ShardingMode
    from lightning_megatron_fsdp.megatron.uneven_dtensor import (
        attach_uneven_dtensor_metadata,
        chunk_metadata_by_fqn,
    )
    from lightning_megatron_fsdp.strategies.precision import (
        MegatronFSDPPrecision,
        clip_sharded_grad_norm_,
        clip_sharded_grad_value_,
    )
    from lightning_megatron_fsdp.strategies.strategy import MegatronFSDPStrategy
    from lightning_megatron_fsdp.tools.export import consolidate_checkpoint
    from lightning_megatron_fsdp.tools.inspection import (
        CheckpointInfo,
        TensorInfo,
        inspect_checkpoint,
        verify_checkpoint,
    )
    from lightning_megatron_fsdp.tools.lightning_checkpoint import (
        export_lightning_checkpoint,
        load_lightning_module,
    )
    from lightning_megatron_fsdp.weights.pretrained import (
        FullWeightsLoad,
        PretrainedWeights,
        load_full_weights,
    )

__version__ = "0.1.0"

_EXPORTS = {
    "CheckpointCorruptedError": "checkpoint.errors",
    "CheckpointError": "checkpoint.errors",
    "CheckpointInfo": "tools.inspection",
    "CheckpointMismatchError": "checkpoint.errors",
    "CheckpointSaveError": "checkpoint.errors",
    "FullWeightsLoad": "weights.pretrained",
    "MegatronFSDPCheckpointIO": "checkpoint.io",
    "MegatronFSDPPrecision": "strategies.precision",
    "MegatronFSDPStrategy": "strategies.strategy",
    "NotACheckpointError": "checkpoint.errors",
    "PretrainedWeights": "weights.pretrained",
    "ShardingMode": "megatron.sharding_modes",
    "TensorInfo": "tools.inspection",
    "attach_uneven_dtensor_metadata": "megatron.uneven_dtensor",
    "chunk_metadata_by_fqn": "megatron.uneven_dtensor",
    "clip_sharded_grad_norm_": "strategies.precision",
    "clip_sharded_grad_value_": "strategies.precision",
    "consolidate_checkpoint": "tools.export",
    "cpu_execution_enabled": "megatron.cpu_execution",
    "enable_cpu_execution": "megatron.cpu_execution",
    "ensure_optimizer_state": "megatron.optimizer_state",
    "export_lightning_checkpoint": "tools.lightning_checkpoint",
    "fsdp_placements": "megatron.sharding",
    "full_tensor": "megatron.gather",
    "grad_norm": "megatron.gather",
    "hsdp_placements": "megatron.sharding",
    "inspect_checkpoint": "tools.inspection",
    "interrupted_saves": "checkpoint.commit",
    "is_complete_checkpoint": "checkpoint.format",
    "load_full_weights": "weights.pretrained",
    "load_lightning_module": "tools.lightning_checkpoint",
    "read_manifest": "checkpoint.format",
    "resolve_latest_checkpoint": "checkpoint.commit",
    "shard_module": "megatron.sharding",
    "sharded_grad_norm": "megatron.gather",
    "sharding_scope": "megatron.sharding",
    "verify_checkpoint": "tools.inspection",
}

CONSOLE_SCRIPT = "lightning-megatron-fsdp"


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


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


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


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
