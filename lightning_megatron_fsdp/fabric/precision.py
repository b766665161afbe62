"""The Trainer strategy's precision flags for Fabric's calling convention:
:class:`MegatronFSDPFabricPrecision` keeps the flag table and overrides only backward and
step, which Fabric calls without LightningModule hooks or a closure.
"""

from __future__ import annotations

from typing import Any

from lightning.fabric.utilities.types import Optimizable
from torch import Tensor
from torch.nn import Module
from typing_extensions import override

from lightning_megatron_fsdp.common import MegatronFSDPPrecision, reject_closure_optimizer

__all__ = ["MegatronFSDPFabricPrecision"]


class MegatronFSDPFabricPrecision(MegatronFSDPPrecision):
    """The Trainer strategy's ``MegatronFSDPPrecision``, for Fabric loops.

    Same flags, same meaning (README, "Precision flags"); the strategy finishes gradients
    after each backward (it knows the set-up models, Fabric passes none).
    """

    @override
    def pre_backward(self, tensor: Tensor, module: Module | None) -> Any:  # type: ignore[override]
        return None

    @override
    def backward(self, tensor: Tensor, model: Module | None, *args: Any, **kwargs: Any) -> None:  # type: ignore[override]
        tensor.backward(*args, **kwargs)

    @override
    def post_backward(self, tensor: Tensor, module: Module | None) -> Any:  # type: ignore[override]
        return tensor

    @override
    def optimizer_step(self, optimizer: Optimizable, **kwargs: Any) -> Any:  # type: ignore[override]
        """Step without a closure (``fully_shard_optimizer`` refuses one).

        Raises:
            TypeError: For ``torch.optim.LBFGS``, which re-evaluates its closure.
        """
        reject_closure_optimizer(optimizer)
        return optimizer.step(**kwargs)
