"""``MegatronFSDPStrategy``: train a LightningModule with Megatron-FSDP on every device.

Problem: Megatron-FSDP's experimental ``fully_shard`` is a library, not a trainer. It must
be applied bottom-up, one unit at a time; forward has to enter through the outermost
sharded module (the root builds one shared context lazily); its optimizer adapter refuses
``optimizer.step(closure)``, which is how Lightning steps; HSDP gradient accumulation needs
its ``microbatch`` context; and its parameters are packed ``Shard(0)`` DTensors whose local
shards are *not* torch's canonical ones, so DTensor collectives (``clip_grad_norm_``,
``full_tensor``) and Lightning's default checkpointing give wrong answers or hang.

How this strategy fits it into Lightning's ``ParallelStrategy`` contract:

* Processes: one per device, launched by Lightning (``devices=N``, re-running the script)
  or externally (``torchrun``, SLURM, ...) through Lightning's cluster environments. The
  process group is NCCL on CUDA and gloo on CPU, where :func:`enable_cpu_execution` is
  applied for the user. Every process is one data-parallel rank. Groups the strategy
  created are destroyed in ``teardown`` (kept after a failed run) and re-created by the
  next Trainer run.
* Mesh: 1-D ``("dp_shard",)`` over the world by default (plain FSDP), or 2-D
  ``("dp_replicate", "dp_shard")`` for HSDP: parameters, gradients and optimizer state are
  sharded within a row and replicated across rows, gradients are reduce-scattered within
  the row and all-reduced across rows on the last micro-batch. It is exposed to
  ``LightningModule.configure_model`` as ``self.device_mesh``.
* Sharding, in ``setup``: the units chosen by ``auto_wrap_policy`` bottom-up, then the
  LightningModule itself as the root; modules the user sharded in ``configure_model``
  are left alone. Each unit is materialised (meta-device init), cast to the compute
  dtype, and sharded before the next, so a rank never holds more than one unsharded unit.
* Steps: ``training_step`` and friends run *inside* the root's forward (the root is the
  LightningModule, so a call through ``__call__`` fires its hooks), and the loss is
  returned through it, so the root's backward hook unshards its parameters again.
* Optimizers: adapted with ``fully_shard_optimizer``; the closure runs before the step
  (see :mod:`~lightning_megatron_fsdp.precision`).
* Checkpoints: by FQN through torch's DCP state-dict helpers, with
  :func:`attach_uneven_dtensor_metadata` so DCP places every packed shard correctly, and
  written by ``MegatronFSDPCheckpointIO`` (see ``docs/DESIGN.md``).

Layout of the 2-D (HSDP) mesh over 4 ranks, ``device_mesh=(2, 2)``::

                   dp_shard 0   dp_shard 1
    dp_replicate 0   rank 0       rank 1      <- one shard group: ranks 0 and 1 together
    dp_replicate 1   rank 2       rank 3         hold one full copy of the model
                       ^ replicate group: ranks 0 and 2 hold the same shard

Alternatives rejected:
    * Subclassing Lightning's ``ModelParallelStrategy``: it refuses checkpoint plugins,
      requires ``configure_model``, moves the whole model with ``module.to(device)``
      (wrong for sharded DTensor parameters) and saves with DCP's canonical planner.
    * Wrapping the LightningModule in a separate root module: Lightning's hooks, logging
      and ``self.trainer`` all expect the LightningModule itself, so it is the root.
    * Keeping the process group alive after ``teardown`` (as Lightning's DDP/FSDP
      strategies do) and destroying it ``atexit``: a 2-rank CPU run then intermittently
      aborted at exit ("terminate called without an active exception"), which never
      showed when the group was destroyed in normal program flow. ``teardown`` destroys
      the groups this strategy created; the next ``fit``/``test``/... creates fresh ones
      and re-binds the one mesh object the sharded model holds.
"""

from __future__ import annotations

import atexit
import contextlib
import inspect
import math
import os
import re
from collections.abc import Callable, Generator, Iterable, Iterator, Mapping
from datetime import timedelta
from fnmatch import fnmatch
from pathlib import Path
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.fabric.utilities.device_dtype_mixin import _update_properties
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.distributed import group as _group
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import _PATH, ReduceOp
from lightning.pytorch.callbacks import ModelCheckpoint, OnExceptionCheckpoint
from lightning.pytorch.plugins.io import AsyncCheckpointIO
from lightning.pytorch.plugins.io.wrapper import _WrappingCheckpointIO
from lightning.pytorch.plugins.precision import (
    DoublePrecision,
    HalfPrecision,
    MixedPrecision,
    Precision,
)
from lightning.pytorch.strategies import StrategyRegistry
from lightning.pytorch.strategies.launchers.launcher import _Launcher
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.strategies.strategy import TBroadcast
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_only, rank_zero_warn
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from megatron_fsdp import MixedPrecisionPolicy
from megatron_fsdp.experimental import (
    Flat,
    Partial,
    Placements,
    Replicate,
    fully_shard_optimizer,
    microbatch,
)
from megatron_fsdp.experimental.module import FsdpModule
from megatron_fsdp.experimental.parameter_group import get_containing_parameter_group
from torch import Tensor, nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.device_mesh import DeviceMesh
from torch.optim import Optimizer
from typing_extensions import override

from lightning_megatron_fsdp.cpu_execution import enable_cpu_execution
from lightning_megatron_fsdp.manifest import (
    ASIDE,
    DCP_METADATA_FILE,
    MANIFEST_FILE,
    META_FILE,
    CheckpointError,
    CheckpointMismatchError,
    CheckpointSaveError,
    is_complete_checkpoint,
    parse_hidden_name,
    read_manifest,
    recover_checkpoint,
)
from lightning_megatron_fsdp.optimizer_state import ensure_optimizer_state
from lightning_megatron_fsdp.precision import MegatronFSDPPrecision, _reject_closure_optimizer
from lightning_megatron_fsdp.pretrained import (
    PretrainedWeights,
    apply_pretrained_weights,
    as_pretrained_weights,
    load_full_weights,
)
from lightning_megatron_fsdp.sharding import shard_module
from lightning_megatron_fsdp.uneven_dtensor import attach_uneven_dtensor_metadata

if TYPE_CHECKING:
    from lightning.pytorch.utilities.types import STEP_OUTPUT

__all__ = ["AutoWrapPolicy", "MegatronFSDPStrategy", "fsdp_placements", "hsdp_placements"]

#: A set of module classes, or a callable ``policy(module) -> bool`` or torch-FSDP style
#: ``policy(module, recurse, nonwrapped_numel) -> bool`` (``ModuleWrapPolicy``,
#: ``functools.partial(size_based_auto_wrap_policy, ...)``).
AutoWrapPolicy = set[type[nn.Module]] | Callable[..., bool]

_STRATEGY = "MegatronFSDPStrategy"
_SHARD_DIM = "dp_shard"
_REPLICATE_DIM = "dp_replicate"


def fsdp_placements() -> Placements:
    """Placements for plain FSDP on a 1-D mesh: everything ``Flat`` (sharded)."""
    return Placements(dp_axes=[0], parameter=[Flat()], gradient=[Flat()], optimizer=[Flat()])


def hsdp_placements() -> Placements:
    """Placements for HSDP on a 2-D ``(dp_replicate, dp_shard)`` mesh.

    Parameters and optimizer state are replicated across rows and sharded within a row.
    Gradients rest ``Partial(AVG)`` across rows between micro-batches: each backward
    reduce-scatters (averages) within the row, and only the last micro-batch of an
    accumulation window all-reduces (averages) across rows, finalising them to the
    parameters' placements (megatron-fsdp's ``reduce_partial_gradients``).
    """
    return Placements(
        dp_axes=[0, 1],
        parameter=[Replicate(), Flat()],
        gradient=[Partial(dist.ReduceOp.AVG), Flat()],
        optimizer=[Replicate(), Flat()],
    )


class MegatronFSDPStrategy(ParallelStrategy):
    """Lightning strategy for NVIDIA Megatron-FSDP (``megatron_fsdp.experimental``).

    ``Trainer(strategy=MegatronFSDPStrategy())`` or ``Trainer(strategy="megatron_fsdp")``.

    Args:
        auto_wrap_policy: Which submodules become their own FSDP unit, applied bottom-up
            before the LightningModule (the root unit, which always exists). A set of
            module classes, or a callable as in Lightning's ``FSDPStrategy``: either
            ``policy(module) -> bool`` or torch FSDP's ``policy(module, recurse,
            nonwrapped_numel) -> bool`` (called with ``recurse=False``). ``None``: only
            the root, plus whatever ``configure_model`` sharded itself. Keep tied
            parameters in one unit (wrap blocks, not a tied embedding).
        device_mesh: ``None`` for plain FSDP over all processes; ``(replicate, shard)``
            with ``replicate * shard == world size`` for HSDP; or a ``DeviceMesh`` of 1 or
            2 dims spanning the world.
        mixed_precision_policy: Megatron-FSDP main weight/gradient dtypes; derived from
            the Trainer's ``precision`` when ``None`` (see
            :class:`~lightning_megatron_fsdp.precision.MegatronFSDPPrecision`).
        process_group_backend: ``"nccl"``, ``"gloo"``, ...; by device type when ``None``.
        timeout: Timeout of every collective of the process groups this strategy creates.
        allow_weights_only_resume: Let ``fit(ckpt_path=...)`` resume from a checkpoint
            without optimizer state (saved with ``weights_only=True``): weights and the
            training position load, the optimizers start fresh. Off by default, so such a
            resume is refused on every rank instead of silently changing the run.
        init_weights_from: Full (unsharded) weights to initialise the model with, right
            after sharding and before optimizers are created: a ``torch.save`` state dict
            (``.pt``/``.pth``/``.bin``), a Lightning ``.ckpt`` file (DDP, single device),
            a ``.safetensors`` file, a consolidated export, or a DCP checkpoint directory
            (ours at any world size or mesh, or Lightning ``ModelParallelStrategy``'s).
            Each rank reads only the rows it owns. A path, or a
            :class:`~lightning_megatron_fsdp.pretrained.PretrainedWeights` for key prefixes
            and non-strict loading. Applied once per model (a later ``test`` with the same
            model keeps its trained weights); a ``ckpt_path`` restore overrides it. See
            :func:`~lightning_megatron_fsdp.pretrained.load_full_weights`.
        accelerator: Set by the Trainer.
        parallel_devices: Set by the Trainer.
        cluster_environment: Set by the Trainer (``torchrun``, SLURM, Lightning, ...).
        checkpoint_io: Defaults to ``MegatronFSDPCheckpointIO``.
        precision_plugin: Set by the Trainer from ``precision=...``.

    Raises:
        TypeError: If ``auto_wrap_policy``, ``device_mesh``, ``timeout`` or
            ``init_weights_from`` has the wrong type.
        ValueError: If ``device_mesh`` has a non-positive size.
    """

    strategy_name = "megatron_fsdp"

    def __init__(
        self,
        *,
        auto_wrap_policy: AutoWrapPolicy | None = None,
        device_mesh: tuple[int, int] | DeviceMesh | None = None,
        mixed_precision_policy: MixedPrecisionPolicy | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        init_weights_from: _PATH | PretrainedWeights | None = None,
        allow_weights_only_resume: bool = False,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self.checkpoint_io = checkpoint_io  # through the setter, which validates it
        self._auto_wrap_policy = _validate_auto_wrap_policy(auto_wrap_policy)
        self._mesh_request = _validate_device_mesh(device_mesh)
        if mixed_precision_policy is not None and not isinstance(
            mixed_precision_policy, MixedPrecisionPolicy
        ):
            raise TypeError(
                f"{_STRATEGY}: mixed_precision_policy must be a megatron_fsdp."
                f"MixedPrecisionPolicy, got {type(mixed_precision_policy).__name__}."
            )
        if timeout is not None and not isinstance(timeout, timedelta):
            raise TypeError(f"{_STRATEGY}: timeout must be a datetime.timedelta, got {timeout!r}.")
        self._mixed_precision_policy = mixed_precision_policy
        self._init_weights_from = as_pretrained_weights(init_weights_from)
        if not isinstance(allow_weights_only_resume, bool):
            raise TypeError(
                f"{_STRATEGY}: allow_weights_only_resume must be a bool, got "
                f"{allow_weights_only_resume!r}."
            )
        self.allow_weights_only_resume = allow_weights_only_resume
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self._device_mesh: DeviceMesh | None = None
        self._failed = False
        self.num_nodes = 1

    # ------------------------------------------------------------------ properties

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_processes(self) -> int:
        """Processes (devices) on this node."""
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def is_distributed(self) -> bool:
        """Always ``True``: Lightning then adds a ``DistributedSampler`` to dataloaders."""
        return True

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Every rank is a data-parallel rank, HSDP replicas and shards alike.
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

    @property
    def process_group_backend(self) -> str | None:
        """The process group backend (resolved in ``setup_environment``)."""
        return self._process_group_backend

    @property
    def device_mesh(self) -> DeviceMesh:
        """The data-parallel mesh (1-D FSDP or 2-D HSDP).

        Raises:
            RuntimeError: Before ``setup_environment`` has created it.
        """
        if self._device_mesh is None:
            raise RuntimeError(
                f"{_STRATEGY}.device_mesh is created in setup_environment(), when the "
                "processes have joined; access it from configure_model() or later."
            )
        return self._device_mesh

    @property
    def placements(self) -> Placements:
        """Megatron-FSDP placements matching :attr:`device_mesh` (FSDP or HSDP)."""
        return hsdp_placements() if self.device_mesh.ndim == 2 else fsdp_placements()

    @property
    def mixed_precision_policy(self) -> MixedPrecisionPolicy:
        """The user's policy, or the one the precision flag implies."""
        if self._mixed_precision_policy is not None:
            return self._mixed_precision_policy
        return self.precision_plugin.mixed_precision_policy()

    @property  # type: ignore[override]
    @override
    def precision_plugin(self) -> MegatronFSDPPrecision:
        if self._precision_plugin is None:
            self._precision_plugin = MegatronFSDPPrecision("32-true")
        return self._precision_plugin  # type: ignore[return-value]

    @precision_plugin.setter
    @override
    def precision_plugin(self, precision_plugin: Precision | None) -> None:
        self._precision_plugin = _to_megatron_precision(precision_plugin)

    @property
    @override
    def checkpoint_io(self) -> CheckpointIO:
        if self._checkpoint_io is None:
            self._checkpoint_io = _default_checkpoint_io()
        elif (
            isinstance(self._checkpoint_io, _WrappingCheckpointIO)
            and self._checkpoint_io.checkpoint_io is None
        ):
            self._checkpoint_io.checkpoint_io = _default_checkpoint_io()
        return self._checkpoint_io

    @checkpoint_io.setter
    @override
    def checkpoint_io(self, io: CheckpointIO | None) -> None:
        if isinstance(io, AsyncCheckpointIO):
            raise TypeError(
                f"{_STRATEGY}: Lightning's AsyncCheckpointIO saves from a background thread, "
                "whose DCP collectives would interleave with training's. Use "
                "MegatronFSDPCheckpointIO(async_save=True) instead."
            )
        self._checkpoint_io = io

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        # Load targets are the sharded parameters and adapted optimizers: setup first.
        return True

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        # load_checkpoint() already loaded optimizer state in place, by FQN.
        return False

    # ------------------------------------------------------------------ processes

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = _SubprocessScriptLauncher(
                self.cluster_environment, self.num_processes, self.num_nodes
            )

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self._check_mesh_fits_world()
        reset_seed()
        self.set_world_ranks()
        self._process_group_backend = self._get_process_group_backend()
        assert self.cluster_environment is not None
        created = not _distributed_is_initialized()
        kwargs: dict[str, Any] = {"timeout": self._timeout}
        if self.root_device.type != "cpu":
            kwargs["device_id"] = self.root_device
        rendezvous = _take_pending_rendezvous(self.global_rank, self.world_size)
        if created and rendezvous is not None:
            rendezvous.init_process_group(self._process_group_backend, **kwargs)
        else:
            _init_dist_connection(self.cluster_environment, self._process_group_backend, **kwargs)
        if created:
            _OWNERSHIP.default_group = True
        if self.root_device.type == "cpu":
            enable_cpu_execution()
        if self.precision_plugin.device_type is None:
            self.precision_plugin.device_type = self.root_device.type
        assert self.lightning_module is not None
        self._device_mesh = self._resolve_device_mesh(self.lightning_module)
        self.lightning_module._device_mesh = self._device_mesh

    def set_world_ranks(self) -> None:
        """Tell the cluster environment (and ``rank_zero_only``) this process's ranks."""
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(
                self.node_rank * self.num_processes + self.local_rank
            )
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    def _get_process_group_backend(self) -> str:
        return self._process_group_backend or _get_default_process_group_backend_for_device(
            self.root_device
        )

    def _check_mesh_fits_world(self) -> None:
        """Raise (on every rank, before any collective) if the mesh is not the world."""
        world = self.num_nodes * self.num_processes
        request = self._mesh_request
        size = request.size() if isinstance(request, DeviceMesh) else _prod(request or (world,))
        if size != world:
            raise ValueError(
                f"{_STRATEGY}: device_mesh={_describe_mesh(request)} spans {size} processes, "
                f"but the world has {world} (num_nodes={self.num_nodes} x "
                f"devices={self.num_processes}). Every process is a data-parallel rank: "
                f"choose (replicate, shard) with replicate * shard == {world}, e.g. "
                f"(1, {world}), or leave device_mesh=None for plain FSDP."
            )

    def _resolve_device_mesh(self, model: nn.Module) -> DeviceMesh:
        """This strategy's mesh, the mesh an already-sharded ``model`` uses, or a new one.

        A model sharded by an earlier run keeps that run's mesh object in every DBuffer and
        DTensor parameter; if a teardown destroyed its groups, it is re-bound to fresh
        ones (with the same rank layout), so the model trains and evaluates again.

        Raises:
            ValueError: If the model was sharded on a mesh of another shape.
        """
        mesh = self._device_mesh if self._device_mesh is not None else _mesh_of(model)
        if mesh is None:
            return self._build_device_mesh()
        wanted = self._requested_shape()
        if wanted is not None and tuple(mesh.shape) != wanted:
            raise ValueError(
                f"{_STRATEGY}: the model is already sharded on a mesh of shape "
                f"{tuple(mesh.shape)}, but this strategy asks for {wanted}. A sharded model "
                "keeps its mesh; use the same device_mesh (and world size) as the run that "
                "sharded it."
            )
        if not _mesh_is_bound(mesh):
            _rebind_mesh(mesh, self._mesh_groups())
        return mesh

    def _requested_shape(self) -> tuple[int, ...] | None:
        request = self._mesh_request
        if isinstance(request, DeviceMesh):
            return tuple(request.shape)
        return request or (self.world_size,)

    def _build_device_mesh(self) -> DeviceMesh:
        """Build the data-parallel mesh on process groups that carry ``timeout``.

        ``init_device_mesh`` would create the 2-D sub-groups with torch's default timeout
        (30 minutes), so a failing peer would stall the others that long; here the 1-D
        mesh reuses the world group and the 2-D rows/columns are created explicitly.
        """
        request = self._mesh_request
        device_type = self.root_device.type
        if isinstance(request, DeviceMesh):
            if request.device_type != device_type or request.ndim not in (1, 2):
                raise ValueError(
                    f"{_STRATEGY}: device_mesh must be a 1-D or 2-D {device_type!r} mesh, got "
                    f"a {request.ndim}-D {request.device_type!r} mesh."
                )
            return request
        groups = self._mesh_groups()
        if request is None:
            return DeviceMesh.from_group(groups[0], device_type, mesh_dim_names=(_SHARD_DIM,))
        return DeviceMesh.from_group(
            groups,
            device_type,
            mesh=torch.arange(self.world_size).view(request),
            mesh_dim_names=(_REPLICATE_DIM, _SHARD_DIM),
        )

    def _mesh_groups(self) -> list[dist.ProcessGroup]:
        """The world group (1-D), or this rank's (replicate, shard) groups (2-D).

        The 2-D groups are built with ``new_subgroups_by_enumeration`` (a collective every
        rank enters in the same order): shard groups are the rows of the rank grid,
        replicate groups its columns.
        """
        request = self._mesh_request
        if request is None:
            return [_group.WORLD]
        assert isinstance(request, tuple)
        ranks = torch.arange(self.world_size).view(request)
        timeout = self._timeout
        shard_group, _ = dist.new_subgroups_by_enumeration(ranks.tolist(), timeout=timeout)
        replicate_group, _ = dist.new_subgroups_by_enumeration(ranks.T.tolist(), timeout=timeout)
        return [replicate_group, shard_group]

    # ------------------------------------------------------------------ model setup

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        if self._layer_sync is not None:
            raise ValueError(
                f"{_STRATEGY} does not support Trainer(sync_batchnorm=True): its buffers are "
                "not sharded and SyncBatchNorm's conversion would replace sharded modules. "
                "Remove sync_batchnorm."
            )
        assert self.lightning_module is not None
        self._shard_model(self.lightning_module)
        if self._init_weights_from is not None:
            apply_pretrained_weights(self.lightning_module, self._init_weights_from)
        self.model = self.lightning_module
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()

    @override
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        # Re-create optimizers on every fit: an earlier stage's optimizers may hold other
        # parameter objects.
        self._reset_optimizers_and_schedulers()
        super().setup_optimizers(trainer)
        assert self.lightning_module is not None
        names = {id(p): n for n, p in self.lightning_module.named_parameters()}
        for index, optimizer in enumerate(self.optimizers):
            _reject_closure_optimizer(optimizer)
            for group in optimizer.param_groups:
                for parameter in group["params"]:
                    _check_sharded_parameter(parameter, names, index)
            if not getattr(optimizer, "_lmf_fully_sharded", False):
                fully_shard_optimizer(optimizer)
                optimizer._lmf_fully_sharded = True  # type: ignore[attr-defined]

    @override
    def model_to_device(self) -> None:
        """Move what sharding does not own (buffers, torchmetrics states) to the device.

        Never ``module.to(device)``: that would re-create the sharded DTensor parameters.
        """
        assert self.lightning_module is not None
        _move_unsharded_state(self.lightning_module, self.root_device)

    @contextlib.contextmanager
    @override
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        # Materialisation happens unit by unit in setup(), right before each unit is sharded.
        device = torch.device("meta") if empty_init else contextlib.nullcontext()
        with device, self.precision_plugin.tensor_init_context():
            yield

    def shard(self, module: nn.Module) -> None:
        """Make ``module`` one Megatron-FSDP unit with this strategy's mesh and precision.

        Owns every parameter of ``module`` that no child unit owns. Materialises meta
        tensors first (``to_empty`` + ``reset_parameters``, ties preserved), moves the
        unit's buffers to the device, casts to the compute dtype under the ``-true``
        precisions (keeping the exact original values as the fp32 main weights), then
        shards through :func:`~lightning_megatron_fsdp.shard_module`. Call it from
        ``configure_model`` (children before parents) to choose units by hand.

        Args:
            module: A module not yet sharded.

        Raises:
            ValueError: If ``module`` is already sharded or a tie crosses unit boundaries.
            TypeError: If a meta-device module has no ``reset_parameters``.
        """
        device = self.root_device
        modules = list(_unit_modules(module))
        _materialize(modules, device)
        plugin = self.precision_plugin
        originals: dict[int, Tensor] = {}
        for _, owner in modules:
            for name, buffer in owner._buffers.items():
                if buffer is not None:
                    moved = buffer.to(device)
                    if plugin.casts_parameters and moved.is_floating_point():
                        moved = moved.to(plugin.compute_dtype)
                    owner._buffers[name] = moved
            if not plugin.casts_parameters:
                continue
            for parameter in owner._parameters.values():
                if parameter is None or not parameter.is_floating_point():
                    continue
                if parameter.dtype != plugin.compute_dtype:
                    originals[id(parameter)] = parameter.detach()
                    parameter.data = parameter.data.to(plugin.compute_dtype)
        policy = self.mixed_precision_policy
        shard_module(module, self.device_mesh, self.placements, mixed_precision_policy=policy)
        if originals:
            assert isinstance(module, FsdpModule)
            _restore_main_weights(module, originals)

    def _shard_model(self, model: pl.LightningModule) -> None:
        """Shard ``model`` bottom-up: policy units, then the root (unless done before)."""
        _check_no_foreign_sharding(model)
        if not isinstance(model, FsdpModule):
            for unit in _select_units(model, self._auto_wrap_policy):
                self.shard(unit)
            self.shard(model)
        _move_unsharded_state(model, self.root_device)
        _check_fully_sharded(model)

    # ------------------------------------------------------------------ steps

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        with self.precision_plugin.train_step_context():
            return self._call_through_root("training_step", *args, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        with self.precision_plugin.val_step_context():
            return self._call_through_root("validation_step", *args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        with self.precision_plugin.test_step_context():
            return self._call_through_root("test_step", *args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.predict_step_context():
            return self._call_through_root("predict_step", *args, **kwargs)

    def _call_through_root(self, method_name: str, *args: Any, **kwargs: Any) -> Any:
        """Run ``LightningModule.<method_name>`` as the forward of the root FSDP unit.

        The root's forward hooks unshard its own parameters (and prefetch the first
        child), and its backward hook, attached to the forward's output, unshards them
        again for backward. That hook only sees a tensor output, so the loss (the
        tensor, or ``output["loss"]``) is what forward returns, and the caller gets the
        hooked loss back in its place; other outputs pass around the hook.

        Raises:
            RuntimeError: If ``setup`` has not sharded the LightningModule.
        """
        module = self.lightning_module
        if not isinstance(module, FsdpModule):
            raise RuntimeError(
                f"{_STRATEGY}: {method_name} called before setup() sharded the LightningModule."
            )
        outputs: list[Any] = []

        def forward(*forward_args: Any, **forward_kwargs: Any) -> Any:
            module.__dict__.pop("forward", None)
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

    @override
    def post_backward(self, closure_loss: Tensor) -> None:
        # On CUDA, gradient reduce-scatters run on a side stream; the root's final
        # backward callback joins it, but a manual backward inside the root's forward
        # never registers that callback, so join it here before anything reads .grad.
        for module in _fsdp_modules(self.lightning_module):
            context = module._context
            if context is not None and context.root_module is module:
                context.current_stream().wait_stream(context.reduce_scatter_stream)

    @contextlib.contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Mark the non-final micro-batches of gradient accumulation for HSDP.

        Lightning enters this around every accumulating micro-batch except the last. Plain
        FSDP finalises gradients on every backward and needs nothing; HSDP defers the
        all-reduce across replicas to the last micro-batch (``microbatch``).
        """
        model = self.lightning_module
        if isinstance(model, FsdpModule) and self.device_mesh.ndim > 1:
            with microbatch(model, is_last=False):
                yield
        else:
            yield

    @override
    def on_train_start(self) -> None:
        trainer = self._trainer()
        self._check_equal_batch_counts("training", [trainer.num_training_batches])

    @override
    def on_validation_start(self) -> None:
        trainer = self._trainer()
        counts = trainer.num_sanity_val_batches if trainer.sanity_checking else None
        self._check_equal_batch_counts("validation", counts or trainer.num_val_batches)

    @override
    def on_test_start(self) -> None:
        self._check_equal_batch_counts("test", self._trainer().num_test_batches)

    @override
    def on_predict_start(self) -> None:
        self._check_equal_batch_counts("predict", self._trainer().num_predict_batches)

    def _trainer(self) -> pl.Trainer:
        assert self.lightning_module is not None
        return self.lightning_module.trainer

    def _check_equal_batch_counts(self, stage: str, counts: list[int | float]) -> None:
        """Raise on every rank if ranks would run different numbers of steps.

        Every forward all-gathers parameters across the ranks, so a rank with one more
        batch would wait forever for its peers (until the collective timeout). Lightning
        pads training/validation/test samplers but not the predict sampler, so an uneven
        predict set is the usual culprit.

        Raises:
            ValueError: Naming each rank's batch counts.
        """
        if not _distributed_is_initialized() or self.world_size == 1:
            return
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, [float(c) for c in counts])
        if all(other == gathered[0] for other in gathered):
            return
        per_rank = ", ".join(f"rank {r}: {c}" for r, c in enumerate(gathered))
        raise ValueError(
            f"{_STRATEGY}: the {stage} dataloaders give ranks different numbers of batches "
            f"({per_rank}). Every rank must run the same number of steps, because each "
            "forward all-gathers parameters from all ranks. Make the dataset length a "
            "multiple of world_size x batch_size (Lightning's predict sampler does not pad), "
            "or use a sampler that pads or drops the remainder."
        )

    # ------------------------------------------------------------------ collectives

    @override
    def barrier(self, name: str | None = None) -> None:
        if not _distributed_is_initialized():
            return
        if dist.get_backend() == "nccl":
            dist.barrier(device_ids=[self.root_device.index])
        else:
            dist.barrier()

    @override
    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        if not _distributed_is_initialized():
            return obj
        container = [obj]
        dist.broadcast_object_list(container, src, group=_group.WORLD)
        return container[0]

    @override
    def reduce(
        self,
        tensor: Tensor | Any,
        group: Any | None = None,
        reduce_op: ReduceOp | str | None = "mean",
    ) -> Tensor | Any:
        if isinstance(tensor, Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    # ------------------------------------------------------------------ checkpoints

    #: Let ``fit(ckpt_path=...)`` start from a checkpoint that holds no optimizer state
    #: (one saved with ``weights_only=True`` or ``ModelCheckpoint(save_weights_only=True)``).
    #: ``False`` (the default) refuses such a resume on every rank with an error that says
    #: so, because continuing with fresh optimizer state is not the run that was saved.
    #: ``True`` loads the weights and the training position (loops, epoch, global step,
    #: callbacks if saved), leaves the optimizers as freshly created (all-zero state, see
    #: :func:`~lightning_megatron_fsdp.ensure_optimizer_state`) and the LR schedulers as
    #: configured, and warns. Set it on the instance before ``fit``:
    #: ``strategy.allow_weights_only_resume = True``. A checkpoint that does hold
    #: optimizer state always resumes fully.
    allow_weights_only_resume: bool = False

    @property
    @override
    def launcher(self) -> _Launcher | None:
        """Lightning's launcher, wrapped so ``ckpt_path="last"`` means a complete checkpoint.

        Lightning resolves ``"last"`` before the strategy sees the run (in the Trainer's
        checkpoint connector, before ``connect`` and ``setup_environment``): it takes the
        most recently modified ``last*`` entry of each ``ModelCheckpoint`` directory. That
        may be a damaged directory, and after a crash between the two renames of an
        overwrite (see ``docs/DESIGN.md``) there is no ``last*`` entry at all, so training
        would silently start from scratch. The one strategy hook that runs earlier is the
        launcher's ``launch``, which receives the Trainer and the stage's arguments: the
        wrapper first restores checkpoints a crash left renamed aside, then replaces
        ``"last"`` by the most recently written *complete* ``last*`` checkpoint (manifest
        mtime, Lightning's "most recent" rule), and leaves ``"last"`` to Lightning when there
        is none. Every rank does this before any process group exists (recovery is
        idempotent across ranks); :meth:`load_checkpoint` then loads rank 0's choice.

        Alternatives rejected:
            * Resolving in :meth:`load_checkpoint`: it is never called when Lightning finds
              no ``last*`` entry, which is exactly the crash case.
            * Patching ``ModelCheckpoint._find_last_checkpoints``: the user's callback would
              no longer be the unchanged Lightning callback.
            * Ordering by ``global_step`` (as ``resolve_latest_checkpoint`` does): a run
              restarted from scratch into the same directory writes ``last-v1.ckpt``, and
              Lightning's "last" means that newer run, not the older run's higher step.
        """
        inner = self._launcher
        cached = self.__dict__.get("_lmf_launcher")
        if cached is not None and cached[0] is inner:
            return cached[1]
        wrapper: _Launcher
        if inner is None:  # processes created externally (torchrun, SLURM, ...)
            wrapper = _ResolvingLastLauncher()
        elif type(inner) is _SubprocessScriptLauncher:
            wrapper = _ResolvingLastSubprocessScriptLauncher(
                inner.cluster_environment, inner.num_processes, inner.num_nodes
            )
        else:
            return inner
        self._lmf_launcher = (inner, wrapper)
        return wrapper

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The model's state by FQN, sharded parameters as DTensors (no collective)."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        assert self.lightning_module is not None
        return get_model_state_dict(self.lightning_module)

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """The optimizer's state keyed by parameter FQN (DCP's ``get_optimizer_state_dict``).

        An optimizer that has not stepped yet first gets all-zero state
        (:func:`~lightning_megatron_fsdp.ensure_optimizer_state`), equivalent to a fresh
        optimizer, so every checkpoint of a run has the same optimizer fingerprint.
        """
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        optimizer = getattr(optimizer, "_optimizer", optimizer)
        assert self.lightning_module is not None
        ensure_optimizer_state(optimizer)
        return get_optimizer_state_dict(self.lightning_module, optimizer)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """Nothing to do: :meth:`load_checkpoint` loaded the weights in place."""

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Nothing to do: :meth:`load_checkpoint` loaded optimizer state in place."""

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None
    ) -> None:
        """Save on every rank (a collective): each rank writes only its own shards.

        ``checkpoint`` comes from Lightning's ``dump_checkpoint`` and already holds the
        FQN-keyed model and optimizer state dicts from :meth:`lightning_module_state_dict`
        and :meth:`optimizer_state`; this attaches each packed shard's true chunk to them
        and hands everything to the checkpoint IO. The path is rank 0's, so all ranks
        write one checkpoint even if their clocks or names differ. Attaching is rank-local
        and can fail on one rank alone (a rank whose state differs), so the ranks agree on
        its outcome with one all-reduce before the IO's first collective.

        Called after a Trainer stage ended (``trainer.save_checkpoint`` after ``fit``),
        when ``teardown`` has destroyed the process group, it re-creates the group on the
        rendezvous that teardown prepared, saves, and destroys it again.

        Raises:
            CheckpointSaveError: On every rank if any rank fails (the failing rank names
                its own error, the others name the failing rank); nothing is written.
            CheckpointError: If the process group is gone and cannot be re-created.
        """
        with self._checkpoint_process_group(f"save checkpoint {filepath}"):
            path = self.broadcast(str(filepath))
            model = self.lightning_module
            assert model is not None
            error: Exception | None = None
            try:
                attach_uneven_dtensor_metadata(model, checkpoint.get("state_dict", {}), {})
                for optimizer_state in checkpoint.get("optimizer_states", []):
                    attach_uneven_dtensor_metadata(model, {}, optimizer_state)
            except Exception as err:
                error = err
            self._raise_together(
                f"saving checkpoint {path} (attaching chunk metadata)",
                error,
                CheckpointSaveError,
                consequence="nothing was written",
            )
            try:
                self.checkpoint_io.save_checkpoint(
                    checkpoint, path, storage_options=storage_options
                )
            except CheckpointException as err:  # a BaseException: never let it escape as is
                raise CheckpointSaveError(_dcp_exception_message("Saving", path, err)) from err

    @override
    def load_checkpoint(
        self, checkpoint_path: _PATH, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Load a checkpoint in place into the sharded model (and optimizers when fitting).

        Collective: every rank calls it, and rank 0's path is loaded. Targets are built
        from the live model and optimizers (a fresh optimizer first gets all-zero state,
        so DCP has tensors to fill), the ranks agree that every rank built them, the IO
        checks the checkpoint's fingerprint against them before any rank reads tensor data
        and loads them, optimizer hyper-parameters are applied by FQN, and the compute
        weights are refreshed from the loaded main weights. validate/test/predict load
        weights only. A fit from a checkpoint without optimizer state is refused unless
        :attr:`allow_weights_only_resume` is set.

        Returns:
            The non-tensor rest of the checkpoint, plus the filled targets.

        Raises:
            NotACheckpointError: ``checkpoint_path`` is missing, a file, or incomplete.
            CheckpointMismatchError: The checkpoint does not fit the model or optimizers
                (naming every missing, unexpected or reshaped FQN), or it holds no
                optimizer state and :attr:`allow_weights_only_resume` is off.
            CheckpointError: Building the targets, reading, or applying the state failed
                on some rank. Every error is raised on every rank; before any tensor is
                read, the model and optimizers are unchanged.
        """
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        with self._checkpoint_process_group(f"load checkpoint {checkpoint_path}"):
            peek = _saved_optimizer_count(checkpoint_path) if self.is_global_zero else None
            path, saved_optimizers = self.broadcast((str(checkpoint_path), peek))
            model = self.lightning_module
            assert model is not None
            optimizers = [getattr(o, "_optimizer", o) for o in self.optimizers]
            fitting = bool(optimizers) and model.trainer.state.fn == TrainerFn.FITTING
            if _is_foreign_lightning_dcp(path):
                return self._load_foreign_checkpoint(
                    path, optimizers if fitting else [], weights_only
                )
            weights_only_resume = fitting and saved_optimizers == 0
            if weights_only_resume and not self.allow_weights_only_resume:
                raise CheckpointMismatchError(
                    f"{_STRATEGY}: checkpoint {path} holds no optimizer state (it was saved "
                    "with weights_only=True, e.g. by ModelCheckpoint(save_weights_only=True)), "
                    f"so fit() cannot resume the run exactly with its {len(optimizers)} "
                    "optimizer(s). To train on from its weights with fresh optimizer state, set "
                    "strategy.allow_weights_only_resume = True before fit; to evaluate it, use "
                    "trainer.validate/test/predict(ckpt_path=...); to resume exactly, save "
                    "checkpoints with optimizer state."
                )
            load_optimizers = fitting and not weights_only_resume
            state: dict[str, Any] = {}
            error: Exception | None = None
            try:
                state = _load_targets(model, optimizers if load_optimizers else [])
            except Exception as err:
                error = err
            self._raise_together(
                f"loading checkpoint {path} (building the load targets)",
                error,
                CheckpointError,
                consequence="nothing was read; the model and optimizers are unchanged",
            )
            try:
                checkpoint = self.checkpoint_io.load_checkpoint(
                    path, weights_only=weights_only, state=state, strict=model.strict_loading
                )
            except CheckpointException as err:  # a BaseException: never let it escape as is
                raise CheckpointError(_dcp_exception_message("Loading", path, err)) from err
            try:
                if load_optimizers:
                    for optimizer, optimizer_state in zip(
                        optimizers, checkpoint["optimizer_states"], strict=True
                    ):
                        set_optimizer_state_dict(model, optimizer, optimizer_state)
                _sync_compute_weights(model)
            except Exception as err:
                error = err
            self._raise_together(
                f"loading checkpoint {path} (applying the loaded state)",
                error,
                CheckpointError,
                consequence="the tensors were loaded but the optimizers may be half restored; "
                "do not train on, load again",
            )
        if weights_only_resume:
            checkpoint = self._weights_only_resume(checkpoint, path)
        return checkpoint

    def _load_foreign_checkpoint(
        self, path: str, optimizers: list[Optimizer], weights_only: bool | None
    ) -> dict[str, Any]:
        """Resume from another strategy's Lightning DCP checkpoint (``ModelParallelStrategy``).

        Such a directory has DCP's ``.metadata`` and Lightning's ``meta.pt`` but no manifest
        of ours. :func:`load_full_weights` reads every rank's own rows of the weights and,
        when fitting, the optimizer state by FQN (it validates keys and shapes on every
        rank first); ``meta.pt`` holds the loop, epoch, scheduler and callback state that
        Lightning restores from the returned dict.
        """
        model = self.lightning_module
        assert model is not None
        load_full_weights(model, path, optimizers=optimizers, strict=model.strict_loading)
        return torch.load(Path(path, META_FILE), map_location="cpu", weights_only=weights_only)

    @override
    def remove_checkpoint(self, filepath: _PATH) -> None:
        """Remove a checkpoint directory: rank 0 deletes, every rank learns the outcome.

        ``ModelCheckpoint`` calls this on every rank (``save_top_k``, a replaced
        ``last``); the IO knows the layout and refuses to delete anything that is not one
        of its checkpoints. A refusal on rank 0 is raised on every rank, so no rank trains
        on while another has stopped.

        Raises:
            CheckpointError: On every rank, if rank 0 could not remove it.
        """
        error: Exception | None = None
        if self.is_global_zero:
            try:
                self.checkpoint_io.remove_checkpoint(filepath)
            except Exception as err:
                error = err
        self._raise_together(
            f"removing checkpoint {filepath}",
            error,
            CheckpointError,
            consequence="the checkpoint was not removed",
        )

    @contextlib.contextmanager
    def _checkpoint_process_group(self, action: str) -> Generator[None, None, None]:
        """Make sure every rank is in a process group for a checkpoint collective.

        Inside a Trainer stage the group exists. After one, ``teardown`` has destroyed it
        (see the module docstring) but prepared the rendezvous of the next group, so a
        save after ``fit`` (``trainer.save_checkpoint``) joins a fresh group there and
        destroys it again afterwards; without this, each rank would save alone, as if it
        were the whole world, and the ranks would overwrite each other's checkpoint.

        Raises:
            CheckpointError: If there is no group and none can be re-created (no rendezvous
                was prepared: this strategy never created the group).
        """
        if _distributed_is_initialized() or self.world_size <= 1:
            yield
            return
        rendezvous = _take_pending_rendezvous(self.global_rank, self.world_size)
        if rendezvous is None:
            raise CheckpointError(
                f"{_STRATEGY}: cannot {action}: the process group is not initialized and "
                f"this strategy cannot re-create it (world size {self.world_size}). A "
                "checkpoint is a collective of all ranks: call trainer.save_checkpoint / "
                "load from every rank during or after a Trainer stage this strategy ran, or "
                "initialize torch.distributed yourself first."
            )
        kwargs: dict[str, Any] = {"timeout": self._timeout}
        if self.root_device.type != "cpu":
            kwargs["device_id"] = self.root_device
        rendezvous.init_process_group(self._get_process_group_backend(), **kwargs)
        _OWNERSHIP.default_group = True
        try:
            if self._device_mesh is not None and not _mesh_is_bound(self._device_mesh):
                _rebind_mesh(self._device_mesh, self._mesh_groups())
            yield
        except BaseException:
            self._failed = True  # keep the group: a peer may be gone (_destroy_process_group)
            raise
        finally:
            # An async save still writes (and commits) over this group in the background:
            # finish it, and drop the IO's groups, before the group goes away.
            teardown_io = getattr(self._checkpoint_io, "teardown", None)
            try:
                if teardown_io is not None and not self._failed:
                    teardown_io()
            finally:
                self._destroy_process_group()

    def _raise_together(
        self,
        action: str,
        error: Exception | None,
        error_type: type[CheckpointError],
        *,
        consequence: str,
    ) -> None:
        """Raise on every rank if rank-local work failed on any rank; else return.

        One all-reduce of a per-rank error flag on the default group (whose timeout bounds
        it), so a rank that failed alone never leaves its peers waiting in the next
        collective. The failing rank raises its own error, the others name it.

        Args:
            action: What was being done, for the message (``"saving checkpoint <path>"``).
            error: This rank's error, or ``None`` if its part succeeded.
            error_type: The class to raise.
            consequence: What state the failure leaves, for the message.

        Raises:
            CheckpointError: ``error_type``, on every rank, when any rank passed an error,
                or when the all-reduce itself failed (a peer crashed or timed out).
        """
        then = consequence[:1].upper() + consequence[1:]
        if not _distributed_is_initialized() or dist.get_world_size() == 1:
            if error is not None:
                raise error_type(
                    f"{_STRATEGY}: {action} failed: {_describe(error)}. {then}."
                ) from error
            return
        rank, world_size = dist.get_rank(), dist.get_world_size()
        device = torch.device("cpu") if dist.get_backend() == "gloo" else self.root_device
        flags = torch.zeros(world_size, dtype=torch.int32, device=device)
        flags[rank] = int(error is not None)
        try:
            dist.all_reduce(flags)
        except RuntimeError as err:  # gloo/NCCL failures and timeouts
            raise error_type(
                f"{_STRATEGY}: {action}: the ranks could not agree whether every rank "
                f"succeeded ({_describe(err)}); another rank probably crashed or timed out "
                "(check its log). "
                + (f"This rank failed too: {_describe(error)}. " if error else "")
                + f"{then}."
            ) from (error or err)
        failed = [r for r, flag in enumerate(flags.tolist()) if flag]
        if not failed:
            return
        if error is not None:
            others = [r for r in failed if r != rank]
            also = f" (rank(s) {others} failed too)" if others else ""
            raise error_type(
                f"{_STRATEGY}: {action} failed on rank {rank}{also}: {_describe(error)}. "
                f"Every rank raises; {consequence}."
            ) from error
        raise error_type(
            f"{_STRATEGY}: {action} failed on rank(s) {failed}; see that rank's error for why. "
            f"Rank {rank} raises too so that no rank waits in a collective; {consequence}."
        )

    def _weights_only_resume(self, checkpoint: dict[str, Any], path: str) -> dict[str, Any]:
        """Let Lightning restore a weights-only checkpoint for ``fit``: schedulers as configured.

        Lightning refuses a checkpoint without ``lr_schedulers`` when fitting; the current
        schedulers' own state makes its restore a no-op.
        """
        rank_zero_warn(
            f"{_STRATEGY}: resuming fit from weights-only checkpoint {path} "
            "(allow_weights_only_resume=True): model weights and the training position are "
            "restored; optimizer state and LR schedulers start fresh."
        )
        checkpoint = dict(checkpoint)
        checkpoint.setdefault(
            "lr_schedulers", [config.scheduler.state_dict() for config in self.lr_scheduler_configs]
        )
        return checkpoint

    # ------------------------------------------------------------------ teardown

    @override
    def teardown(self) -> None:
        # Not ParallelStrategy.teardown: it moves the model to CPU (module.cpu()), which
        # would re-create the sharded parameters.
        if self.cluster_environment is not None:
            self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        if self.accelerator is not None:
            self.accelerator.teardown()
        if self._checkpoint_io is not None:
            self._checkpoint_io.teardown()
        self._destroy_process_group()

    @override
    def on_exception(self, exception: BaseException) -> None:
        # Lightning calls this before teardown when a run fails on this rank.
        self._failed = True

    def _destroy_process_group(self) -> None:
        """Destroy the groups a MegatronFSDPStrategy created (never a user's).

        Left to interpreter exit, a process could abort there ("terminate called without
        an active exception", see the module docstring). Before destroying, the ranks
        agree (over the old group) on a fresh rendezvous store for the next run, and the
        mesh drops its references to the old groups, so the old store really closes and a
        later run cannot join it by mistake.

        After a failed run (``on_exception``) the group is kept, as Lightning's other
        strategies do: agreeing on a new store needs every peer, which may never come,
        and re-initialising on the cluster environment's fixed port right after a
        destroy races with rank 0 closing its old store. A later run in the same process
        reuses the kept group, and the next successful teardown destroys it.
        """
        failed, self._failed = self._failed, False
        if failed or not (_OWNERSHIP.default_group and _distributed_is_initialized()):
            return
        assert self.cluster_environment is not None
        host = self.cluster_environment.main_address
        _set_pending_rendezvous(
            _Rendezvous.prepare(self.global_rank, self.world_size, host, self._timeout)
        )
        if self._device_mesh is not None:
            _unbind_mesh(self._device_mesh)
        dist.destroy_process_group()
        _OWNERSHIP.default_group = False

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        if cls.strategy_name in strategy_registry:
            return
        strategy_registry.register(
            cls.strategy_name,
            cls,
            description="Megatron-FSDP (megatron_fsdp.experimental) fully sharded training",
        )


# ---------------------------------------------------------------------- helpers


def _default_checkpoint_io() -> CheckpointIO:
    try:
        from lightning_megatron_fsdp.checkpoint_io import MegatronFSDPCheckpointIO
    except ImportError as err:  # pragma: no cover - only while checkpoint_io.py is missing
        raise ImportError(
            f"{_STRATEGY}: the default checkpoint IO, lightning_megatron_fsdp.checkpoint_io."
            "MegatronFSDPCheckpointIO, could not be imported; pass checkpoint_io=... or "
            "install the complete package."
        ) from err
    return MegatronFSDPCheckpointIO()


# ---------------------------------------------------------------------- checkpoint helpers


def _load_targets(model: nn.Module, optimizers: list[Optimizer]) -> dict[str, Any]:
    """FQN-keyed state dicts of the live model (and ``optimizers``) for DCP to load into.

    Rank-local. A fresh optimizer first gets all-zero state (``ensure_optimizer_state``),
    equivalent to one that never stepped, so a load works before the first step.
    """
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    model_state = get_model_state_dict(model)
    attach_uneven_dtensor_metadata(model, model_state, {})
    state: dict[str, Any] = {"state_dict": model_state}
    if optimizers:
        for optimizer in optimizers:
            ensure_optimizer_state(optimizer)
        state["optimizer_states"] = [get_optimizer_state_dict(model, o) for o in optimizers]
        for optimizer_state in state["optimizer_states"]:
            attach_uneven_dtensor_metadata(model, {}, optimizer_state)
    return state


def _is_foreign_lightning_dcp(path: str) -> bool:
    """Whether ``path`` is a ``ModelParallelStrategy`` (FSDP2) checkpoint directory.

    Recognised positively, never by what is missing: DCP's ``.metadata`` and Lightning's
    ``meta.pt`` without our manifest, *and* Lightning's ``optimizer_<i>.`` keys, which our
    format never writes (ours are ``optimizer_states.<i>.``). So a checkpoint of ours whose
    manifest was lost or not yet copied still goes to our loader, which refuses it as
    incomplete instead of loading it unchecked.
    """
    directory = Path(path)
    if not (
        (directory / DCP_METADATA_FILE).is_file()
        and (directory / META_FILE).is_file()
        and not (directory / MANIFEST_FILE).exists()
    ):
        return False
    from torch.distributed.checkpoint import FileSystemReader

    try:
        keys = FileSystemReader(directory).read_metadata().state_dict_metadata
    except Exception:
        return False
    return any(re.match(r"optimizer_\d+\.", key) for key in keys)


def _saved_optimizer_count(path: _PATH) -> int | None:
    """How many optimizers' state the checkpoint at ``path`` holds; ``None`` if unreadable.

    Filesystem work for rank 0 only: restores a checkpoint a crash left renamed aside
    first, as the IO's load would. An unreadable checkpoint is the IO's to explain.
    """
    try:
        recover_checkpoint(os.fspath(path))
        return len(read_manifest(os.fspath(path)).optimizer_fingerprints)
    except (CheckpointError, OSError, ValueError, TypeError):
        return None


def _describe(err: BaseException) -> str:
    """``"<type>: <message>"``, without a final period (callers go on with their own)."""
    return f"{type(err).__name__}: {str(err).rstrip().rstrip('.')}"


def _dcp_exception_message(action: str, path: str, err: CheckpointException) -> str:
    """Name the failing ranks and their errors from DCP's ``CheckpointException``."""
    failures = getattr(err, "failures", None) or {}
    details = []
    for rank, failure in sorted(failures.items()):
        cause = failure[0] if isinstance(failure, tuple) else failure
        details.append(f"rank {rank}: {_describe(cause)}")
    listed = "; ".join(details) or str(err)
    return (
        f"{_STRATEGY}: {action} checkpoint {path} failed in torch.distributed.checkpoint on "
        f"rank(s) {sorted(failures)}: {listed}"
    )


def _with_last_resolved(
    function: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    trainer: pl.Trainer | None,
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``function``'s arguments with ``ckpt_path="last"`` replaced by a complete checkpoint.

    ``function`` is the Trainer stage (``_fit_impl``, ``_validate_impl``, ...); its
    ``ckpt_path`` argument is found by name. Unchanged when it is not ``"last"`` or no
    complete ``last*`` checkpoint exists (Lightning then warns and starts fresh).
    """
    if trainer is None:
        return args, kwargs
    try:
        bound = inspect.signature(function).bind(*args, **kwargs)
    except (TypeError, ValueError):
        return args, kwargs
    if bound.arguments.get("ckpt_path") != "last":
        return args, kwargs
    resolved = _latest_complete_last_checkpoint(trainer)
    if resolved is None:
        return args, kwargs
    bound.arguments["ckpt_path"] = resolved
    return bound.args, bound.kwargs


def _latest_complete_last_checkpoint(trainer: pl.Trainer) -> str | None:
    """The most recently written complete checkpoint Lightning's ``"last"`` could mean.

    Candidates are Lightning's: the ``last*`` entries of every ``ModelCheckpoint``
    directory and the ``OnExceptionCheckpoint`` paths. A checkpoint a crashed commit left
    renamed aside (``.<name>.old-<token>``) is renamed back first. Rank-local filesystem
    work, safe on every rank at once: a rank that loses a rename race finds the checkpoint
    already restored.
    """
    candidates: set[Path] = set()
    for callback in trainer.checkpoint_callbacks:
        if not isinstance(callback, ModelCheckpoint):
            continue
        dirpath = _checkpoint_dir(callback, trainer)
        if dirpath is None or "://" in str(dirpath):  # remote: left to Lightning
            continue
        directory = Path(dirpath)
        pattern = f"{callback.CHECKPOINT_NAME_LAST}*{callback.FILE_EXTENSION}"
        with contextlib.suppress(OSError):
            for sibling in list(directory.iterdir()):
                hidden = parse_hidden_name(sibling.name)
                if hidden is not None and hidden[1] == ASIDE and fnmatch(hidden[0], pattern):
                    with contextlib.suppress(OSError):  # another rank restored it first
                        if recover_checkpoint(directory / hidden[0]):
                            rank_zero_warn(
                                f"Restored {directory / hidden[0]}, which an interrupted "
                                "save had renamed aside."
                            )
            candidates.update(
                p
                for p in directory.iterdir()
                if not p.name.startswith(".") and fnmatch(p.name, pattern)
            )
    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        if isinstance(callback, OnExceptionCheckpoint):
            candidates.add(Path(callback.ckpt_path))
    newest: tuple[tuple[int, str], Path] | None = None
    for candidate in candidates:
        try:
            if not is_complete_checkpoint(candidate):
                continue
            key = ((candidate / MANIFEST_FILE).stat().st_mtime_ns, str(candidate))
        except OSError:
            continue
        if newest is None or key > newest[0]:
            newest = (key, candidate)
    return None if newest is None else str(newest[1])


def _checkpoint_dir(callback: ModelCheckpoint, trainer: pl.Trainer) -> _PATH | None:
    """The directory ``callback`` saves to, resolved exactly as its ``"last"`` lookup does.

    Before ``setup`` a ``ModelCheckpoint`` without ``dirpath`` has not resolved it yet;
    Lightning's lookup calls the callback's private resolver, and so does this.
    """
    resolve = getattr(callback, "_ModelCheckpoint__resolve_ckpt_dir", None)
    if callable(resolve):
        with contextlib.suppress(Exception):
            return resolve(trainer)
    return callback.dirpath


class _ResolvingLastLauncher(_Launcher):
    """For processes created externally: run the stage here, ``ckpt_path="last"`` resolved."""

    @property
    def is_interactive_compatible(self) -> bool:
        return True

    def launch(
        self,
        function: Callable[..., Any],
        *args: Any,
        trainer: pl.Trainer | None = None,
        **kwargs: Any,
    ) -> Any:
        args, kwargs = _with_last_resolved(function, args, kwargs, trainer)
        return function(*args, **kwargs)

    def kill(self, signum: Any) -> None:
        """Nothing to kill: this launcher started no process."""


class _ResolvingLastSubprocessScriptLauncher(_SubprocessScriptLauncher):
    """Lightning's script launcher, with ``ckpt_path="last"`` resolved before it spawns."""

    @override
    def launch(
        self,
        function: Callable[..., Any],
        *args: Any,
        trainer: pl.Trainer | None = None,
        **kwargs: Any,
    ) -> Any:
        args, kwargs = _with_last_resolved(function, args, kwargs, trainer)
        return super().launch(function, *args, trainer=trainer, **kwargs)


class _Rendezvous:
    """A fresh TCP store for the next process group, agreed on over the current one.

    Re-initialising on the cluster environment's port would race: a fast rank could reach
    rank 0's *old* store before rank 0 closed it and read the previous run's keys. Rank 0
    therefore opens a new store on a port the OS picks, before the old group is
    destroyed, and broadcasts the port; the next ``init_process_group`` uses that store.
    """

    def __init__(
        self, rank: int, world_size: int, host: str, port: int, server: Any | None
    ) -> None:
        self.rank, self.world_size, self.host, self.port = rank, world_size, host, port
        self.server = server  # rank 0's TCPStore (server and client), else None

    @classmethod
    def prepare(
        cls, rank: int, world_size: int, host: str, timeout: timedelta | None
    ) -> _Rendezvous:
        """Open rank 0's store and share its address (a collective on the current group).

        Args:
            rank: This process's global rank.
            world_size: Number of processes.
            host: Rank 0's address as the other ranks reach it (the cluster's main address).
            timeout: Store timeout (connects and waits).
        """
        server = None
        address: list[Any] = [None]
        if rank == 0:
            server = dist.TCPStore(
                host,
                0,
                world_size,
                is_master=True,
                timeout=timeout or default_pg_timeout,
                wait_for_workers=False,
            )
            address = [(host, server.port)]
        dist.broadcast_object_list(address, src=0)
        host, port = address[0]
        return cls(rank, world_size, host, port, server)

    def init_process_group(self, backend: str, **kwargs: Any) -> None:
        """Initialise the default process group on this rendezvous's store."""
        timeout = kwargs.get("timeout") or default_pg_timeout
        store = self.server or dist.TCPStore(
            self.host, self.port, self.world_size, is_master=False, timeout=timeout
        )
        dist.init_process_group(
            backend, store=store, rank=self.rank, world_size=self.world_size, **kwargs
        )


class _Ownership:
    """Whether this process's default group was created by a MegatronFSDPStrategy.

    Process-wide, not per strategy: a later Trainer (with a new strategy) that reuses the
    group after a failed run must still destroy it.
    """

    default_group = False


_OWNERSHIP = _Ownership()
_PENDING_RENDEZVOUS: _Rendezvous | None = None


def _set_pending_rendezvous(rendezvous: _Rendezvous | None) -> None:
    global _PENDING_RENDEZVOUS
    _PENDING_RENDEZVOUS = rendezvous


def _take_pending_rendezvous(rank: int, world_size: int) -> _Rendezvous | None:
    """The rendezvous an earlier teardown prepared, if it fits this rank and world."""
    rendezvous = _PENDING_RENDEZVOUS
    _set_pending_rendezvous(None)
    if rendezvous is None or (rendezvous.rank, rendezvous.world_size) != (rank, world_size):
        return None
    return rendezvous


# A store left pending after the last run is closed while the interpreter is intact.
atexit.register(_set_pending_rendezvous, None)


def _mesh_of(model: nn.Module) -> DeviceMesh | None:
    """The mesh of the first Megatron-FSDP parameter group in ``model``, if any."""
    for module in _fsdp_modules(model):
        for group in module.parameter_groups:
            return group.mesh
    return None


def _mesh_is_bound(mesh: DeviceMesh) -> bool:
    return bool(getattr(mesh, "_pg_registry", None))


def _unbind_mesh(mesh: DeviceMesh) -> None:
    """Drop the mesh's references to its groups (about to be destroyed)."""
    _check_mesh_internals(mesh)
    mesh._pg_registry = {}


def _check_mesh_internals(mesh: DeviceMesh) -> None:
    if not (hasattr(mesh, "_dim_group_names") and hasattr(mesh, "_pg_registry")):
        raise AssertionError(
            f"{_STRATEGY}: torch.distributed.DeviceMesh no longer stores its groups in "
            "_dim_group_names/_pg_registry; this torch version is not supported."
        )


def _rebind_mesh(mesh: DeviceMesh, groups: list[dist.ProcessGroup]) -> None:
    """Point ``mesh`` at new process groups, in place, after the old ones were destroyed.

    The mesh object is shared by every DBuffer, FSDP parameter group and DTensor parameter
    of the sharded model, so updating it is what keeps the model usable across Trainer
    runs. ``DeviceMesh.get_group`` resolves a dim through ``_dim_group_names`` and
    ``_pg_registry`` (torch 2.13).

    Raises:
        AssertionError: If torch's ``DeviceMesh`` no longer has those attributes.
    """
    _check_mesh_internals(mesh)
    if len(groups) != mesh.ndim:
        raise AssertionError(f"{_STRATEGY}: {len(groups)} groups for a {mesh.ndim}-D mesh.")
    mesh._dim_group_names = [group.group_name for group in groups]
    mesh._pg_registry = {group.group_name: group for group in groups}
    for dim, group in enumerate(groups):
        if mesh.get_group(dim) is not group:
            raise AssertionError(f"{_STRATEGY}: re-binding mesh dim {dim} did not take effect.")


def _prod(values: Iterable[int]) -> int:
    result = 1
    for value in values:
        result *= value
    return result


def _describe_mesh(request: tuple[int, int] | DeviceMesh | None) -> str:
    if isinstance(request, DeviceMesh):
        return f"DeviceMesh(shape={tuple(request.shape)})"
    return repr(request)


def _validate_device_mesh(
    device_mesh: tuple[int, int] | DeviceMesh | None,
) -> tuple[int, int] | DeviceMesh | None:
    if device_mesh is None or isinstance(device_mesh, DeviceMesh):
        return device_mesh
    if (
        not isinstance(device_mesh, tuple | list)
        or len(device_mesh) != 2
        or not all(isinstance(v, int) and not isinstance(v, bool) for v in device_mesh)
    ):
        raise TypeError(
            f"{_STRATEGY}: device_mesh must be None, a (replicate, shard) tuple of two ints, "
            f"or a DeviceMesh; got {device_mesh!r}."
        )
    if min(device_mesh) < 1:
        raise ValueError(
            f"{_STRATEGY}: device_mesh sizes must be >= 1, got {tuple(device_mesh)!r}."
        )
    return (device_mesh[0], device_mesh[1])


def _validate_auto_wrap_policy(policy: Any) -> AutoWrapPolicy | None:
    if policy is None or (callable(policy) and not isinstance(policy, type)):
        return policy
    if isinstance(policy, set | frozenset | list | tuple) and policy:
        bad = [p for p in policy if not (isinstance(p, type) and issubclass(p, nn.Module))]
        if not bad:
            return set(policy)
        raise TypeError(
            f"{_STRATEGY}: auto_wrap_policy must contain nn.Module subclasses only; got "
            f"{', '.join(repr(b) for b in bad)}. Pass the classes themselves, e.g. "
            "{TransformerBlock}."
        )
    raise TypeError(
        f"{_STRATEGY}: auto_wrap_policy must be a non-empty set of nn.Module subclasses or a "
        f"callable policy(module) -> bool, got {policy!r} ({type(policy).__name__}). For "
        "example auto_wrap_policy={TransformerBlock}."
    )


def _policy_accepts_module_only(policy: Callable[..., bool]) -> bool:
    """Whether ``policy`` can be called as ``policy(module)`` (else torch FSDP's signature)."""
    try:
        inspect.signature(policy).bind(None)
    except TypeError:
        return False
    except ValueError:  # builtins without a signature: assume torch FSDP's convention
        return False
    return True


def _select_units(root: nn.Module, policy: AutoWrapPolicy | None) -> list[nn.Module]:
    """Modules the policy makes units, in post-order (children before parents).

    Subtrees already sharded (by the user in ``configure_model``) are skipped, as are
    selected modules that would own no parameter. The root is never selected: it is
    always the last unit.
    """
    if policy is None:
        return []
    if isinstance(policy, set):
        classes = tuple(policy)

        def wants(module: nn.Module, numel: int) -> bool:
            return isinstance(module, classes)

    elif _policy_accepts_module_only(policy):

        def wants(module: nn.Module, numel: int) -> bool:
            return bool(policy(module))

    else:

        def wants(module: nn.Module, numel: int) -> bool:
            return bool(policy(module=module, recurse=False, nonwrapped_numel=numel))

    units: list[nn.Module] = []

    def visit(module: nn.Module) -> int:
        if isinstance(module, FsdpModule):
            return 0
        numel = sum(p.numel() for p in module.parameters(recurse=False))
        numel += sum(visit(child) for child in module.children())
        if module is not root and numel > 0 and wants(module, numel):
            units.append(module)
            return 0
        return numel

    visit(root)
    return units


def _unit_modules(module: nn.Module, prefix: str = "") -> Iterator[tuple[str, nn.Module]]:
    """Yield ``(prefix, module)`` for ``module`` and descendants outside child units."""
    yield prefix, module
    for name, child in module.named_children():
        if not isinstance(child, FsdpModule):
            yield from _unit_modules(child, f"{prefix}{name}.")


def _materialize(modules: list[tuple[str, nn.Module]], device: torch.device) -> None:
    """Replace meta tensors of ``modules`` by real ones and re-initialise them.

    One new tensor per meta parameter object, installed under every name that shared it,
    so ties survive (``to_empty`` per module would split them).

    Raises:
        TypeError: If a module with meta tensors has no ``reset_parameters`` (checked
            before anything is materialised).
    """
    pending: list[tuple[str, nn.Module]] = []
    for prefix, module in modules:
        tensors = [*module._parameters.values(), *module._buffers.values()]
        if any(t is not None and t.is_meta for t in tensors):
            if not callable(getattr(module, "reset_parameters", None)):
                raise TypeError(
                    f"{_STRATEGY}: module {prefix.rstrip('.') or '<root>'!r} "
                    f"({type(module).__name__}) has parameters or buffers on the meta device "
                    "but no reset_parameters() to initialise them. Implement "
                    "reset_parameters(), or build this module outside "
                    "trainer.init_module(empty_init=True)."
                )
            pending.append((prefix, module))
    replacements: dict[int, nn.Parameter] = {}
    for _, module in pending:
        for name, parameter in module._parameters.items():
            if parameter is None or not parameter.is_meta:
                continue
            new = replacements.get(id(parameter))
            if new is None:
                new = nn.Parameter(
                    torch.empty_like(parameter, device=device),
                    requires_grad=parameter.requires_grad,
                )
                replacements[id(parameter)] = new
            module._parameters[name] = new
        for name, buffer in module._buffers.items():
            if buffer is not None and buffer.is_meta:
                module._buffers[name] = torch.empty_like(buffer, device=device)
    with torch.no_grad():
        for _, module in pending:
            module.reset_parameters()


def _restore_main_weights(module: FsdpModule, originals: Mapping[int, Tensor]) -> None:
    """Overwrite main weights (cast up from the compute dtype) with the exact originals.

    ``originals`` maps ``id(parameter)`` of the unsharded parameter objects (the group's
    ``unsharded_parameters``; their storage was swapped, their identity kept) to their
    values before the cast. Parameters without an original were already in the compute
    dtype, which the main weight holds exactly. Copies only this rank's rows of each
    tensor: a rank owns whole dim-0 rows, starting at ``buffer.offset`` within the flat
    layout, so no collective is needed.
    """
    for group in module.parameter_groups:
        main = group.main_weight
        restored = False
        for index, parameter in enumerate(group.unsharded_parameters):
            original = originals.get(id(parameter))
            local = main.get_local_tensor(index)
            if original is None or local.shape[0] == 0:
                continue
            shape = main.layout.tensor_shapes[index]
            start = main.layout.tensor_to_offset[index]
            first_row = (max(main.offset, start) - start) // math.prod(shape[1:])
            rows = original.reshape(shape)[first_row : first_row + local.shape[0]]
            local.copy_(rows.to(device=local.device, dtype=local.dtype))
            restored = True
        if restored:
            group.sync_model_weight_from_main_weight()


def _fsdp_modules(model: nn.Module | None) -> list[FsdpModule]:
    if model is None:
        return []
    return [m for m in model.modules() if isinstance(m, FsdpModule)]


def _sync_compute_weights(model: nn.Module) -> None:
    """Refresh every unit's compute weights from its (just loaded) main weights."""
    for module in _fsdp_modules(model):
        for group in module.parameter_groups:
            group.sync_model_weight_from_main_weight()


def _move_unsharded_state(model: nn.Module, device: torch.device) -> None:
    """Move buffers and torchmetrics states to ``device``; record it as the model's device."""
    try:
        from torchmetrics import Metric
    except ImportError:  # pragma: no cover - torchmetrics is a dependency of Lightning
        Metric = None  # noqa: N806
    for module in model.modules():
        if Metric is not None and isinstance(module, Metric):
            module.to(device)
            continue
        for name, buffer in module._buffers.items():
            if buffer is not None and buffer.device != device:
                module._buffers[name] = buffer.to(device)
    _update_properties(model, device=device)


def _check_no_foreign_sharding(model: nn.Module) -> None:
    """Raise if another data-parallel wrapper owns part of ``model``.

    Raises:
        TypeError: For torch FSDP, FSDP2 (``fully_shard``) or DDP modules, naming the first.
    """
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
    from torch.nn.parallel import DistributedDataParallel

    wrappers = (
        (FullyShardedDataParallel, "torch FSDP (FullyShardedDataParallel)"),
        (FSDPModule, "torch FSDP2 (torch.distributed.fsdp.fully_shard)"),
        (DistributedDataParallel, "DistributedDataParallel"),
    )
    for name, module in model.named_modules():
        for cls, what in wrappers:
            if isinstance(module, cls):
                raise TypeError(
                    f"{_STRATEGY}: module {name or '<root>'!r} ({type(module).__name__}) is "
                    f"already wrapped by {what}. Megatron-FSDP must own every parameter "
                    "itself: remove that wrapping (e.g. from configure_model) and let the "
                    "strategy shard the module (auto_wrap_policy), or shard it with "
                    "lightning_megatron_fsdp.shard_module / strategy.shard()."
                )


def _check_fully_sharded(model: nn.Module) -> None:
    """Every parameter must be a Megatron-FSDP sharded parameter after setup.

    Raises:
        RuntimeError: Naming the first parameter that is not (it would never be reduced).
    """
    for name, parameter in model.named_parameters():
        group = get_containing_parameter_group(parameter)
        if group is None or not any(parameter is p for p in group.sharded_parameters):
            raise RuntimeError(
                f"{_STRATEGY}: parameter {name!r} is not a Megatron-FSDP sharded parameter "
                "after setup (it would be trained without gradient reduction). Expected the "
                "root unit to own it; was it added after sharding?"
            )


def _check_sharded_parameter(parameter: Tensor, names: Mapping[int, str], index: int) -> None:
    """Raise unless ``parameter`` is a live sharded parameter of the model.

    Raises:
        ValueError: Naming the optimizer and parameter.
    """
    group = get_containing_parameter_group(parameter)  # type: ignore[arg-type]
    if group is not None and any(parameter is p for p in group.sharded_parameters):
        return
    where = names.get(id(parameter), f"<unnamed {tuple(parameter.shape)} tensor>")
    raise ValueError(
        f"{_STRATEGY}: optimizer {index} holds parameter {where!r}, which is not one of the "
        "model's Megatron-FSDP sharded parameters (it was probably captured before "
        "sharding). Create optimizers in configure_optimizers() from self.parameters()."
    )


def _loss_of(output: Any) -> Tensor | None:
    if isinstance(output, Tensor):
        return output
    if isinstance(output, Mapping) and isinstance(output.get("loss"), Tensor):
        return output["loss"]
    return None


def _to_megatron_precision(plugin: Precision | None) -> MegatronFSDPPrecision | None:
    """Translate Lightning's precision plugins into :class:`MegatronFSDPPrecision`.

    Raises:
        ValueError: For precision flags Megatron-FSDP cannot honour (``16-mixed``, ``64-true``).
        TypeError: For other precision plugins.
    """
    if plugin is None or isinstance(plugin, MegatronFSDPPrecision):
        return plugin
    if type(plugin) is Precision:
        return MegatronFSDPPrecision("32-true")
    if type(plugin) is HalfPrecision:
        return MegatronFSDPPrecision(plugin.precision)
    if type(plugin) is MixedPrecision:
        return MegatronFSDPPrecision(plugin.precision, device_type=plugin.device)
    if type(plugin) is DoublePrecision:
        raise ValueError(
            f"{_STRATEGY}: precision='64-true' is not supported (Megatron-FSDP's main weights "
            "are fp32). Use '32-true', 'bf16-true', '16-true' or 'bf16-mixed'."
        )
    raise TypeError(
        f"{_STRATEGY} needs a MegatronFSDPPrecision plugin (or Trainer(precision=...) with "
        f"'32-true', 'bf16-true', '16-true' or 'bf16-mixed'), got {type(plugin).__name__}."
    )


MegatronFSDPStrategy.register_strategies(StrategyRegistry)
