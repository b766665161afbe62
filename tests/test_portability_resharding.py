"""Resharding resume through the real Trainer: save at 4 ranks, resume at 1, 2 and 3.

A checkpoint saved by ``MegatronFSDPStrategy`` at world size 4 -- plain FSDP, HSDP on a
(2, 2) mesh, and HSDP on a (2, 2) ``DeviceMesh`` the user built -- is resumed with
``trainer.fit(ckpt_path=...)`` at other world sizes on a 1-D mesh. Each rank of the new
layout reads its own new chunks by global offset (the IO level, HSDP targets included, is
covered by ``tests/test_checkpoint_io.py`` and ``tests/test_hsdp_checkpoint.py``; this is
the Trainer path, optimizer and loop state included). Asserted:

* the saved state is right: the parameters and Adam state, assembled from every rank's
  shards at the offsets ``chunk_metadata_by_fqn`` reports (each row exactly once), match
  one plain process that trained the unsharded model on the same global batches -- the
  offsets are the code under test, so this is what catches an offset wrong the same way
  on save and load; the user's mesh trains bit-identically to ``device_mesh=(2, 2)``;
* right after the restore, the model's outputs are bit-identical to the saved run's, and
  the restored parameters and Adam state equal the saved ones by FQN, bit for bit;
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
from lightning.pytorch.callbacks import Callback

from tests.harness import PROCESS_GROUP_TIMEOUT, run_distributed
from tests.models import hsdp_mesh
from tests.test_portability import (
    AtTrainStart,
    PackedLit,
    Shards,
    assemble,
    assert_same,
    fit_two_epochs,
    make_trainer,
    megatron_strategy,
    optimizer_shards,
    param_shards,
    probe_outputs,
    train_loader,
    train_reference,
)

SAVED = "epoch=0-step=2.ckpt"  # saved after the first of two epochs (2 steps each)
# Sharded training vs one process: only the order of the gradient reduction differs.
REFERENCE_ATOL = 1e-6


class _AfterFirstEpoch(Callback):
    """The saved state: what the model and optimizer hold when epoch 0's checkpoint is taken."""

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.current_epoch == 0:
            self.outputs = probe_outputs(pl_module)
            self.params = param_shards(pl_module)
            self.optimizer = optimizer_shards(pl_module, trainer.optimizers[0])


def _fit_two_epochs(world_size: int, root: str, mesh: Any) -> dict[str, Any]:
    """Two uninterrupted epochs on ``mesh``, checkpointing into ``root`` after each."""
    model = PackedLit(seed=0)
    strategy = megatron_strategy(device_mesh=mesh)
    return {
        **fit_two_epochs(world_size, strategy, model, root, _AfterFirstEpoch()),
        "final": param_shards(model),
        "mesh": (tuple(model.device_mesh.shape), model.device_mesh.mesh_dim_names),
    }


def _save_at_four(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """Plain FSDP, then HSDP from ``device_mesh=(2, 2)``; the strategy owns the groups."""
    return {
        name: _fit_two_epochs(world_size, os.path.join(root, name), mesh)
        for name, mesh in (("fsdp", None), ("hsdp", (2, 2)))
    }


def _save_on_a_user_mesh(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """HSDP on a 2-D ``DeviceMesh`` built here, on the group the harness created (the
    strategy neither creates nor destroys it), with the user's own dim names."""
    mesh = hsdp_mesh(2, 2, names=("replicas", "shards"), timeout=PROCESS_GROUP_TIMEOUT)
    return {"user-mesh": _fit_two_epochs(world_size, os.path.join(root, "user-mesh"), mesh)}


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


def _assert_close(
    actual: dict[str, np.ndarray], expected: dict[str, np.ndarray], what: str
) -> None:
    assert sorted(actual) == sorted(expected), what
    for key, value in expected.items():
        np.testing.assert_allclose(
            actual[key], value, rtol=0, atol=REFERENCE_ATOL, err_msg=f"{what}: {key}", strict=True
        )


def test_resume_at_other_world_sizes_and_from_hsdp_to_1d(tmp_path: Path) -> None:
    """4 ranks (FSDP, (2, 2) HSDP, a user's 2-D DeviceMesh) -> 1, 2, 3 ranks: state equal
    to one process's, exact restore, matching continuation."""
    saved = run_distributed(_save_at_four, 4, str(tmp_path), init_process_group=False, timeout=240)
    on_user_mesh = run_distributed(_save_on_a_user_mesh, 4, str(tmp_path), timeout=240)
    for result, user in zip(saved, on_user_mesh, strict=True):
        result.update(user)
    expected = {
        "fsdp": {
            "params": assemble([r["fsdp"]["params"] for r in saved]),
            "optimizer": assemble([r["fsdp"]["optimizer"] for r in saved]),
            "final": assemble([r["fsdp"]["final"] for r in saved]),
        },
        **{
            name: {
                "params": _replicas([r[name]["params"] for r in saved], 2),
                "optimizer": _replicas([r[name]["optimizer"] for r in saved], 2),
                "final": _replicas([r[name]["final"] for r in saved], 2),
            }
            for name in ("hsdp", "user-mesh")
        },
    }
    first, second = train_reference(2)
    reference = {**first, "final": second["params"]}
    for name in ("fsdp", "hsdp", "user-mesh"):
        for result in saved[1:]:  # every rank computed the same outputs
            np.testing.assert_array_equal(
                result[name]["outputs"], saved[0][name]["outputs"], strict=True
            )
        np.testing.assert_allclose(
            saved[0][name]["outputs"], reference["outputs"], rtol=0, atol=1e-5, strict=True
        )
        for part in ("params", "optimizer", "final"):
            _assert_close(expected[name][part], reference[part], f"{name} {part}")
        # Not vacuous: the second epoch moved the weights.
        assert not np.array_equal(
            expected[name]["final"]["lm.embed.weight"], expected[name]["params"]["lm.embed.weight"]
        )
    assert [r["hsdp"]["mesh"] for r in saved] == [((2, 2), ("dp_replicate", "dp_shard"))] * 4
    assert [r["user-mesh"]["mesh"] for r in saved] == [((2, 2), ("replicas", "shards"))] * 4
    # The user's mesh is the same layout as device_mesh=(2, 2): the same bits.
    for result in saved:
        for part in ("outputs", "params", "optimizer", "final"):
            user, ours = result["user-mesh"][part], result["hsdp"][part]
            if part == "outputs":
                np.testing.assert_array_equal(user, ours, strict=True)
            else:
                assert user.keys() == ours.keys()
                for key, (offset, value) in ours.items():
                    assert user[key][0] == offset, (part, key)
                    np.testing.assert_array_equal(user[key][1], value, strict=True)
    # The uneven case is present at 4 ranks: some rank owns no row of the head bias.
    assert any(r["fsdp"]["params"]["lm.head.bias"][1].shape[0] == 0 for r in saved)

    paths = {name: str(tmp_path / name / SAVED) for name in ("fsdp", "hsdp", "user-mesh")}
    runs = {
        1: {k: paths[k] for k in ("fsdp", "hsdp")},
        2: {k: paths[k] for k in ("fsdp", "hsdp")},
        3: {k: paths[k] for k in ("fsdp", "hsdp", "user-mesh")},
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
