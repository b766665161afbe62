"""The megatron-fsdp adapter: sharding, meshes, packed-shard chunks, replicas, CPU execution.

Other folders use the names below; megatron-fsdp's own objects are reached through the
adapter module ``_megatron`` (as torch's and Lightning's through ``_torch`` and
``_lightning``).
"""

from lightning_megatron_fsdp.lazy_exports import lazy_exports

_EXPORTS = {
    "FsdpModule": "_megatron",
    "MixedPrecisionPolicy": "_megatron",
    "Placements": "_megatron",
    "fsdp_placements": "_megatron",
    "hsdp_placements": "_megatron",
    "dcp_view": "checkpointable_chunks",
    "keep_loaded_values": "checkpointable_chunks",
    "cpu_execution_enabled": "cpu_execution",
    "enable_cpu_execution": "cpu_execution",
    "bind_full_tensor": "gather",
    "full_tensor": "gather",
    "grad_norm": "gather",
    "lightning_grad_norm_explained": "gather",
    "local_grad": "gather",
    "sharded_grad_norm": "gather",
    "MeshRequest": "mesh",
    "build_device_mesh": "mesh",
    "check_mesh_fits_world": "mesh",
    "mesh_ndim": "mesh",
    "validate_device_mesh": "mesh",
    "ensure_optimizer_state": "optimizer_state",
    "BufferSync": "replicas",
    "check_replicas": "replicas",
    "sync_replicas": "replicas",
    "AutoWrapPolicy": "sharding",
    "check_fully_sharded": "sharding",
    "check_no_foreign_sharding": "sharding",
    "check_optimizer_parameters": "sharding",
    "check_placements": "sharding",
    "materialize_outside_units": "sharding",
    "plan_units": "sharding",
    "shard_module": "sharding",
    "shard_unit": "sharding",
    "sharding_scope": "sharding",
    "validate_auto_wrap_policy": "sharding",
    "ShardingMode": "sharding_modes",
    "resolve_sharding_mode": "sharding_modes",
    "CHUNK_ATTR": "uneven_dtensor",
    "attach_uneven_dtensor_metadata": "uneven_dtensor",
    "chunk_metadata_by_fqn": "uneven_dtensor",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
