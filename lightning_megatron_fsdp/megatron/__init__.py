"""The megatron-fsdp adapter: sharding, meshes, packed-shard chunks, replicas, CPU execution.

Other folders use the names below; megatron-fsdp's own objects are reached through the
adapter module ``_megatron`` (as torch's and Lightning's through ``_torch`` and
``_lightning``).
"""

from lightning_megatron_fsdp.lazy_exports import lazy_exports

_EXPORTS = {
    "_megatron": (
        "FsdpModule",
        "MixedPrecisionPolicy",
        "Placements",
        "fsdp_placements",
        "hsdp_placements",
    ),
    "checkpointable_chunks": ("dcp_view", "keep_loaded_values"),
    "cpu_execution": ("cpu_execution_enabled", "enable_cpu_execution"),
    "gather": (
        "bind_full_tensor",
        "full_tensor",
        "grad_norm",
        "lightning_grad_norm_explained",
        "local_grad",
        "sharded_grad_norm",
    ),
    "mesh": (
        "MeshRequest",
        "build_device_mesh",
        "check_mesh_fits_world",
        "mesh_ndim",
        "validate_device_mesh",
    ),
    "optimizer_state": ("ensure_optimizer_state",),
    "replicas": ("BufferSync", "check_replicas", "sync_replicas"),
    "sharding": (
        "AutoWrapPolicy",
        "check_fully_sharded",
        "check_no_foreign_sharding",
        "check_optimizer_parameters",
        "check_placements",
        "materialize_outside_units",
        "plan_units",
        "shard_module",
        "shard_unit",
        "sharding_scope",
        "validate_auto_wrap_policy",
    ),
    "sharding_modes": ("ShardingMode", "resolve_sharding_mode"),
    "uneven_dtensor": ("CHUNK_ATTR", "attach_uneven_dtensor_metadata", "chunk_metadata_by_fqn"),
}
__all__, __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
