"""Resharding resume through the real Trainer: save at 4 ranks, resume at 1, 2 and 3.

A checkpoint saved by ``MegatronFSDPStrategy`` at world size 4 (plain FSDP, and HSDP on a
(2, 2) mesh) is resumed with ``trainer.fit(ckpt_path=...)`` at other world sizes on a
1-D mesh. Each rank of the new layout reads its own new chunks by global offset (the IO
level is covered by ``tests/test_checkpoint_io.py``; this is the Trainer path, optimizer
and loop state included). Asserted:

* right after the restore, the model's outputs are bit-identical to the saved run's, and
  the parameters and Adam state (assembled from every rank's shards at the offsets
  ``chunk_metadata_by_fqn`` reports, each row exactly once) equal the saved ones by FQN;
* the resumed run continues to match the run that never changed size within 1e-6 (the
  same global batches: the sampler's permutation does not depend on the world size; only
  the order of the gradient reduction differs).

The resumed model starts from other values (seed 1, and a different buffer), so a restore
that does nothing cannot pass.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from tests.harness import run_distributed
from tests.test_portability import (
    AtTrainStart,
    PackedLit,
    Shards,
    assemble,
    assert_same,
    make_trainer,
    megatron_strategy,
    optimizer_shards,
    param_shards,
    probe_outputs,
    train_loader,
)

SAVED = "epoch=0-step=2.ckpt"  # saved after the first of two epochs (2 steps each)


class _AfterFirstEpoch(Callback):
    """The saved state: what the model and optimizer hold when epoch 0's checkpoint is taken."""

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.current_epoch == 0:
            self.outputs = probe_outputs(pl_module)
            self.params = param_shards(pl_module)
            self.optimizer = optimizer_shards(pl_module, trainer.optimizers[0])


def _save_at_four(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """Two uninterrupted epochs per mesh, checkpointing after each."""
    result: dict[str, Any] = {}
    for name, mesh in (("fsdp", None), ("hsdp", (2, 2))):
        model = PackedLit(seed=0)
        saved = _AfterFirstEpoch()
        checkpoints = ModelCheckpoint(dirpath=os.path.join(root, name), save_top_k=-1)
        trainer = make_trainer(
            world_size,
            megatron_strategy(device_mesh=mesh),
            max_epochs=2,
            enable_checkpointing=True,
            callbacks=[saved, checkpoints],
        )
        trainer.fit(model, train_loader(world_size))
        result[name] = {
            "outputs": saved.outputs,
            "params": saved.params,
            "optimizer": saved.optimizer,
            "final": param_shards(model),
        }
    return result


def _resume(rank: int, world_size: int, paths: dict[str, str]) -> dict[str, Any]:
    """Resume each checkpoint on a 1-D mesh of ``world_size`` ranks for the second epoch."""
    result: dict[str, Any] = {}
    for name, path in paths.items():
        model = PackedLit(seed=1)
        model.temperature.fill_(2.0)
        restored = AtTrainStart()
        trainer = make_trainer(world_size, megatron_strategy(), max_epochs=2, callbacks=[restored])
        trainer.fit(model, train_loader(world_size), ckpt_path=path)
        result[name] = {
            "outputs": restored.outputs,
            "params": restored.params,
            "optimizer": restored.optimizer,
            "final": param_shards(model),
            "global_step": trainer.global_step,
        }
    return result


def _replicas(per_rank: list[Shards], shard_size: int) -> dict[str, np.ndarray]:
    """Assemble each HSDP replica (a row of the mesh) separately; they must agree."""
    rows = [per_rank[i : i + shard_size] for i in range(0, len(per_rank), shard_size)]
    first = assemble(rows[0])
    for other in rows[1:]:
        assert_same(assemble(other), first)
    return first


def test_resume_at_other_world_sizes_and_from_hsdp_to_1d(tmp_path: Path) -> None:
    """4 ranks (FSDP and (2, 2) HSDP) -> 1, 2, 3 ranks: exact restore, matching continuation."""
    saved = run_distributed(_save_at_four, 4, str(tmp_path), init_process_group=False, timeout=240)
    expected = {
        "fsdp": {
            "params": assemble([r["fsdp"]["params"] for r in saved]),
            "optimizer": assemble([r["fsdp"]["optimizer"] for r in saved]),
            "final": assemble([r["fsdp"]["final"] for r in saved]),
        },
        "hsdp": {
            "params": _replicas([r["hsdp"]["params"] for r in saved], 2),
            "optimizer": _replicas([r["hsdp"]["optimizer"] for r in saved], 2),
            "final": _replicas([r["hsdp"]["final"] for r in saved], 2),
        },
    }
    for name in ("fsdp", "hsdp"):
        for result in saved[1:]:  # every rank computed the same outputs
            np.testing.assert_array_equal(
                result[name]["outputs"], saved[0][name]["outputs"], strict=True
            )
        # Not vacuous: the second epoch moved the weights.
        assert not np.array_equal(
            expected[name]["final"]["lm.embed.weight"], expected[name]["params"]["lm.embed.weight"]
        )
    # The uneven case is present at 4 ranks: some rank owns no row of the head bias.
    assert any(r["fsdp"]["params"]["lm.head.bias"][1].shape[0] == 0 for r in saved)

    fsdp = {"fsdp": str(tmp_path / "fsdp" / SAVED)}
    runs = {
        1: fsdp,
        2: {**fsdp, "hsdp": str(tmp_path / "hsdp" / SAVED)},
        3: fsdp,
    }
    for world_size, paths in runs.items():
        resumed = run_distributed(_resume, world_size, paths, init_process_group=False, timeout=180)
        for name in paths:
            context = f"{name} checkpoint resumed at {world_size} rank(s)"
            for result in resumed:
                np.testing.assert_array_equal(
                    result[name]["outputs"], saved[0][name]["outputs"], err_msg=context, strict=True
                )
                assert result[name]["global_step"] == 4, context  # epoch 1 ran, epoch 0 not
            assert_same(assemble([r[name]["params"] for r in resumed]), expected[name]["params"])
            assert_same(
                assemble([r[name]["optimizer"] for r in resumed]), expected[name]["optimizer"]
            )
            final = assemble([r[name]["final"] for r in resumed])
            for fqn, value in expected[name]["final"].items():
                np.testing.assert_allclose(
                    final[fqn], value, rtol=0, atol=1e-6, err_msg=f"{context}: {fqn}", strict=True
                )
