"""Train with NVIDIA Megatron-FSDP in PyTorch Lightning, and checkpoint/resume it bit-exactly."""

from lightning_megatron_fsdp.cpu_execution import cpu_execution_enabled, enable_cpu_execution
from lightning_megatron_fsdp.optimizer_state import ensure_optimizer_state
from lightning_megatron_fsdp.sharding import shard_module
from lightning_megatron_fsdp.uneven_dtensor import (
    attach_uneven_dtensor_metadata,
    chunk_metadata_by_fqn,
)

__version__ = "0.1.0"

__all__ = [
    "attach_uneven_dtensor_metadata",
    "chunk_metadata_by_fqn",
    "cpu_execution_enabled",
    "enable_cpu_execution",
    "ensure_optimizer_state",
    "shard_module",
]
