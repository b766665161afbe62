"""``MegatronFSDPStrategy``: the Lightning Trainer strategy that trains a LightningModule with
Megatron-FSDP on every device. It is Lightning glue only: it fits megatron-fsdp's
library-style ``fully_shard`` (bottom-up units, its optimizer adapter, packed shards) into
Lightning's ``ParallelStrategy`` contract, and hands each mechanism to the module that holds
it (docs/DESIGN.md, "Layers").
"""

from __future__ import annotations

import contextlib
from collections.abc import Generator, Mapping
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import CheckpointIO
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.plugins.io import AsyncCheckpointIO
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import Unpack, override

from lightning_megatron_fsdp import _lightning
from lightning_megatron_fsdp.agreement import Ranks
from lightning_megatron_fsdp.checkpoint import MegatronFSDPCheckpointIO
from lightning_megatron_fsdp.common import (
    MegatronFSDPPrecision,
    ShardingOptions,
    StrategyOptionsMixin,
    move_unsharded_state,
    precision_property,
    reject_closure_optimizer,
    takes_sharding_options,
)
from lightning_megatron_fsdp.errors import CheckpointError
from lightning_megatron_fsdp.megatron import (
    AutoWrapPolicy,
    BufferSync,
    _megatron,
    bind_full_tensor,
    check_optimizer_parameters,
    ensure_optimizer_state,
    fsdp_placements,
    hsdp_placements,
)
from lightning_megatron_fsdp.strategies.join import UnevenBatchJoin, refuse_uneven_batches
from lightning_megatron_fsdp.strategies.launcher import resolving_last_launcher
from lightning_megatron_fsdp.strategies.steps import StepHooks
from lightning_megatron_fsdp.weights import (
    PretrainedWeights,
    apply_pretrained_weights,
    as_pretrained_weights,
)

if TYPE_CHECKING:
    from lightning.pytorch.utilities.types import LRSchedulerConfig

__all__ = ["AutoWrapPolicy", "MegatronFSDPStrategy", "fsdp_placements", "hsdp_placements"]

_STRATEGY = "MegatronFSDPStrategy"


class MegatronFSDPStrategy(StrategyOptionsMixin, StepHooks):
    """Lightning strategy for NVIDIA Megatron-FSDP (``megatron_fsdp.experimental``).

    ``Trainer(strategy=MegatronFSDPStrategy())`` or ``Trainer(strategy="megatron_fsdp")``.

    Takes the sharding options of :class:`~lightning_megatron_fsdp.common.options.
    ShardingOptions` as keywords (``auto_wrap_policy``, ``device_mesh``,
    ``sharding_strategy``, ``mixed_precision_policy``, ``process_group_backend``,
    ``timeout``, ``check_replicas``; documented there), and:

    Args:
        init_weights_from: Full (unsharded) weights to initialise the model with, right
            after sharding and before optimizers are created: a ``torch.save`` state dict
            (``.pt``/``.pth``/``.bin``), a Lightning ``.ckpt`` file, a ``.safetensors``
            file, a consolidated export, or a DCP checkpoint directory (ours at any world
            size or mesh, Lightning ``ModelParallelStrategy``'s, or megatron-fsdp's own
            ``save_checkpoint``), locally or on an object store (a URL such as
            ``s3://bucket/model.safetensors``, read in place with ranged GETs). Each rank
            reads only the rows it owns. A path or URL, or a
            :class:`~lightning_megatron_fsdp.weights.pretrained.PretrainedWeights` for key prefixes
            and non-strict loading. Applied once per model; a ``ckpt_path`` restore
            overrides it.
        allow_weights_only_resume: Let ``fit(ckpt_path=...)`` resume from a checkpoint
            without optimizer state (saved with ``weights_only=True``): weights and the
            training position load, the optimizers start fresh. Off by default, so such a
            resume is refused on every rank instead of silently changing the run.
        checkpoint_io: Defaults to ``MegatronFSDPCheckpointIO``.
        precision_plugin: Set by the Trainer from ``precision=...``.

    The accelerator, devices and cluster environment are the Trainer's to set
    (``accelerator=``, ``devices=``, ``plugins=[environment]``), as for Lightning's
    ``ModelParallelStrategy``.

    Raises:
        TypeError: If an option is unknown, or ``auto_wrap_policy``, ``device_mesh``,
            ``timeout``, ``mixed_precision_policy``, ``check_replicas``,
            ``allow_weights_only_resume`` or ``init_weights_from`` has the wrong type.
        ValueError: If ``device_mesh`` has a non-positive size, or ``sharding_strategy`` is
            unknown, does not fit ``device_mesh``, or needs another megatron-fsdp version.
    """

    strategy_name = "megatron_fsdp"
    # Always distributed: Lightning then adds a ``DistributedSampler`` to dataloaders.
    is_distributed = True
    # Load targets are the sharded parameters and adapted optimizers: setup first.
    restore_checkpoint_after_setup = True
    # load_checkpoint() already loaded optimizer state in place, by FQN.
    lightning_restore_optimizer = False

    @takes_sharding_options
    def __init__(
        self,
        *,
        init_weights_from: _lightning.PATH | PretrainedWeights | None = None,
        allow_weights_only_resume: bool = False,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        **options: Unpack[ShardingOptions],
    ) -> None:
        super().__init__(checkpoint_io=checkpoint_io, precision_plugin=precision_plugin)
        self.checkpoint_io = checkpoint_io  # through the setter, which validates it
        self._take_options(_STRATEGY, options)
        if not isinstance(allow_weights_only_resume, bool):
            raise TypeError(
                f"{_STRATEGY}: allow_weights_only_resume must be a bool, got "
                f"{allow_weights_only_resume!r}."
            )
        self._init_weights_from = as_pretrained_weights(init_weights_from)
        self.allow_weights_only_resume = allow_weights_only_resume
        self._join: UnevenBatchJoin | None = None
        self._buffer_sync = BufferSync()
        self.num_nodes = 1

    # ------------------------------------------------------------------ properties

    _mesh_missing_hint = (
        "is created in setup_environment(), when the processes have joined; access it "
        "from configure_model() or later."
    )

    precision_plugin = precision_property("_precision_plugin", MegatronFSDPPrecision, _STRATEGY)
    _megatron_precision = precision_plugin

    @StrategyOptionsMixin.checkpoint_io.setter
    def checkpoint_io(self, io: CheckpointIO | None) -> None:
        if isinstance(io, AsyncCheckpointIO):
            raise TypeError(
                f"{_STRATEGY}: Lightning's AsyncCheckpointIO saves from a background thread, "
                "whose DCP collectives would interleave with training's. Use "
                "MegatronFSDPCheckpointIO(async_save=True) instead."
            )
        self._checkpoint_io = io

    # ------------------------------------------------------------------ processes

    @override
    def _configure_launcher(self) -> None:
        """Lightning's launcher, wrapped so ``ckpt_path="last"`` means a complete checkpoint.

        See :mod:`~lightning_megatron_fsdp.strategies.launcher`: the launch is the one strategy hook
        that runs before Lightning resolves ``"last"``.
        """
        assert self.cluster_environment is not None
        inner = None
        if not self.cluster_environment.creates_processes_externally:
            inner = _lightning.SubprocessScriptLauncher(
                self.cluster_environment, self.num_processes, self.num_nodes
            )
        self._launcher = resolving_last_launcher(inner, self._options.timeout)

    @override
    def setup_environment(self) -> None:
        """Join the process group (once per process) and build the mesh.

        The group is created with Lightning's ``_init_dist_connection`` and lives until
        the process ends: later stages and any use of the model after ``fit`` run on it.
        Lightning registers its destruction at exit for NCCL only; the strategy's exit
        hook destroys it for every backend, then waits until gloo's worker threads are done
        with Python (:mod:`~lightning_megatron_fsdp.common.interpreter_exit`).
        """
        super().setup_environment()
        self._ignore_known_warnings()
        module = self.lightning_module
        assert module is not None
        _lightning.set_device_mesh(module, self._join_processes(module))

    # ------------------------------------------------------------------ model setup

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        if _lightning.layer_sync(self) is not None:
            raise ValueError(
                f"{_STRATEGY} does not support Trainer(sync_batchnorm=True): its buffers are "
                "not sharded and SyncBatchNorm's conversion would replace sharded modules. "
                "Remove sync_batchnorm."
            )
        assert self.lightning_module is not None
        # Bottom-up (see ``sharding.plan_units``).
        self._sharder.shard_model(
            self.lightning_module,
            self._options.auto_wrap_policy,
            self.shard,
            self.root_device,
            self.placements,
        )
        bind_full_tensor(self.lightning_module, gradients=False)  # p.full_tensor() works
        if self._init_weights_from is not None:
            apply_pretrained_weights(self.lightning_module, self._init_weights_from)
        self._replicas_agree(self.lightning_module)
        self.model = self.lightning_module
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()

    @override
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        # Re-create optimizers on every fit: an earlier stage's optimizers may hold other
        # parameter objects.
        _lightning.reset_optimizers_and_schedulers(self)
        super().setup_optimizers(trainer)
        assert self.lightning_module is not None
        for index, optimizer in enumerate(self.optimizers):
            reject_closure_optimizer(optimizer)
            check_optimizer_parameters(optimizer, self.lightning_module, index, _STRATEGY)
            _megatron.fully_shard_optimizer(optimizer)  # once per optimizer

    @override
    def model_to_device(self) -> None:
        """Move what sharding does not own (buffers, torchmetrics states) to the device.

        Never ``module.to(device)``: that would re-create the sharded DTensor parameters.
        """
        assert self.lightning_module is not None
        move_unsharded_state(self.lightning_module, self.root_device)

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
        tensors first (ties preserved), moves the unit's buffers to the device, casts to
        the compute dtype under the ``-true`` precisions (keeping the exact original
        values as the fp32 main weights), then shards. Call it from ``configure_model``
        (children before parents) to choose units by hand; every unit of the model shares
        one sharding context, finalised at the end of ``setup``.

        Args:
            module: A module not yet sharded.

        Raises:
            ValueError: If ``module`` is already sharded or a tie crosses unit boundaries.
            TypeError: If a meta-device module has no ``reset_parameters``.
        """
        self._shard_unit(module)

    # ------------------------------------------------------------------ stage hooks

    @override
    def on_train_start(self) -> None:
        trainer = _trainer_of(self)
        refuse_uneven_batches("training", [trainer.num_training_batches], where=_STRATEGY)
        # Last of the on_train_start hooks, right before the first batch: see exact_resume.
        self._exact_resume.train_starting(self.root_device)
        self._exact_resume.continue_progress_bar(trainer)  # a mid-epoch resume's bar

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        # A failed background save raises at each rank's next step (no collective).
        if isinstance(self.checkpoint_io, MegatronFSDPCheckpointIO):
            self.checkpoint_io.poll()

    @override
    def on_validation_end(self) -> None:
        # Validation inside fit does not shift the training random streams (exact_resume).
        self._exact_resume.validation_ended(self.root_device)

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """Give the train loader's sampler its epoch before Lightning restores the loader.

        Lightning restores a resumable loader's position and creates its iterator before it
        calls ``set_epoch``, so a resume in epoch >= 1 would replay epoch 0's order; see
        :meth:`~lightning_megatron_fsdp.common.exact_resume.ExactResume.train_loader`.
        """
        trainer = _trainer_of(self)
        if trainer.state.fn == TrainerFn.FITTING and trainer.training:
            self._exact_resume.train_loader(trainer, dataloader, self.root_device)
        return dataloader

    # ------------------------------------------------------------------ uneven evaluation data

    @override
    def on_validation_start(self) -> None:
        trainer = _trainer_of(self)
        counts = trainer.num_sanity_val_batches if trainer.sanity_checking else None
        self._start_join(trainer, "validation_step", counts or trainer.num_val_batches)
        if trainer.state.fn == TrainerFn.FITTING:
            self._exact_resume.validation_started(self.root_device)

    @override
    def on_test_start(self) -> None:
        trainer = _trainer_of(self)
        self._start_join(trainer, "test_step", trainer.num_test_batches)

    @override
    def on_predict_start(self) -> None:
        trainer = _trainer_of(self)
        self._start_join(trainer, "predict_step", trainer.num_predict_batches)

    # ------------------------------------------------------------------ collectives

    @override
    def reduce(
        self,
        tensor: Tensor | Any,
        group: Any | None = None,
        reduce_op: ReduceOp | str | None = "mean",
    ) -> Tensor | Any:
        if isinstance(tensor, Tensor):
            return _lightning.sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    # ------------------------------------------------------------------ checkpoints

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The model's state by FQN, sharded parameters as DTensors (no collective)."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        assert self.lightning_module is not None
        _megatron.release_prefetched(self.lightning_module)  # every unit at rest: DTensors
        return get_model_state_dict(self.lightning_module)

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """The optimizer's state keyed by parameter FQN (DCP's ``get_optimizer_state_dict``).

        An optimizer that has not stepped yet first gets all-zero state
        (:func:`~lightning_megatron_fsdp.ensure_optimizer_state`), equivalent to a fresh
        optimizer, so every checkpoint of a run has the same optimizer fingerprint.
        """
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        optimizer = _lightning.unwrap_optimizer(optimizer)
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
        self,
        checkpoint: dict[str, Any],
        filepath: _lightning.PATH,
        storage_options: Any | None = None,
    ) -> None:
        """Save on every rank (a collective): each rank writes only its own shards.

        ``checkpoint`` comes from Lightning's ``dump_checkpoint`` and already holds the
        FQN-keyed model and optimizer state dicts from :meth:`lightning_module_state_dict`
        and :meth:`optimizer_state`; this attaches each packed shard's true chunk to them
        and hands everything to the checkpoint IO. The path is rank 0's, so all ranks
        write one checkpoint even if their clocks or names differ. Attaching is rank-local
        and can fail on one rank alone (a rank whose state differs), so the ranks agree on
        its outcome before the IO's first collective.

        Raises:
            CheckpointSaveError: On every rank if any rank fails (naming the failing rank
                and its error); nothing is written.
        """
        model = self.lightning_module
        assert model is not None
        # In place: ``checkpoint["state_dict"]`` holds the buffers themselves.
        self._buffer_sync.settle(model)
        # After fit nothing else waits for an async write (no later step, save or
        # teardown): the checkpoint must be committed when the call returns.
        self._save_sharded(
            checkpoint, filepath, model, storage_options, commit=not _stage_running(model)
        )

    @override
    def load_checkpoint(
        self, checkpoint_path: _lightning.PATH, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Load a checkpoint in place into the sharded model (and optimizers when fitting).

        Collective: every rank calls it, and rank 0's path is loaded. The checkpoint IO
        recognises the format (ours, or another strategy's DCP directory), checks it
        against the live model and optimizers before any rank reads tensor data, and loads
        in place; this applies optimizer hyper-parameters by FQN and refreshes the compute
        weights from the loaded main weights. validate/test/predict load weights only. A
        fit from a checkpoint without optimizer state is refused unless
        :attr:`allow_weights_only_resume` is set.

        Returns:
            The non-tensor rest of the checkpoint, plus the filled targets.

        Raises:
            NotACheckpointError: ``checkpoint_path`` is missing, a file, or incomplete.
            CheckpointMismatchError: The checkpoint does not fit the model or optimizers
                (naming every missing, unexpected or reshaped FQN), or it holds no
                optimizer state and :attr:`allow_weights_only_resume` is off.
            CheckpointError: Reading or applying the state failed on some rank. Every
                error is raised on every rank; before any tensor is read, the model and
                optimizers are unchanged.
        """
        path = str(checkpoint_path)  # rank 0's is loaded
        model = self.lightning_module
        assert model is not None
        optimizers = [_lightning.unwrap_optimizer(o) for o in self.optimizers]
        stage_fits = model.trainer.state.fn == TrainerFn.FITTING
        fitting = bool(optimizers) and stage_fits
        result = self._load_sharded(
            path,
            model,
            optimizers if fitting else [],
            fitting=stage_fits,
            weights_only=weights_only,
            strict=model.strict_loading,
            allow_missing_optimizers=self.allow_weights_only_resume or not fitting,
        )
        if fitting and not result.optimizers_loaded:
            return _weights_only_resume(result.checkpoint, path, self.lr_scheduler_configs)
        return result.checkpoint

    @override
    def remove_checkpoint(self, filepath: _lightning.PATH) -> None:
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
        Ranks.of().raise_together(
            f"{_STRATEGY}: removing checkpoint {filepath}",
            error,
            CheckpointError,
            consequence="the checkpoint was not removed",
        )

    # ------------------------------------------------------------------ teardown

    @override
    def teardown(self) -> None:
        """Release what this stage owns; keep what the model needs.

        Not ``ParallelStrategy.teardown``: it moves the model to CPU (``module.cpu()``),
        which would re-create the sharded parameters. The process group and the mesh stay
        (the model's buffers and DTensors hold them) until the process ends; the
        checkpoint IO finishes an async save and drops its background group here.
        """
        self._join = None  # the stage's join and its cached batches (the next stage makes its own)
        self._exact_resume.reset()
        if self.cluster_environment is not None:
            self.cluster_environment.teardown()
        self._release()


# ---------------------------------------------------------------------- helpers


def _trainer_of(strategy: MegatronFSDPStrategy) -> pl.Trainer:
    assert strategy.lightning_module is not None
    return strategy.lightning_module.trainer


def _stage_running(model: pl.LightningModule) -> bool:
    """Whether a Trainer stage (fit, validate, ...) is running, so its teardown will come."""
    trainer = _lightning.attached_trainer(model)
    return trainer is not None and trainer.state.status == TrainerStatus.RUNNING


def _weights_only_resume(
    checkpoint: dict[str, Any], path: str, lr_scheduler_configs: list[LRSchedulerConfig]
) -> dict[str, Any]:
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
        "lr_schedulers", [config.scheduler.state_dict() for config in lr_scheduler_configs]
    )
    return checkpoint


MegatronFSDPStrategy.register_strategies(StrategyRegistry)
