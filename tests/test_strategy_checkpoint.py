"""End-to-end smoke test of the strategy's checkpoint hooks with the real Trainer and IO.

Thorough checkpoint coverage (formats, corruption, resharding) lives in the checkpoint
tests; this checks the wiring: ``ModelCheckpoint`` saves through
``MegatronFSDPStrategy.save_checkpoint``, ``fit(ckpt_path="last")`` restores weights and
optimizer state in place so the resumed run continues bit-exactly, and
``validate(ckpt_path=...)`` loads weights only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pytest
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from lightning_megatron_fsdp.storage.format import MANIFEST_FILE
from tests.harness import run_distributed
from tests.test_strategy import MLP, Block, _regression_data, _shards, _strategy, _trainer

# CI runs this module in every pass (README, "Supported torch and megatron-fsdp versions").
pytestmark = pytest.mark.both_versions


class _ShardsAtStart(Callback):
    """This rank's shards when the loop starts, i.e. right after a checkpoint restore."""

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.shards = _shards(pl_module)

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.shards = _shards(pl_module)


def _loader(world_size: int) -> DataLoader:
    # One optimizer step per epoch, so "last" is saved at an epoch boundary and the resumed
    # run draws the same shuffled batches as the uninterrupted one.
    return DataLoader(TensorDataset(*_regression_data(2 * world_size, seed=9)), batch_size=2)


def _model() -> MLP:
    pl.seed_everything(0, verbose=False)
    return MLP()


def _save_resume(rank: int, world_size: int, root: str) -> dict[str, Any]:
    result: dict[str, Any] = {}
    straight = _model()
    _trainer(world_size, _strategy(auto_wrap_policy={Block})).fit(straight, _loader(world_size))
    result["straight"] = _shards(straight)

    saved = _model()
    checkpoints = ModelCheckpoint(dirpath=root, save_last=True)
    trainer = _trainer(
        world_size,
        _strategy(auto_wrap_policy={Block}),
        max_steps=2,
        enable_checkpointing=True,
        callbacks=[checkpoints],
    )
    trainer.fit(saved, _loader(world_size))
    result["saved"] = _shards(saved)
    result["files"] = sorted(p.name for p in Path(root).iterdir())

    restored = _model()
    probe = _ShardsAtStart()
    trainer = _trainer(
        world_size,
        _strategy(auto_wrap_policy={Block}),
        enable_checkpointing=True,
        callbacks=[probe, ModelCheckpoint(dirpath=root, save_last=True)],
    )
    trainer.fit(restored, _loader(world_size), ckpt_path="last")
    result["restored"] = probe.shards
    result["resumed"] = _shards(restored)
    result["resumed_from_step"] = len(restored.step_losses)

    evaluated = _model()
    probe = _ShardsAtStart()
    trainer = _trainer(world_size, _strategy(auto_wrap_policy={Block}), callbacks=[probe])
    trainer.validate(evaluated, _loader(world_size), ckpt_path=str(Path(root) / "last.ckpt"))
    result["validated"] = probe.shards
    return result


Shards = dict[str, tuple[int, np.ndarray]]


def _assert_same(a: Shards, b: Shards) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert a[name][0] == b[name][0], name
        np.testing.assert_array_equal(a[name][1], b[name][1], err_msg=name)


def test_fit_resume_from_last_continues_bit_exactly(tmp_path: Path) -> None:
    """Save 2 steps, resume from "last" for a 3rd: equals 3 uninterrupted steps, bit for bit."""
    world_size = 2
    results = run_distributed(
        _save_resume, world_size, str(tmp_path), init_process_group=False, timeout=150
    )
    for result in results:
        assert result["files"] == ["epoch=1-step=2.ckpt", "last.ckpt"]  # step 1 removed
        _assert_same(result["restored"], result["saved"])
        # The resumed run's ModelCheckpoint saved step 3 as "last"; validate loads that.
        _assert_same(result["validated"], result["resumed"])
        assert result["resumed_from_step"] == 1  # only step 3 ran after the restore
        _assert_same(result["resumed"], result["straight"])
        # The restore was not vacuous: training moved the weights away from the start.
        assert any(
            not np.array_equal(result["saved"][n][1], result["straight"][n][1])
            for n in result["saved"]
        )
    assert (tmp_path / "last.ckpt" / MANIFEST_FILE).is_file()  # a real MegatronFSDP checkpoint
