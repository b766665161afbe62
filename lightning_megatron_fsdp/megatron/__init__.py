"""The megatron-fsdp adapter: sharding, meshes, packed-shard chunks, CPU execution."""
