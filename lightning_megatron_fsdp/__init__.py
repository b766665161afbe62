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
    from lightning_megatron_fsdp.cpu_execution import cpu_execution_enabled, enable_cpu_execution
    from lightning_megatron_fsdp.export import consolidate_checkpoint
    from lightning_megatron_fsdp.gather import full_tensor, grad_norm
    from lightning_megatron_fsdp.inspection import (
        CheckpointInfo,
        TensorInfo,
        inspect_checkpoint,
        verify_checkpoint,
    )
    from lightning_megatron_fsdp.lightning_checkpoint import (
        export_lightning_checkpoint,
        load_lightning_module,
    )
    from lightning_megatron_fsdp.optimizer_state import ensure_optimizer_state
    from lightning_megatron_fsdp.precision import (
        MegatronFSDPPrecision,
        clip_sharded_grad_norm_,
        clip_sharded_grad_value_,
        sharded_grad_norm,
    )
    from lightning_megatron_fsdp.pretrained import (
        FullWeightsLoad,
        PretrainedWeights,
        load_full_weights,
    )
    from lightning_megatron_fsdp.sharding import (
        fsdp_placements,
        hsdp_placements,
        shard_module,
        sharding_scope,
    )
    from lightning_megatron_fsdp.sharding_modes import ShardingMode
    from lightning_megatron_fsdp.strategy import MegatronFSDPStrategy
    from lightning_megatron_fsdp.uneven_dtensor import (
        attach_uneven_dtensor_metadata,
        chunk_metadata_by_fqn,
    )

__version__ = "0.1.0"

_EXPORTS = {
    "CheckpointCorruptedError": "checkpoint.errors",
    "CheckpointError": "checkpoint.errors",
    "CheckpointInfo": "inspection",
    "CheckpointMismatchError": "checkpoint.errors",
    "CheckpointSaveError": "checkpoint.errors",
    "FullWeightsLoad": "pretrained",
    "MegatronFSDPCheckpointIO": "checkpoint.io",
    "MegatronFSDPPrecision": "precision",
    "MegatronFSDPStrategy": "strategy",
    "NotACheckpointError": "checkpoint.errors",
    "PretrainedWeights": "pretrained",
    "ShardingMode": "sharding_modes",
    "TensorInfo": "inspection",
    "attach_uneven_dtensor_metadata": "uneven_dtensor",
    "chunk_metadata_by_fqn": "uneven_dtensor",
    "clip_sharded_grad_norm_": "precision",
    "clip_sharded_grad_value_": "precision",
    "consolidate_checkpoint": "export",
    "cpu_execution_enabled": "cpu_execution",
    "enable_cpu_execution": "cpu_execution",
    "ensure_optimizer_state": "optimizer_state",
    "export_lightning_checkpoint": "lightning_checkpoint",
    "fsdp_placements": "sharding",
    "full_tensor": "gather",
    "grad_norm": "gather",
    "hsdp_placements": "sharding",
    "inspect_checkpoint": "inspection",
    "interrupted_saves": "checkpoint.commit",
    "is_complete_checkpoint": "checkpoint.format",
    "load_full_weights": "pretrained",
    "load_lightning_module": "lightning_checkpoint",
    "read_manifest": "checkpoint.format",
    "resolve_latest_checkpoint": "checkpoint.commit",
    "shard_module": "sharding",
    "sharded_grad_norm": "precision",
    "sharding_scope": "sharding",
    "verify_checkpoint": "inspection",
}

CONSOLE_SCRIPT = "lightning-megatron-fsdp"


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


if os.path.basename(getattr(sys, "argv", [""])[0] or "") != CONSOLE_SCRIPT:
    # Registers strategy="megatron_fsdp" with the Trainer and with Fabric.
    importlib.import_module(f"{__name__}.strategy")
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
