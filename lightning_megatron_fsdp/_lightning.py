"""Every private Lightning (and torchmetrics) name the package relies on, chosen by feature.

Lightning's underscore names change between releases without notice. Keeping them here
means a release that drops or reshapes one breaks this module alone, and
``tests/test_lightning_compat.py`` fails first, naming the shim to update. Where a public
equivalent exists it is the fallback; no other module imports a private Lightning name
(``tests/test_structure.py`` checks it).
"""

from __future__ import annotations

import os
from typing import Any, TypeAlias

import torch.distributed as dist
from lightning.fabric.plugins.precision import utils as _precision_utils
from lightning.fabric.utilities import data as _fabric_data
from lightning.fabric.utilities import device_dtype_mixin as _device_dtype_mixin
from lightning.fabric.utilities import distributed as _fabric_distributed
from lightning.fabric.utilities import types as _fabric_types
from lightning.pytorch.loops import fetchers as _fetchers
from lightning.pytorch.loops import loop as _loop
from lightning.pytorch.plugins.io import wrapper as _io_wrapper
from lightning.pytorch.strategies.launchers import launcher as _launcher
from lightning.pytorch.strategies.launchers import subprocess_script as _subprocess_script

__all__ = [
    "PATH",
    "DataLoaderIterDataFetcher",
    "Launcher",
    "Loop",
    "StrategyRegistry",
    "SubprocessScriptLauncher",
    "WrappingCheckpointIO",
    "convert_fp_tensor",
    "default_process_group_backend",
    "distributed_is_initialized",
    "init_dist_connection",
    "layer_sync",
    "metric_state_names",
    "reset_optimizers_and_schedulers",
    "set_sampler_epoch",
    "sync_ddp_if_available",
    "update_properties",
    "wrap_closure",
]

PATH: TypeAlias = getattr(_fabric_types, "_PATH", str | os.PathLike[str])  # type: ignore[valid-type]
"""A path argument as Lightning types it."""

# Base classes and types we subclass or test against: no public equivalent exists.
Launcher = _launcher._Launcher
SubprocessScriptLauncher = _subprocess_script._SubprocessScriptLauncher
WrappingCheckpointIO = _io_wrapper._WrappingCheckpointIO
Loop = _loop._Loop
DataLoaderIterDataFetcher = _fetchers._DataLoaderIterDataFetcher
StrategyRegistry: Any = getattr(
    __import__("lightning.fabric.strategies.registry", fromlist=["_StrategyRegistry"]),
    "_StrategyRegistry",
    dict,
)
"""The type of Lightning's strategy registry (a dict subclass)."""


def distributed_is_initialized() -> bool:
    """Whether the default process group exists (Lightning's check, else torch's)."""
    check = getattr(_fabric_distributed, "_distributed_is_initialized", None)
    if check is not None:
        return bool(check())
    return dist.is_available() and dist.is_initialized()


def init_dist_connection(cluster_environment: Any, backend: str | None, **kwargs: Any) -> None:
    """Create the default process group the way Lightning's strategies do."""
    _fabric_distributed._init_dist_connection(cluster_environment, backend, **kwargs)


def default_process_group_backend(device: Any) -> str:
    """Lightning's default backend for ``device`` (``nccl`` on CUDA, else ``gloo``)."""
    return str(_fabric_distributed._get_default_process_group_backend_for_device(device))


def sync_ddp_if_available(tensor: Any, group: Any, *, reduce_op: Any) -> Any:
    """Reduce ``tensor`` over ``group`` as Lightning's strategies do."""
    return _fabric_distributed._sync_ddp_if_available(tensor, group, reduce_op=reduce_op)


def update_properties(module: Any, **kwargs: Any) -> None:
    """Record ``device``/``dtype`` on Lightning's device-dtype mixins inside ``module``."""
    _device_dtype_mixin._update_properties(module, **kwargs)


def set_sampler_epoch(dataloader: Any, epoch: int) -> None:
    """Set the epoch on every sampler of ``dataloader`` that has ``set_epoch``."""
    _fabric_data._set_sampler_epoch(dataloader, epoch)


def convert_fp_tensor(tensor: Any, dst_type: Any) -> Any:
    """Lightning's cast of a floating-point tensor to ``dst_type`` (others unchanged)."""
    return _precision_utils._convert_fp_tensor(tensor, dst_type)


def wrap_closure(precision: Any, model: Any, optimizer: Any, closure: Any) -> Any:
    """Run Lightning's precision closure (``Precision._wrap_closure``): the closure, then
    ``on_before_optimizer_step`` and gradient clipping."""
    return precision._wrap_closure(model, optimizer, closure)


def layer_sync(strategy: Any) -> Any:
    """The strategy's ``sync_batchnorm`` plugin (``None`` when off)."""
    return strategy._layer_sync


def reset_optimizers_and_schedulers(strategy: Any) -> None:
    """Drop the strategy's optimizers, schedulers and their configs (before a new fit)."""
    strategy._reset_optimizers_and_schedulers()


def metric_state_names(metric: Any) -> list[str]:
    """The state names a torchmetrics ``Metric`` registered with ``add_state``."""
    return list(metric._defaults)
