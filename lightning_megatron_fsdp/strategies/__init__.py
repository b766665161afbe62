"""The Lightning Trainer strategy: ``Trainer(strategy=MegatronFSDPStrategy())``."""

from lightning_megatron_fsdp.strategies.strategy import MegatronFSDPStrategy

__all__ = ["MegatronFSDPStrategy"]
