"""Megatron-FSDP for Lightning Fabric loops: ``Fabric(strategy=MegatronFSDPStrategy())``."""

from lightning.fabric.strategies import STRATEGY_REGISTRY

from lightning_megatron_fsdp.fabric.precision import MegatronFSDPFabricPrecision
from lightning_megatron_fsdp.fabric.strategy import MegatronFSDPStrategy

__all__ = ["MegatronFSDPFabricPrecision", "MegatronFSDPStrategy"]

MegatronFSDPStrategy.register_strategies(STRATEGY_REGISTRY)
