"""Offline tools: inspect, verify and export checkpoints without a process group."""

from lightning_megatron_fsdp.lazy_exports import lazy_exports

_EXPORTS = {
    "consolidate_checkpoint": "export",
    "CheckpointInfo": "inspection",
    "TensorInfo": "inspection",
    "inspect_checkpoint": "inspection",
    "verify_checkpoint": "inspection",
    "export_lightning_checkpoint": "lightning_checkpoint",
    "load_lightning_module": "lightning_checkpoint",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
