"""What Lightning's ``precision=`` flags mean under Megatron-FSDP
(:class:`MegatronFSDPPrecision`: low-precision compute weights over fp32 main weights and
optimizer state), the closure-first optimizer step ``fully_shard_optimizer`` needs, and
clipping that counts every element of the packed shards exactly once
(:func:`clip_sharded_grad_norm_` on ``gather.sharded_grad_norm``,
:func:`clip_sharded_grad_value_`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator, Iterable
from typing import Any, Literal, TypeVar, cast

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.types import Steppable
from lightning.pytorch.plugins.precision import Precision
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_megatron_fsdp import _lightning
from lightning_megatron_fsdp.megatron import (
    MixedPrecisionPolicy,
    _megatron,
    bind_full_tensor,
    lightning_grad_norm_explained,
    local_grad,
    sharded_grad_norm,
)

__all__ = [
    "SUPPORTED_PRECISIONS",
    "MegatronFSDPPrecision",
    "clip_sharded_grad_norm_",
    "clip_sharded_grad_value_",
    "precision_property",
    "to_megatron_precision",
]

_PrecisionFlag = Literal["32-true", "bf16-true", "16-true", "bf16-mixed"]
SUPPORTED_PRECISIONS: tuple[str, ...] = ("32-true", "bf16-true", "16-true", "bf16-mixed")
_COMPUTE_DTYPES = {
    "32-true": torch.float32,
    "bf16-true": torch.bfloat16,
    "16-true": torch.float16,
    "bf16-mixed": torch.float32,
}


class MegatronFSDPPrecision(Precision):
    """Precision plugin for :class:`~lightning_megatron_fsdp.MegatronFSDPStrategy`.

    The strategy converts Lightning's own plugins (chosen by ``Trainer(precision=...)``)
    into this one, so users rarely build it themselves.

    Args:
        precision: One of :data:`SUPPORTED_PRECISIONS` (see the module docstring).
        device_type: Device type for ``torch.autocast`` under ``"bf16-mixed"``; the
            strategy fills it from its root device when ``None``.

    Raises:
        ValueError: If ``precision`` is not supported.
    """

    def __init__(self, precision: str = "32-true", *, device_type: str | None = None) -> None:
        if precision not in SUPPORTED_PRECISIONS:
            hint = (
                " fp16 autocast needs a loss scaler that Megatron-FSDP's uneven shards do not "
                "support yet; use 'bf16-mixed' or 'bf16-true'."
                if precision == "16-mixed"
                else ""
            )
            raise ValueError(
                f"MegatronFSDPPrecision: precision={precision!r} is not supported; expected one "
                f"of {', '.join(map(repr, SUPPORTED_PRECISIONS))}.{hint}"
            )
        self.precision = cast(_PrecisionFlag, precision)  # type: ignore[assignment]
        self.device_type = device_type

    @property
    def compute_dtype(self) -> torch.dtype:
        """Dtype of the compute weights the strategy shards (``float32`` unless ``-true``)."""
        return _COMPUTE_DTYPES[self.precision]

    @property
    def casts_parameters(self) -> bool:
        """Whether the strategy casts parameters to :attr:`compute_dtype` before sharding."""
        return self.precision in ("bf16-true", "16-true")

    def mixed_precision_policy(self) -> MixedPrecisionPolicy:
        """Return the Megatron-FSDP policy this flag implies: fp32 main weights and grads.

        Returns:
            A fresh policy; fp32 main gradients for the half-precision ``-true`` flags so
            gradient accumulation does not round each micro-batch to 8 mantissa bits.
        """
        if self.casts_parameters:
            return MixedPrecisionPolicy(
                main_params_dtype=torch.float32, main_grads_dtype=torch.float32
            )
        return MixedPrecisionPolicy(main_params_dtype=torch.float32)

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        """Leave the module alone: the strategy casts each unit as it shards it."""
        return module

    def tensor_init_context(self) -> contextlib.AbstractContextManager:
        """Initialise in the default dtype, so fp32 main weights start exact."""
        return contextlib.nullcontext()

    def module_init_context(self) -> contextlib.AbstractContextManager:
        """Initialise in the default dtype, so fp32 main weights start exact."""
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        """Default dtype = compute dtype (``-true``), or bf16 autocast (``bf16-mixed``)."""
        if self.precision == "bf16-mixed":
            with torch.autocast(self.device_type or "cuda", dtype=torch.bfloat16):
                yield
            return
        if not self.casts_parameters:
            yield
            return
        previous = torch.get_default_dtype()
        torch.set_default_dtype(self.compute_dtype)
        try:
            yield
        finally:
            torch.set_default_dtype(previous)

    def convert_input(self, data: Any) -> Any:
        """Cast floating-point inputs to the compute dtype under the ``-true`` flags."""
        if not self.casts_parameters:
            return data
        return apply_to_collection(
            data, function=_lightning.convert_fp_tensor, dtype=Tensor, dst_type=self.compute_dtype
        )

    def optimizer_step(  # type: ignore[override]
        self,
        optimizer: Steppable,
        model: pl.LightningModule,
        closure: Callable[[], Any],
        **kwargs: Any,
    ) -> Any:
        """Run the closure (forward, backward, clipping hooks), then step without it.

        ``fully_shard_optimizer`` refuses ``step(closure)``, because it must cast
        gradients between the closure and the update. Every optimizer that evaluates its
        closure once (SGD, Adam, ...) computes the same update this way.

        Returns:
            The optimizer's step output, or the closure's result when the step returns
            ``None`` (what ``step(closure)`` would have returned).

        Raises:
            TypeError: For ``torch.optim.LBFGS``, which re-evaluates its closure.
        """
        reject_closure_optimizer(optimizer)
        with lightning_grad_norm_explained():  # in the closure and its hooks
            closure_result = _lightning.wrap_closure(self, model, optimizer, closure)
        step_output = optimizer.step(**kwargs)
        return closure_result if step_output is None else step_output

    @override
    def post_backward(self, tensor: Tensor, module: pl.LightningModule) -> Tensor:  # type: ignore[override]
        """Finish the gradients, then run Lightning's ``on_after_backward`` hooks.

        Waits for pending gradient reduce-scatters (a side stream on CUDA), reshards units
        an unconsumed prefetch left gathered (:func:`~lightning_megatron_fsdp.megatron._megatron.
        release_prefetched`), and makes
        ``.full_tensor()`` on the fresh sharded gradients safe
        (``gather.bind_full_tensor``) before the hooks read them.
        """
        _megatron.join_gradient_reduction(module)
        _megatron.release_prefetched(module)  # a prefetched unit whose backward never ran
        bind_full_tensor(module, gradients=True)
        return super().post_backward(tensor, module)

    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        """Clip the optimizer's gradients to total norm ``clip_val`` across all shards."""
        clip_sharded_grad_norm_(self.main_params(optimizer), clip_val)

    def clip_grad_by_value(self, optimizer: Optimizer, clip_val: int | float) -> None:
        """Clamp every gradient element of the optimizer to ``[-clip_val, clip_val]``."""
        clip_sharded_grad_value_(self.main_params(optimizer), clip_val)


_Ours = TypeVar("_Ours", bound=MegatronFSDPPrecision)


def precision_property(attribute: str, target: type[_Ours], where: str) -> property:
    """A strategy's precision plugin, kept in ``attribute``: ``target("32-true")`` until the
    framework sets one, which the setter translates (:func:`to_megatron_precision`).

    One definition for the property both frameworks name differently (the Trainer's
    ``precision_plugin``, Fabric's ``precision``); a strategy also binds it as
    ``_megatron_precision``, the name the shared code reads.
    """

    def get(strategy: Any) -> _Ours:
        if getattr(strategy, attribute) is None:
            setattr(strategy, attribute, target("32-true"))
        return getattr(strategy, attribute)

    def set_plugin(strategy: Any, plugin: Any) -> None:
        setattr(strategy, attribute, to_megatron_precision(plugin, where, target=target))

    return property(get, set_plugin, doc=f"The ``{target.__name__}`` plugin.")


def to_megatron_precision(
    plugin: Any,
    where: str,
    *,
    target: type[_Ours] = MegatronFSDPPrecision,  # type: ignore[assignment]
) -> _Ours | None:
    """Translate the plugin Lightning builds from ``precision=...`` into ``target``.

    The one translation of the flags for both front ends: the Trainer's plugins
    (``lightning.pytorch.plugins.precision``) and Fabric's
    (``lightning.fabric.plugins.precision``) share their class names. Each is matched by
    exact type: a subclass is a user's own plugin, which means something else.

    Raises:
        ValueError: For precision flags Megatron-FSDP cannot honour (``16-mixed``, ``64-true``).
        TypeError: For other precision plugins.
    """
    from lightning.fabric.plugins import precision as fabric_plugins
    from lightning.pytorch.plugins import precision as trainer_plugins

    def built_as(name: str) -> bool:
        return type(plugin) in (getattr(fabric_plugins, name), getattr(trainer_plugins, name))

    if plugin is None or isinstance(plugin, target):
        return plugin
    if built_as("Precision"):
        return target("32-true")
    if built_as("HalfPrecision"):
        return target(plugin.precision)
    if built_as("MixedPrecision"):
        return target(plugin.precision, device_type=plugin.device)
    if built_as("DoublePrecision"):
        raise ValueError(
            f"{where}: precision='64-true' is not supported (Megatron-FSDP's main weights "
            "are fp32). Use '32-true', 'bf16-true', '16-true' or 'bf16-mixed'."
        )
    raise TypeError(
        f"{where} needs precision='32-true', 'bf16-true', '16-true' or 'bf16-mixed' (or a "
        f"{target.__name__}), got {type(plugin).__name__}."
    )


def reject_closure_optimizer(optimizer: Any) -> None:
    """Raise for optimizers that need ``step(closure)`` to re-run forward and backward."""
    inner = _lightning.unwrap_optimizer(optimizer)
    if isinstance(inner, torch.optim.LBFGS):
        raise TypeError(
            "MegatronFSDPStrategy: torch.optim.LBFGS re-evaluates its closure several times "
            "per step, but Megatron-FSDP's fully_shard_optimizer cannot run a closure inside "
            "optimizer.step (it must cast gradients between backward and the update). Use an "
            "optimizer that evaluates the loss once per step (SGD, Adam, AdamW, ...)."
        )


def clip_sharded_grad_norm_(
    parameters: Iterable[Tensor], max_norm: float, norm_type: float = 2.0
) -> Tensor:
    """Scale gradients in place so their total norm is at most ``max_norm``.

    Same arithmetic as ``torch.nn.utils.clip_grad_norm_`` (``coef = max_norm / (norm +
    1e-6)``, clamped to 1), with the norm from :func:`sharded_grad_norm`.

    Args:
        parameters: Parameters whose gradients to clip.
        max_norm: Maximum total norm.
        norm_type: ``p`` of the p-norm.

    Returns:
        The total norm before clipping, identical on every rank.
    """
    parameters = list(parameters)
    total = sharded_grad_norm(parameters, norm_type)
    coefficient = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for parameter in parameters:
        local = local_grad(parameter)
        if local is not None and local.numel():
            local.mul_(coefficient.to(device=local.device, dtype=local.dtype))
    return total


def clip_sharded_grad_value_(parameters: Iterable[Tensor], clip_value: float) -> None:
    """Clamp every gradient element to ``[-clip_value, clip_value]``, in place, rank-local.

    Args:
        parameters: Parameters whose gradients to clip.
        clip_value: Bound on each element's magnitude.
    """
    for parameter in parameters:
        local = local_grad(parameter)
        if local is not None and local.numel():
            local.clamp_(-clip_value, clip_value)
