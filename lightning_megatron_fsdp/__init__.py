"""Train with NVIDIA Megatron-FSDP in PyTorch Lightning, and checkpoint/resume it bit-exactly."""

from lightning_megatron_fsdp.checkpoint.commit import interrupted_saves, resolve_latest_checkpoint
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
