"""A resumed ``fit`` continues the uninterrupted run bit for bit: random streams and data order.

Real ranks (``tests.harness``), the real ``Trainer`` and ``MegatronFSDPStrategy``, real DCP
checkpoints, torchdata's ``StatefulDataLoader`` (a resumable loader, shuffled by the
``DistributedSampler`` Lightning injects). The model is ``tests.models.PackedLM`` with
dropout on its logits; each training step also records one draw from torch's, numpy's and
Python's generators, and each validation step draws from all three (as a sampling callback
would) between the save and the next training batch.

The loader is ``StatefulDataLoader(shuffle=True)``, the form users write.

Run A trains 10 steps uninterrupted (4 batches per epoch, ``max_steps``) while one
``ModelCheckpoint`` saves every 2 steps and another at each epoch end, and validation runs
every 2 steps (after the step's save). Fresh models then resume from step 4 (saved after
the last batch of epoch 0, and again by ``on_train_epoch_end``) and step 6 (mid-epoch 1):
every later step must equal run A's: the epoch, the batch, every draw, the loss, and the
final logits. Each rank's streams are seeded
differently, so a rank given another rank's state would fail. A 3-rank run resumes the
2-rank step-6 checkpoint and must say, once, which random streams it did not restore.
"""

from __future__ import annotations

import random
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import Tensor, nn
from torchdata.stateful_dataloader import StatefulDataLoader

from lightning_megatron_fsdp.common.exact_resume import RNG_STATES_KEY
from lightning_megatron_fsdp.storage.format import META_FILE
from tests.harness import run_distributed
from tests.models import build_packed_lm, make_batch, make_trainer, sequence_loader

SAMPLES = 16  # 2 ranks x batch 2: 4 batches per rank per epoch
TOTAL_STEPS = 10
# Saved by every_n_train_steps after the last batch of epoch 0 and mid-epoch 1, and by
# on_train_epoch_end at the end of epoch 0.
RESUMED_FROM = ("step=4", "step=6", "end-step=4")
PROBE = make_batch(99, batch_size=2, seq_len=5)[0]


class NoisyLM(pl.LightningModule):
    """PackedLM with dropout on the logits; records each step's batch, draws and loss."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        self.model = build_packed_lm(seed)
        self.records: dict[int, dict[str, Any]] = {}

    def on_fit_start(self) -> None:
        # Distinct streams per rank (a resumed run's restore overrides this).
        rank = self.global_rank
        torch.manual_seed(1000 + rank)
        np.random.seed(2000 + rank)
        random.seed(3000 + rank)

    def training_step(self, batch: list[Tensor], batch_idx: int) -> Tensor:
        (sequences,) = batch
        tokens, targets = sequences[:, :-1], sequences[:, 1:]
        logits = nn.functional.dropout(self.model(tokens), p=0.3, training=True)
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
        self.records[self.global_step] = {
            "epoch": self.current_epoch,
            "batch": sequences.clone(),
            "torch": torch.rand(()).item(),
            "numpy": float(np.random.rand()),
            "python": random.random(),
            "loss": loss.detach().clone(),
        }
        return loss

    def validation_step(self, batch: list[Tensor], batch_idx: int) -> None:
        # Random draws during validation, as a sampling callback makes.
        torch.rand(7), np.random.rand(7), random.random()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=0.02)


def _loader() -> StatefulDataLoader:
    return sequence_loader(5, rows=SAMPLES)


def _trainer(world_size: int, root: Path, **kwargs: Any) -> pl.Trainer:
    options: dict[str, Any] = {
        "max_steps": TOTAL_STEPS,
        "val_check_interval": 2,
        "check_val_every_n_epoch": None,
        "limit_val_batches": 1,
        "num_sanity_val_steps": 0,
        "default_root_dir": root,
    }
    return make_trainer(world_size, **{**options, **kwargs})


def _probe(model: NoisyLM) -> Tensor:
    with torch.no_grad():
        return model.model(PROBE).clone()


def _uninterrupted_then_resumed(rank: int, world_size: int, root: str) -> dict[str, Any]:
    pl.seed_everything(0, verbose=False)
    checkpoints = Path(root, "checkpoints")
    savers = [
        ModelCheckpoint(
            dirpath=checkpoints, filename="{step}", every_n_train_steps=2, save_top_k=-1
        ),
        ModelCheckpoint(
            dirpath=checkpoints,
            filename="end-{step}",
            every_n_epochs=1,
            save_on_train_epoch_end=True,
            save_top_k=-1,
        ),
    ]
    model = NoisyLM()
    trainer = _trainer(world_size, Path(root), callbacks=savers)
    trainer.fit(model, _loader(), _loader())
    facts: dict[str, Any] = {"full": model.records, "full_probe": _probe(model), "resumed": {}}
    for name in RESUMED_FROM:
        resumed = NoisyLM(seed=1)  # other initial weights: the checkpoint must restore them
        path = checkpoints / f"{name}.ckpt"
        trainer = _trainer(world_size, Path(root))
        trainer.fit(resumed, _loader(), _loader(), ckpt_path=path)
        facts["resumed"][name] = {"records": resumed.records, "probe": _probe(resumed)}
    if rank == 0:
        meta = torch.load(checkpoints / "step=6.ckpt" / META_FILE, weights_only=True)
        facts["saved_rng_world_size"] = meta[RNG_STATES_KEY]["world_size"]
    return facts


@pytest.mark.both_versions
def test_resume_continues_random_streams_and_data_order(tmp_path: Path) -> None:
    """Steps after a resume at an epoch end and mid-epoch 1 equal the uninterrupted run's."""
    results = run_distributed(
        _uninterrupted_then_resumed, 2, str(tmp_path), init_process_group=False, timeout=240
    )
    assert results[0]["saved_rng_world_size"] == 2
    for rank, facts in enumerate(results):
        full = facts["full"]
        assert sorted(full) == list(range(TOTAL_STEPS))
        # What makes this test able to fail: epoch 1 is shuffled differently from epoch 0,
        # and the ranks' streams differ.
        assert not torch.equal(full[4]["batch"], full[0]["batch"])
        other = results[1 - rank]["full"]
        assert full[5]["torch"] != other[5]["torch"] and full[5]["numpy"] != other[5]["numpy"]
        for name, resumed in facts["resumed"].items():
            records = resumed["records"]
            step = int(name.rpartition("=")[2])
            assert sorted(records) == list(range(step, TOTAL_STEPS)), (rank, name)
            for later in records:
                got, expected = records[later], full[later]
                where = f"rank {rank}, resumed from {name}, step {later}"
                assert got["epoch"] == expected["epoch"], where
                assert torch.equal(got["batch"], expected["batch"]), f"{where}: batch"
                for stream in ("torch", "numpy", "python"):
                    assert got[stream] == expected[stream], f"{where}: {stream} draw"
                torch.testing.assert_close(
                    got["loss"], expected["loss"], rtol=0, atol=0, msg=f"{where}: loss"
                )
            torch.testing.assert_close(resumed["probe"], facts["full_probe"], rtol=0, atol=0)


def _resume_on_other_world_size(rank: int, world_size: int, checkpoint: str) -> dict[str, Any]:
    pl.seed_everything(0, verbose=False)
    model = NoisyLM(seed=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = _trainer(world_size, Path(checkpoint).parent, max_steps=7)
        trainer.fit(model, _loader(), ckpt_path=checkpoint)
    return {
        "warnings": [str(w.message) for w in caught if "random" in str(w.message)],
        "steps": sorted(model.records),
    }


def test_resharding_resume_warns_once_about_random_streams(tmp_path: Path) -> None:
    """2 ranks save, 3 ranks resume: weights and loops load, one warning names the streams."""
    run_distributed(_save_two_rank_checkpoint, 2, str(tmp_path), init_process_group=False)
    checkpoint = str(tmp_path / "checkpoints" / "step=6.ckpt")
    results = run_distributed(
        _resume_on_other_world_size, 3, checkpoint, init_process_group=False, timeout=180
    )
    (message,) = results[0]["warnings"]
    assert "saved by 2 ranks and this run has 3" in message, message
    for stream in ("torch CPU", "numpy", "Python random"):
        assert stream in message, message
    assert "CUDA" not in message, message  # a CPU run has no CUDA stream to name
    assert "were not restored" in message and "random random" not in message, message
    for rank, facts in enumerate(results):
        assert facts["steps"] == [6], rank  # resumed at step 6 and trained on to 7
        if rank:
            assert facts["warnings"] == [], rank


def _save_two_rank_checkpoint(rank: int, world_size: int, root: str) -> None:
    pl.seed_everything(0, verbose=False)
    saver = ModelCheckpoint(
        dirpath=Path(root, "checkpoints"), filename="{step}", every_n_train_steps=6
    )
    trainer = _trainer(world_size, Path(root), max_steps=6, callbacks=[saver])
    trainer.fit(NoisyLM(), _loader())


def test_a_checkpoint_without_random_states_names_this_runs_streams() -> None:
    """Another strategy's checkpoint (no random states): the warning names the streams this
    CPU process has, and no CUDA stream."""
    from lightning_megatron_fsdp.common.exact_resume import ExactResume

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ExactResume("MegatronFSDPStrategy").checkpoint_loaded({}, fitting=True)
    (message,) = [str(w.message) for w in caught if "random" in str(w.message)]
    assert "holds no random states" in message, message
    assert "(torch CPU, numpy, Python random)" in message, message
