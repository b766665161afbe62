"""Every private Lightning (and torchmetrics) name our Lightning adapter relies on, one test each.

``lightning_megatron_fsdp/_lightning.py`` is the only module that touches Lightning's
underscore names. When a Lightning release renames or reshapes one, the strategy would fail
somewhere inside a Trainer run; these tests fail first, each naming the shim that needs
updating and the Lightning name it relies on. They check the name exists, has the shape the
shim calls it with, and, where it runs without a process group, that it does what we use it
for.
"""

from __future__ import annotations

import ast
import inspect
from typing import Any

import lightning
import torch
from lightning.fabric.plugins.precision.utils import _convert_fp_tensor
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from torch.utils.data import DataLoader, DistributedSampler

from lightning_megatron_fsdp import _lightning

VERSION = lightning.__version__


def _broken(shim: str, what: str) -> str:
    """The failure message: which shim breaks, on which Lightning, because of what."""
    return (
        f"lightning {VERSION}: {what}. `_lightning.{shim}` relies on it: update that shim "
        "(and this test) for this Lightning version, choosing the path by feature detection."
    )


def _parameters(function: Any) -> list[str]:
    return list(inspect.signature(function).parameters)


def test_path_type() -> None:
    from lightning.fabric.utilities import types

    assert _lightning.PATH is getattr(types, "_PATH", _lightning.PATH), _broken(
        "PATH", "lightning.fabric.utilities.types._PATH is gone (the fallback is in use)"
    )


def test_launcher_classes() -> None:
    from lightning.pytorch.strategies.launchers.launcher import _Launcher
    from lightning.pytorch.strategies.launchers.subprocess_script import (
        _SubprocessScriptLauncher,
    )

    assert _lightning.Launcher is _Launcher
    assert issubclass(_lightning.SubprocessScriptLauncher, _Launcher), _broken(
        "SubprocessScriptLauncher", "_SubprocessScriptLauncher is no _Launcher"
    )
    launch = _parameters(_SubprocessScriptLauncher.launch)
    assert launch[:2] == ["self", "function"] and "trainer" in launch, _broken(
        "SubprocessScriptLauncher", f"launch takes {launch}"
    )
    init = _parameters(_SubprocessScriptLauncher.__init__)
    assert init[1:4] == ["cluster_environment", "num_processes", "num_nodes"], _broken(
        "SubprocessScriptLauncher", f"__init__ takes {init}"
    )


def test_wrapping_checkpoint_io() -> None:
    from lightning.pytorch.plugins.io import AsyncCheckpointIO

    assert issubclass(AsyncCheckpointIO, _lightning.WrappingCheckpointIO), _broken(
        "WrappingCheckpointIO", "AsyncCheckpointIO no longer subclasses _WrappingCheckpointIO"
    )
    assert "checkpoint_io" in dir(_lightning.WrappingCheckpointIO), _broken(
        "WrappingCheckpointIO", "_WrappingCheckpointIO.checkpoint_io is gone"
    )


def test_loop_restarting_setter() -> None:
    restarting = inspect.getattr_static(_lightning.Loop, "restarting")
    assert isinstance(restarting, property) and restarting.fset is not None, _broken(
        "Loop", "_Loop.restarting is no settable property"
    )


def test_data_fetcher_class() -> None:
    from lightning.pytorch.loops.fetchers import _DataFetcher

    assert issubclass(_lightning.DataLoaderIterDataFetcher, _DataFetcher), _broken(
        "DataLoaderIterDataFetcher", "_DataLoaderIterDataFetcher is no _DataFetcher"
    )


def test_strategy_registry_type() -> None:
    assert isinstance(StrategyRegistry, _lightning.StrategyRegistry), _broken(
        "StrategyRegistry", "the strategy registry is no _StrategyRegistry"
    )
    assert _lightning.StrategyRegistry is not dict, _broken(
        "StrategyRegistry", "lightning.fabric.strategies.registry._StrategyRegistry is gone"
    )


def test_distributed_helpers() -> None:
    from lightning.fabric.utilities import distributed

    assert _lightning.distributed_is_initialized() is False, _broken(
        "distributed_is_initialized", "_distributed_is_initialized() without a group"
    )
    assert hasattr(distributed, "_distributed_is_initialized"), _broken(
        "distributed_is_initialized", "_distributed_is_initialized is gone (fallback in use)"
    )
    assert _parameters(distributed._init_dist_connection)[:2] == [
        "cluster_environment",
        "torch_distributed_backend",
    ], _broken("init_dist_connection", "_init_dist_connection's parameters changed")
    assert _lightning.default_process_group_backend(torch.device("cpu")) == "gloo", _broken(
        "default_process_group_backend", "_get_default_process_group_backend_for_device"
    )
    tensor = torch.ones(2)
    reduced = _lightning.sync_ddp_if_available(tensor, None, reduce_op="mean")
    assert torch.equal(reduced, tensor), _broken(
        "sync_ddp_if_available", "_sync_ddp_if_available without a group is not the identity"
    )


def test_update_properties() -> None:
    from lightning.fabric.utilities.device_dtype_mixin import _DeviceDtypeModuleMixin

    class Mixed(_DeviceDtypeModuleMixin):
        pass

    module = Mixed()
    _lightning.update_properties(module, device=torch.device("meta"))
    assert module.device == torch.device("meta"), _broken(
        "update_properties", "_update_properties does not record the device"
    )


def test_set_sampler_epoch() -> None:
    sampler = DistributedSampler(range(8), num_replicas=2, rank=0)
    _lightning.set_sampler_epoch(DataLoader(range(8), sampler=sampler), 5)
    assert sampler.epoch == 5, _broken("set_sampler_epoch", "_set_sampler_epoch sets no epoch")


def test_convert_fp_tensor() -> None:
    converted = _lightning.convert_fp_tensor(torch.ones(2), torch.bfloat16)
    kept = _lightning.convert_fp_tensor(torch.ones(2, dtype=torch.int64), torch.bfloat16)
    assert converted.dtype == torch.bfloat16 and kept.dtype == torch.int64, _broken(
        "convert_fp_tensor", "_convert_fp_tensor casts other than floating point only"
    )
    assert _parameters(_convert_fp_tensor) == ["tensor", "dst_type"]


def test_wrap_closure() -> None:
    params = _parameters(Precision._wrap_closure)
    assert params == ["self", "model", "optimizer", "closure"], _broken(
        "wrap_closure", f"Precision._wrap_closure takes {params}"
    )
    source = inspect.getsource(Precision._wrap_closure)
    assert "closure()" in source and "_after_closure" in source, _broken(
        "wrap_closure", "Precision._wrap_closure no longer runs the closure, then its hooks"
    )


def test_strategy_private_members() -> None:
    strategy = DDPStrategy()
    assert _lightning.layer_sync(strategy) is None, _broken(
        "layer_sync", "Strategy._layer_sync is not None by default"
    )
    strategy.optimizers = [torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)]
    _lightning.reset_optimizers_and_schedulers(strategy)
    assert strategy.optimizers == [], _broken(
        "reset_optimizers_and_schedulers", "Strategy._reset_optimizers_and_schedulers"
    )


def test_metric_state_names() -> None:
    from torchmetrics import MeanMetric

    assert set(_lightning.metric_state_names(MeanMetric())) == {"mean_value", "weight"}, _broken(
        "metric_state_names", "torchmetrics Metric._defaults does not name the states"
    )


def test_metric_counters() -> None:
    from torchmetrics import MeanMetric

    metric = MeanMetric()
    before = _lightning.metric_counters(metric)
    assert set(before) == {
        "_update_count",
        "_computed",
        "_forward_cache",
        "_is_synced",
        "_should_unsync",
    }, _broken("metric_counters", f"a torchmetrics Metric keeps {sorted(before)}")
    metric(torch.tensor(2.0))
    metric.compute()
    assert metric.update_count == 1 and _lightning.metric_counters(metric) != before
    _lightning.set_metric_counters(metric, before)
    assert metric.update_count == 0 and _lightning.metric_counters(metric) == before


def test_fabric_backward_sync_control() -> None:
    from lightning.fabric.strategies.strategy import _BackwardSyncControl

    assert _lightning.BackwardSyncControl is _BackwardSyncControl
    assert _parameters(_BackwardSyncControl.no_backward_sync) == [
        "self",
        "module",
        "enabled",
    ], _broken(
        "BackwardSyncControl",
        "_BackwardSyncControl.no_backward_sync no longer takes (module, enabled)",
    )


def test_fabric_stateful_protocol() -> None:
    from lightning.fabric.utilities.types import _Stateful

    class Counter:
        def state_dict(self) -> dict[str, int]:
            return {"n": 1}

        def load_state_dict(self, state: dict[str, int]) -> None:
            pass

    assert _lightning.Stateful is _Stateful
    assert isinstance(Counter(), _lightning.Stateful), _broken(
        "Stateful", "_Stateful no longer recognises an object with state_dict/load_state_dict"
    )
    assert not isinstance(object(), _lightning.Stateful)


def test_fabric_strict_key_check() -> None:
    _lightning.validate_keys_for_strict_loading(["a"], {"a": 1, "b": 2}, strict=True)
    _lightning.validate_keys_for_strict_loading(["a", "c"], {"a": 1}, strict=False)
    try:
        _lightning.validate_keys_for_strict_loading(["a", "c"], {"a": 1}, strict=True)
    except KeyError as err:
        assert "c" in str(err)
    else:
        raise AssertionError(
            _broken(
                "validate_keys_for_strict_loading",
                "_validate_keys_for_strict_loading no longer raises KeyError for a missing key",
            )
        )


def private_attributes(tree: ast.AST) -> set[str]:
    """The private attribute names (``x._name``) an adapter's syntax tree reads."""
    return {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and node.attr.startswith("_")
    }


def test_this_module_covers_every_private_name_of_the_adapter() -> None:
    """Every private Lightning name ``_lightning.py`` uses has a test above."""
    tree = ast.parse(inspect.getsource(_lightning))
    used = private_attributes(tree)
    used |= {
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and node.value.startswith("_")
        and not node.value.startswith("__")
    }
    covered = {
        "_BackwardSyncControl",
        "_Stateful",
        "_validate_keys_for_strict_loading",
        "_PATH",
        "_Launcher",
        "_SubprocessScriptLauncher",
        "_WrappingCheckpointIO",
        "_Loop",
        "_DataLoaderIterDataFetcher",
        "_StrategyRegistry",
        "_distributed_is_initialized",
        "_init_dist_connection",
        "_get_default_process_group_backend_for_device",
        "_sync_ddp_if_available",
        "_update_properties",
        "_set_sampler_epoch",
        "_convert_fp_tensor",
        "_wrap_closure",
        "_layer_sync",
        "_reset_optimizers_and_schedulers",
        "_defaults",
        # test_metric_counters:
        "_update_count",
        "_computed",
        "_forward_cache",
        "_is_synced",
        "_should_unsync",
        # test_private_attribute_accessors:
        "_optimizer",
        "_trainer",
        "_device_mesh",
        "_current_fx_name",
        "_data_fetcher",
        "_combined_loader_states_to_load",
        "_sampler",
        "_ModelCheckpoint__resolve_ckpt_dir",
    }
    assert used <= covered, f"add tests for {sorted(used - covered)} to {__name__}"


def test_private_attribute_accessors() -> None:
    """The accessors of Lightning objects' private attributes read and write them."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.core.optimizer import LightningOptimizer
    from lightning.pytorch.overrides.distributed import _DatasetSamplerWrapper

    module = pl.LightningModule()
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)
    assert _lightning.unwrap_optimizer(LightningOptimizer(optimizer)) is optimizer, _broken(
        "unwrap_optimizer", "LightningOptimizer keeps no _optimizer"
    )
    assert _lightning.unwrap_optimizer(optimizer) is optimizer
    assert _lightning.attached_trainer(module) is None
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
    module.trainer = trainer
    assert _lightning.attached_trainer(module) is trainer, _broken(
        "attached_trainer", "LightningModule keeps its trainer elsewhere than _trainer"
    )
    mesh = object()
    _lightning.set_device_mesh(module, mesh)
    assert module.device_mesh is mesh, _broken(
        "set_device_mesh", "LightningModule.device_mesh does not read _device_mesh"
    )
    assert _lightning.current_fx_name(module) is None
    _lightning.set_current_fx_name(module, "validation_step")
    assert _lightning.current_fx_name(module) == "validation_step"
    assert "_data_fetcher" in vars(trainer.validate_loop), _broken(
        "data_fetcher", "the evaluation loop keeps no _data_fetcher"
    )
    _lightning.set_data_fetcher(trainer.validate_loop, "fetcher")
    assert _lightning.data_fetcher(trainer.validate_loop) == "fetcher"
    assert "_combined_loader_states_to_load" in vars(trainer.fit_loop), _broken(
        "forget_dataloader_states_to_load", "the fit loop has no _combined_loader_states_to_load"
    )
    trainer.fit_loop._combined_loader_states_to_load = [{"state": 1}]
    _lightning.forget_dataloader_states_to_load(trainer.fit_loop)
    assert trainer.fit_loop._combined_loader_states_to_load == []
    sampler = DistributedSampler(range(8), num_replicas=2, rank=0)
    assert _lightning.wrapped_sampler(_DatasetSamplerWrapper(sampler)) is sampler, _broken(
        "wrapped_sampler", "_DatasetSamplerWrapper keeps no _sampler"
    )
    resolve = _lightning.checkpoint_dir_resolver(ModelCheckpoint())
    assert resolve is not None and _parameters(resolve) == ["trainer"], _broken(
        "checkpoint_dir_resolver", "ModelCheckpoint has no __resolve_ckpt_dir(trainer)"
    )
