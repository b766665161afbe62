"""Materialise optimizer state before a load, so DCP has tensors to fill in place.

DCP loads in place: a fresh optimizer that has never stepped has no ``exp_avg`` to read
into. torch's ``get_optimizer_state_dict`` creates state by installing
``torch.zeros_like(param)`` gradients and stepping with ``lr=0``, but a Megatron-FSDP
sharded parameter advertises its gradient dtype through ``grad_dtype`` (bf16 under
bf16 compute with fp32 main weights), and a gradient of the parameter's own dtype
violates it: the assignment raises. :func:`ensure_optimizer_state` does the same
zero-learning-rate step with gradients of the advertised dtype.
"""

from __future__ import annotations

import torch

__all__ = ["ensure_optimizer_state"]


def ensure_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create every parameter's optimizer state with one step at learning rate zero.

    A no-op when the optimizer already holds state or any parameter has a gradient
    (a stateless optimizer such as SGD then needs none). Parameters and their values
    are unchanged: the step runs with ``lr=0`` (tensor or float, restored afterwards),
    and gradients are cleared to ``None`` again.

    Args:
        optimizer: A plain or ``fully_shard_optimizer``-adapted torch optimizer.
    """
    if optimizer.state:
        return
    parameters = [p for group in optimizer.param_groups for p in group["params"]]
    if any(p.grad is not None for p in parameters):
        return
    for parameter in parameters:
        if parameter.requires_grad:
            grad_dtype = getattr(parameter, "grad_dtype", None) or parameter.dtype
            parameter.grad = torch.zeros_like(parameter, dtype=grad_dtype)
    saved_lrs = []
    for group in optimizer.param_groups:
        lr = group.get("lr")
        saved_lrs.append(lr)
        if lr is not None:
            group["lr"] = torch.zeros_like(lr) if isinstance(lr, torch.Tensor) else 0.0
    try:
        with torch.no_grad():
            optimizer.step()
    finally:
        for group, lr in zip(optimizer.param_groups, saved_lrs, strict=True):
            if lr is not None:
                group["lr"] = lr
        optimizer.zero_grad(set_to_none=True)
