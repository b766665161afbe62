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
from lightning.fabric.strategies import strategy as _fabric_strategy
from lightning.fabric.strategies.launchers import subprocess_script as _fabric_subprocess
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
    "BackwardSyncControl",
    "DataLoaderIterDataFetcher",
    "FabricSubprocessScriptLauncher",
    "Launcher",
    "Loop",
    "Stateful",
    "StrategyRegistry",
    "SubprocessScriptLauncher",
    "WrappingCheckpointIO",
    "attached_trainer",
    "checkpoint_dir_resolver",
    "convert_fp_tensor",
    "current_fx_name",
    "data_fetcher",
    "default_process_group_backend",
    "distributed_is_initialized",
    "forget_dataloader_states_to_load",
    "init_dist_connection",
    "layer_sync",
    "metric_counters",
    "metric_state_names",
    "reset_optimizers_and_schedulers",
    "set_current_fx_name",
    "set_data_fetcher",
    "set_device_mesh",
    "set_metric_counters",
    "set_sampler_epoch",
    "sync_ddp_if_available",
    "unwrap_optimizer",
    "update_properties",
    "validate_keys_for_strict_loading",
    "wrap_closure",
    "wrapped_sampler",
]

PATH: TypeAlias = getattr(_fabric_types, "_PATH", str | os.PathLike[str])  # type: ignore[valid-type]
"""A path argument as Lightning types it."""

# Base classes and types we subclass or test against: no public equivalent exists.
Launcher = _launcher._Launcher
SubprocessScriptLauncher = _subprocess_script._SubprocessScriptLauncher
WrappingCheckpointIO = _io_wrapper._WrappingCheckpointIO
Loop = _loop._Loop
# Fabric's: the launcher that re-runs the script per device, the interface behind
# ``fabric.no_backward_sync``, and the protocol of objects with ``state_dict``.
FabricSubprocessScriptLauncher = _fabric_subprocess._SubprocessScriptLauncher
BackwardSyncControl = _fabric_strategy._BackwardSyncControl
Stateful = _fabric_types._Stateful
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


# What a torchmetrics ``Metric`` counts and caches beside its states.
_METRIC_COUNTERS = ("_update_count", "_computed", "_forward_cache", "_is_synced", "_should_unsync")


def metric_counters(metric: Any) -> dict[str, Any]:
    """What a torchmetrics ``Metric`` keeps beside its states (the update count, the cached
    ``compute`` and ``forward`` results, the sync flags), for :func:`set_metric_counters`."""
    fields = vars(metric)
    return {name: fields[name] for name in _METRIC_COUNTERS if name in fields}


def set_metric_counters(metric: Any, counters: dict[str, Any]) -> None:
    """Put back what :func:`metric_counters` returned."""
    for name, value in counters.items():
        setattr(metric, name, value)


def validate_keys_for_strict_loading(requested: Any, available: Any, *, strict: bool) -> None:
    """Fabric's check that every requested key is in the checkpoint (``KeyError`` if not)."""
    _fabric_strategy._validate_keys_for_strict_loading(requested, available, strict=strict)


# Private attributes of Lightning's objects, read or written through these accessors only.


def unwrap_optimizer(optimizer: Any) -> Any:
    """The torch optimizer inside a ``LightningOptimizer``, or ``optimizer`` itself."""
    return getattr(optimizer, "_optimizer", optimizer)


def attached_trainer(module: Any) -> Any:
    """The Trainer ``module`` is attached to, or ``None`` (its ``trainer`` property raises)."""
    return getattr(module, "_trainer", None)


def set_device_mesh(module: Any, mesh: Any) -> None:
    """Give a LightningModule its ``device_mesh`` (a read-only property over ``_device_mesh``)."""
    module._device_mesh = mesh


def current_fx_name(module: Any) -> str | None:
    """The hook a LightningModule is running, as ``self.log`` reads it."""
    return module._current_fx_name


def set_current_fx_name(module: Any, name: str | None) -> None:
    """Mark ``module`` as running hook ``name`` (what ``self.log`` checks against)."""
    module._current_fx_name = name


def data_fetcher(loop: Any) -> Any:
    """The data fetcher an evaluation or fit loop draws its batches from (``None`` if absent)."""
    return getattr(loop, "_data_fetcher", None)


def set_data_fetcher(loop: Any, fetcher: Any) -> None:
    """Make ``loop`` draw its batches from ``fetcher``."""
    loop._data_fetcher = fetcher


def forget_dataloader_states_to_load(fit_loop: Any) -> None:
    """Drop the dataloader states a restored fit loop would load into its next epoch."""
    fit_loop._combined_loader_states_to_load = []


def wrapped_sampler(dataset: Any) -> Any:
    """The sampler inside the dataset of Lightning's ``DistributedSamplerWrapper``
    (``_DatasetSamplerWrapper``), or ``None``."""
    return getattr(dataset, "_sampler", None)


def checkpoint_dir_resolver(callback: Any) -> Any:
    """``ModelCheckpoint``'s private ``__resolve_ckpt_dir(trainer)``, or ``None``: how its
    ``"last"`` lookup resolves the directory before ``setup``."""
    resolve = getattr(callback, "_ModelCheckpoint__resolve_ckpt_dir", None)
    return resolve if callable(resolve) else None
