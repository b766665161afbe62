"""What both strategies (Trainer and Fabric) do to set a model up: join the long-lived process
group, shard a model's units bottom-up in one sharding context, save with each packed
shard's true chunk attached. It exists so the two framework contracts drive one copy of that
glue instead of two that drift.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
from lightning.fabric.plugins import ClusterEnvironment
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_megatron_fsdp import _lightning, _torch
from lightning_megatron_fsdp.common.interpreter_exit import register_exit_hook
from lightning_megatron_fsdp.megatron import (
    AutoWrapPolicy,
    FsdpModule,
    MixedPrecisionPolicy,
    Placements,
    check_fully_sharded,
    check_no_foreign_sharding,
    check_placements,
    enable_cpu_execution,
    materialize_outside_units,
    plan_units,
    shard_unit,
    sharding_scope,
)

__all__ = [
    "ModelSharder",
    "join_process_group",
    "move_unsharded_state",
]


def join_process_group(
    cluster_environment: ClusterEnvironment,
    backend: str,
    root_device: torch.device,
    timeout: timedelta | None,
) -> None:
    """Join the default process group once per process; it lives until the process ends.

    Lightning registers its destruction at exit for NCCL only; the exit hook destroys it
    for every backend, then waits until gloo's worker threads are done with Python
    (:mod:`~lightning_megatron_fsdp.common.interpreter_exit`). Registered also for a group the
    user created: the race is the same. Off CUDA the CPU adapter is enabled.
    """
    kwargs: dict[str, Any] = {"timeout": timeout}
    if root_device.type != "cpu":
        kwargs["device_id"] = root_device
    if not _lightning.distributed_is_initialized():
        _lightning.init_dist_connection(cluster_environment, backend, **kwargs)
    register_exit_hook()
    if root_device.type != "cuda":
        enable_cpu_execution()


class ModelSharder:
    """Shards one model's units bottom-up in one sharding context, as a strategy does.

    Args:
        where: Names the strategy in errors.
    """

    def __init__(self, where: str) -> None:
        self._where = where
        self._sharding: contextlib.ExitStack | None = None

    def shard(
        self,
        module: nn.Module,
        mesh: DeviceMesh,
        placements: Placements,
        *,
        device: torch.device,
        compute_dtype: torch.dtype | None,
        mixed_precision_policy: MixedPrecisionPolicy | None,
    ) -> None:
        """Make ``module`` one unit (inside the context this sharder keeps open).

        See :func:`~lightning_megatron_fsdp.megatron.sharding.shard_unit`; the context is opened
        on the first call and finalised by :meth:`close`.
        """
        if self._sharding is None:
            self._sharding = contextlib.ExitStack()
            self._sharding.enter_context(sharding_scope())
        shard_unit(
            module,
            mesh,
            placements,
            device=device,
            compute_dtype=compute_dtype,
            mixed_precision_policy=mixed_precision_policy,
            where=self._where,
        )

    def shard_model(
        self,
        model: nn.Module,
        policy: AutoWrapPolicy | None,
        shard: Callable[[nn.Module], None],
        device: torch.device,
        placements: Placements,
    ) -> None:
        """Shard ``model`` bottom-up (``sharding.plan_units``).

        ``shard`` shards one unit (the strategy's, which knows mesh and precision); units
        the user already sharded are left alone (they must have ``placements``). The
        context is finalised (or abandoned on error) before returning.
        """
        check_no_foreign_sharding(model, self._where)
        try:
            if not isinstance(model, FsdpModule):
                for unit in plan_units(model, policy):
                    shard(unit)
        except BaseException as err:
            self.close(err)
            raise
        self.close(None)
        materialize_outside_units(model, device, self._where)
        move_unsharded_state(model, device)
        check_fully_sharded(model, self._where)
        check_placements(model, placements, self._where)

    def close(self, error: BaseException | None) -> None:
        """Finalise the sharding context (or abandon it after ``error``)."""
        stack, self._sharding = self._sharding, None
        if stack is None:
            return
        if error is None:
            stack.close()
        else:
            stack.__exit__(type(error), error, error.__traceback__)


def move_unsharded_state(model: nn.Module, device: torch.device) -> None:
    """Move buffers and torchmetrics states to ``device``; record it as the model's device."""
    from torchmetrics import Metric

    for module in model.modules():
        if isinstance(module, Metric):
            module.to(device)
            continue
        buffers = _torch.own_buffers(module)
        for name, buffer in buffers.items():
            if buffer is not None and buffer.device != device:
                buffers[name] = buffer.to(device)
    _lightning.update_properties(model, device=device)
