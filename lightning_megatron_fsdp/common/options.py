"""The options both strategies (Trainer and Fabric) take, validated in one place
(:class:`StrategyOptions`), and what both derive from them (:class:`StrategyOptionsMixin`:
the sharding properties, the ranks, joining the processes and building the mesh, sharding a
unit, barrier, broadcast and registration). It exists
so the two framework contracts share one copy of that surface instead of two that drift.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.accelerators import Accelerator
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.strategies.strategy import TBroadcast
from lightning.fabric.utilities.distributed import group as _group
from lightning.fabric.utilities.rank_zero import rank_zero_only
from lightning.fabric.utilities.seed import reset_seed
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.optim import Optimizer

from lightning_megatron_fsdp import _lightning
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

__all__ = ["StrategyOptions", "StrategyOptionsMixin"]


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
    def validate(
        cls,
        where: str,
        *,
        auto_wrap_policy: AutoWrapPolicy | None,
        device_mesh: tuple[int, int] | DeviceMesh | None,
        sharding_strategy: str | Placements | ShardingMode | None,
        mixed_precision_policy: MixedPrecisionPolicy | None,
        process_group_backend: str | None,
        timeout: timedelta | None,
        check_replicas: bool,
    ) -> StrategyOptions:
        """Validate the constructor's options (see either strategy's docstring).

        Raises:
            TypeError: If ``auto_wrap_policy``, ``device_mesh``, ``timeout``,
                ``mixed_precision_policy`` or ``check_replicas`` has the wrong type.
            ValueError: If ``device_mesh`` has a non-positive size, or
                ``sharding_strategy`` is unknown, does not fit the mesh, or needs another
                megatron-fsdp version.
        """
        policy = validate_auto_wrap_policy(auto_wrap_policy, where)
        mesh_request = validate_device_mesh(device_mesh, where)
        mode = resolve_sharding_mode(sharding_strategy, mesh_ndim(mesh_request), where)
        if mixed_precision_policy is not None and not isinstance(
            mixed_precision_policy, MixedPrecisionPolicy
        ):
            raise TypeError(
                f"{where}: mixed_precision_policy must be a megatron_fsdp."
                f"MixedPrecisionPolicy, got {type(mixed_precision_policy).__name__}."
            )
        if timeout is not None and not isinstance(timeout, timedelta):
            raise TypeError(f"{where}: timeout must be a datetime.timedelta, got {timeout!r}.")
        if not isinstance(check_replicas, bool):
            raise TypeError(f"{where}: check_replicas must be a bool, got {check_replicas!r}.")
        return cls(
            where,
            policy,
            mesh_request,
            mode,
            mixed_precision_policy,
            process_group_backend,
            timeout,
            check_replicas,
        )


class StrategyOptionsMixin:
    """What both strategies derive from their :class:`StrategyOptions`, and the collectives
    and registration they share.

    Mixed in before Lightning's (or Fabric's) ``ParallelStrategy``, whose attributes it
    reads (``parallel_devices``, ``local_rank``, ``node_rank``, ``num_nodes``,
    ``cluster_environment``). A strategy sets ``_options`` and ``_sharder`` in its
    constructor, and names its precision plugin in :attr:`_megatron_precision` and how to
    reach the mesh in :attr:`_mesh_missing_hint`.
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
    checkpoint_io: CheckpointIO
    _checkpoint_io: CheckpointIO | None
    _exact_resume: ExactResume

    @property
    def _megatron_precision(self) -> MegatronFSDPPrecision:
        raise NotImplementedError

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
