"""Full weights into a sharded model: sources, megatron-fsdp's own checkpoints."""
