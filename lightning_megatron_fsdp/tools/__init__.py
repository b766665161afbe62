"""Offline tools: inspect, verify and export checkpoints without a process group."""

from lightning_megatron_fsdp.lazy_exports import lazy_exports

_EXPORTS = {
    "export": ("consolidate_checkpoint",),
    "inspection": ("CheckpointInfo", "TensorInfo", "inspect_checkpoint", "verify_checkpoint"),
    "lightning_checkpoint": ("export_lightning_checkpoint", "load_lightning_module"),
}
__all__, __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
