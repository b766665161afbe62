"""The sharding options both strategies take are declared once
(``common.options.ShardingOptions`` with ``SHARDING_OPTION_DEFAULTS``), yet each constructor
shows them: ``inspect.signature`` lists every option, keyword-only, with its type and
default, and LightningCLI (jsonargparse, which reads that signature) configures the Trainer
strategy from ``class_path``/``init_args`` and trains with it.
"""

from __future__ import annotations

import inspect
from datetime import timedelta
from pathlib import Path
from typing import Any, get_type_hints

import pytest
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_megatron_fsdp import MegatronFSDPStrategy as TrainerStrategy
from lightning_megatron_fsdp.common.options import SHARDING_OPTION_DEFAULTS, ShardingOptions
from lightning_megatron_fsdp.fabric import MegatronFSDPStrategy as FabricStrategy
from tests.harness import run_distributed


@pytest.mark.parametrize("strategy", [TrainerStrategy, FabricStrategy])
def test_signature_lists_every_sharding_option(strategy: type) -> None:
    parameters = inspect.signature(strategy).parameters
    hints = get_type_hints(ShardingOptions)
    assert len(hints) == 7, hints
    for name, hint in hints.items():
        parameter = parameters[name]
        assert parameter.kind is inspect.Parameter.KEYWORD_ONLY, parameter
        assert parameter.annotation == hint, parameter
        assert parameter.default == SHARDING_OPTION_DEFAULTS[name], parameter  # type: ignore[literal-required]
    kinds = {p.kind for p in parameters.values()}
    assert kinds == {inspect.Parameter.KEYWORD_ONLY}, parameters
    with pytest.raises(TypeError, match=r"unexpected keyword argument.*sharding_stratgy"):
        strategy(sharding_stratgy="FULL_SHARD")


def _fit_from_cli(rank: int, world_size: int, root: str) -> dict[str, Any]:
    args = [
        "fit",
        "--trainer.strategy=lightning_megatron_fsdp.MegatronFSDPStrategy",
        "--trainer.strategy.device_mesh=[2, 1]",
        "--trainer.strategy.sharding_strategy=HYBRID_SHARD",
        "--trainer.strategy.timeout=0:00:45",
        "--trainer.strategy.check_replicas=true",
        "--trainer.accelerator=cpu",
        f"--trainer.devices={world_size}",
        "--trainer.max_steps=2",
        "--trainer.logger=false",
        "--trainer.enable_checkpointing=false",
        "--trainer.enable_progress_bar=false",
        "--trainer.enable_model_summary=false",
        f"--trainer.default_root_dir={root}",
    ]
    cli = LightningCLI(BoringModel, args=args, save_config_callback=None)
    strategy = cli.trainer.strategy
    assert isinstance(strategy, TrainerStrategy)
    init_args = cli.config.fit.trainer.strategy.init_args
    return {
        "step": cli.trainer.global_step,
        "mode": strategy.sharding_mode.name,
        "mesh": tuple(strategy.device_mesh.shape),
        "timeout": strategy._options.timeout,
        "check_replicas": strategy._options.check_replicas,
        "configured": {name: init_args[name] for name in SHARDING_OPTION_DEFAULTS},
    }


def test_lightning_cli_configures_and_trains_with_the_strategy(tmp_path: Path) -> None:
    results = run_distributed(
        _fit_from_cli, 2, str(tmp_path), init_process_group=False, timeout=240.0
    )
    for result in results:
        assert result["step"] == 2, result
        assert result["mode"] == "HYBRID_SHARD", result
        assert result["mesh"] == (2, 1), result
        assert result["timeout"] == timedelta(seconds=45), result
        assert result["check_replicas"] is True, result
        # Every sharding option is in the parsed configuration, the ones not given at
        # their declared defaults.
        configured = result["configured"]
        assert configured["auto_wrap_policy"] is None, configured
        assert configured["process_group_backend"] is None, configured
        assert configured["mixed_precision_policy"] is None, configured
