"""Materialise optimizer state before a load, so DCP has tensors to fill in place:
:func:`ensure_optimizer_state` takes torch's zero-learning-rate step with gradients of the
dtype a Megatron-FSDP parameter advertises (``grad_dtype``), which torch's own helper does
not.
"""

from __future__ import annotations

import torch

__all__ = ["ensure_optimizer_state"]


def ensure_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer state of every parameter that has none, as a fresh optimizer's.

    Only parameters without state take part: they get zero gradients of their advertised
    ``grad_dtype``, every other parameter's gradient is set aside (so its state does not
    advance), and one step runs with ``lr=0`` (tensor or float, restored afterwards). The
    gradients set aside are put back afterwards, whatever they were (mid-accumulation
    gradients survive), and every state tensor the step created (moments and step counters
    alike) is zeroed, so the next real step matches a fresh optimizer's bit for bit (see the
    module docstring for which optimizers). Parameter values are unchanged. A stateless
    optimizer (plain SGD) creates nothing, and that is fine: there is nothing to load.

    Args:
        optimizer: A plain or ``fully_shard_optimizer``-adapted torch optimizer.
    """
    parameters = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    missing = [p for p in parameters if not optimizer.state.get(p)]
    if not missing:
        return
    stashed = [(p, p.grad) for p in parameters]
    saved_lrs = []
    try:
        for parameter in parameters:
            parameter.grad = None
        for parameter in missing:
            grad_dtype = getattr(parameter, "grad_dtype", None) or parameter.dtype
            parameter.grad = torch.zeros_like(parameter, dtype=grad_dtype)
        for group in optimizer.param_groups:
            lr = group.get("lr")
            saved_lrs.append(lr)
            if lr is not None:
                group["lr"] = torch.zeros_like(lr) if isinstance(lr, torch.Tensor) else 0.0
        with torch.no_grad():
            optimizer.step()
    finally:
        # Not strict: saved_lrs is short if setting up the step failed part-way.
        for group, lr in zip(optimizer.param_groups, saved_lrs, strict=False):
            if lr is not None:
                group["lr"] = lr
        for parameter, grad in stashed:
            parameter.grad = None
            parameter.grad = grad
    with torch.no_grad():
        for parameter in missing:
            for value in optimizer.state.get(parameter, {}).values():
                if isinstance(value, torch.Tensor):
                    value.zero_()
