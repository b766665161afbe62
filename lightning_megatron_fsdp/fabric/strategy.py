"""``MegatronFSDPStrategy`` for Lightning Fabric: a thin Fabric ``ParallelStrategy`` over the
Trainer strategy's machinery (process group and unit sharding, precision flags, shard-aware
clipping, the checkpoint IO), so hand-written loops such as litgpt's train with
Megatron-FSDP and read and write the same checkpoint format (docs/DESIGN.md, "Fabric").
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
from lightning.fabric.plugins import CheckpointIO, Precision
from lightning.fabric.strategies.parallel import ParallelStrategy
from lightning.fabric.utilities.distributed import ReduceOp
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import Unpack, override

from lightning_megatron_fsdp import _lightning
from lightning_megatron_fsdp.agreement import peer_failures_explained
from lightning_megatron_fsdp.common import (
    ExactResume,
    ShardingOptions,
    StrategyOptionsMixin,
    clip_sharded_grad_norm_,
    clip_sharded_grad_value_,
    move_unsharded_state,
    precision_property,
    reject_closure_optimizer,
    takes_sharding_options,
)
from lightning_megatron_fsdp.fabric.checkpoint_state import (
    restore_rest,
    saved_optimizer_order,
    split_state,
    to_checkpoint,
)
from lightning_megatron_fsdp.fabric.precision import MegatronFSDPFabricPrecision
from lightning_megatron_fsdp.megatron import (
    BufferSync,
    FsdpModule,
    _megatron,
    bind_full_tensor,
    ensure_optimizer_state,
)
from lightning_megatron_fsdp.weights import load_full_weights

__all__ = ["MegatronFSDPStrategy"]

_STRATEGY = "MegatronFSDPStrategy (Fabric)"


class MegatronFSDPStrategy(StrategyOptionsMixin, ParallelStrategy):
    """Lightning Fabric strategy for NVIDIA Megatron-FSDP (``megatron_fsdp.experimental``).

    ``Fabric(strategy=MegatronFSDPStrategy(...))``, or ``Fabric(strategy="megatron_fsdp")``
    once ``lightning_megatron_fsdp`` is imported.

    Takes the sharding options of :class:`~lightning_megatron_fsdp.common.options.
    ShardingOptions` as keywords (``auto_wrap_policy``, ``device_mesh``,
    ``sharding_strategy``, ``mixed_precision_policy``, ``process_group_backend``,
    ``timeout``, ``check_replicas``; documented there, as in the Trainer strategy), and:

    Args:
        checkpoint_io: Defaults to ``MegatronFSDPCheckpointIO()``.
        precision: Set by Fabric from ``precision=...``.

    The accelerator, devices and cluster environment are Fabric's to set (``accelerator=``,
    ``devices=``, ``plugins=[environment]``), as for Lightning's ``ModelParallelStrategy``.

    Raises:
        TypeError: If an option is unknown, or ``auto_wrap_policy``, ``device_mesh``,
            ``timeout``, ``mixed_precision_policy`` or ``check_replicas`` has the wrong type.
        ValueError: If ``device_mesh`` has a non-positive size, or ``sharding_strategy`` is
            unknown, does not fit the mesh, or needs a newer megatron-fsdp.
    """

    strategy_name = "megatron_fsdp"

    @takes_sharding_options
    def __init__(
        self,
        *,
        checkpoint_io: CheckpointIO | None = None,
        precision: Precision | None = None,
        **options: Unpack[ShardingOptions],
    ) -> None:
        super().__init__(checkpoint_io=checkpoint_io, precision=precision)
        self._take_options(_STRATEGY, options)
        self._num_nodes = 1
        self._models: list[nn.Module] = []
        self._buffer_syncs: dict[int, BufferSync] = {}
        self._backward_sync_control = _MicrobatchControl(self)

    # ------------------------------------------------------------------ properties

    _mesh_missing_hint = "is created when the processes have joined; call fabric.launch() first."

    @property
    def num_nodes(self) -> int:
        """Nodes taking part (set by Fabric)."""
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    precision = precision_property("_precision", MegatronFSDPFabricPrecision, _STRATEGY)
    _megatron_precision = precision

    # ------------------------------------------------------------------ processes

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = _lightning.FabricSubprocessScriptLauncher(
                self.cluster_environment, self.num_processes, self.num_nodes
            )

    @override
    def setup_environment(self) -> None:
        """Join the process group (once per process; it lives until the process ends), build
        the mesh."""
        super().setup_environment()
        self._ignore_known_warnings()
        self._join_processes(nn.Module())

    # ------------------------------------------------------------------ model setup

    @override
    def module_init_context(self, empty_init: bool | None = None) -> AbstractContextManager:
        """``empty_init=True``: build on the meta device; each unit is materialised
        (``reset_parameters``) right before it is sharded, in ``setup_module``."""
        stack = contextlib.ExitStack()
        stack.enter_context(torch.device("meta") if empty_init else self.root_device)
        stack.enter_context(self.precision.module_init_context())
        return stack

    @override
    def module_to_device(self, module: nn.Module) -> None:
        """Move an unsharded, materialised module to the device; otherwise only what
        sharding does not own (buffers, torchmetrics states): ``module.to`` would re-create
        sharded parameters, and meta tensors are materialised unit by unit."""
        if any(t.is_meta for t in (*module.parameters(), *module.buffers())):
            return  # setup_module materialises it on the device
        if any(isinstance(m, FsdpModule) for m in module.modules()):
            move_unsharded_state(module, self.root_device)
        else:
            module.to(self.root_device)

    @override
    def setup_module(self, module: nn.Module) -> nn.Module:
        """Shard ``module`` bottom-up into Megatron-FSDP units, in place.

        Units as in the Trainer strategy: the ``auto_wrap_policy``'s, then every top-level
        submodule that still owns parameters, then ``module`` itself only if it owns
        parameters directly; modules already sharded (``shard_module``) are left alone.
        """
        self._sharder.shard_model(
            module,
            self._options.auto_wrap_policy,
            self._shard_unit,
            self.root_device,
            self.placements,
        )
        bind_full_tensor(module, gradients=False)  # p.full_tensor() works
        self._replicas_agree(module)
        if id(module) not in self._buffer_syncs:
            self._buffer_syncs[id(module)] = _keep_buffers_in_step(module)
        self._models.append(module)
        return module

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """Adapt ``optimizer`` (built on the sharded parameters) with ``fully_shard_optimizer``.

        Raises:
            ValueError: If it holds a parameter that is not a sharded one of a set-up model.
            TypeError: For ``torch.optim.LBFGS``.
        """
        reject_closure_optimizer(optimizer)
        for group in optimizer.param_groups:
            for parameter in group["params"]:
                if not _megatron.is_sharded_parameter(parameter):
                    raise ValueError(
                        f"{_STRATEGY}: the optimizer holds a {tuple(parameter.shape)} parameter "
                        "that is not a Megatron-FSDP sharded parameter of a model set up by "
                        "this strategy. Create the optimizer after `model = "
                        "fabric.setup_module(model)` from `model.parameters()`, or pass both "
                        "to `fabric.setup(model, optimizer)`."
                    )
        _megatron.fully_shard_optimizer(optimizer)  # once per optimizer
        return optimizer

    @override
    def setup_module_and_optimizers(
        self, module: nn.Module, optimizers: list[Optimizer], scheduler: Any | None = None
    ) -> tuple[nn.Module, list[Optimizer], Any | None]:
        """Shard ``module``, then re-point ``optimizers`` (built on its unsharded
        parameters) at the sharded ones, by parameter name.

        Raises:
            ValueError: An optimizer holds a tensor that is not a parameter of ``module``,
                or has state already (it stepped before sharding).
        """
        names: dict[int, str] = {
            id(p): name for name, p in module.named_parameters(remove_duplicate=False)
        }
        for index, optimizer in enumerate(optimizers):
            if optimizer.state:
                raise ValueError(
                    f"{_STRATEGY}: optimizer {index} has state already (it stepped before "
                    "fabric.setup); create it fresh, then call fabric.setup(model, optimizer)."
                )
            for group in optimizer.param_groups:
                for parameter in group["params"]:
                    if _megatron.is_sharded_parameter(parameter):
                        continue
                    if id(parameter) not in names:
                        raise ValueError(
                            f"{_STRATEGY}: optimizer {index} holds a {tuple(parameter.shape)} "
                            "tensor that is not a parameter of the model passed to "
                            "fabric.setup; build it from model.parameters()."
                        )
        module = self.setup_module(module)
        sharded = dict(module.named_parameters(remove_duplicate=False))
        for optimizer in optimizers:
            for group in optimizer.param_groups:
                group["params"] = [
                    p if _megatron.is_sharded_parameter(p) else sharded[names[id(p)]]
                    for p in group["params"]
                ]
        return module, [self.setup_optimizer(o) for o in optimizers], scheduler

    # ------------------------------------------------------------------ steps

    @override
    def backward(self, tensor: Tensor, module: nn.Module | None, *args: Any, **kwargs: Any) -> None:
        """Backward, then finish the gradients of every set-up model.

        Waits for pending reduce-scatters (a side stream on CUDA), reshards units an
        unconsumed prefetch left gathered, and makes ``.full_tensor()`` of the fresh
        gradients safe; Fabric passes no model, so all set-up models are finished.
        """
        with peer_failures_explained(f"{_STRATEGY}: backward"):
            super().backward(tensor, module, *args, **kwargs)
        for model in self._models:
            _megatron.join_gradient_reduction(model)
            _megatron.release_prefetched(model)
            bind_full_tensor(model, gradients=True)
            if id(model) in self._buffer_syncs:  # rank 0's buffers, as DDP's
                self._buffer_syncs[id(model)].settle(model)

    @override
    def clip_gradients_norm(
        self,
        module: nn.Module,
        optimizer: Optimizer,
        max_norm: float | int,
        norm_type: float | int = 2.0,
        error_if_nonfinite: bool = True,
    ) -> Tensor:
        """Clip to total norm ``max_norm`` over all shards (each element counted once).

        Raises:
            RuntimeError: With ``error_if_nonfinite``, if the total norm is NaN or infinite
                (on every rank: the norm is the same on all).
        """
        total = clip_sharded_grad_norm_(self.precision.main_params(optimizer), max_norm, norm_type)
        if error_if_nonfinite and not torch.isfinite(total):
            raise RuntimeError(
                f"{_STRATEGY}: the total norm of order {float(norm_type)} of the gradients is "
                f"{total.item()}, so they cannot be clipped. Set "
                "fabric.clip_gradients(..., error_if_nonfinite=False) to skip this check."
            )
        return total

    @override
    def clip_gradients_value(
        self, module: nn.Module, optimizer: Optimizer, clip_val: float | int
    ) -> None:
        clip_sharded_grad_value_(self.precision.main_params(optimizer), clip_val)

    # ------------------------------------------------------------------ collectives

    @override
    def all_reduce(
        self, tensor: Tensor, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean"
    ) -> Tensor:
        if isinstance(tensor, Tensor):
            return _lightning.sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    # ------------------------------------------------------------------ checkpoints

    @override
    def save_checkpoint(
        self,
        path: _lightning.PATH,
        state: dict[str, nn.Module | Optimizer | Any],
        storage_options: Any | None = None,
        filter: dict[str, Callable[[str, Any], bool]] | None = None,
    ) -> None:
        """Save ``state`` as one of our checkpoint directories, on every rank (a collective).

        The model's and optimizers' state by FQN, each rank writing its own shards; every
        other entry (a ``Stateful``'s ``state_dict()``, or the value) and each rank's random
        streams in ``meta.pt``. Atomic and checksummed as the Trainer strategy's saves; a
        Trainer ``fit(ckpt_path=...)`` resumes from it (model and optimizers by FQN).

        Raises:
            ValueError: ``filter`` is given, or the state holds no (or several) set-up models,
                or a key the format reserves.
            CheckpointSaveError: On every rank if any rank fails; nothing is written.
        """
        if filter is not None:
            raise ValueError(
                f"{_STRATEGY}: fabric.save(..., filter=...) is not supported: a sharded "
                "checkpoint is loaded by FQN against the whole model. Save everything, or "
                "export a filtered file afterwards with `lightning-megatron-fsdp consolidate`."
            )
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        target = self.broadcast(str(path))
        fabric_state = split_state(state, _STRATEGY, "fabric.save")
        model = fabric_state.model
        _megatron.release_prefetched(model)  # every unit at rest: DTensors
        if id(model) in self._buffer_syncs:
            self._buffer_syncs[id(model)].settle(model)
        optimizer_states = []
        for _, optimizer in fabric_state.optimizers:
            ensure_optimizer_state(optimizer)
            optimizer_states.append(get_optimizer_state_dict(model, optimizer))
        checkpoint = to_checkpoint(fabric_state, get_model_state_dict(model), optimizer_states)
        # Fabric has no later hook that would wait for an async write.
        self._save_sharded(checkpoint, target, model, storage_options, commit=True)

    @override
    def load_checkpoint(
        self,
        path: _lightning.PATH,
        state: nn.Module | Optimizer | dict[str, nn.Module | Optimizer | Any] | None = None,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """Restore ``state`` in place from one of our checkpoints (any world size), or a
        module from a single file of full weights (``fabric.load_raw``).

        Model and optimizers by FQN (optimizers matched by their saved key, or by
        position for a Trainer checkpoint); other entries as Fabric does (``load_state_dict``
        for ``Stateful`` objects, replaced otherwise). Each rank's random streams are
        restored at the model's next forward when the world size is the same.

        Returns:
            The checkpoint's other entries (not requested in ``state``).

        Raises:
            ValueError: No state, or a state without exactly one set-up model.
            NotACheckpointError / CheckpointCorruptedError / CheckpointMismatchError /
                CheckpointError: As the Trainer strategy's load, on every rank.
        """
        if not state:
            raise ValueError(
                f"{_STRATEGY}: fabric.load(path, state) needs a state with the model to load "
                "into, e.g. {'model': model, 'optimizer': optimizer}; a sharded checkpoint "
                "cannot be returned whole."
            )
        if isinstance(state, nn.Module):
            target = self.broadcast(str(path))
            load_full_weights(state, target, strict=strict, weights_only=weights_only is not False)
            _megatron.sync_compute_weights(state)
            self._check_replicas(state, f"after loading {target}")
            return {}
        if isinstance(state, Optimizer):
            raise NotImplementedError(
                f"{_STRATEGY}: loading a single optimizer is not supported; pass "
                "{'model': model, 'optimizer': optimizer} to fabric.load."
            )
        fabric_state = split_state(state, _STRATEGY, "fabric.load")
        model = fabric_state.model
        target = str(path)  # rank 0's is loaded

        def in_saved_order(meta: dict[str, Any], saved_count: int) -> list[Optimizer]:
            return saved_optimizer_order(meta, fabric_state, saved_count, target, _STRATEGY, strict)

        checkpoint = self._load_sharded(
            target,
            model,
            [optimizer for _, optimizer in fabric_state.optimizers],
            fitting=True,
            weights_only=weights_only,
            strict=strict,
            allow_missing_optimizers=not strict,
            match_optimizers=in_saved_order,
        ).checkpoint
        _restore_streams_at_next_forward(model, self._exact_resume, self.root_device)
        return restore_rest(checkpoint, state, fabric_state, strict)

    @override
    def teardown(self) -> None:
        """Finish an async save; the process group stays (the model holds it) until exit."""
        self._release()


class _MicrobatchControl(_lightning.BackwardSyncControl):
    """``fabric.no_backward_sync``: HSDP, ZeRO-1 and no-shard defer a gradient reduction to
    the last micro-batch (``microbatch``); plain FSDP and ZeRO-2 finalise gradients on every
    backward, as in the Trainer strategy, so there is nothing to skip."""

    def __init__(self, strategy: MegatronFSDPStrategy) -> None:
        self._strategy = strategy

    @override
    def no_backward_sync(self, module: nn.Module, enabled: bool) -> AbstractContextManager:
        if enabled and self._strategy.sharding_mode.defers_gradient_reduction:
            return _megatron.microbatch(module, is_last=False)
        return contextlib.nullcontext()


def _keep_buffers_in_step(model: nn.Module) -> BufferSync:
    """Keep ``model``'s buffers in step (``replicas.BufferSync``): a forward with gradients
    enabled is a training forward, as for DDP."""
    sync = BufferSync()

    def hook(module: nn.Module, args: Any) -> None:
        sync.before_forward(module, training=torch.is_grad_enabled())

    model.register_forward_pre_hook(hook)
    return sync


def _restore_streams_at_next_forward(
    model: nn.Module, resume: ExactResume, device: torch.device
) -> None:
    """Put the loaded random streams back right before ``model``'s next forward, once."""

    def hook(module: nn.Module, args: Any) -> None:
        handle.remove()
        resume.train_starting(device)

    handle = model.register_forward_pre_hook(hook, prepend=True)
