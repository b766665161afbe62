"""The Trainer strategy's step hooks, as a base class of ``MegatronFSDPStrategy``: each
LightningModule step runs as the root unit's forward, and backward ends with megatron-fsdp's
gradient reduction joined.

Megatron-FSDP unshards a unit's parameters in the unit's forward hooks, and its backward
hook hangs on the forward's output. When the LightningModule owns parameters itself it is
a unit, so ``training_step`` and friends must run *inside* its forward, the loss returned
through it; otherwise every unit is a submodule with hooks of its own and a step runs as it
is. Evaluation steps also run under the uneven-batch join (:mod:`.join`), whose dummy steps
are the same steps without the join.

Lightning's own step hooks redirect a step through a forward (``_ForwardRedirection``)
only when ``strategy.model`` wraps the LightningModule; here they are one module.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Generator, Mapping
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies.parallel import ParallelStrategy
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_megatron_fsdp.agreement import peer_failures_explained
from lightning_megatron_fsdp.megatron import (
    BufferSync,
    FsdpModule,
    ShardingMode,
    _megatron,
    lightning_grad_norm_explained,
)
from lightning_megatron_fsdp.strategies.join import UnevenBatchJoin, join_uneven_batches

if TYPE_CHECKING:
    from lightning.pytorch.utilities.types import STEP_OUTPUT

__all__ = ["StepHooks"]

_STRATEGY = "MegatronFSDPStrategy"


class StepHooks(ParallelStrategy):
    """The step, backward and gradient-accumulation hooks of ``MegatronFSDPStrategy``.

    Abstract: the strategy subclasses it, sets ``_buffer_sync`` and ``_join`` in its
    constructor, and provides ``sharding_mode`` (``StrategyOptionsMixin``).
    """

    _buffer_sync: BufferSync
    _join: UnevenBatchJoin | None
    sharding_mode: ShardingMode

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        with self.precision_plugin.train_step_context(), lightning_grad_norm_explained():
            return self._call_through_root("training_step", args, kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        return self._evaluation_step("validation_step", args, kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        return self._evaluation_step("test_step", args, kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluation_step("predict_step", args, kwargs)

    def _evaluation_step(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self._join is not None:  # uneven batches: agree with the ranks that ran out
            self._join.before_step(args, kwargs)
        return self._plain_evaluation_step(name, args, kwargs)

    def _plain_evaluation_step(
        self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """A validation/test/predict step as such; also what a joining rank's dummy runs."""
        contexts = {
            "validation_step": self.precision_plugin.val_step_context,
            "test_step": self.precision_plugin.test_step_context,
            "predict_step": self.precision_plugin.predict_step_context,
        }
        with contexts[name]():
            output = self._call_through_root(name, args, kwargs)
        _megatron.release_prefetched(self.lightning_module)  # no backward consumes its prefetch
        return output

    def _call_through_root(
        self, method_name: str, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """Run ``LightningModule.<method_name>``, as the root unit's forward if it is one
        (:func:`_run_as_root_forward`); a peer's failure inside is explained as such."""
        with peer_failures_explained(f"{_STRATEGY}: {method_name}"):
            module = self.lightning_module
            assert module is not None
            training = method_name == "training_step"
            self._buffer_sync.before_forward(module, training=training)
            if not isinstance(module, FsdpModule):
                return getattr(module, method_name)(*args, **kwargs)
            return _run_as_root_forward(module, method_name, args, kwargs)

    def _start_join(self, trainer: pl.Trainer, step_name: str, counts: list[int | float]) -> None:
        """Ranks with fewer batches will join the others' forwards (:mod:`.join`); call from
        ``on_{validation,test,predict}_start``."""
        self._join = join_uneven_batches(
            trainer,
            step_name=step_name,
            counts=counts,
            run_step=functools.partial(self._plain_evaluation_step, step_name),
            device=self.root_device,
            where=_STRATEGY,
        )

    @override
    def backward(
        self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any
    ) -> Tensor:
        # Gradient reduce-scatters run inside backward: explain a peer's failure there too.
        with peer_failures_explained(f"{_STRATEGY}: backward"):
            return super().backward(closure_loss, optimizer, *args, **kwargs)

    @override
    def post_backward(self, closure_loss: Tensor) -> None:
        # On CUDA, gradient reduce-scatters run on a side stream; a root's final backward
        # callback joins it, but a manual backward inside the root's forward never
        # registers that callback, so join it here before anything reads .grad.
        assert self.lightning_module is not None
        _megatron.join_gradient_reduction(self.lightning_module)
        self._buffer_sync.settle(self.lightning_module)  # rank 0's buffers, as DDP's

    @contextlib.contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Mark the non-final micro-batches of gradient accumulation.

        Lightning enters this around every accumulating micro-batch except the last. Plain
        FSDP finalises gradients on every backward and needs nothing; HSDP, ZeRO-1 and
        no-shard defer a reduction to the last micro-batch (``microbatch``).
        """
        model = self.lightning_module
        if model is not None and self.sharding_mode.defers_gradient_reduction:
            with _megatron.microbatch(model, is_last=False):
                yield
        else:
            yield


def _run_as_root_forward(
    module: torch.nn.Module, method_name: str, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """Run ``module.<method_name>`` as ``module``'s forward, so its unit hooks run.

    Its forward hooks unshard the root's own parameters; its backward hook, attached to
    the forward's output, unshards them again for backward. That hook only sees a tensor
    output, so the loss (the tensor, or ``output["loss"]``) is what forward returns, and
    the caller gets the hooked loss back in its place; other outputs pass around the hook.
    """
    outputs: list[Any] = []

    def forward(*forward_args: Any, **forward_kwargs: Any) -> Any:
        module.__dict__.pop("forward", None)
        with _megatron.nested_calls_unhooked(module):  # the step's own self(x) calls
            output = getattr(module, method_name)(*forward_args, **forward_kwargs)
        outputs.append(output)
        loss = _loss_of(output)
        return loss if loss is not None else ()

    module.forward = forward  # type: ignore[method-assign]
    try:
        hooked = module(*args, **kwargs)
    finally:
        module.__dict__.pop("forward", None)
    (output,) = outputs
    if isinstance(output, Tensor):
        return hooked
    if isinstance(output, Mapping) and isinstance(hooked, Tensor):
        return {**output, "loss": hooked}
    return output


def _loss_of(output: Any) -> Tensor | None:
    if isinstance(output, Tensor):
        return output
    if isinstance(output, Mapping) and isinstance(output.get("loss"), Tensor):
        return output["loss"]
    return None
