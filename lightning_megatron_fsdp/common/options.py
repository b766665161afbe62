"""The options both strategies (Trainer and Fabric) take, declared once
(:class:`ShardingOptions`, each with its type, default and doc) and validated in one place
(:class:`StrategyOptions`), and what both derive from them (:class:`StrategyOptionsMixin`:
the sharding properties, the ranks, joining the processes and building the mesh, sharding a
unit, barrier, broadcast and registration). It exists so the two framework contracts share
one copy of that surface instead of two that drift.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypedDict, TypeVar, get_type_hints

import torch
import torch.distributed as dist
from lightning.fabric.accelerators import Accelerator
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies.strategy import TBroadcast
from lightning.fabric.utilities.distributed import group as _group
from lightning.fabric.utilities.rank_zero import rank_zero_only
from lightning.fabric.utilities.seed import reset_seed
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.optim import Optimizer

from lightning_megatron_fsdp import _lightning
from lightning_megatron_fsdp.checkpoint import MegatronFSDPCheckpointIO
from lightning_megatron_fsdp.common.exact_resume import ExactResume
from lightning_megatron_fsdp.common.model_setup import ModelSharder, join_process_group
from lightning_megatron_fsdp.common.precision import MegatronFSDPPrecision
from lightning_megatron_fsdp.common.sharded_checkpoint import (
    LoadResult,
    OptimizerMatcher,
    load_into_sharded_model,
    save_sharded_checkpoint,
)
from lightning_megatron_fsdp.known_warnings import ignore_known_warnings, stop_ignoring
from lightning_megatron_fsdp.megatron import (
    AutoWrapPolicy,
    MeshRequest,
    MixedPrecisionPolicy,
    Placements,
    ShardingMode,
    build_device_mesh,
    check_mesh_fits_world,
    check_replicas,
    mesh_ndim,
    resolve_sharding_mode,
    sync_replicas,
    validate_auto_wrap_policy,
    validate_device_mesh,
)

__all__ = [
    "SHARDING_OPTION_DEFAULTS",
    "ShardingOptions",
    "StrategyOptions",
    "StrategyOptionsMixin",
    "takes_sharding_options",
]


class ShardingOptions(TypedDict, total=False):
    """The sharding options both strategies (Trainer and Fabric) take as keywords.

    Declared here once, with :data:`SHARDING_OPTION_DEFAULTS`: each constructor takes them
    as ``**options: Unpack[ShardingOptions]`` (so type checkers check each keyword) and
    :func:`takes_sharding_options` spells them out in its runtime signature (so
    ``inspect.signature``, ``help()`` and LightningCLI list each with its type and default).
    """

    auto_wrap_policy: AutoWrapPolicy | None
    """Which submodules become their own FSDP unit, applied bottom-up before the
    top-level units. A set of module classes, or a callable as in Lightning's
    ``FSDPStrategy``: either ``policy(module) -> bool`` or torch FSDP's ``policy(module,
    recurse, nonwrapped_numel) -> bool`` (called with ``recurse=False``). ``None``: only the
    top-level units, plus whatever ``configure_model`` sharded itself. Keep tied
    parameters in one unit (wrap blocks, not a tied embedding)."""
    device_mesh: tuple[int, int] | DeviceMesh | None
    """``None`` for plain FSDP over all processes; ``(replicate, shard)`` with ``replicate
    * shard == world size`` for HSDP; or a ``DeviceMesh`` of 1 or 2 dims spanning the
    world."""
    sharding_strategy: str | Placements | ShardingMode | None
    """What is sharded: ``"FULL_SHARD"`` (ZeRO-3, the default on a 1-D mesh),
    ``"SHARD_GRAD_OP"`` (ZeRO-2), ``"SHARD_OPTIMIZER"`` (ZeRO-1), ``"NO_SHARD"``
    (DDP-like), and on a 2-D mesh ``"HYBRID_SHARD"`` (the default there) and
    ``"HYBRID_SHARD_GRAD_OP"``; torch's ``ShardingStrategy``, Megatron-LM's names
    (``"optim"``, ...), or raw ``megatron_fsdp.experimental.Placements`` for anything else
    (see :mod:`~lightning_megatron_fsdp.megatron.sharding_modes`). Checkpoints of every
    mode load into every other, at any world size."""
    mixed_precision_policy: MixedPrecisionPolicy | None
    """Megatron-FSDP main weight/gradient dtypes; derived from the ``precision`` flag when
    ``None`` (see :class:`~lightning_megatron_fsdp.common.precision.MegatronFSDPPrecision`)."""
    process_group_backend: str | None
    """``"nccl"``, ``"gloo"``, ...; by device type when ``None``."""
    timeout: timedelta | None
    """Timeout of every collective of the process groups the strategy creates."""
    check_replicas: bool
    """After setup and after each checkpoint load, compare a checksum of every replicated
    tensor (main weights of the replicated modes, buffers) across its replica group and
    raise :class:`~lightning_megatron_fsdp.megatron.replicas.ReplicaMismatchError` on every
    rank, naming the first that differs. Off by default: one round per replica group, a
    few percent of a small model's step."""


SHARDING_OPTION_DEFAULTS: ShardingOptions = {
    "auto_wrap_policy": None,
    "device_mesh": None,
    "sharding_strategy": None,
    "mixed_precision_policy": None,
    "process_group_backend": None,
    "timeout": default_pg_timeout,
    "check_replicas": False,
}
"""What each sharding option is when a constructor is not given it."""

_Init = TypeVar("_Init", bound=Callable[..., None])


def takes_sharding_options(init: _Init) -> _Init:
    """Mark a strategy constructor that takes ``**options: Unpack[ShardingOptions]``.

    Its runtime signature (``__signature__``, which ``inspect.signature`` and LightningCLI's
    jsonargparse read) lists each sharding option in place of ``**options``: keyword-only,
    with its type from :class:`ShardingOptions` and its default from
    :data:`SHARDING_OPTION_DEFAULTS`, first after ``self``.
    """
    signature = inspect.signature(init, eval_str=True)
    parameters = list(signature.parameters.values())
    if [p.kind for p in parameters].count(inspect.Parameter.VAR_KEYWORD) != 1:
        raise AssertionError(f"{init.__qualname__} must take **options: Unpack[ShardingOptions]")
    defaults: dict[str, Any] = dict(SHARDING_OPTION_DEFAULTS)
    options = [
        inspect.Parameter(
            name, inspect.Parameter.KEYWORD_ONLY, default=defaults[name], annotation=hint
        )
        for name, hint in get_type_hints(ShardingOptions).items()
    ]
    own = [p for p in parameters[1:] if p.kind is not inspect.Parameter.VAR_KEYWORD]
    init.__signature__ = signature.replace(parameters=[parameters[0], *options, *own])  # type: ignore[attr-defined]
    return init


@dataclass(frozen=True)
class StrategyOptions:
    """The sharding options of a strategy's constructor, validated.

    Attributes:
        where: Names the strategy in errors.
        auto_wrap_policy: The validated ``auto_wrap_policy``.
        mesh_request: The validated ``device_mesh`` (``None``, a pair or a mesh).
        sharding_mode: The validated ``sharding_strategy`` for that mesh.
        mixed_precision_policy: The user's policy, if any.
        process_group_backend: The user's backend, if any.
        timeout: Timeout of every collective of the groups the strategy creates.
        check_replicas: Compare a checksum of every replicated tensor across its replica
            group after setup and after a load (``megatron/replicas.py``).
    """

    where: str
    auto_wrap_policy: AutoWrapPolicy | None
    mesh_request: MeshRequest
    sharding_mode: ShardingMode
    mixed_precision_policy: MixedPrecisionPolicy | None
    process_group_backend: str | None
    timeout: timedelta | None
    check_replicas: bool

    @classmethod
    def validate(cls, where: str, options: ShardingOptions) -> StrategyOptions:
        """Validate the constructor's sharding ``options`` (:class:`ShardingOptions`; those
        not given take :data:`SHARDING_OPTION_DEFAULTS`).

        Raises:
            TypeError: If an option is unknown, or ``auto_wrap_policy``, ``device_mesh``,
                ``timeout``, ``mixed_precision_policy`` or ``check_replicas`` has the
                wrong type.
            ValueError: If ``device_mesh`` has a non-positive size, or
                ``sharding_strategy`` is unknown, does not fit the mesh, or needs another
                megatron-fsdp version.
        """
        unknown = sorted(options.keys() - SHARDING_OPTION_DEFAULTS.keys())
        if unknown:
            raise TypeError(
                f"{where} got unexpected keyword argument(s) {', '.join(unknown)}; its "
                f"sharding options are {', '.join(SHARDING_OPTION_DEFAULTS)}."
            )
        given: ShardingOptions = {**SHARDING_OPTION_DEFAULTS, **options}
        policy = validate_auto_wrap_policy(given["auto_wrap_policy"], where)
        mesh_request = validate_device_mesh(given["device_mesh"], where)
        mode = resolve_sharding_mode(given["sharding_strategy"], mesh_ndim(mesh_request), where)
        mixed_precision_policy = given["mixed_precision_policy"]
        if mixed_precision_policy is not None and not isinstance(
            mixed_precision_policy, MixedPrecisionPolicy
        ):
            raise TypeError(
                f"{where}: mixed_precision_policy must be a megatron_fsdp."
                f"MixedPrecisionPolicy, got {type(mixed_precision_policy).__name__}."
            )
        timeout = given["timeout"]
        if timeout is not None and not isinstance(timeout, timedelta):
            raise TypeError(f"{where}: timeout must be a datetime.timedelta, got {timeout!r}.")
        check = given["check_replicas"]
        if not isinstance(check, bool):
            raise TypeError(f"{where}: check_replicas must be a bool, got {check!r}.")
        return cls(
            where,
            policy,
            mesh_request,
            mode,
            mixed_precision_policy,
            given["process_group_backend"],
            timeout,
            check,
        )


class StrategyOptionsMixin:
    """What both strategies derive from their :class:`StrategyOptions`, and the collectives
    and registration they share.

    Mixed in before Lightning's (or Fabric's) ``ParallelStrategy``, whose attributes it
    reads (``parallel_devices``, ``local_rank``, ``node_rank``, ``num_nodes``,
    ``cluster_environment``). A strategy hands its sharding options to
    :meth:`_take_options` in its constructor, names its precision plugin in
    :attr:`_megatron_precision` and how to reach the mesh in :attr:`_mesh_missing_hint`.
    """

    strategy_name: str
    _options: StrategyOptions
    _sharder: ModelSharder
    _device_mesh: DeviceMesh | None = None
    _resolved_backend: str | None = None
    _mesh_missing_hint: str = ""
    parallel_devices: list[torch.device] | None
    local_rank: int
    node_rank: int
    num_nodes: int
    global_rank: int
    cluster_environment: ClusterEnvironment | None
    accelerator: Accelerator | None
    _checkpoint_io: CheckpointIO | None
    _exact_resume: ExactResume

    @property
    def _megatron_precision(self) -> MegatronFSDPPrecision:
        raise NotImplementedError

    @property
    def checkpoint_io(self) -> CheckpointIO:
        """``MegatronFSDPCheckpointIO()`` unless one was given (also inside a Lightning
        wrapper given without one)."""
        if self._checkpoint_io is None:
            self._checkpoint_io = MegatronFSDPCheckpointIO()
        elif (
            isinstance(self._checkpoint_io, _lightning.WrappingCheckpointIO)
            and self._checkpoint_io.checkpoint_io is None
        ):
            self._checkpoint_io.checkpoint_io = MegatronFSDPCheckpointIO()
        return self._checkpoint_io

    @checkpoint_io.setter
    def checkpoint_io(self, io: CheckpointIO | None) -> None:
        self._checkpoint_io = io

    def _take_options(self, where: str, options: ShardingOptions) -> None:
        """Validate the constructor's sharding ``options`` (see
        :meth:`StrategyOptions.validate`) and create what the mixin keeps, each naming the
        strategy as ``where`` in its errors."""
        self._options = StrategyOptions.validate(where, options)
        self._sharder = ModelSharder(where)
        self._exact_resume = ExactResume(where)

    @property
    def root_device(self) -> torch.device:
        """This process's device."""
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_processes(self) -> int:
        """Processes (devices) on this node."""
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Every rank is a data-parallel rank, HSDP replicas and shards alike."""
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

    @property
    def process_group_backend(self) -> str | None:
        """The process group backend (resolved in ``setup_environment``)."""
        return self._resolved_backend or self._options.process_group_backend

    @property
    def device_mesh(self) -> DeviceMesh:
        """The data-parallel mesh (1-D FSDP or 2-D HSDP).

        Raises:
            RuntimeError: Before ``setup_environment`` has created it.
        """
        if self._device_mesh is None:
            raise RuntimeError(f"{self._options.where}.device_mesh {self._mesh_missing_hint}")
        return self._device_mesh

    @property
    def sharding_mode(self) -> ShardingMode:
        """The validated ``sharding_strategy``."""
        return self._options.sharding_mode

    @property
    def placements(self) -> Placements:
        """Megatron-FSDP placements of :attr:`sharding_mode` for :attr:`device_mesh`."""
        return self._options.sharding_mode.placements

    @property
    def mixed_precision_policy(self) -> MixedPrecisionPolicy:
        """The user's policy, or the one the precision flag implies."""
        if self._options.mixed_precision_policy is not None:
            return self._options.mixed_precision_policy
        return self._megatron_precision.mixed_precision_policy()

    def set_world_ranks(self) -> None:
        """Tell the cluster environment (and ``rank_zero_only``) this process's ranks."""
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(
                self.node_rank * self.num_processes + self.local_rank
            )
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    def _join_processes(self, mesh_model: nn.Module) -> DeviceMesh:
        """Join the process group (once per process; it lives until the process ends) and
        build the mesh, reusing one ``mesh_model`` is already sharded on.

        Raises:
            ValueError: If the mesh does not span ``num_nodes x devices`` processes.
        """
        options = self._options
        world = self.num_nodes * self.num_processes
        detail = f"num_nodes={self.num_nodes} x devices={self.num_processes}"
        check_mesh_fits_world(options.mesh_request, world, detail, options.where)
        reset_seed()
        self.set_world_ranks()
        backend = options.process_group_backend or _lightning.default_process_group_backend(
            self.root_device
        )
        self._resolved_backend = backend
        assert self.cluster_environment is not None
        join_process_group(self.cluster_environment, backend, self.root_device, options.timeout)
        precision = self._megatron_precision
        if precision.device_type is None:
            precision.device_type = self.root_device.type
        self._device_mesh = build_device_mesh(
            options.mesh_request,
            model=mesh_model,
            world_size=dist.get_world_size(),
            device_type=self.root_device.type,
            timeout=options.timeout,
            where=options.where,
        )
        return self._device_mesh

    def _ignore_known_warnings(self) -> None:
        """Silence the known warnings from ``setup_environment`` until :meth:`_release`."""
        self._ignored_warnings = ignore_known_warnings()

    def _release(self) -> None:
        """What both teardowns release: an unfinished sharding, the ignored warnings, the
        precision's and accelerator's state, and the checkpoint IO (finishing an async
        save). The process group and mesh stay: the model's DTensors hold them."""
        self._sharder.close(RuntimeError("teardown before setup finished sharding"))
        stop_ignoring(getattr(self, "_ignored_warnings", []))
        self._megatron_precision.teardown()
        if self.accelerator is not None:
            self.accelerator.teardown()
        if self._checkpoint_io is not None:
            self._checkpoint_io.teardown()

    def _save_sharded(
        self,
        checkpoint: dict[str, Any],
        path: Any,
        model: nn.Module,
        storage_options: Any | None,
        *,
        commit: bool,
    ) -> None:
        """``save_sharded_checkpoint`` through this strategy's IO, with this rank's random
        streams. Collective."""
        save_sharded_checkpoint(
            self.checkpoint_io,
            checkpoint,
            path,
            model,
            self._exact_resume.states_for_checkpoint(self.root_device),
            where=self._options.where,
            storage_options=storage_options,
            commit=commit,
        )

    def _load_sharded(
        self,
        path: str,
        model: nn.Module,
        optimizers: list[Optimizer],
        *,
        fitting: bool,
        weights_only: bool | None,
        strict: bool,
        allow_missing_optimizers: bool,
        match_optimizers: OptimizerMatcher | None = None,
    ) -> LoadResult:
        """``load_into_sharded_model`` through this strategy's IO, then the loaded random
        streams handed to exact resume and the optional replica check. Collective."""
        result = load_into_sharded_model(
            self.checkpoint_io,
            path,
            model,
            optimizers,
            weights_only=weights_only,
            strict=strict,
            allow_missing_optimizers=allow_missing_optimizers,
            match_optimizers=match_optimizers,
            where=self._options.where,
        )
        self._exact_resume.checkpoint_loaded(result.checkpoint, fitting=fitting)
        self._check_replicas(model, f"after loading {path}")
        return result

    def _shard_unit(self, module: nn.Module) -> None:
        """Make ``module`` one unit with this strategy's mesh, placements and precision
        (inside the sharder's context; see ``ModelSharder.shard``)."""
        precision = self._megatron_precision
        self._sharder.shard(
            module,
            self.device_mesh,
            self.placements,
            device=self.root_device,
            compute_dtype=precision.compute_dtype if precision.casts_parameters else None,
            mixed_precision_policy=self.mixed_precision_policy,
        )

    def _replicas_agree(self, model: nn.Module) -> None:
        """After sharding (and initial weights): every replica group takes its first rank's
        replicated tensors (``replicas.sync_replicas``), then the optional check."""
        sync_replicas(model)
        self._check_replicas(model, "after setup")

    def _check_replicas(self, model: nn.Module, when: str) -> None:
        """``replicas.check_replicas`` when the ``check_replicas`` option is on."""
        if self._options.check_replicas:
            check_replicas(model, f"{self._options.where}: {when}")

    def barrier(self, name: str | None = None) -> None:
        """Wait until every process is here (nothing to wait for without a group)."""
        if not _lightning.distributed_is_initialized():
            return
        if dist.get_backend() == "nccl":
            dist.barrier(device_ids=[self.root_device.index])
        else:
            dist.barrier()

    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        """``obj`` of rank ``src`` on every rank (itself without a group)."""
        if not _lightning.distributed_is_initialized():
            return obj
        container = [obj]
        dist.broadcast_object_list(container, src, group=_group.WORLD)
        return container[0]

    @classmethod
    def register_strategies(cls, strategy_registry: _lightning.StrategyRegistry) -> None:
        """Register as ``strategy_name`` (once) in the framework's strategy registry."""
        if cls.strategy_name in strategy_registry:
            return
        strategy_registry.register(
            cls.strategy_name,
            cls,
            description="Megatron-FSDP (megatron_fsdp.experimental) fully sharded training",
        )
